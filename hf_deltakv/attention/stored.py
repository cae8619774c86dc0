"""What a cache layer's `update` returns: keys and values whose data stay in the cache.

`StoredKV` is a tensor subclass with the shape and dtype of a layer's whole key (or value) history and no storage of
its own. When attention calls `torch.nn.functional.scaled_dot_product_attention` on a layer's pair (transformers'
`"sdpa"` attention, its default), the call is answered by the layer, which attends straight from its packed storage
(a compiled kernel where one applies); any other use of the tensors (eager attention, `repeat_kv`, inspection)
decodes the history once, memoised for that pair, and runs the operation on it. Nothing is registered or patched: only
the tensors a cache returns behave this way, so other models and caches in the process are untouched, and what
attention reads is exactly what the cache stores either way.

The layer is duck-typed (this module sits below the cache layers): it needs `reconstruct() -> (keys, values)` and
`sdpa(query, mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor | None` (None: not served, decode instead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class _Pair:
    """A layer's keys and values as returned by one `update`, and their decoded history once something asks."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.decoded: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        if self.decoded is None:
            self.decoded = self.layer.reconstruct()
        return self.decoded[index].to(dtype)


class StoredKV(torch.Tensor):
    """Keys (`index` 0) or values (1) of a cache layer, `[batch, kv_heads, tokens, dim]`, data kept in the cache."""

    pair: _Pair
    index: int

    @staticmethod
    def __new__(cls, pair: _Pair, index: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        out.pair, out.index = pair, index
        return out

    def __repr__(self) -> str:
        return f"StoredKV({'keys' if self.index == 0 else 'values'}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def decoded(self) -> torch.Tensor:
        """The history this tensor stands for, decoded (memoised with its pair)."""
        return self.pair.decode(self.index, self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            served = _serve_sdpa(args, kwargs)
            if served is not None:
                return served
        elif getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_decoded, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only by operations that bypass __torch_function__ (e.g. from C++): decode and run them.
        args, kwargs = tree_map(_decoded, (args, kwargs or {}))
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous}  # fmt: skip


def _decoded(x):
    return x.decoded() if isinstance(x, StoredKV) else x


def _serve_sdpa(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The layer's answer to an SDPA call on its own keys and values, or None (then SDPA runs on the decoded ones)."""
    call = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS[: len(args)], args, strict=True)), **kwargs}
    query, key, value = call["query"], call["key"], call["value"]
    if not (isinstance(key, StoredKV) and isinstance(value, StoredKV)) or key.pair is not value.pair:
        return None
    if key.index != 0 or value.index != 1 or isinstance(query, StoredKV):
        return None
    mask = call["attn_mask"]
    if isinstance(mask, StoredKV):
        return None
    return key.pair.layer.sdpa(query, mask, call["dropout_p"], call["is_causal"], call["scale"], call["enable_gqa"])


def stored_pair(
    layer, keys_shape: tuple[int, ...], values_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[StoredKV, StoredKV]:
    """Keys and values of `layer`'s whole history (`[batch, kv_heads, tokens, dim]`) as `StoredKV` tensors."""
    pair = _Pair(layer)
    return StoredKV(pair, 0, keys_shape, dtype, device), StoredKV(pair, 1, values_shape, dtype, device)
