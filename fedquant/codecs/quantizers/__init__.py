"""Quantizers: a flat tensor to side data and symbols (one module per family)."""

from fedquant.codecs.quantizers.base import Quantized, Quantizer, SideField

__all__ = ["Quantized", "Quantizer", "SideField"]
