"""What a cache layer's `update` returns: keys and values whose data stay in the cache.

`StoredKV` is a tensor subclass with the shape and dtype of a layer's whole key (or value) history and no storage of
its own. When attention calls `torch.nn.functional.scaled_dot_product_attention` on a layer's pair (transformers'
`"sdpa"` attention, its default), the call is answered by the layer, which attends straight from its packed storage
(a compiled kernel where one applies); any other use of the tensors (eager attention, `repeat_kv`, inspection)
decodes the history once, memoised for that pair, and runs the operation on it. Nothing is registered or patched: only
the tensors a cache returns behave this way, so other models and caches in the process are untouched, and what
attention reads is exactly what the cache stores either way.

The layer is duck-typed (this module sits below the cache layers): it needs `reconstruct() -> (keys, values)` and
`sdpa(query, mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor | None` (None: not served, decode instead), and
may have `read_done()`, called once attention has read the pair, and `decoded_outside_sdpa(op)`, called when
something other than SDPA makes a pair decode (the cache warns once: `HistoryDecodedWarning`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class HistoryDecodedWarning(UserWarning):
    """Attention (or another operation) read a compressed cache's history as a decoded tensor instead of through
    `scaled_dot_product_attention`, which reads the packed storage."""


class _Pair:
    """A layer's keys and values as returned by one `update`, and their decoded history once something asks."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.decoded: tuple[torch.Tensor, torch.Tensor] | None = None

    def decode(self, index: int, dtype: torch.dtype, op=None) -> torch.Tensor:
        """The decoded history's keys (0) or values (1); `op`: the operation other than SDPA that asks, if one does."""
        if self.decoded is None:
            self.decoded = self.layer.reconstruct()
            _read_done(self.layer)
        hook = getattr(self.layer, "decoded_outside_sdpa", None)
        if op is not None and hook is not None:
            hook(getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or str(op))
        return self.decoded[index].to(dtype)


class StoredKV(torch.Tensor):
    """Keys (`index` 0) or values (1) of a cache layer, `[batch, kv_heads, tokens, dim]`, data kept in the cache.

    transformers' `repeat_kv` (GQA attention with a mask and several queries: `x[:, :, None].expand(...).reshape(...)`)
    is followed lazily (`stage`, `repeats`), so that SDPA on the repeated heads is still served from storage.
    """

    pair: _Pair
    index: int
    stage: str  # "plain" [B, H, S, D]; "unsqueezed" [B, H, 1, S, D]; "expanded" [B, H, R, S, D]
    repeats: int  # query heads per stored head (repeat_kv's factor)

    @staticmethod
    def __new__(
        cls,
        pair: _Pair,
        index: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        stage: str = "plain",
        repeats: int = 1,
    ):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        out.pair, out.index, out.stage, out.repeats = pair, index, stage, repeats
        return out

    def __repr__(self) -> str:
        return f"StoredKV({'keys' if self.index == 0 else 'values'}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def decoded(self, op=None) -> torch.Tensor:
        """The tensor this one stands for, decoded (the history memoised with its pair); `op`: the operation other
        than SDPA that needs it, if one does."""
        history = self.pair.decode(self.index, self.dtype, op)
        if self.stage == "unsqueezed":
            return history[:, :, None]
        if self.stage == "expanded":
            return history[:, :, None].expand(self.shape)
        if self.repeats > 1:
            return history.repeat_interleave(self.repeats, dim=1)
        return history

    def _derived(self, shape: tuple[int, ...], stage: str, repeats: int) -> StoredKV:
        return StoredKV(self.pair, self.index, shape, self.dtype, self.device, stage, repeats)

    def _follow_repeat_kv(self, func, args: tuple, kwargs: dict) -> StoredKV | None:
        """The next step of `repeat_kv` on this tensor as a lazy StoredKV, or None for any other operation."""
        if kwargs:
            return None
        shape = tuple(self.shape)
        if func is torch.Tensor.__getitem__ and self.stage == "plain" and self.repeats == 1:
            index = args[1]
            full = slice(None)
            if index in ((full, full, None, full, full), (full, full, None), (full, full, None, Ellipsis)):
                return self._derived((*shape[:2], 1, *shape[2:]), "unsqueezed", 1)
        elif func is torch.Tensor.expand and self.stage == "unsqueezed":
            sizes = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
            if len(sizes) == 5 and sizes[:2] == shape[:2] and sizes[3:] == shape[3:]:
                return self._derived(tuple(sizes), "expanded", sizes[2])
        elif func in (torch.Tensor.reshape, torch.Tensor.view) and self.stage == "expanded":
            sizes = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
            batch, heads, repeats, length, dim = shape
            if tuple(sizes) == (batch, heads * repeats, length, dim):
                return self._derived(tuple(sizes), "plain", repeats)
        return None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "a compressed cache's keys and values reached a compiled attention (attn_implementation="
                "'flex_attention'?), which cannot read them: pass the model to the cache (model=model) so that it "
                "hands that attention decoded tensors, or load the model with attn_implementation='sdpa', which "
                "attends straight from the packed storage"
            )
        if func is F.scaled_dot_product_attention:
            call = _own_call(args, kwargs)
            if call is not None:
                served = _serve_sdpa(call)
                if served is None:
                    served = _sdpa_on_decoded(call)
                if served is not None:
                    return served
        elif getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        elif args and isinstance(args[0], StoredKV):
            followed = args[0]._follow_repeat_kv(func, args, kwargs)
            if followed is not None:
                return followed
        op = None if func is F.scaled_dot_product_attention else func  # (an SDPA call the layer did not serve)
        args, kwargs = tree_map(functools.partial(_decoded, op=op), (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only by operations that bypass __torch_function__ (e.g. from C++): decode and run them.
        args, kwargs = tree_map(functools.partial(_decoded, op=func), (args, kwargs or {}))
        return func(*args, **kwargs)


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous}  # fmt: skip


def _decoded(x, op=None):
    return x.decoded(op) if isinstance(x, StoredKV) else x


def _own_call(args: tuple, kwargs: dict) -> dict | None:
    """The arguments of an SDPA call by name when its keys and values are one layer's own pair as `update` returned
    it (maybe repeated by `repeat_kv`), else None. `enable_gqa` is set when repeat_kv repeated the heads: the layer's
    own kv heads are read either way."""
    call = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS[: len(args)], args, strict=True)), **kwargs}
    key, value = call["key"], call["value"]
    if not (isinstance(key, StoredKV) and isinstance(value, StoredKV)) or key.pair is not value.pair:
        return None
    if key.index != 0 or value.index != 1 or isinstance(call["query"], StoredKV):
        return None
    if key.stage != "plain" or value.stage != "plain" or key.repeats != value.repeats:
        return None
    if isinstance(call["attn_mask"], StoredKV):
        return None
    return {**call, "enable_gqa": call["enable_gqa"] or key.repeats > 1}


def _serve_sdpa(call: dict) -> torch.Tensor | None:
    """The layer's answer to an SDPA call on its own keys and values (`_own_call`), or None (then SDPA runs on the
    decoded ones)."""
    key = call["key"]
    out = key.pair.layer.sdpa(
        call["query"], call["attn_mask"], call["dropout_p"], call["is_causal"], call["scale"], call["enable_gqa"]
    )
    if out is not None:
        _read_done(key.pair.layer)
    return out


SDPA_QUERY_BLOCK = 256  # query rows per SDPA call over a decoded history (bounds the float mask made of a bool one)


def _sdpa_on_decoded(call: dict) -> torch.Tensor | None:
    """SDPA over a layer's decoded history (a prefill chunk) without what the plain call would allocate on top of
    it: the history is decoded once at its own kv heads (SDPA's `enable_gqa` rather than `repeat_kv`'s copy per query
    head), and queries go `SDPA_QUERY_BLOCK` rows at a time under a mask (SDPA turns a bool mask into a float one of
    queries x history). The same numbers as the plain call (each query row's softmax is its own). None: not this
    case (then the plain call runs). `call`: an SDPA call on a layer's own pair (`_own_call`)."""
    if call["dropout_p"]:
        return None
    query, key, mask = call["query"], call["key"], call["attn_mask"]
    if call["is_causal"] and query.shape[-2] != key.shape[-2]:
        return None  # SDPA's own top-left causal rule over a longer history: left to the plain call
    keys, values = key.pair.decode(0, key.dtype), key.pair.decode(1, call["value"].dtype)
    gqa = call["enable_gqa"]
    rows = query.shape[-2]
    if mask is None or rows <= SDPA_QUERY_BLOCK or mask.shape[-2] != rows:
        return F.scaled_dot_product_attention(
            query, keys, values, mask, 0.0, call["is_causal"], scale=call["scale"], enable_gqa=gqa
        )
    blocks = [
        F.scaled_dot_product_attention(
            query[..., start : start + SDPA_QUERY_BLOCK, :],
            keys,
            values,
            mask[..., start : start + SDPA_QUERY_BLOCK, :],
            scale=call["scale"],
            enable_gqa=gqa,
        )
        for start in range(0, rows, SDPA_QUERY_BLOCK)
    ]
    return torch.cat(blocks, dim=-2)


def _read_done(layer) -> None:
    """Tell the layer that this forward's attention has read it (optional `read_done()`: a sliding window drops now
    what no later query sees)."""
    done = getattr(layer, "read_done", None)
    if done is not None:
        done()


def stored_pair(
    layer, keys_shape: tuple[int, ...], values_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[StoredKV, StoredKV]:
    """Keys and values of `layer`'s whole history (`[batch, kv_heads, tokens, dim]`) as `StoredKV` tensors."""
    pair = _Pair(layer)
    return StoredKV(pair, 0, keys_shape, dtype, device), StoredKV(pair, 1, values_shape, dtype, device)
