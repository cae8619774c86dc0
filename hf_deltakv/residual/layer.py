"""One model layer of the learned residual cache: sinks, references, residual codes and a raw recent window.

Storage, per layer (all counted by `nbytes`):
- the first `sink_tokens` tokens and the last `window` tokens raw (up to `CODE_BATCH - 1` more while decoding), keys
  after RoPE as the model gave them;
- every `stride`-th token after the sinks a reference: pre-RoPE key and value (heads concatenated) in
  `reference_format` (`stride=0`: no references);
- every other token that has left the window: packed latent codes of its residual against the mean of its
  `top_k` nearest earlier references (against zero without references), fp16 group scales, and the ids of those
  references (int16).
Tokens are compressed when they slide out of the window (`CODE_BATCH` at a time while decoding), in order, so their
references already exist.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels
from ..kernels.layout import RopeAngles
from ..kernels.online_softmax import OnlineSoftmax
from ..layers import PositionLog, StreamLayer
from ..quant import QuantizedTensor, owned
from ..rope import RopeForm
from .attention import attend_coded
from .codec import decode_residuals, encode_residuals
from .compressor import LayerCompressor, ResidualLayout
from .references import is_reference, load_references, reference_mean, split_tokens
from .tokens import heads_to_tokens, tokens_to_heads

# Decoding codes the tokens leaving the raw window this many at a time: coding one token costs the encoder's fixed
# overhead (~40 small ops per layer, 17 ms of a 182 ms bf16 step at 4K on SmolLM2), coding 16 costs little more. The
# window then holds `window` to `window + CODE_BATCH - 1` raw tokens (counted in the bytes); an update of several tokens
# (a prefill) codes all but the last `window`, as training sees them (`window.code_window`).
CODE_BATCH = 16


class ResidualLayer(StreamLayer):
    """Cache layer storing tokens as learned residual codes against long-range references.

    Args:
        compressor: this layer's trained encoder/decoder.
        bits: bit depth of each latent group (0 = dropped).
        layout: references, sinks and raw window (`ResidualLayout`; `sink_tokens` is taken from it).
        rope, positions: see `StreamLayer`.
    """

    def __init__(
        self,
        compressor: LayerCompressor,
        bits: list[int],
        layout: ResidualLayout,
        rope: RopeForm | None = None,
        positions: PositionLog | None = None,
        window: int | None = None,
    ) -> None:
        self.compressor, self.bits, self.layout = compressor, bits, layout
        super().__init__(layout.sink_tokens, rope, positions, window)

    def _clear_stream(self) -> None:
        self.window_keys = self.window_values = None  # raw, [B, H, <= window, D]
        self.references: QuantizedTensor | None = None  # [B, R, 2 * H * D]
        self.codes = self.scales = self.reference_ids = None  # [B, C, bytes], [B, C, groups], [B, C, top_k]
        self.compressed = 0  # tokens after the sinks that have left the window

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.compressor.to(key_states.device)  # shared by every cache built from it; a no-op once there
        expected = self.compressor.stream_dim
        for name, t in (("keys", key_states), ("values", value_states)):
            if t.shape[1] * t.shape[3] != expected:
                raise ValueError(
                    f"{name} have {t.shape[1]} heads of {t.shape[3]} channels, but the residual compressor was "
                    f"trained for {expected} channels per token: load the compressor trained for this model"
                )

    def _append_stream(self, keys: torch.Tensor, values: torch.Tensor, begin: int) -> None:
        keys, values = self._to_sink(keys), self._to_sink(values)  # raw, saturating as sinks do
        if self.window_keys is None:
            self.window_keys, self.window_values = keys.clone(), values.clone()
        else:
            self.window_keys = torch.cat([self.window_keys, keys], dim=2)
            self.window_values = torch.cat([self.window_values, values], dim=2)
        overflow = self.window_keys.shape[2] - self.layout.window
        if overflow >= CODE_BATCH or (overflow > 0 and keys.shape[2] > 1):
            self._compress(overflow)

    def _compress(self, n: int) -> None:
        """Move the oldest `n` window tokens into reference or residual storage."""
        keys, values = self.window_keys[:, :, :n].float(), self.window_values[:, :, :n].float()
        self.window_keys = owned(self.window_keys[:, :, n:])
        self.window_values = owned(self.window_values[:, :, n:])
        # Tokens leave the window during an update, before cumulative_length counts the new ones; the sinks are full.
        begin = self.sink_tokens + self.compressed
        if self.rope is not None:
            keys = kernels.undo_rope(keys, self.positions.ids[:, begin : begin + n], self.rope.freqs, self.rope.order)
        if self.layout.stride == 0:  # no references: every token coded against zero (split_tokens' answer, cheaper)
            self._append_codes(
                *encode_residuals(self.compressor, self.bits, heads_to_tokens(keys), heads_to_tokens(values))
            )
            self.compressed += n
            return
        x = torch.cat([heads_to_tokens(keys), heads_to_tokens(values)], dim=-1)
        index = torch.arange(self.compressed, self.compressed + n, device=x.device)
        split = split_tokens(x, index, self.layout, self.references)
        if split.stored is not None:
            stored = [q for q in (self.references, split.stored) if q is not None]
            self.references = QuantizedTensor.cat(stored, 1)
        coded = ~split.is_reference
        if coded.any():
            dim = self.compressor.stream_dim
            residual = x[:, coded] - split.bases
            packed, scales = encode_residuals(self.compressor, self.bits, residual[..., :dim], residual[..., dim:])
            self._append_codes(packed, scales)
            if split.ids is not None:
                ids = split.ids.to(torch.int16)
                self.reference_ids = ids if self.reference_ids is None else torch.cat([self.reference_ids, ids], 1)
        self.compressed += n

    def _append_codes(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes = packed if self.codes is None else torch.cat([self.codes, packed], dim=1)
        self.scales = scales if self.scales is None else torch.cat([self.scales, scales], dim=1)

    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys_parts, value_parts = [], []
        if self.compressed:
            dim = self.compressor.stream_dim
            x = torch.empty(self.batch_size, self.compressed, 2 * dim, device=self.device)
            is_ref = is_reference(torch.arange(self.compressed, device=self.device), self.layout.stride)
            if self.references is not None:
                refs = load_references(self.references)
                x[:, is_ref] = refs
            if self.codes is not None:
                residual_k, residual_v = decode_residuals(self.compressor, self.bits, self.codes, self.scales)
                coded = torch.cat([residual_k, residual_v], dim=-1)
                if self.reference_ids is not None:
                    coded = coded + reference_mean(refs, self.reference_ids.long())
                x[:, ~is_ref] = coded
            keys = tokens_to_heads(x[..., :dim], self.kv_heads)
            if self.rope is not None:
                begin = self.sink_tokens
                keys = self.rope.redo(keys, self.positions.ids[:, begin : begin + self.compressed])
            keys_parts.append(keys)
            value_parts.append(tokens_to_heads(x[..., dim:], self.kv_heads))
        if self.window_keys is not None and self.window_keys.shape[2]:
            keys_parts.append(self.window_keys.float())
            value_parts.append(self.window_values.float())
        if not keys_parts:
            return None
        return torch.cat(keys_parts, dim=2), torch.cat(value_parts, dim=2)

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention read from storage: sinks and window raw, coded tokens through `attend_coded` (values attended
        in latent space). With references (`stride` > 0) the history is decoded first (`StreamLayer.attend`)."""
        if self.codes is None or self.references is not None:
            return super().attend(query, mask, scale)
        offset = self._first_stored()
        mask = self._stored_mask(mask, query.shape[2])
        state = OnlineSoftmax(query, scale, mask, self.cumulative_length - offset)
        first = self.sink_tokens - offset
        # Raw parts (keys, values, first position): sinks and window. A lone query without a mask sees every key, so
        # a decoding step folds both in one product (each fold is ~10 small ops per layer).
        raw = [(self.sink_keys, self.sink_values, 0)] if self.sink_keys is not None else []
        if self.window_keys is not None and self.window_keys.shape[2]:
            raw.append((self.window_keys, self.window_values, first + self.compressed))
        if len(raw) == 2 and mask is None and query.shape[2] == 1:
            raw = [(torch.cat([raw[0][0], raw[1][0]], dim=2), torch.cat([raw[0][1], raw[1][1]], dim=2), 0)]
        for keys, values, start in raw:
            state.add(keys, values, start=start)

        def rope(begin: int, end: int) -> RopeAngles | None:
            return None if self.rope is None else self._rope_angles(self.sink_tokens + begin, self.sink_tokens + end)

        canonical = self.rope.to_canonical if self.rope is not None else None
        attend_coded(state, self.compressor, self.bits, self.codes, self.scales, first, self.kv_heads, rope, canonical)
        return state.result()

    def _truncate_stream(self, tokens: int) -> None:
        """A crop within the raw window drops raw tokens; coded tokens are not decoded back, so deeper is refused."""
        if tokens < self.compressed:
            raise ValueError(
                f"ResidualKVCache crops only within its raw window of the last {self.layout.window} tokens: "
                f"{self.compressed - tokens} coded tokens would have to be dropped"
            )
        keep = tokens - self.compressed
        if self.window_keys is not None:
            self.window_keys = owned(self.window_keys[:, :, :keep])
            self.window_values = owned(self.window_values[:, :, :keep])

    def _stored(self) -> list:
        return [self.window_keys, self.window_values, self.references, self.codes, self.scales, self.reference_ids]

    def _stream_held(self) -> list:
        return self._stored()

    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.window_keys is not None:
            self.window_keys, self.window_values = fn(self.window_keys), fn(self.window_values)
        if self.references is not None:
            self.references = self.references.map(fn)
        if self.codes is not None:
            self.codes, self.scales = fn(self.codes), fn(self.scales)
        if self.reference_ids is not None:
            self.reference_ids = fn(self.reference_ids)
