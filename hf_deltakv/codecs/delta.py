"""Keyframes plus closed-loop quantized deltas, like a video codec's I- and P-frames.

Every `kf`-th token of a stream is a keyframe, quantized on its own. Every other token is stored as the quantized
difference from the *reconstruction* of its reference (the previous token, or its group's keyframe), so the
error of each token is that of one quantization step, at any distance from its keyframe. Decoding is the
keyframe plus a prefix sum of the dequantized deltas.

With `intra=True`, each block of channels of a token may instead be coded against a long-term reference, whichever
reconstructs it better: the inter/intra decision of video codecs. The long-term reference is the stream's running
mean (`mean_reference=True`; zero otherwise), snapshotted in fp16 when the stream reaches 16, 64, 256 and 1024
tokens and every 2048 tokens after that, and used only for later tokens (causal). Keys before RoPE carry a large
per-channel offset and only weak token-to-token correlation, so in many blocks the mean predicts better than the
previous token does. The one flag bit per block lives in the least significant mantissa bit of the block's fp16
scale (a relative change of the scale of at most 2**-10), so it costs no extra storage.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import delta_encode_groups, segmented_prefix_sum, use_triton
from ..quant import QuantizedTensor, dequantize, get_format, quantize
from .base import StreamCodec, append_along_seq, check_range, slice_seq

REFERENCES = ("previous", "keyframe")
GROWING_POINTS = (16, 64, 256)  # mean snapshots taken before LAST_GROWING, which is the fourth
LAST_GROWING, LATER_INTERVAL = 1024, 2048


def snapshots_at_or_before(index: torch.Tensor) -> torch.Tensor:
    """How many mean snapshots exist once the stream holds `index` tokens.

    Snapshots are taken at 16, 64, 256 and 1024 tokens (the mean settles fast), then every 2048 tokens.
    """
    t = index.long()
    growing = sum((t >= point).long() for point in GROWING_POINTS)
    later = len(GROWING_POINTS) + 1 + (t - LAST_GROWING) // LATER_INTERVAL
    return torch.where(t < LAST_GROWING, growing, later)


def snapshot_count(t: int) -> int:
    """`snapshots_at_or_before` of one position, in Python integers (no tensor ops on the per-token path)."""
    if t < LAST_GROWING:
        return sum(t >= point for point in GROWING_POINTS)
    return len(GROWING_POINTS) + 1 + (t - LAST_GROWING) // LATER_INTERVAL


def _with_flags(q: QuantizedTensor, flags: torch.Tensor) -> QuantizedTensor:
    """Store one flag per block in the scale's lowest mantissa bit."""
    bits = q.scales.view(torch.int16)
    bits = (bits & ~1) | flags.to(torch.int16)
    return QuantizedTensor(q.fmt, q.dim, q.codes, bits.view(torch.float16), q.mins)


def _flags(q: QuantizedTensor) -> torch.Tensor:
    return (q.scales.view(torch.int16) & 1).bool()


def _select_blocks(flags: torch.Tensor, a: QuantizedTensor, b: QuantizedTensor) -> QuantizedTensor:
    """Blockwise choice: `a` where `flags`, else `b` (same format and shape)."""

    def pick(x: torch.Tensor | None, y: torch.Tensor | None, f: torch.Tensor) -> torch.Tensor | None:
        return None if x is None else torch.where(f, x, y)

    return QuantizedTensor(
        a.fmt,
        a.dim,
        pick(a.codes, b.codes, flags.unsqueeze(-1)),
        pick(a.scales, b.scales, flags),
        pick(a.mins, b.mins, flags),
    )


def _block_sse(recon: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """Squared error per block, in fp64: exact squares and a sum whose order barely matters, so that kernels summing
    in another order make the same inter/intra choices."""
    pad = (-x.shape[-1]) % block
    err = torch.nn.functional.pad(recon - x, (0, pad)).double() ** 2
    return err.reshape(*err.shape[:-1], -1, block).sum(-1)


def _expand_blocks(flags: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    return flags.repeat_interleave(block, dim=-1)[..., :dim]


def _delta_positions(count: int, kf: int, device: torch.device) -> torch.Tensor:
    """Stream positions of the first `count` non-keyframe tokens (offsets 1..kf-1 of each group)."""
    index = torch.arange(count, device=device)
    return (index // (kf - 1)) * kf + index % (kf - 1) + 1


def code_delta(
    x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool
) -> tuple[QuantizedTensor, torch.Tensor]:
    """Quantize `x - base` in `fmt`; with `intra`, per block the better of that and `x - long_term` (flagged in the
    scale). Returns the stored blocks and the reconstruction the decoder will compute from them."""
    inter = quantize(x - base, fmt)
    inter_rec = base + dequantize(inter)
    if not intra:
        return inter, inter_rec
    coded_intra = quantize(x - long_term, fmt)
    intra_rec = long_term + dequantize(coded_intra)
    block = get_format(fmt).block_size
    use_intra = _block_sse(intra_rec, x, block) < _block_sse(inter_rec, x, block)
    chosen = _with_flags(_select_blocks(use_intra, coded_intra, inter), use_intra)
    # Reconstruct from what is stored (the flagged scale), exactly as the decoder will.
    values = dequantize(chosen)
    flags = _expand_blocks(_flags(chosen), block, x.shape[-1])
    return chosen, torch.where(flags, long_term + values, base + values)


class DeltaCodec(StreamCodec):
    """Closed-loop delta coding of one stream.

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
        self,
        kf: int = 32,
        delta_format: str = "q4_0",
        keyframe_format: str = "q8_0",
        reference: str = "previous",
        intra: bool = True,
        mean_reference: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(kf, int) or isinstance(kf, bool) or kf < 1:
            raise ValueError(f"kf must be an integer >= 1, got {kf!r}")
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
        points = [p for p in range(start + 1, end + 1) if snapshot_count(p) > snapshot_count(p - 1)]
        if points:
            sums = before + x.cumsum(dim=2)  # sums[:, :, i] = sum of tokens < start + i + 1
            snaps = torch.stack([sums[:, :, p - start - 1] / p for p in points], dim=2).to(torch.float16)
            self.means = append_along_seq(self.means, snaps)
        self.running_sum = before + (x if x.shape[2] == 1 else x.sum(dim=2, keepdim=True))

    def _snapshot_index(self, position: int) -> int:
        """Index in `means` of the long-term reference of the token at `position` (-1: none yet, zero reference);
        positions past the stream (the rest of an unfinished group) get the newest snapshot: they are never coded."""
        if not self.mean_reference or self.means is None:
            return -1
        return min(snapshot_count(position) - 1, self.means.shape[2] - 1)

    def _means_at(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The long-term reference of tokens at `positions` (see `_snapshot_index`), `[B, H, n, D]` in fp32."""
        batch, heads, _, dim = like.shape
        if not self.mean_reference or self.means is None or not positions.numel():
            return torch.zeros(batch, heads, positions.numel(), dim, device=like.device)
        n, newest = positions.numel(), self.means.shape[2] - 1
        first, last = (self._snapshot_index(int(positions[i])) for i in (0, -1))
        if first == last:  # one snapshot for all (a decoded token's group): a broadcast slice, no table rebuild
            if first < 0:
                return torch.zeros(batch, heads, n, dim, device=like.device)
            return self.means[:, :, first : first + 1].float().expand(batch, heads, n, dim)
        index = (snapshots_at_or_before(positions) - 1).clamp(max=newest)
        table = torch.cat([torch.zeros_like(self.means[:, :, :1]), self.means], dim=2).float()
        return table.index_select(2, (index + 1).to(table.device))

    def _code_delta(
        self, x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor
    ) -> tuple[QuantizedTensor, torch.Tensor]:
        return code_delta(x, base, long_term, self.delta_format, self.intra)

    def _kernel_block(self, x: torch.Tensor) -> int | None:
        """Block size when the fused encode kernel applies on `x`'s device (q4_0 deltas from the previous token,
        dim / block a power of two), else None."""
        fmt = get_format(self.delta_format)
        blocks = x.shape[-1] // fmt.block_size
        supported = fmt.name in ("q4_0", "q4_0_16") and self.reference == "previous"
        if not supported or x.shape[-1] % fmt.block_size or blocks & (blocks - 1) or not use_triton(x.device):
            return None
        return fmt.block_size

    def _encode_groups(
        self, slots: torch.Tensor, long_term: torch.Tensor, keyframes: torch.Tensor
    ) -> tuple[QuantizedTensor, torch.Tensor]:
        """Code offsets 1..kf-1 of every group with `kernels.delta_encode_groups` (see `reference`)."""
        batch, heads, groups, kf, dim = slots.shape
        block = self._kernel_block(slots)
        codes, scales, recon = delta_encode_groups(
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

    def append(self, x: torch.Tensor) -> None:
        batch, heads, new, dim = x.shape
        kf, start = self.kf, self.length % self.kf
        x = x.float()
        if self.mean_reference:
            self._take_snapshots(x)
        if new == 1 and self.keyframes is not None:
            self._append_token(x[:, :, 0])
            return
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
            self.keyframes = append_along_seq(self.keyframes, key)
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
                q, recon[:, :, :, offset] = self._code_delta(slots[:, :, :, offset], base, long)
                coded.append(q)
            if coded:
                stacked = QuantizedTensor.cat([c.map(lambda t: t.unsqueeze(3)) for c in coded], dim=3)

        if stacked is not None:
            # Gather the delta tokens of this chunk in sequence order: slot (group, offset) for the coded offsets.
            flat = stacked.map(lambda t: t.flatten(2, 3))
            offset_index = torch.tensor(list(offsets), device=x.device)
            position = (torch.arange(groups, device=x.device)[:, None] * kf + offset_index).flatten()
            keep = torch.nonzero((position >= start) & (position < start + new)).squeeze(1)
            self.deltas = append_along_seq(self.deltas, flat.map(lambda t: t.index_select(2, keep)))

        end = start + new - 1
        if self.reference == "keyframe":
            self.reference_state = anchor[:, :, end // kf].unsqueeze(2).clone()
        else:
            self.reference_state = recon.view(batch, heads, groups * kf, dim)[:, :, end : end + 1].clone()
        self.length += new

    def _append_token(self, x: torch.Tensor) -> None:
        """One decoded token `[B, H, D]` after the first: the same arithmetic as the general path of `append` (same
        bytes, tested), without its whole-group scaffolding, which dominates the cost of a decoding step; on the
        CPU through the compiled encode kernels (`kernels.quantize`, `kernels.code_delta`)."""
        offset = self.length % self.kf
        if offset == 0:
            key = kernels.quantize(x, self.keyframe_format)
            self.keyframes = append_along_seq(self.keyframes, key.map(lambda t: t.unsqueeze(2)))
            self.reference_state = dequantize(key).unsqueeze(2)
        else:
            base = self.reference_state[:, :, 0]
            long_term = base  # not read without intra
            if self.intra:
                index = self._snapshot_index(self.length)
                long_term = self.means[:, :, index].float() if index >= 0 else torch.zeros_like(x)
            q, recon = kernels.code_delta(x, base, long_term, self.delta_format, self.intra)
            self.deltas = append_along_seq(self.deltas, q.map(lambda t: t.unsqueeze(2)))
            if self.reference == "previous":
                self.reference_state = recon.unsqueeze(2)
        self.length += 1

    def decode_range(self, start: int, end: int) -> torch.Tensor:
        """Only the keyframe groups overlapping the range are decoded (each group decodes on its own)."""
        check_range(start, end, self.length)
        kf = self.kf
        first, last = start // kf, -(-end // kf)
        keys = dequantize(slice_seq(self.keyframes, first, last))
        batch, heads, groups, dim = keys.shape
        values = torch.zeros(batch, heads, groups * kf, dim, dtype=torch.float32, device=keys.device)
        values.view(batch, heads, groups, kf, dim)[:, :, :, 0] = keys
        flags = None
        if self.deltas is not None:
            stored = slice_seq(self.deltas, first * (kf - 1), last * (kf - 1))
            deltas = dequantize(stored)
            position = _delta_positions(deltas.shape[2], kf, keys.device)  # from the first group's keyframe
            if self.intra:
                block = get_format(self.delta_format).block_size
                token_flags = _expand_blocks(_flags(stored), block, dim)
                if self.mean_reference:
                    deltas = deltas + token_flags * self._means_at(position + first * kf, keys)
                flags = torch.zeros(batch, heads, groups * kf, dim, dtype=torch.bool, device=keys.device)
                flags[:, :, position] = token_flags
                flags = flags.view(batch, heads, groups, kf, dim)
            values[:, :, position] = deltas
        recon = self._decode_groups(values.view(batch, heads, groups, kf, dim), flags)
        return recon.reshape(batch, heads, groups * kf, dim)[:, :, start - first * kf : end - first * kf]

    def _decode_groups(self, values: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        """values `[B, H, G, kf, D]`: keyframe at offset 0, then deltas (or long-term-coded values where `flags`)."""
        if self.reference == "keyframe":
            rec = values + values[:, :, :, :1]
            rec[:, :, :, 0] = values[:, :, :, 0]
            return rec if flags is None else torch.where(flags, values, rec)
        if flags is None:
            return values.cumsum(dim=3)
        # Segmented prefix sum: every intra block (and the keyframe) restarts the running sum of its channels.
        return segmented_prefix_sum(values, flags, dim=3)
