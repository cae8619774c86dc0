"""Cache layers: one model layer's packed storage."""

from .compressed import CompressedLayer, PositionLog

__all__ = ["CompressedLayer", "PositionLog"]
