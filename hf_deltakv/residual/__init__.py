"""The learned residual cache as one feature: compressor modules, codes, references, the cache layer and the cache,
fitting, training and checkpoints."""

from .cache import ResidualKVCache
from .checkpoint import load_compressor, save_compressor
from .compressor import ResidualCompressor, ResidualConfig, ResidualLayout
from .static import StaticResidualKVCache

__all__ = [
    "ResidualCompressor",
    "ResidualConfig",
    "ResidualKVCache",
    "ResidualLayout",
    "StaticResidualKVCache",
    "load_compressor",
    "save_compressor",
]
