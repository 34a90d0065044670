"""The Flower App that ``flwr run .`` starts: server and client apps, data, models, sweeps."""
