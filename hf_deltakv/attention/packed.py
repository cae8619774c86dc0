"""What a compileable cache layer's `update` returns for a decoding step: keys and values that stand for the packed
storage, which `torch.compile` can trace.

`StoredKV` (stored.py) is a wrapper subclass whose pair lives in Python objects made at every update; a compiled
graph cannot make those. `packed_pair` instead returns a zero-stride view of one scalar (no memory) of the history's
shape, as a subclass made once per layer (`packed_classes`). transformers' `sdpa` attention only reads its shape and
follows `repeat_kv` (views, followed here as views of the placeholder); `scaled_dot_product_attention` on the pair is
answered by the layer (`layer.attend_packed(query, mask, scale)`), which reads its packed storage. Dynamo traces
`__torch_function__` of such a subclass like any Python function, so the step stays one graph.

The layer is duck-typed: `attend_packed(query [batch, heads, n, dim], mask bool [batch, 1, n, slots] or None,
scale) -> [batch, heads, n, value_dim]`; no mask is causal (the queries are the last `n` tokens held: SDPA's
`is_causal` over a prompt's own keys, as transformers asks it of a prompt into an empty static cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_VIEWS = {torch.Tensor.__getitem__, torch.Tensor.expand, torch.Tensor.reshape, torch.Tensor.view}
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous}  # fmt: skip


class PackedKV(torch.Tensor):
    """Keys (`which` 0) or values (1) of one layer (`layer`, a class attribute: one subclass per layer and index)."""

    layer = None
    which = 0  # (not `index`: a Tensor attribute)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = {**dict(zip(_SDPA_ARGS[: len(args)], args, strict=False)), **kwargs}
            return _attend(cls.layer, call)
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _VIEWS and args and type(args[0]) is cls:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(cls)  # a view of zero strides: no memory
        raise RuntimeError(
            f"a compiled cache's keys and values were read by {getattr(func, '__name__', func)}: only "
            "scaled_dot_product_attention reads them (load the model with attn_implementation='sdpa', transformers' "
            "default, or give the cache the model so that it hands other attentions decoded tensors)"
        )


def _attend(layer, call: dict) -> torch.Tensor:
    key, value, mask = call["key"], call["value"], call.get("attn_mask")
    if not (isinstance(key, PackedKV) and isinstance(value, PackedKV)):
        raise RuntimeError("scaled_dot_product_attention was given a compiled cache's keys or values with other ones")
    if type(key).which != 0 or type(value).which != 1 or call.get("dropout_p", 0.0):
        raise RuntimeError("a compiled cache layer serves scaled_dot_product_attention(query, keys, values, mask)")
    if call.get("is_causal", False) and (mask is not None or key.shape[-2] != call["query"].shape[-2]):
        # (transformers' prompt into an empty static cache: no mask, causal over the prompt's own keys)
        raise RuntimeError("a compiled cache layer serves is_causal=True only over as many keys as queries, unmasked")
    if mask is not None and mask.dtype != torch.bool:
        raise RuntimeError(f"a compiled cache layer takes a boolean attention mask, got {mask.dtype}")
    query = call["query"]
    scale = call.get("scale")
    return layer.attend_packed(query, mask, scale if scale is not None else query.shape[-1] ** -0.5)


def packed_classes(layer) -> tuple[type, type]:
    """The subclasses standing for `layer`'s keys and values (made once per layer)."""
    return tuple(type("PackedKV", (PackedKV,), {"layer": layer, "which": which}) for which in (0, 1))


def packed_pair(classes: tuple[type, type], keys_shape, values_shape, dtype, device):
    """Keys and values of `keys_shape` / `values_shape` standing for a layer's storage (`classes`: `packed_classes`)."""
    scalar = torch.zeros((), dtype=dtype, device=device)
    return tuple(
        scalar.expand(shape).as_subclass(c) for c, shape in zip(classes, (keys_shape, values_shape), strict=True)
    )
