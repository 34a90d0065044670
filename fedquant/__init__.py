"""fedquant: quantized uplink compression for the Flower federated learning framework."""

from importlib.metadata import PackageNotFoundError, version

from fedquant.errors import PayloadError

try:
    __version__ = version("fedquant")  # pyproject.toml's, as installed; moves with each release
except PackageNotFoundError:  # sources on PYTHONPATH without an installation
    __version__ = "0+unknown"

__all__ = ["PayloadError", "__version__"]
