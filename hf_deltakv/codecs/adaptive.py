"""Per-channel groups with the bits placed where attention needs them: DeltaKVCache's key codec.

Keys (before RoPE especially) have channels of very different ranges, and queries weigh channels very differently.
A group of `group` tokens (aligned to absolute positions, like a video codec's group of pictures) stores, per
channel, a range (`low`, fp16, and a step, fp16: the clipped range that codes the channel's tokens best, `CLIPS`),
and every token's code in that channel at the channel's own bit depth (1-8 bits, `quant.bitplanes`). The depths
of a group spend a fixed budget of `bits * dim` bits per token where they reduce the attention-score error most:
channel `c` gets about `bits + log2(range_c * sqrt(w_c)) - mean` bits (reverse water-filling), `w_c` being the mean
squared query of that channel, paired as RoPE pairs channels, over the positions before the group (causal: observed
by the cache layer when attention reads it, `observe`). Before any query is seen (the first group, or attention that
never goes through the layer), all channels weigh the same.

Tokens of an unfinished group, and complete groups not yet flushed, are held raw (fp16, counted in the bytes): a
group is coded when it is complete and the queries before it have been observed (`flush`, at the next read).

Measured on both real models (benchmarks/ablation_kld.py, keys alone): KL divergence 0.0019 (SmolLM2) / 0.0091
(Gemma 3) against 0.0075 / 0.0123 for KIVI's per-channel 4 bits; the query weights pay on SmolLM2 (0.0033 without)
but not on Gemma 3 (0.0084 without). Per-channel prediction from the previous token (closed-loop DPCM, chosen per
channel and group) did not pay and is not used here.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quant import FP16_MAX, owned, pack_4bit, saturate_fp16
from ..quant.bitplanes import MAX_BITS
from .base import StreamCodec, append_along_seq

GROUPS = (8, 16, 32, 64)  # token group sizes (a plane is a whole number of bytes; the kernels read up to 64)
CODED = ("planes", "depths", "low", "step")  # the state of coded groups, one row per group


def allocate_bits(score: torch.Tensor, total: int) -> torch.Tensor:
    """Integer depths in 1..8 per entry of the last dimension `[..., D]`, summing to `total` in every row, about
    `total / D + log2(sqrt(score)) - mean` (reverse water-filling of a uniform quantizer's error `score * 2**-2b`).

    `score` is each channel's error weight at one bit (its range squared times its query weight); non-finite or zero
    scores get the least. Deterministic: the water level is found by bisection, then the bits left over go to the
    largest fractional depths (the lower channel index first on ties).
    """
    dim = score.shape[-1]
    if not dim <= total <= MAX_BITS * dim:
        raise ValueError(f"{total} bits cannot be spread over {dim} channels at 1 to {MAX_BITS} bits each")
    finite = torch.isfinite(score) & (score > 0)
    level = torch.where(finite, score, torch.ones_like(score)).log2() * 0.5
    lowest = level.masked_fill(~finite, float("inf")).amin(-1, keepdim=True).clamp(max=0) - 2 * MAX_BITS
    level = torch.where(finite, level, lowest.expand_as(level))
    return kernels.allocate_depths(level, total, MAX_BITS)


# Fractions of a channel's range given up at its low and high ends, tried in every pair: each channel of a group keeps
# the clipped range that codes its tokens with the least squared error (the encoder's choice; the decoder reads low and
# step as before). Extremes of a few tokens otherwise stretch the step of all: at 3 bits per key (kf=64) the clipping
# cuts the keys' KL divergence by a quarter on SmolLM2 and by 40 % on Gemma 3 (validation text; docs/codec.md).
CLIPS = torch.tensor([(a, b) for a in (0, 0.03, 0.06, 0.1, 0.15, 0.2) for b in (0, 0.03, 0.06, 0.1, 0.15, 0.2)])
CLIP_ELEMENTS = 1 << 20  # candidate codes per pass of the encoder: groups are coded in chunks of ~4 MB


@torch.no_grad()  # codes carry no gradient, and the search works in place (even when a forward records autograd)
def clipped_codes(x: torch.Tensor, low: torch.Tensor, span: torch.Tensor, levels: torch.Tensor, clips: torch.Tensor):
    """Codes `uint8 [..., group, D]`, low and step (fp16 `[..., D]`) of groups `x` `[..., group, D]` at `levels + 1`
    levels per channel, each channel over the candidate range of `clips` (rows of `CLIPS`) that reconstructs it best.

    The candidates' errors are computed in place in one `[..., group, D, candidates]` buffer (the search is bound by
    memory traffic); the chosen candidate's codes are then computed again, by the same arithmetic."""
    clips = clips.to(x.device)
    lows = (low.unsqueeze(-1) + clips[:, 0] * span.unsqueeze(-1)).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    highs = low.unsqueeze(-1) + span.unsqueeze(-1) * (1 - clips[:, 1])
    steps = ((highs - lows.float()) / levels.unsqueeze(-1)).clamp(0, FP16_MAX).to(torch.float16)  # [..., D, C]
    step_f, low_f = steps.float().unsqueeze(-3), lows.float().unsqueeze(-3)  # [..., 1, D, C]
    error = _codes(x.unsqueeze(-1), low_f, step_f, levels.unsqueeze(-2).unsqueeze(-1))
    error.mul_(step_f).add_(low_f).sub_(x.unsqueeze(-1)).square_()
    best = error.sum(-3).nan_to_num_(float("inf")).argmin(-1, keepdim=True)  # ties (and NaN) keep the whole range
    low, step = lows.gather(-1, best).squeeze(-1), steps.gather(-1, best).squeeze(-1)
    codes = _codes(x, low.float().unsqueeze(-2), step.float().unsqueeze(-2), levels.unsqueeze(-2))
    return codes.to(torch.uint8), low, step


def _codes(x: torch.Tensor, low: torch.Tensor, step: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Float codes of `x` on the grid `low + k * step`, k in 0..top (a new tensor, then modified in place)."""
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    codes = (x - low).mul_(inverse).round_().nan_to_num_(0.0).clamp_min_(0)
    return torch.minimum(codes, top, out=codes)


class AdaptiveChannelCodec(StreamCodec):
    """Groups of tokens coded per channel at query-weighted bit depths.

    Args:
        group: tokens per group (8, 16, 32 or 64), aligned to absolute positions.
        bits: mean bits per code (a budget of `bits * dim` per token, `bits * dim` an integer).
        offset: absolute position of the stream's first token (the cache layer's raw sink tokens come before it).
        query_weights: weigh the channels by the queries observed (off: by their ranges alone; for the ablation).
        clip_range: code each channel over the clipped range of `CLIPS` with the least error (off: its whole range).
    """

    def __init__(
        self, *, group: int, bits: float, offset: int, query_weights: bool = True, clip_range: bool = True
    ) -> None:
        super().__init__()
        if group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"bits must be a number in [1, {MAX_BITS}], got {bits!r}")
        self.group, self.bits, self.query_weights, self.clip_range = group, float(bits), query_weights, clip_range
        # The stream's first token sits in absolute group `first_group`, at slot `pad` of it.
        self.first_group, self.pad = divmod(offset, group)
        self.planes = self.depths = self.low = self.step = None  # coded groups
        self.tail = None  # fp16 [B, H, t, D]: tokens not yet coded
        self.coded = 0  # coded groups
        # Encoder state: summed pair energies of the queries observed (fp32 [B, H, D]) and over how many positions;
        # the same sums before the start of each absolute group still to code (group -> (sum, positions)).
        self.energy = None
        self.observed = 0
        self.before_group: dict[int, tuple[torch.Tensor, int]] = {}

    @property
    def observes_queries(self) -> bool:
        return self.query_weights

    def state_names(self) -> tuple[str, ...]:
        return ("planes", "depths", "low", "step", "tail", "energy")

    def held(self) -> list:
        return [*super().held(), self.before_group]

    def map_batch(self, fn) -> None:
        super().map_batch(fn)
        self.before_group = {g: (fn(e), n) for g, (e, n) in self.before_group.items()}

    def _budget(self, dim: int) -> int:
        total = self.bits * dim
        if total != int(total):
            raise ValueError(f"bits * head_dim must be a whole number of bits, got {self.bits} * {dim}")
        return int(total)

    def append(self, x: torch.Tensor) -> None:
        if self.tail is None:
            self._budget(x.shape[-1])
        self.tail = append_along_seq(self.tail, saturate_fp16(x))
        self.length += x.shape[2]

    def observe(self, energy: torch.Tensor, first: int) -> None:
        """Queries' pair energies `[B, H, n, D]` at absolute positions `first ... first + n - 1`, in order; positions
        already observed are skipped. Records the sums before every group start they cross."""
        skip = max(self.observed - first, 0)
        energy = energy[:, :, skip:].float()
        first += skip
        n = energy.shape[2]
        if not n:
            return
        total = self.energy if self.energy is not None else torch.zeros_like(energy[:, :, 0])
        start = -(-(first + 1) // self.group) * self.group  # group starts s with first < s <= first + n
        for s in range(start, first + n + 1, self.group):
            if s // self.group >= self.first_group + self.coded:
                self.before_group[s // self.group] = (total + energy[:, :, : s - first].sum(2), s)
        self.energy = total + energy.sum(2)
        self.observed = first + n

    def flush(self) -> None:
        """Code every complete group of the tail, with the query weights observed before each."""
        if self.tail is None:
            return
        slots = self.pad + self.length  # slots from the start of the stream's first group
        complete = slots // self.group - self.coded
        if complete <= 0:
            return
        batch, heads, _, dim = self.tail.shape
        pad = self.pad if self.coded == 0 else 0
        take = complete * self.group - pad
        x = self.tail[:, :, :take].float()
        if pad:  # the slots before the stream (sink tokens) repeat its first token, so they change no range
            x = torch.cat([x[:, :, :1].expand(batch, heads, pad, dim), x], dim=2)
        grouped = x.view(batch, heads, complete, self.group, dim)
        first = self.first_group + self.coded
        planes, depths, low, step = self._encode(grouped, self._weights(range(first, first + complete), grouped))
        for name, value in zip(CODED, (planes, depths, low, step), strict=True):
            self._append_rows(name, value)  # in place, in a buffer with room: a flush does not copy the history
        self.tail = owned(self.tail[:, :, take:])
        for g in range(first, first + complete):
            self.before_group.pop(g, None)
        self.coded += complete

    def _weights(self, groups: range, like: torch.Tensor) -> torch.Tensor | None:
        """Mean query pair energy before each absolute group's start `[B, H, groups, D]`, None when none was seen
        (or `query_weights` is off: depths from the ranges alone, for the ablation)."""
        if not self.query_weights:
            return None
        rows = []
        for g in groups:
            total, count = self.before_group.get(g, (None, 0))
            if not count and self.energy is not None and self.observed <= g * self.group:
                total, count = self.energy, self.observed
            rows.append(total / count if count else None)
        if all(r is None for r in rows):
            return None
        ones = torch.ones_like(like[:, :, 0, 0])
        return torch.stack([ones if r is None else r for r in rows], dim=2)

    def _encode(self, x: torch.Tensor, weights: torch.Tensor | None):
        """Code groups `x` fp32 `[B, H, G, group, D]`: (planes, packed depths, low, step)."""
        low, high = x.amin(3), x.amax(3)
        span = high - low
        score = span.pow(2) if weights is None else span.pow(2) * weights
        depths = allocate_bits(score, self._budget(x.shape[-1]))
        levels = ((1 << depths.long()) - 1).float()
        clips = CLIPS if self.clip_range else CLIPS[:1]  # the first candidate is the whole range
        chunk = max(1, CLIP_ELEMENTS // max(x[:, :, :1].numel() * len(clips), 1))  # groups per pass
        parts = [
            clipped_codes(*(t[:, :, g : g + chunk] for t in (x, low, span, levels)), clips)
            for g in range(0, x.shape[2], chunk)
        ]
        codes, low, step = (torch.cat(t, dim=2) for t in zip(*parts, strict=True))
        return kernels.pack_planes(codes, depths), pack_4bit(depths), low, step

    def _coded_tokens(self) -> int:
        """Stream tokens held in coded groups (the first coded group may start after sink slots)."""
        return self.coded * self.group - self.pad if self.coded else 0

    def droppable(self, tokens: int) -> int:
        """Whole coded groups only: the first holds `group - pad` tokens, the others `group`."""
        tokens = min(tokens, self._coded_tokens())
        if tokens < self.group - self.pad:
            return 0
        return (tokens + self.pad) // self.group * self.group - self.pad

    def drop_front(self, tokens: int) -> None:
        groups = (tokens + self.pad) // self.group
        for name in CODED:
            setattr(self, name, owned(getattr(self, name)[:, :, groups:]))  # the dropped groups are freed
        self._release_rows()
        self.coded -= groups
        self.first_group += groups
        self.pad = 0
        self.length -= tokens

    def truncate(self, tokens: int) -> None:
        """Keep the first `tokens`: a cut inside a coded group decodes its kept tokens back into the raw tail (they
        are coded again when the group fills up). Query statistics gathered so far are kept."""
        coded = self._coded_tokens()
        if tokens >= coded:
            self.tail = owned(self.tail[:, :, : tokens - coded])
        else:
            keep = (tokens + self.pad) // self.group  # whole groups before the cut
            start = keep * self.group - self.pad if keep else 0
            partial = saturate_fp16(kernels.decode_stream(self.layout(), start, tokens))
            for name in CODED:
                value = owned(getattr(self, name)[:, :, :keep])
                setattr(self, name, value if keep else None)
            self._release_rows()
            self.coded = keep
            self.tail = partial.contiguous()
        self.length = tokens
        self.observed = min(self.observed, self.first_group * self.group + self.pad + tokens)
        first_open = self.first_group + self.coded
        self.before_group = {g: v for g, v in self.before_group.items() if g >= first_open}

    def layout(self) -> kernels.AdaptiveStream:
        self.flush()
        return kernels.AdaptiveStream(
            planes=self.planes,
            bits=self.depths,
            low=self.low,
            step=self.step,
            tail=self.tail,
            group=self.group,
            offset=self.pad,
            dim=self.tail.shape[-1],
            length=self.length,
        )
