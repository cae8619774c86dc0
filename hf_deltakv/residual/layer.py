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
references already exist. The window and the codes live in buffers with room (counted in `nbytes`): a decoding step
writes its token into the window's room, and a coding step its codes into the codes' room, so that neither copies
what is stored (without references, on GPUs: one launch each, `kernels.write_raw` and `kernels.encode_latent_into`,
and attention in two, `kernels.latent_stream_attention`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels
from ..codecs import base as storage
from ..codecs.base import ROOM_FRACTION
from ..kernels.layout import LatentStream, RopeAngles
from ..kernels.online_softmax import OnlineSoftmax
from ..layers import PositionLog, StreamLayer
from ..quant import QuantizedTensor, owned
from ..quant.bitpack import GROUP
from ..rope import RopeForm
from .attention import attend_coded, latent_coder
from .codec import decode_residuals, encode_residuals
from .compressor import LayerCompressor, ResidualLayout
from .references import load_references, reference_mean, split_positions, split_tokens
from .tokens import heads_to_tokens, tokens_to_heads

# Decoding codes the tokens leaving the raw window this many at a time: coding one token costs the encoder's fixed
# overhead (~40 small ops per layer, 17 ms of a 182 ms bf16 step at 4K on SmolLM2), coding 16 costs little more. The
# window then holds `window` to `window + CODE_BATCH - 1` raw tokens (counted in the bytes); an update of several tokens
# (a prefill) codes all but the last `window`, as training sees them (`window.code_window`).
CODE_BATCH = 16
# Rows of room the raw window's buffer keeps for decoding steps (or 1/ROOM_FRACTION of the window, if more): the window
# (a few dozen tokens) is moved into a larger buffer every few steps at most, never copied at every step.
WINDOW_ROOM = CODE_BATCH // 4


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
        self.window_keys = self.window_values = None  # raw, [B, H, <= window, D]: views into a buffer with room
        self.references: QuantizedTensor | None = None  # [B, R, 2 * H * D]
        self.codes = self.scales = self.reference_ids = None  # [B, C, bytes], [B, C, groups], [B, C, top_k]
        self.compressed = 0  # tokens after the sinks that have left the window
        self._growing_window = self._growing_codes = None  # the buffers behind the views (keys, values / codes, scales)

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
        n = keys.shape[2]
        buffers, at = self._window_room(n)
        kernels.write_raw(keys, values, *buffers, at)  # raw, saturating as sinks do
        self.window_keys, self.window_values = (t[:, :, at - self._window_length() : at + n] for t in buffers)
        overflow = self.window_keys.shape[2] - self.layout.window
        if overflow >= CODE_BATCH or (overflow > 0 and n > 1):
            storage.settle_growth()  # (the window's tokens moved into a grown buffer are read now)
            self._compress(overflow)
            self._rebuffer_window()

    def _window_length(self) -> int:
        return 0 if self.window_keys is None else self.window_keys.shape[2]

    def _window_room(self, n: int, room: int | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """The window's buffers and the row where `n` new tokens go (after its tokens): the buffers when they have
        room and the views are still theirs, else new ones with the window's tokens moved over and `room` rows more
        (default: `WINDOW_ROOM`, or 1/`ROOM_FRACTION` of the window, for the next decoding steps' tokens; none for a
        prefill's)."""
        held, length = self._growing_window, self._window_length()
        if held is not None and self.window_keys is not None and _same_storage(self.window_keys, held[0]):
            end = (self.window_keys.storage_offset() - held[0].storage_offset()) // held[0].stride(2) + length
            if end + n <= held[0].shape[2]:
                return held, end
        if room is None:  # (a prefill's tokens: as many rows; the window keeps its last ones)
            room = 0 if self.window_keys is None and n > 1 else max(WINDOW_ROOM, (length + n) // ROOM_FRACTION)
        like = (self.batch_size, self.kv_heads, length + n + room)
        grown = (torch.empty(*like, self.head_dim, dtype=self.sink_dtype, device=self.device),
                 torch.empty(*like, self.value_dim, dtype=self.sink_dtype, device=self.device))  # fmt: skip
        if length:
            storage.move_rows(grown[0][:, :, :length], self.window_keys)  # (grown buffers are counted there)
            storage.move_rows(grown[1][:, :, :length], self.window_values)
        self._growing_window = grown
        return grown, length

    def _rebuffer_window(self) -> None:
        """After coding: a buffer much larger than what the window holds (a prefill's) is let go, the window's tokens
        moved into one of their size (the next decoding step grows it, with room)."""
        held = self._growing_window
        if held is not None and held[0].shape[2] > 2 * (self._window_length() + CODE_BATCH):
            self._growing_window = None
            buffers, at = self._window_room(0, room=0)
            self.window_keys, self.window_values = (t[:, :, :at] for t in buffers)

    def _codes_room(self, n: int) -> tuple[LatentStream, int]:
        """The codes' and scales' buffers and the row where `n` more tokens' go (grown when short, with room for
        `ROOM_FRACTION` of them and at least a coding step's; a prefill's first codes get none)."""
        held, have = self._growing_codes, 0 if self.codes is None else self.codes.shape[1]
        if held is not None and have and _same_storage(self.codes, held[0]) and held[0].shape[1] >= have + n:
            return LatentStream(*held, tuple(self.bits)), have
        rows = have + n + (max(CODE_BATCH, (have + n) // ROOM_FRACTION) if have else 0)
        kept = [b for b in self.bits if b]
        grown = (torch.empty(self.batch_size, rows, sum(GROUP * b // 8 for b in kept), dtype=torch.uint8,
                             device=self.device),
                 torch.empty(self.batch_size, rows, len(kept), dtype=torch.float16, device=self.device))  # fmt: skip
        if have:  # (the copies see them as [B, 1, rows, ...])
            storage.move_rows(grown[0][:, None, :have], self.codes[:, None])
            storage.move_rows(grown[1][:, None, :have], self.scales[:, None])
        self._growing_codes = grown
        return LatentStream(*grown, tuple(self.bits)), have

    def _compress(self, n: int) -> None:
        """Move the oldest `n` window tokens into reference or residual storage."""
        # Tokens leave the window during an update, before cumulative_length counts the new ones; the sinks are full.
        begin = self.sink_tokens + self.compressed
        if self.layout.stride == 0:  # no references: every token coded against zero (split_tokens' answer, cheaper)
            target, at = self._codes_room(n)
            turn = (None, None, None)
            if self.rope is not None:
                turn = (self.positions.at(self.device)[:, begin : begin + n], *self.rope.on(self.device))
            coder = latent_coder(self.compressor, tuple(self.bits))
            raw = (self.window_keys[:, :, :n], self.window_values[:, :, :n])
            kernels.encode_latent_into(*raw, *turn, coder, tuple(self.bits), target, at)
            self.codes, self.scales = target.codes[:, : at + n], target.scales[:, : at + n]
            self.window_keys, self.window_values = self.window_keys[:, :, n:], self.window_values[:, :, n:]
            self.compressed += n
            return
        keys, values = self.window_keys[:, :, :n].float(), self.window_values[:, :, :n].float()
        self.window_keys = owned(self.window_keys[:, :, n:])
        self.window_values = owned(self.window_values[:, :, n:])
        self._growing_window = None
        if self.rope is not None:
            ids = self.positions.at(self.device)[:, begin : begin + n]
            keys = kernels.undo_rope(keys, ids, *self.rope.on(self.device))
        x = torch.cat([heads_to_tokens(keys), heads_to_tokens(values)], dim=-1)
        split = split_tokens(x, self.compressed, self.layout, self.references)
        if split.stored is not None:
            stored = [q for q in (self.references, split.stored) if q is not None]
            self.references = QuantizedTensor.cat(stored, 1)
        if split.coded_at.numel():
            dim = self.compressor.stream_dim
            residual = x.index_select(1, split.coded_at) - split.bases
            packed, scales = encode_residuals(self.compressor, self.bits, residual[..., :dim], residual[..., dim:])
            self._append_codes(packed, scales)
            if split.ids is not None:
                ids = split.ids.to(torch.int16)
                self.reference_ids = ids if self.reference_ids is None else torch.cat([self.reference_ids, ids], 1)
        self.compressed += n

    def _append_codes(self, packed: torch.Tensor, scales: torch.Tensor) -> None:
        target, at = self._codes_room(packed.shape[1])
        target.codes[:, at : at + packed.shape[1]] = packed
        target.scales[:, at : at + packed.shape[1]] = scales
        self.codes, self.scales = target.codes[:, : at + packed.shape[1]], target.scales[:, : at + packed.shape[1]]

    def _decode_stream(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys_parts, value_parts = [], []
        if self.compressed:
            dim = self.compressor.stream_dim
            x = torch.empty(self.batch_size, self.compressed, 2 * dim, device=self.device)
            ref_at, coded_at = split_positions(0, self.compressed, self.layout.stride, self.device)
            if self.references is not None:
                refs = load_references(self.references)
                x.index_copy_(1, ref_at, refs.to(x.dtype))
            if self.codes is not None:
                residual_k, residual_v = decode_residuals(self.compressor, self.bits, self.codes, self.scales)
                coded = torch.cat([residual_k, residual_v], dim=-1)
                if self.reference_ids is not None:
                    coded = coded + reference_mean(refs, self.reference_ids.long())
                x.index_copy_(1, coded_at, coded.to(x.dtype))
            keys = tokens_to_heads(x[..., :dim], self.kv_heads)
            if self.rope is not None:
                begin = self.sink_tokens
                keys = self.rope.redo(keys, self.positions.at(self.device)[:, begin : begin + self.compressed])
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
        in latent space), or on GPUs `kernels.latent_stream_attention` (one query per head). With references
        (`stride` > 0) the history is decoded first (`StreamLayer.attend`)."""
        if self.codes is None or self.references is not None:
            return super().attend(query, mask, scale)
        offset = self._first_stored()
        mask = self._stored_mask(mask, query.shape[2])
        first = self.sink_tokens - offset
        served = self._attend_kernel(query, mask, scale, first)
        if served is not None:
            return served
        if mask is not None and query.shape[2] == 1 and mask.device.type == "cpu" and bool(mask.all()):
            mask = None  # (every token visible: the causal rule is the same, whether a mask was given or not)
        state = OnlineSoftmax(query, scale, mask, self.cumulative_length - offset)
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

    def _attend_kernel(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, first: int):
        """`kernels.latent_stream_attention` over the sinks, the coded tokens (mask columns from `first`) and the
        window, or None where it does not serve (then the chunked path runs)."""
        batch, q_heads, n, dim = query.shape
        if mask is not None and mask.shape[1] != 1:
            return None
        empty = query.new_empty(batch, self.kv_heads, 0, dim)
        raw = [(self.sink_keys if self.sink_keys is not None else empty,
                self.sink_values if self.sink_values is not None else empty, 0),
               (self.window_keys if self.window_keys is not None else empty,
                self.window_values if self.window_values is not None else empty, first + self.compressed)]  # fmt: skip
        rope, order = None, None
        if self.rope is not None:
            rope = self._rope_angles(self.sink_tokens, self.sink_tokens + self.compressed)
            order = self.rope.on(self.device)[1]
        coder = latent_coder(self.compressor, tuple(self.bits))
        stream = LatentStream(self.codes, self.scales, tuple(self.bits))
        grouped = query.unflatten(1, (self.kv_heads, q_heads // self.kv_heads))  # [B, kv heads, group, n, D]: a view
        out = kernels.latent_stream_attention(grouped, raw, stream, coder, rope, order, first,
                                              None if mask is None else mask[:, 0], n,
                                              self.cumulative_length - self._first_stored() - n, scale)  # fmt: skip
        return None if out is None else out.reshape(batch, q_heads, n, -1)

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
            self._growing_window = None

    def _stored(self) -> list:
        return [self.window_keys, self.window_values, self.references, self.codes, self.scales, self.reference_ids]

    def _stream_held(self) -> list:
        return self._stored()

    def _map_stream(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._growing_window = self._growing_codes = None
        if self.window_keys is not None:
            self.window_keys, self.window_values = fn(self.window_keys), fn(self.window_values)
        if self.references is not None:
            self.references = self.references.map(fn)
        if self.codes is not None:
            self.codes, self.scales = fn(self.codes), fn(self.scales)
        if self.reference_ids is not None:
            self.reference_ids = fn(self.reference_ids)


def _same_storage(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` lies in `buffer`'s storage (a state not replaced since the buffer was made)."""
    return view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
