"""hf_deltakv: compressed KV caches for HuggingFace transformers, with real packed storage."""

from . import _compat  # noqa: F401  (first: a transformers too old to serve stops the import, saying why)
from .attention import HistoryDecodedWarning
from .cache import (
    CompressedKVCache,
    DeltaKVCache,
    EvictionCache,
    KIVIKVCache,
    QuantizedKVCache,
    SnapKVCache,
    StreamingLLMCache,
)
from .residual.cache import ResidualKVCache
from .residual.static import StaticResidualKVCache
from .static import (
    StaticDeltaKVCache,
    StaticKIVIKVCache,
    StaticQuantizedKVCache,
    StaticSnapKVCache,
    StaticStreamingLLMCache,
)
from .weight_skip import SkipSimulator, enable_weight_skip

__all__ = [
    "CompressedKVCache",
    "DeltaKVCache",
    "EvictionCache",
    "HistoryDecodedWarning",
    "KIVIKVCache",
    "QuantizedKVCache",
    "ResidualKVCache",
    "SkipSimulator",
    "SnapKVCache",
    "StaticDeltaKVCache",
    "StaticKIVIKVCache",
    "StaticQuantizedKVCache",
    "StaticResidualKVCache",
    "StaticSnapKVCache",
    "StaticStreamingLLMCache",
    "StreamingLLMCache",
    "enable_weight_skip",
]
__version__ = "0.1.0"
