"""Cache layers: one file per storage scheme, all on the shared `StreamLayer` base."""

from .base import PositionLog, StreamLayer
from .compressed import CompressedLayer

__all__ = ["CompressedLayer", "PositionLog", "StreamLayer"]
