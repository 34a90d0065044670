"""Transforms applied before quantizing: on the wire (rotations) or client state (error feedback)."""

from fedquant.codecs.transforms.base import StatefulTransform, Transform

__all__ = ["StatefulTransform", "Transform"]
