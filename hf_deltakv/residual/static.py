"""`StaticResidualKVCache`: the learned residual cache with its storage preallocated to `max_cache_len` tokens, whose
decoding step compiles (`torch.compile`, one graph, no recompiles), as the other caches of `hf_deltakv.static`.

Each layer (`PackedResidualLayer`) holds the raw sinks, a raw window of `window + CODE_BATCH` rows, and the latent
codes and scales of the tokens that left it (`max_cache_len - sinks - window` rows): what `ResidualLayer` holds, in
buffers that never grow. A prompt runs `ResidualKVCache`'s own layers; a decoding step is two ops per layer
(`residual.ops`: `latent_append`, `latent_attention_step`), whose arguments are the storage and the compressor's
weights as tensors (read once, at the first forward: a compressor changed afterwards is not followed).
"""

from __future__ import annotations

import dataclasses

import torch

from ..layers.base import given_position_ids
from ..layers.static import PositionedLayer, _rows
from ..quant.bitpack import GROUP
from ..static import StaticStreamCache
from . import ops
from .attention import coded_weights, latent_coder
from .cache import ResidualKVCache
from .layer import CODE_BATCH, ResidualLayer


class PackedResidualLayer(PositionedLayer):
    """A `ResidualLayer` without references (`stride=0`, the built-in compressor's layout) whose storage holds
    `max_cache_len` tokens and whose decoding step compiles (`layers.static.EagerPromptLayer`): the same bytes, the
    same attention.

    Args:
        inner: the eager layer.
        max_cache_len: tokens the layer can hold.
        shared, last: as `layers.static.PositionedLayer`.
    """

    def __init__(self, inner: ResidualLayer, max_cache_len: int, shared, last: bool) -> None:
        super().__init__(inner, max_cache_len, 2, shared, last)
        if not isinstance(inner, ResidualLayer) or inner.layout.stride:
            raise ValueError(
                "max_cache_len serves ResidualKVCache without references (stride=0, the built-in compressor's "
                "layout): its references would be looked up among every earlier token at each coding"
            )
        if inner.window:
            raise ValueError("max_cache_len serves full-attention layers")
        self.bits = [int(b) for b in inner.bits]
        self.window = inner.layout.window

    def _make_storage(self, make, dim: int, value_dim: int) -> None:
        stream = max(self.max_cache_len - self.sinks, 0)
        rows = min(self.window + CODE_BATCH, stream)  # (the most the window holds before it codes CODE_BATCH)
        self.window_keys = make(rows, dim, dtype=self.sink_keys.dtype)
        self.window_values = make(rows, value_dim, dtype=self.sink_keys.dtype)
        kept = [b for b in self.bits if b]
        coded = max(stream - self.window, 0)
        self.codes = torch.zeros(self.batch_size, coded, sum(GROUP * b // 8 for b in kept), dtype=torch.uint8,
                                 device=self.device)  # fmt: skip
        self.scales = torch.zeros(self.batch_size, coded, len(kept), dtype=torch.float16, device=self.device)
        self._make_positions()
        compressor = self.inner.compressor.to(self.device)
        coder = latent_coder(compressor, tuple(self.bits))
        self.coder = [getattr(coder, f.name) for f in dataclasses.fields(coder)]  # (LatentCoder's order)
        weights = coded_weights(compressor, self.bits, self.num_heads)
        self.decoders = [weights.key_decoder, weights.value_decoder]
        if not torch.compiler.is_compiling():
            for t in (*self.coder, *self.decoders):
                torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (batch first; the shared positions and the compressor's weights not included)."""
        return [self.sink_keys, self.sink_values, self.window_keys, self.window_values, self.codes, self.scales]

    def _append_step(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> None:
        ids = given_position_ids(kwargs, None, 1, key_states)  # (None: the op takes the count of tokens held)
        key_mean, value_mean, key_encoder, value_encoder = self.coder[:4]
        torch.ops.hf_deltakv.latent_append(
            key_states, value_states, ids, self.sink_keys, self.sink_values, self.window_keys, self.window_values,
            self.codes, self.scales, self.positions, self.freqs, self.order, key_mean, value_mean, key_encoder,
            value_encoder, self.counts, bits=self.bits, window=self.window,
        )  # fmt: skip

    def _attend_step(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        batch, heads, n, dim = query.shape
        if n > 1:  # transformers' GQA query heads of the one token packed as rows: one query per head, as the eager
            # layer is given them (the same sums, bit for bit)
            query, mask = query.reshape(batch, heads * n, 1, dim), None if mask is None else mask[:, :1]
        out = torch.ops.hf_deltakv.latent_attention_step(
            query, mask, self.sink_keys, self.sink_values, self.window_keys, self.window_values, self.codes,
            self.scales, self.positions, self.freqs, self.order, *self.coder, *self.decoders, self.counts,
            bits=self.bits, scale=scale,
        )  # fmt: skip
        return out.reshape(batch, heads, n, -1)

    def _window_length(self) -> int:
        held, coded = self.counts.tolist()
        return max(held - self.sinks - coded, 0)

    def _stream_to_inner(self, stream: int) -> None:
        inner, coded = self.inner, int(self.counts[ops.CODED])
        length = self._window_length()
        inner.window_keys, inner.window_values = (t[:, :, :length].clone() for t in (self.window_keys,
                                                                                     self.window_values))  # fmt: skip
        inner.codes, inner.scales = (t[:, :coded].clone() if coded else None for t in (self.codes, self.scales))
        inner.compressed = coded
        self._positions_to_inner(int(self.counts[ops.TOKENS]))

    def _from_inner(self) -> None:
        inner = self.inner
        held = inner.cumulative_length
        self._sinks_from_inner()
        length = inner._window_length()
        if length:
            self.window_keys[:, :, :length] = inner.window_keys
            self.window_values[:, :, :length] = inner.window_values
        coded = inner.compressed
        if coded:
            self.codes[:, :coded] = inner.codes
            self.scales[:, :coded] = inner.scales
        self.counts.copy_(torch.tensor([held, coded]))
        self._positions_from_inner(held)

    def used_nbytes(self) -> int:
        """Bytes of what the tokens held fill: the sinks, the window's tokens, the codes (what the eager layer holds
        for them, less its buffers' room)."""
        if not self.is_initialized:
            return 0
        held, coded = self.counts.tolist()
        used = [_rows(t, min(held, self.sinks)) for t in (self.sink_keys, self.sink_values)]
        used += [_rows(t, self._window_length()) for t in (self.window_keys, self.window_values)]
        return sum(used) + sum(t[0, 0].nbytes * t.shape[0] * coded for t in (self.codes, self.scales) if t.numel())


class StaticResidualKVCache(StaticStreamCache):
    """`ResidualKVCache` whose decoding step compiles: each layer's storage holds `max_cache_len` tokens from the first
    forward on and is written in place (`PackedResidualLayer`): the same codes and tokens as `ResidualKVCache`.
    `nbytes()` counts the capacity, `used_nbytes()` what the tokens held fill. Needs the model (`model=`), SDPA
    attention (transformers' default), full-attention layers, and a layout without references (`stride=0`, the
    built-in compressor's).

    Args:
        model: the model.
        compressor, window, sink_tokens, uncompressed_layers: as `ResidualKVCache`.
        max_cache_len: tokens the cache can hold (prompt and new tokens).

    >>> # cache = StaticResidualKVCache(model=model, max_cache_len=4096)
    >>> # model.generate(**inputs, cache=cache, compile_config=CompileConfig(fullgraph=True, dynamic=False))
    """

    def __init__(
        self,
        model,
        compressor=None,
        window: int | None = None,
        sink_tokens: int | None = None,
        uncompressed_layers: tuple[int, ...] | None = None,
        *,
        max_cache_len: int,
        stride: int | None = None,
    ) -> None:
        eager = ResidualKVCache(model, compressor, stride=stride, window=window, sink_tokens=sink_tokens,
                                uncompressed_layers=uncompressed_layers)  # fmt: skip
        self.compressor, self.layout = eager.compressor, eager.layout
        super().__init__(eager, PackedResidualLayer, max_cache_len, model)
