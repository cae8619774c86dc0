"""Caches for compiled decoding (`torch.compile`, CUDA graphs): storage preallocated to `max_cache_len` tokens.

`StaticQuantizedKVCache(..., max_cache_len=N, model=model)` is transformers' `StaticCache` with llama.cpp-style
packed storage (`layers.static.PackedStaticLayer`); `StaticDeltaKVCache`, `StaticKIVIKVCache`,
`StaticStreamingLLMCache` and `StaticSnapKVCache` are `DeltaKVCache`, `KIVIKVCache`, `StreamingLLMCache` and
`SnapKVCache` with their storage preallocated (`layers.static.EagerPromptLayer`). `generate` compiles their decoding
step by itself (`cache.is_compileable`) on GPUs, and on the CPU when the compile config asks (`_compile_all_devices`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import model_layer_types, text_config
from .layers.static import (
    PackedChannelLayer,
    PackedDeltaLayer,
    PackedKeptLayer,
    PackedStaticLayer,
    PackedTokenLayer,
    SharedPositions,
)
from .quant import get_format


def _check_capacity(max_cache_len: int, model) -> None:
    """`max_cache_len` a positive integer, `model` a model whose every layer attends fully."""
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
    if not isinstance(model, nn.Module):
        raise ValueError("max_cache_len needs the model (model=...): every layer's storage is made up front")
    kinds = set(model_layer_types(model))
    if kinds != {"full_attention"}:
        raise ValueError(
            f"max_cache_len serves models whose every layer attends fully for now; this one has {sorted(kinds)} "
            "layers: leave max_cache_len out (the cache then grows as needed and is not compiled)"
        )


class StaticQuantizedKVCache(Cache):
    """llama.cpp-style quantized KV cache (every token quantized on its own, per block of 32) that compiles: each
    layer's storage holds `max_cache_len` tokens from the first forward on and is written in place.

    The same bytes as `QuantizedKVCache` with the same formats (`nbytes()` counts the whole capacity, as it is
    allocated; `used_nbytes()` the tokens held). In a decoding step SDPA reads the packed storage (one op per layer,
    `kernels.ops`); a prompt, or an attention other than SDPA, reads it decoded (see `layers.static`). Sinks,
    pre-RoPE keys and sliding-window layers are not served yet.

    Args:
        k_format: block format of keys (`q4_0`, `q4_1`, `q8_0`, `f16`, ...).
        v_format: block format of values.
        rotate: Hadamard-rotate head vectors before quantizing.
        max_cache_len: tokens the cache can hold (prompt and new tokens).
        model: the model (its layer count and layer types).

    >>> from transformers import CompileConfig
    >>> # cache = StaticQuantizedKVCache("q8_0", "q4_0", rotate=True, max_cache_len=4096, model=model)
    >>> # model.generate(**inputs, cache=cache, compile_config=CompileConfig(fullgraph=True, dynamic=False))
    """

    def __init__(
        self, k_format: str = "q4_0", v_format: str = "q4_0", rotate: bool = False, *, max_cache_len: int, model
    ) -> None:
        _check_capacity(max_cache_len, model)
        get_format(k_format), get_format(v_format)
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be True or False, got {rotate!r}")
        self.max_cache_len = max_cache_len
        self.options = {"k_format": k_format, "v_format": v_format, "rotate": rotate, "max_cache_len": max_cache_len}
        layers = len(model_layer_types(model))
        sdpa = getattr(text_config(model), "_attn_implementation", None) == "sdpa"  # else: decoded tensors
        make = lambda: PackedStaticLayer(max_cache_len, k_format, v_format, rotate, packed_attention=sdpa)  # noqa: E731
        super().__init__(layers=[make() for _ in range(layers)])

    def nbytes(self) -> int:
        """Bytes held: every layer's storage for `max_cache_len` tokens (allocated at the first forward)."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_nbytes(self) -> int:
        """Bytes of the tokens held so far (what the same cache grown as needed holds)."""
        return sum(layer.used_nbytes() for layer in self.layers)


class StaticStreamCache(Cache):
    """What the compileable forms of our eager caches share: an eager cache (`eager`) whose layers serve prompts, each
    wrapped in a `layers.static.EagerPromptLayer` subclass (`layer`) holding `max_cache_len` tokens, one position
    buffer for all layers. Needs the model (`model=`), SDPA attention (transformers' default) and full-attention
    layers."""

    def __init__(self, eager, layer, max_cache_len: int, model) -> None:
        _check_capacity(max_cache_len, model)
        if getattr(text_config(model), "_attn_implementation", None) != "sdpa":
            raise ValueError(
                f"a {type(self).__name__} needs attn_implementation='sdpa' (transformers' default): its compiled step "
                "answers scaled_dot_product_attention from the codes"
            )
        self.eager, self.max_cache_len = eager, max_cache_len
        self.options = {**(eager.options or {}), "max_cache_len": max_cache_len}
        self.shared = SharedPositions()
        count = len(model_layer_types(model))
        super().__init__(layers=[layer(eager._new_layer(i), max_cache_len, self.shared, i == count - 1)
                                 for i in range(count)])  # fmt: skip

    def nbytes(self) -> int:
        """Bytes held: every layer's storage for `max_cache_len` tokens and the shared positions (allocated at the
        first forward)."""
        return sum(layer.nbytes() for layer in self.layers) + self.shared.nbytes()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.shared.ids is not None:
            self.shared.ids.copy_(self.shared.ids.index_select(0, beam_idx.to(self.shared.ids.device)))

    def used_nbytes(self) -> int:
        """Bytes the tokens held fill (what the eager cache holds for them, less its buffers' room)."""
        held = int(self.layers[0].counts[0]) if self.layers else 0
        positions = 0 if self.shared.ids is None else self.shared.ids.shape[0] * held * 4
        return sum(layer.used_nbytes() for layer in self.layers) + positions

    def bits_per_element(self) -> float:
        """8 × used_nbytes() / cached key and value scalars (as `CompressedKVCache.bits_per_element`)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        elements = sum(layer.batch_size * layer.num_heads * int(layer.counts[0]) * (layer.k_head_dim + layer.v_head_dim)
                       for layer in layers)  # fmt: skip
        return 8 * self.used_nbytes() / elements if elements else 0.0


class StaticDeltaKVCache(StaticStreamCache):
    """`DeltaKVCache` whose decoding step compiles: each layer's storage holds `max_cache_len` tokens from the first
    forward on and is written in place (`layers.static.PackedDeltaLayer`; `PackedTokenLayer` with `keys="token"`).

    The coding of `DeltaKVCache(kf, key_bits, values, ...)` (adaptive per-channel key groups before RoPE, rotated
    per-token values, raw sinks), the same bytes and tokens: a prompt runs `DeltaKVCache`'s own layers, a decoding
    step two ops per layer (`kernels.ops`). `nbytes()` counts the capacity, `used_nbytes()` what the tokens held
    fill. Needs the model (`model=`), SDPA attention (transformers' default) and full-attention layers.

    Args:
        kf, key_bits, values: as `DeltaKVCache` (its defaults when None).
        max_cache_len: tokens the cache can hold (prompt and new tokens).
        model: the model.
        options: `DeltaKVCache`'s other options (`keys`, `rotate`, `search_scale`, `sink_tokens`, `query_weights`,
            `clip_range`, `bits`, the `keys="token"` options); values in a block format (not `values="delta"`).

    >>> # cache = StaticDeltaKVCache(kf=32, max_cache_len=4096, model=model)
    >>> # model.generate(**inputs, cache=cache, compile_config=CompileConfig(fullgraph=True, dynamic=False))
    """

    def __init__(self, kf: int = 32, key_bits=None, values=None, *, max_cache_len: int, model, **options) -> None:
        from .cache import DEFAULT_KEY_BITS, DEFAULT_VALUES, DeltaKVCache

        key_bits = DEFAULT_KEY_BITS if key_bits is None else key_bits
        values = DEFAULT_VALUES if values is None else values
        eager = DeltaKVCache(kf, key_bits, values, model=model, **options)
        self.kf = kf
        layer = PackedTokenLayer if eager.options["keys"] == "token" else PackedDeltaLayer
        super().__init__(eager, layer, max_cache_len, model)


class StaticKIVIKVCache(StaticStreamCache):
    """`KIVIKVCache` whose decoding step compiles: each layer's storage holds `max_cache_len` tokens from the first
    forward on and is written in place (`layers.static.PackedChannelLayer`).

    The coding of `KIVIKVCache(k_format, v_format, sink_tokens, pre_rope=...)` (keys quantized per channel over
    groups of 32 tokens, the open group raw in fp16; values per token), the same bytes and tokens: a prompt runs
    `KIVIKVCache`'s own layers, a decoding step two ops per layer (`kernels.ops`: `stream_append`,
    `channel_attention`). `nbytes()` counts the capacity, `used_nbytes()` what the tokens held fill. Needs the model
    (`model=`), SDPA attention (transformers' default) and full-attention layers.

    Args:
        k_format, v_format, sink_tokens, pre_rope: as `KIVIKVCache`.
        max_cache_len: tokens the cache can hold (prompt and new tokens).
        model: the model.

    >>> # cache = StaticKIVIKVCache(max_cache_len=4096, model=model)
    """

    def __init__(
        self,
        k_format: str = "q4_1",
        v_format: str = "q4_1",
        sink_tokens: int = 0,
        pre_rope: bool = False,
        *,
        max_cache_len: int,
        model,
    ) -> None:
        from .cache import KIVIKVCache

        eager = KIVIKVCache(k_format, v_format, sink_tokens, model=model, pre_rope=pre_rope)
        super().__init__(eager, PackedChannelLayer, max_cache_len, model)


class StaticStreamingLLMCache(StaticStreamCache):
    """`StreamingLLMCache` whose decoding step compiles (`layers.static.PackedKeptLayer`): fp16 slots preallocated for
    what it keeps of `max_cache_len` tokens (`keep` of them, the sinks first, and the room its buffers grow by), the
    same tokens kept and the same outputs. Needs the model (`model=`), SDPA attention and full-attention layers.

    Args:
        keep, sink_tokens: as `StreamingLLMCache`.
        max_cache_len: tokens the cache can see (prompt and new tokens).
        model: the model.

    >>> # cache = StaticStreamingLLMCache(keep=0.3, max_cache_len=4096, model=model)
    """

    def __init__(self, keep: float = 0.3, sink_tokens: int = 4, *, max_cache_len: int, model) -> None:
        from .cache import StreamingLLMCache

        super().__init__(StreamingLLMCache(keep, sink_tokens, model=model), PackedKeptLayer, max_cache_len, model)


class StaticSnapKVCache(StaticStreamCache):
    """`SnapKVCache` whose decoding step compiles (`layers.static.PackedKeptLayer`), as `StaticStreamingLLMCache`.

    Args:
        keep, window, kernel: as `SnapKVCache`.
        max_cache_len: tokens the cache can see (prompt and new tokens).
        model: the model.
    """

    def __init__(self, keep: float = 0.3, window: int = 32, kernel: int = 7, *, max_cache_len: int, model) -> None:
        from .cache import SnapKVCache

        super().__init__(SnapKVCache(keep, window, kernel, model=model), PackedKeptLayer, max_cache_len, model)
