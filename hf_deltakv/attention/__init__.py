"""Attention straight from compressed caches: the `"hf_deltakv"` attention implementation."""

from .interface import compressed_attention, compressed_attention_forward, reads_compressed, register

__all__ = ["compressed_attention", "compressed_attention_forward", "reads_compressed", "register"]
