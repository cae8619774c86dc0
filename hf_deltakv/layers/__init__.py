"""Cache layers: one file per storage scheme, all on the shared `StreamLayer` base."""

from .base import ForwardLog, PositionLog, StreamLayer
from .compressed import CompressedLayer
from .evicting import EvictingLayer

__all__ = ["CompressedLayer", "EvictingLayer", "ForwardLog", "PositionLog", "StreamLayer"]
