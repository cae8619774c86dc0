"""How transformers' attention reads a compressed cache: `StoredKV`, the tensors a cache layer's `update` returns."""

from .stored import StoredKV, stored_pair

__all__ = ["StoredKV", "stored_pair"]
