"""Keyframes plus closed-loop quantized deltas, like a video codec's I- and P-frames.

Every `kf`-th token of a stream is a keyframe, quantized on its own. Every other token is stored as the quantized
difference from the *reconstruction* of its reference (the previous token, or its group's keyframe), so the
error of each token is that of one quantization step, at any distance from its keyframe. Decoding is the
keyframe plus a prefix sum of the dequantized deltas.

With `intra=True`, each block of channels of a token may instead be coded against a long-term reference, whichever
reconstructs it better: the inter/intra decision of video codecs. The long-term reference is the stream's running
mean (`mean_reference=True`; zero otherwise), snapshotted in fp16 on a fixed schedule (`kernels.layout.SNAPSHOTS`:
16, 64, 256 and 1024 tokens, then every 2048), and used only for later tokens (causal). Keys before RoPE carry a large
per-channel offset and only weak token-to-token correlation, so in many blocks the mean predicts better than the
previous token does. The one flag bit per block lives in the least significant mantissa bit of the block's fp16
scale (a relative change of the scale of at most 2**-10), so it costs no extra storage.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.hadamard import rotate
from ..kernels.layout import SNAPSHOTS
from ..kernels.reference import long_term_reference
from ..quant import QuantizedTensor, dequantize, get_format, quantize, saturate_fp16
from .base import StreamCodec

REFERENCES = ("previous", "keyframe")
STEP_TOKENS = 64  # new tokens up to this many are coded one after the other (a decoding step's, a chunk's)
MAX_KF = 4096  # a prefill codes whole keyframe groups: memory and time grow with kf, so it is bounded


class DeltaCodec(StreamCodec):
    """Closed-loop delta coding of one stream.

    The options have no defaults here: the caches that build a codec hold the one default of each.

    Args:
        kf: keyframe interval in tokens (1 makes every token a keyframe).
        delta_format: block format of the deltas.
        keyframe_format: block format of the keyframes.
        reference: `"previous"` (delta from the previous token's reconstruction) or `"keyframe"` (from the group's
            keyframe reconstruction).
        intra: let each block of a delta token be coded against the long-term reference instead, when that
            reconstructs it better (one flag bit per block, carried in the scale).
        mean_reference: the long-term reference is the stream's running mean (else zero: plain coding).
    """

    def __init__(
        self, *, kf: int, delta_format: str, keyframe_format: str, reference: str, intra: bool, mean_reference: bool
    ) -> None:
        super().__init__()
        if not isinstance(kf, int) or isinstance(kf, bool) or not 1 <= kf <= MAX_KF:
            raise ValueError(f"kf must be an integer in [1, {MAX_KF}], got {kf!r}")
        if reference not in REFERENCES:
            raise ValueError(f"reference must be one of {REFERENCES}, got {reference!r}")
        fmt = get_format(delta_format)
        get_format(keyframe_format)
        if intra and fmt.name == "f16":
            raise ValueError("intra=True needs a block-quantized delta_format (e.g. q4_0, q8_0), not f16")
        self.kf = kf
        self.delta_format = delta_format
        self.keyframe_format = keyframe_format
        self.reference = reference
        self.intra = intra
        self.mean_reference = intra and mean_reference
        self.keyframes = None  # QuantizedTensor [B, H, groups, ...]
        self.deltas = None  # QuantizedTensor [B, H, non-keyframe tokens, ...]
        # fp32 [B, H, 1, D]: what the next token of an unfinished group is coded against, kept so that appending
        # never decodes history: the last token's reconstruction, or the group's keyframe reconstruction.
        self.reference_state = None
        self.running_sum = None  # fp32 [B, H, 1, D]: sum of all inputs, for the next mean snapshot
        self.means = None  # fp16 [B, H, snapshots, D]

    def state_names(self) -> tuple[str, ...]:
        return ("keyframes", "deltas", "reference_state", "running_sum", "means")

    def _take_snapshots(self, x: torch.Tensor) -> None:
        """Record the mean snapshots due within this chunk (each from the tokens before its point)."""
        start, end = self.length, self.length + x.shape[2]
        before = self.running_sum if self.running_sum is not None else torch.zeros_like(x[:, :, :1])
        points = [p for p in range(start + 1, end + 1) if SNAPSHOTS.count(p) > SNAPSHOTS.count(p - 1)]
        if points:
            sums = before + x.cumsum(dim=2)  # sums[:, :, i] = sum of tokens < start + i + 1
            self._store("means", saturate_fp16(torch.stack([sums[:, :, p - start - 1] / p for p in points], dim=2)))
        self.running_sum = before + (x if x.shape[2] == 1 else x.sum(dim=2, keepdim=True))

    def _store(self, name: str, new: QuantizedTensor | torch.Tensor) -> None:
        """Rows `new` appended to state `name`, written into its buffer's room (grown when short: `_reserve`)."""
        packed = isinstance(new, QuantizedTensor)
        first = new.codes if packed else new
        rows = first.shape[2]

        def make(count: int) -> QuantizedTensor | torch.Tensor:
            lead = (*first.shape[:2], count)
            if packed:
                return QuantizedTensor.empty(new.fmt, lead, new.dim, first.device)
            return first.new_empty(*lead, *first.shape[3:])

        target, at = self._reserve(name, rows, make)
        kernels.reference.write_rows(target, new, at)
        self._commit_rows(name, rows)

    def _snapshot_index(self, position: int) -> int:
        """Index in `means` of the long-term reference of the token at `position` (-1: none yet, zero reference);
        positions past the stream (the rest of an unfinished group) get the newest snapshot: they are never coded."""
        if not self.mean_reference or self.means is None:
            return -1
        return min(SNAPSHOTS.count(position) - 1, self.means.shape[2] - 1)

    def _means_at(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The long-term reference of tokens at `positions` (see `kernels.reference.long_term_reference`)."""
        means = self.means if self.mean_reference else None
        return long_term_reference(means, SNAPSHOTS, positions, like.shape)

    def _kernel_block(self, x: torch.Tensor) -> int | None:
        """Block size when the fused encode kernel applies on `x`'s device (q4_0 deltas from the previous token,
        dim / block a power of two), else None."""
        fmt = get_format(self.delta_format)
        blocks = x.shape[-1] // fmt.block_size
        supported = fmt.name in ("q4_0", "q4_0_16") and self.reference == "previous"
        if not supported or x.shape[-1] % fmt.block_size or blocks & (blocks - 1) or not kernels.use_triton(x.device):
            return None
        return fmt.block_size

    def _encode_groups(
        self, slots: torch.Tensor, long_term: torch.Tensor, keyframes: torch.Tensor
    ) -> tuple[QuantizedTensor, torch.Tensor]:
        """Code offsets 1..kf-1 of every group with `kernels.delta_encode_groups`."""
        batch, heads, groups, kf, dim = slots.shape
        block = self._kernel_block(slots)
        codes, scales, recon = kernels.delta_encode_groups(
            slots.reshape(-1, groups, kf, dim),
            long_term.reshape(-1, groups, kf, dim) if self.intra else None,
            keyframes.reshape(-1, groups, dim),
            block,
        )
        stacked = QuantizedTensor(
            get_format(self.delta_format),
            dim,
            codes.view(batch, heads, groups, kf - 1, *codes.shape[-2:]),
            scales.view(batch, heads, groups, kf - 1, -1),
        )
        return stacked, recon.view(batch, heads, groups, kf, dim)

    def append_model(self, x: torch.Tensor, turn: tuple | None = None) -> None:
        self.append_turned(x, turn, 0)

    def append_rotated(self, x: torch.Tensor, rotation: int) -> None:
        self.append_turned(x, None, rotation)

    def append_turned(self, x: torch.Tensor, turn: tuple | None, rotation: int) -> None:
        """New tokens as the model gives them, turned back by their RoPE (`turn`) and rotated (`rotation`): a decoding
        step's tokens in one op (`kernels.delta_tokens`: one kernel on GPUs), a prefill's through `append`."""
        if x.shape[2] <= STEP_TOKENS and self.keyframes is not None:
            self._append_steps(x, turn, rotation)
            return
        x = x.float() if turn is None else kernels.undo_rope(x.float(), *turn)
        self.append(rotate(x) if rotation else x)

    def append(self, x: torch.Tensor) -> None:
        batch, heads, new, dim = x.shape
        kf, start = self.kf, self.length % self.kf
        x = x.float()
        if new <= STEP_TOKENS and self.keyframes is not None:
            self._append_steps(x, None, 0)
            return
        if self.mean_reference:
            self._take_snapshots(x)
        groups = (start + new + kf - 1) // kf
        slots = torch.zeros(batch, heads, groups * kf, dim, dtype=torch.float32, device=x.device)
        slots[:, :, start : start + new] = x
        slots = slots.view(batch, heads, groups, kf, dim)
        positions = torch.arange(self.length - start, self.length - start + groups * kf, device=x.device)
        long_term = self._means_at(positions, x).view(batch, heads, groups, kf, dim)  # zeros without means
        recon = torch.zeros_like(slots)
        anchor = torch.zeros_like(slots[:, :, :, 0])
        if start and self.reference == "keyframe":
            anchor[:, :, 0] = self.reference_state[:, :, 0]

        first_group = 1 if start else 0
        if start == 0 or groups > 1:
            key = quantize(slots[:, :, first_group:, 0], self.keyframe_format)
            recon[:, :, first_group:, 0] = dequantize(key)
            anchor[:, :, first_group:] = recon[:, :, first_group:, 0]
            self._store("keyframes", key)
        stacked = None  # QuantizedTensor [B, H, groups, len(offsets), ...]
        if start == 0 and kf > 1 and self._kernel_block(x) is not None:
            # Whole groups from their keyframes: the fused closed-loop kernel, parallel over streams and groups.
            offsets = range(1, kf)
            stacked, recon = self._encode_groups(slots, long_term, recon[:, :, :, 0])
        else:
            coded: list[QuantizedTensor] = []
            # Within a single group only the offsets of the new tokens need coding (one step per decoded token).
            offsets = range(max(start, 1), start + new) if groups == 1 else range(1, kf)
            for offset in offsets:
                base = recon[:, :, :, offset - 1] if self.reference == "previous" else anchor
                if start and offset == start and self.reference == "previous":
                    # The first group continues a group begun in an earlier call: its reference is the last token.
                    base = torch.cat([self.reference_state, base[:, :, 1:]], dim=2)
                long = long_term[:, :, :, offset]
                q, recon[:, :, :, offset] = kernels.reference.code_delta(
                    slots[:, :, :, offset], base, long, self.delta_format, self.intra
                )
                coded.append(q)
            if coded:
                stacked = QuantizedTensor.cat([c.map(lambda t: t.unsqueeze(3)) for c in coded], dim=3)

        if stacked is not None:
            # The delta tokens of this chunk in sequence order: slot (group, offset) for the coded offsets. Slots are in
            # increasing position, so the new tokens' are one run, found on the host (no device value is read back).
            flat = stacked.map(lambda t: t.flatten(2, 3))
            position = (torch.arange(groups)[:, None] * kf + torch.tensor(list(offsets), dtype=torch.long)).flatten()
            lo, hi = int((position < start).sum()), int((position < start + new).sum())
            self._store("deltas", flat.map(lambda t: t[:, :, lo:hi]))

        end = start + new - 1
        if self.reference == "keyframe":
            self.reference_state = anchor[:, :, end // kf].unsqueeze(2).clone()
        else:
            self.reference_state = recon.view(batch, heads, groups * kf, dim)[:, :, end : end + 1].clone()
        self.length += new

    def _append_steps(self, x: torch.Tensor, turn: tuple | None, rotation: int) -> None:
        """New tokens `[B, H, n, D]` after the first keyframe (as the model gives them: `turn` and `rotation` as
        `append_turned` takes them), coded one after the other as `append` codes them (same bytes, tested) without its
        whole-group scaffolding, in one op (`kernels.delta_tokens`) writing into the room of the storage."""
        batch, heads, new, dim = x.shape
        keys, deltas, snaps = kernels.DeltaRows.counts(self.length, new, self.kf, SNAPSHOTS, self.mean_reference)

        def room(fmt: str):
            return lambda rows: QuantizedTensor.empty(get_format(fmt), (batch, heads, rows), dim, x.device)

        key_rows, key_at = self._reserve("keyframes", keys, room(self.keyframe_format))
        delta_rows, delta_at = self._reserve("deltas", deltas, room(self.delta_format)) if deltas else (None, 0)
        means, mean_at = None, 0
        if snaps:
            fp16 = lambda rows: torch.empty(batch, heads, rows, dim, dtype=torch.float16, device=x.device)  # noqa: E731
            means, mean_at = self._reserve("means", snaps, fp16)
        index = self._snapshot_index(self.length) if self.intra else -1  # the newest snapshot before these tokens
        long_term = self.means[:, :, index] if index >= 0 else None
        rows = kernels.DeltaRows(key_rows, key_at, delta_rows, delta_at, means, mean_at, self.length, self.kf,
                                 self.reference == "previous", self.intra, SNAPSHOTS)  # fmt: skip
        running = self.running_sum if self.mean_reference else None
        self.reference_state, total = kernels.delta_tokens(x, turn, rotation, self.reference_state, running,
                                                           long_term, rows)  # fmt: skip
        for name, count in (("keyframes", keys), ("deltas", deltas), ("means", snaps)):
            if count:
                self._commit_rows(name, count)
        if self.mean_reference:
            self.running_sum = total
        self.length += new

    def truncate(self, tokens: int) -> None:
        """Keep the first `tokens`: codes are cut, and the closed loop continues from the reconstruction of the last
        kept token (or its group's keyframe); mean snapshots taken later are dropped, and the running sum restarts
        from the reconstructions (the inputs are not kept)."""
        if tokens == 0:
            self.__init__(**self._options())
            return
        groups = -(-tokens // self.kf)
        decoded = self.decode_range(0, tokens)
        self.keyframes = self.keyframes.map(lambda t: t[:, :, :groups])
        if self.deltas is not None:
            self.deltas = self.deltas.map(lambda t: t[:, :, : tokens - groups])
        if self.reference == "keyframe":
            self.reference_state = decoded[:, :, (tokens - 1) // self.kf * self.kf].unsqueeze(2).clone()
        else:
            self.reference_state = decoded[:, :, -1:].clone()
        if self.mean_reference:
            kept = SNAPSHOTS.count(tokens)
            self.means = self.means[:, :, :kept] if self.means is not None and kept else None
            self.running_sum = decoded.sum(dim=2, keepdim=True)
        self.length = tokens

    def _options(self) -> dict:
        names = ("kf", "delta_format", "keyframe_format", "reference", "intra", "mean_reference")
        return {name: getattr(self, name) for name in names}

    def layout(self) -> kernels.DeltaStream:
        return kernels.DeltaStream(
            keyframes=self.keyframes,
            deltas=self.deltas,
            means=self.means if self.mean_reference else None,
            kf=self.kf,
            reference=self.reference,
            intra=self.intra,
            dim=self.keyframes.dim,
            length=self.length,
            snapshots=SNAPSHOTS,
        )
