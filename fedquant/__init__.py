"""fedquant: quantized uplink compression for the Flower federated learning framework."""

from fedquant.errors import PayloadError

__all__ = ["PayloadError"]
__version__ = "0.1.0"
