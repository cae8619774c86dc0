"""Caches for compiled decoding (`torch.compile`, CUDA graphs): storage preallocated to `max_cache_len` tokens.

`StaticQuantizedKVCache(..., max_cache_len=N, model=model)` is transformers' `StaticCache`
with llama.cpp-style packed storage (`layers.static.PackedStaticLayer`). `generate` compiles its decoding step by
itself (`cache.is_compileable`) on GPUs, and on the CPU when the compile config asks (`_compile_all_devices`).
"""

from __future__ import annotations

from torch import nn
from transformers.cache_utils import Cache

from .cache import model_layer_types, text_config
from .layers.static import PackedStaticLayer
from .quant import get_format


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
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive integer, got {max_cache_len!r}")
        if not isinstance(model, nn.Module):
            raise ValueError("max_cache_len needs the model (model=...): every layer's storage is made up front")
        get_format(k_format), get_format(v_format)
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be True or False, got {rotate!r}")
        kinds = set(model_layer_types(model))
        if kinds != {"full_attention"}:
            raise ValueError(
                f"max_cache_len serves models whose every layer attends fully for now; this one has {sorted(kinds)} "
                "layers: leave max_cache_len out (the cache then grows as needed and is not compiled)"
            )
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
