"""Let a model's attention read an hf_deltakv cache directly, chunk by chunk, instead of a reconstructed history.

By default a cache's `update` returns the reconstruction of every cached token (what one-forward perplexity
measures). Inside `compressed_attention(model)` the model runs with the `"hf_deltakv"` attention implementation,
registered in `transformers`' `AttentionInterface` (and `AttentionMaskInterface`, with SDPA's boolean mask, so masks
keep working), and the caches' `update` returns an empty marker that names its layer. The registered attention
function then asks the layer to attend (`StreamLayer.attend`): a fused kernel where one applies, else the chunked
online-softmax reference, so decoding never builds a full-precision copy of the history. Inputs without a marker
(other caches, no cache) go to SDPA unchanged.

>>> from hf_deltakv import DeltaKVCache, compressed_attention
>>> with compressed_attention(model):                                     # doctest: +SKIP
...     model.generate(**inputs, cache=DeltaKVCache(model=model))       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import nn

NAME = "hf_deltakv"
_READS_COMPRESSED = contextvars.ContextVar("hf_deltakv_reads_compressed", default=False)
_MARKER = "_hf_deltakv_layer"


def reads_compressed() -> bool:
    """True inside `compressed_attention`: cache layers return markers, not reconstructions."""
    return _READS_COMPRESSED.get()


def marker(layer: object, like: torch.Tensor, dim: int) -> torch.Tensor:
    """An empty `[batch, kv_heads, 0, dim]` tensor naming `layer`: what `update` returns to the attention function.

    Empty on purpose: any other attention implementation that received it would fail or produce NaN, loudly.
    """
    out = like.new_empty(like.shape[0], like.shape[1], 0, dim)
    setattr(out, _MARKER, layer)
    return out


def compressed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `"hf_deltakv"` attention implementation (signature of `transformers`' attention functions)."""
    layer = getattr(key, _MARKER, None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("compressed attention does not support softcapping or learned attention sinks")
    if dropout:
        raise ValueError("compressed attention is for inference: dropout must be 0")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"compressed attention expects a boolean mask, got {attention_mask.dtype}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = layer.attend(query, attention_mask, scale)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register `"hf_deltakv"` with `transformers`' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, compressed_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def compressed_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` with attention read straight from hf_deltakv caches; restores its attention on exit.

    Args:
        model: a `transformers` model whose attention goes through `AttentionInterface` (most decoder models).
    """
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise ValueError(f"compressed_attention needs a transformers PreTrainedModel, got {type(model).__name__}")
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation to {NAME!r}")
    token = _READS_COMPRESSED.set(True)
    try:
        yield model
    finally:
        _READS_COMPRESSED.reset(token)
        model.set_attn_implementation(previous)
