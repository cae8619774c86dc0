"""The learned residual cache's parts: compressor modules, codes, references, fitting, training, checkpoints."""

from .checkpoint import load_compressor, save_compressor
from .compressor import ResidualCompressor, ResidualConfig

__all__ = ["ResidualCompressor", "ResidualConfig", "load_compressor", "save_compressor"]
