"""hf_deltakv: compressed KV caches for HuggingFace transformers, with real packed storage."""

from .cache import CompressedKVCache, DeltaKVCache, KIVIKVCache, QuantizedKVCache

__all__ = ["CompressedKVCache", "DeltaKVCache", "KIVIKVCache", "QuantizedKVCache"]
__version__ = "0.1.0"
