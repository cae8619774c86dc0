"""Attention straight from compressed caches: the `"hf_deltakv"` attention implementation and its chunked reference."""

from .chunked import OnlineSoftmax, chunked_attention
from .interface import compressed_attention, compressed_attention_forward, reads_compressed, register

__all__ = [
    "OnlineSoftmax",
    "chunked_attention",
    "compressed_attention",
    "compressed_attention_forward",
    "reads_compressed",
    "register",
]
