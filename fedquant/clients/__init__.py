"""Client side: ``quantize_mod`` (a Flower Mod) and its error-feedback state.

>>> from flwr.clientapp import ClientApp
>>> from fedquant.clients import quantize_mod
>>> app = ClientApp(mods=[quantize_mod])
"""

from fedquant.clients.quantize_mod import quantize_mod

__all__ = ["quantize_mod"]
