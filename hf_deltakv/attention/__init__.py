"""How transformers' attention reads a compressed cache: `StoredKV`, the tensors a cache layer's `update` returns."""

from .stored import HistoryDecodedWarning, StoredKV, stored_pair

__all__ = ["HistoryDecodedWarning", "StoredKV", "stored_pair"]
