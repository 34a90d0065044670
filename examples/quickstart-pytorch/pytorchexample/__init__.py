"""pytorchexample: Flower's quickstart-pytorch app, its uplink compressed by fedquant."""
