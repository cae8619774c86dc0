"""PyTorch reference implementations: the specification of every op a kernel may replace.

Each function here is what a C++ or Triton kernel of the same name must compute (tests compare the two on odd
shapes). Ops take plain tensors and the stream descriptions of `kernels.layout`, never codec objects.
"""

from __future__ import annotations

import torch

from ..quant import FP16_MAX, QuantizedTensor, dequantize, get_format, pack_4bit, quantize, saturate_fp16, unpack_4bit
from ..quant.bitplanes import MAX_BITS, unpack_planes
from ..quant.bitplanes import pack_planes as _pack_planes
from ..rope import RopeForm, rotate_pairs
from . import basis
from .hadamard import rotate
from .layout import (
    AdaptiveStream,
    BasisStream,
    ChannelStream,
    DeltaRows,
    DeltaStream,
    KeptStream,
    LatentCoder,
    LatentStream,
    Observation,
    PlainStream,
    RopeAngles,
    StreamLayout,
)
from .online_softmax import CHUNK_TOKENS, OnlineSoftmax

__all__ = [
    "code_delta",
    "compact_kept",
    "decode_stream",
    "delta_encode_groups",
    "delta_tokens",
    "dequantize",
    "dequantize_latent",
    "encode_latent_into",
    "keep_rows",
    "kept_attention",
    "kept_channels",
    "latent_attention",
    "latent_stream_attention",
    "long_term_reference",
    "quantize",
    "quantize_latent",
    "segmented_prefix_sum",
    "snapkv_evicted",
    "sparse_matvec",
    "stream_attention",
    "write_raw",
]


# --- the delta codec's closed-loop step -------------------------------------------------------------------------


def with_flags(q: QuantizedTensor, flags: torch.Tensor) -> QuantizedTensor:
    """Store one flag per block in the scale's lowest mantissa bit (a relative change of the scale of <= 2**-10)."""
    bits = q.scales.view(torch.int16)
    bits = (bits & ~1) | flags.to(torch.int16)
    return QuantizedTensor(q.fmt, q.dim, q.codes, bits.view(torch.float16), q.mins)


def block_flags(q: QuantizedTensor) -> torch.Tensor:
    """The flag of every block (see `with_flags`)."""
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


def expand_blocks(flags: torch.Tensor, block: int, dim: int) -> torch.Tensor:
    """Per-block flags `[..., blocks]` repeated over their channels, `[..., dim]`."""
    return flags.repeat_interleave(block, dim=-1)[..., :dim]


def code_delta(
    x: torch.Tensor, base: torch.Tensor, long_term: torch.Tensor, fmt: str, intra: bool
) -> tuple[QuantizedTensor, torch.Tensor]:
    """One closed-loop step of the delta codec: `x - base` quantized in `fmt`, and with `intra` per block the better
    (smaller squared error, summed in fp64) of that and `x - long_term`, flagged in the scale's lowest bit. Returns
    the stored blocks and the reconstruction the decoder computes from them."""
    inter = quantize(x - base, fmt)
    inter_rec = base + dequantize(inter)
    if not intra:
        return inter, inter_rec
    coded_intra = quantize(x - long_term, fmt)
    intra_rec = long_term + dequantize(coded_intra)
    block = get_format(fmt).block_size
    use_intra = _block_sse(intra_rec, x, block) < _block_sse(inter_rec, x, block)
    chosen = with_flags(_select_blocks(use_intra, coded_intra, inter), use_intra)
    # Reconstruct from what is stored (the flagged scale), exactly as the decoder will.
    values = dequantize(chosen)
    flags = expand_blocks(block_flags(chosen), block, x.shape[-1])
    return chosen, torch.where(flags, long_term + values, base + values)


def delta_tokens(
    x: torch.Tensor,
    turn: tuple | None,
    rotation: int,
    reference_state: torch.Tensor,
    running_sum: torch.Tensor | None,
    long_term: torch.Tensor | None,
    rows: DeltaRows,
    undo=None,
    encode=None,
    step=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New tokens of a delta stream that already holds its first keyframe (`codecs.delta`: a decoding step's token, a
    chunk's), coded one after the other into storage with room (`rows`).

    `x` `[batch, heads, n, dim]` as the model gives it is turned back by its RoPE (`turn`: positions `[batch, n]`,
    float64 frequencies, channel order, or None) and rotated (`hadamard.rotate`, when `rotation`). Token by token: a
    keyframe is quantized in its format; another token is one closed-loop step (`code_delta`) from `reference_state`
    (fp32 `[batch, heads, 1, dim]`: the previous token's reconstruction, or its keyframe's) with the long-term
    reference (`long_term` `[batch, heads, dim]`, the newest mean snapshot; None: zero); then it joins `running_sum`
    (None: from zero), and a snapshot due is the sum over the tokens held, saturated to fp16, written into `means` and
    the next tokens' long-term reference. `undo`, `encode` and `step`: the ops used for `undo_rope`, `quantize` and
    `code_delta` (the dispatched ones on the CPU).

    Returns:
        the new `reference_state` and running sum, fp32 `[batch, heads, 1, dim]`.
    """
    x = x.float() if turn is None else (undo or undo_rope)(x.float(), *turn)
    x = rotate(x) if rotation else x
    key_fmt = rows.keyframes.fmt.name
    total = running_sum[:, :, 0] if running_sum is not None else torch.zeros_like(x[:, :, 0])
    long = long_term.float() if long_term is not None else torch.zeros_like(x[:, :, 0])
    base = reference_state[:, :, 0]
    key_at, delta_at, mean_at = rows.key_at, rows.delta_at, rows.mean_at
    for i in range(x.shape[2]):
        token, held = x[:, :, i], rows.start + i
        keyframe = held % rows.kf == 0
        if keyframe:
            coded = (encode or quantize)(token, key_fmt)
            recon = dequantize(coded)
            write_rows(rows.keyframes, coded.map(lambda t: t.unsqueeze(2)), key_at)
            key_at += 1
        else:
            coded, recon = (step or code_delta)(token, base, long, rows.deltas.fmt.name, rows.intra)
            write_rows(rows.deltas, coded.map(lambda t: t.unsqueeze(2)), delta_at)
            delta_at += 1
        if keyframe or rows.previous:
            base = recon
        total = total + token
        if rows.means is not None and rows.snapshots.count(held + 1) > rows.snapshots.count(held):
            rows.means[:, :, mean_at] = saturate_fp16(total / (held + 1))
            long = rows.means[:, :, mean_at].float()
            mean_at += 1
    return base.unsqueeze(2), total.unsqueeze(2)


def delta_encode_groups(
    x: torch.Tensor, long_term: torch.Tensor | None, keyframes: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-loop delta coding of whole keyframe groups (what the delta codec does on a prefill), q4_0 arithmetic.

    Args:
        x: fp32 `[streams, groups, kf, dim]`; offset 0 of each group is its keyframe (not coded here).
        long_term: fp32 like `x`: the intra reference of every token, or None for inter-only coding.
        keyframes: fp32 `[streams, groups, dim]`: the keyframes' reconstructions, where each group's loop starts.
        block: channels per block (16: `q4_0_16`, 32: `q4_0`).

    Returns:
        codes `uint8 [streams, groups, kf - 1, dim / block, block / 2]`, scales `float16 [..., dim / block]` (intra
        flag in the lowest mantissa bit) and the reconstruction of every token `[streams, groups, kf, dim]`.
    """
    fmt = {16: "q4_0_16", 32: "q4_0"}[block]
    recon = [keyframes.float()]
    streams, groups, kf, dim = x.shape
    codes = x.new_empty(streams, groups, kf - 1, dim // block, block // 2, dtype=torch.uint8)
    scales = x.new_empty(streams, groups, kf - 1, dim // block, dtype=torch.float16)
    for offset in range(1, kf):
        reference = long_term[:, :, offset] if long_term is not None else recon[-1]
        q, rec = code_delta(x[:, :, offset], recon[-1], reference, fmt, long_term is not None)
        codes[:, :, offset - 1], scales[:, :, offset - 1] = q.codes, q.scales
        recon.append(rec)
    return codes, scales, torch.stack(recon, dim=2)


def segmented_prefix_sum(values: torch.Tensor, resets: torch.Tensor, dim: int) -> torch.Tensor:
    """Running sum of `values` along `dim` that restarts wherever `resets` is True.

    Args:
        values: fp32 tensor.
        resets: bool tensor broadcastable to `values`; position 0 along `dim` is always a restart.

    Returns:
        `out[i] = values[r] + ... + values[i]` with `r` the last restart at or before `i`.
    """
    resets = resets.expand_as(values).clone()
    resets.narrow(dim, 0, 1).fill_(True)
    shape = [1] * values.dim()
    shape[dim] = values.shape[dim]
    offsets = torch.arange(values.shape[dim], device=values.device).view(shape)
    last_reset = torch.where(resets, offsets, torch.zeros_like(offsets)).cummax(dim=dim).values
    total = values.cumsum(dim=dim)
    return total - (total.gather(dim, last_reset) - values.gather(dim, last_reset))


# --- a decoded token's bookkeeping: RoPE undone, a value stored in place, the adaptive keys' bit placement -----


def undo_rope(
    keys: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, order: torch.Tensor | None
) -> torch.Tensor:
    """Keys after RoPE `[batch, heads, n, D]` (the model's channel order) at `positions` `[batch, n]`, turned back to
    before it in the canonical order (`hf_deltakv.rope.RopeForm.undo`, fp32)."""
    return RopeForm(freqs, order).undo(keys, positions)


def undo_rope_into(
    keys: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    target: torch.Tensor,
    at: int,
    undo=undo_rope,
) -> None:
    """Keys as the model passes them (`[batch, heads, n, D]`, its dtype, after RoPE) written into rows `at:at + n`
    of `target` (fp16 `[batch, heads, rows, D]`, storage with room): turned back to before RoPE in the canonical order
    (`undo_rope`, or a kernel of its signature as `undo`; `freqs` None: as given), saturated to fp16
    (`quant.saturate_fp16`)."""
    x = keys.float() if freqs is None else undo(keys.float(), positions, freqs, order)
    target[:, :, at : at + x.shape[2]] = saturate_fp16(x)


def quantize_at(
    x: torch.Tensor, fmt: str, search_scale: bool, target: QuantizedTensor, at: int, rotation: int = 0
) -> None:
    """`quantize(x, fmt, search_scale)` of new tokens `[batch, heads, n, dim]` (any float dtype; first rotated by
    `hadamard.rotate` when `rotation`, the stream's Hadamard block, is not 0) written into `target`'s sequence rows
    `at:at + n` (storage with room, `[batch, heads, rows, ...]`)."""
    write_rows(target, quantize(rotate(x) if rotation else x.float(), fmt, search_scale), at)


def append_token(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    counts: torch.Tensor,
    tail: torch.Tensor,
    row: int,
    sinks: int,
    values: QuantizedTensor,
    fmt: str,
    search_scale: bool,
    rotation: int,
    undo_into=undo_rope_into,
    quantize_into=quantize_at,
) -> None:
    """A decoding step's token (`key` after RoPE and `value` `[batch, heads, 1, dim]`, at `position_ids` int `[batch,
    1]`; None: the count of tokens held) of a preallocated `DeltaKVCache` layer past its `sinks`, in place: the count
    held (`counts[0]`, int64 on the host) is its slot, where `positions` int32 `[batch, max_cache_len]` records the
    position; the key turned back by its RoPE (`freqs` float64, `order`; None: as given) into row `row` of the raw
    `tail` (`undo_rope_into`, or a kernel of its signature as `undo_into`), the value quantized (`fmt`,
    `search_scale`, Hadamard-rotated by blocks of `rotation`) into row `held - sinks` of `values` (`quantize_at`, or
    `quantize_into`); then `counts[0]` advances."""
    held = int(counts[0])
    positions[:, held] = held if position_ids is None else position_ids[:, 0]
    ids = positions[:, held : held + 1] if freqs is not None else None
    undo_into(key, ids, freqs, order, tail, row)
    quantize_into(value, fmt, search_scale, values, held - sinks, rotation)
    counts[0] += 1


def write_rows(target: QuantizedTensor | torch.Tensor, new: QuantizedTensor | torch.Tensor, at: int) -> None:
    """Tokens `new` (packed, or a tensor) written into `target`'s sequence rows `at:at + n` (`[batch, heads, rows,
    ...]`, in place)."""
    packed = isinstance(target, QuantizedTensor)
    for stored, rows in zip(target.tensors(), new.tensors(), strict=True) if packed else [(target, new)]:
        stored[:, :, at : at + rows.shape[2]] = rows


def copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each `src` `[batch, heads, n, ...]` copied into the first `n` sequence rows of its `dst` (storage grown for
    more rows: its stored rows moved over)."""
    for src, dst in pairs:
        dst[:, :, : src.shape[2]] = src


def pair_energy(query: torch.Tensor) -> torch.Tensor:
    """Squared queries `[..., D]` averaged over each RoPE pair (channels c and c + D/2): a rotation keeps a pair's
    energy, so the mean is the same before and after RoPE."""
    energy = query.float().pow(2)
    half = energy.shape[-1] // 2
    pair = (energy[..., :half] + energy[..., half:]) / 2
    return torch.cat([pair, pair], dim=-1)


def query_energy(query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, one_position: bool) -> torch.Tensor:
    """What the adaptive keys weigh their channels by (`codecs.adaptive`): the queries' pair energies (canonical channel
    order: `order`, None: as given) averaged over the query heads of each kv head, fp32 `[batch, kv_heads, n, D]`.

    `query` `[batch, q_heads, rows, D]`; `one_position`: every row is a query head of the newest position (transformers
    packs a decoded token's GQA heads as rows), averaged into one row (`n` = 1), else row `i` is position `i`."""
    energy = pair_energy(query if order is None else query[..., order.to(query.device)])
    batch, _, rows, dim = energy.shape
    grouped = energy.reshape(batch, kv_heads, -1, 1 if one_position else rows, dim)
    total = grouped[:, :, 0]
    for m in range(1, grouped.shape[2]):  # added in order (a mean's sum in any other order rounds otherwise)
        total = total + grouped[:, :, m]
    return total / grouped.shape[2]


def add_query_energy(
    query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, total: torch.Tensor | None, energies=query_energy
) -> torch.Tensor:
    """`total + e` (`e` when `total` is None), fp32 `[batch, kv_heads, D]`, a new tensor: `e` the pair energies of
    one position's queries (`query_energy(query, order, kv_heads, one_position=True)`, or a kernel of its signature
    as `energies`), the sum the adaptive keys' encoder keeps (`codecs.adaptive`)."""
    energy = energies(query, order, kv_heads, True)[:, :, 0]
    return energy if total is None else total + energy


def group_starts(first: int, n: int, group: int) -> list[int]:
    """The group starts `s` a chunk of `n` positions from `first` crosses before its last: `first < s < first + n`,
    `s` a multiple of `group` (the rows of `add_query_energies` before its last)."""
    return list(range(-(-(first + 1) // group) * group, first + n, group))


def add_query_energies(
    query: torch.Tensor,
    order: torch.Tensor | None,
    kv_heads: int,
    total: torch.Tensor | None,
    first: int,
    group: int,
    energies=query_energy,
) -> torch.Tensor:
    """The running sums of a chunk's query energies (positions `first...`) where the adaptive keys keep them, fp32
    `[batch, kv_heads, len(group_starts(first, n, group)) + 1, D]`: the sum before each group start the chunk crosses,
    then the sum over the whole chunk. The sum before position `p` is `total + e_first + ... + e_(p-1)`, added in
    order (`total` None: from zero), `e` the pair energies of each query (`query_energy(query, order, kv_heads,
    one_position=False)`, or a kernel of its signature as `energies`)."""
    energy = energies(query, order, kv_heads, False)
    n = energy.shape[2]
    running = torch.zeros_like(energy[:, :, 0]) if total is None else total
    kept = []
    for j in range(n):
        running = running + energy[:, :, j]
        if j == n - 1 or (first + j + 1) % group == 0:
            kept.append(running)
    return torch.stack(kept, dim=2)


WATER_LEVEL_STEPS = 40  # bisection steps of `allocate_depths` (the kernels take it from here)


def allocate_depths(level: torch.Tensor, total: int, most: int) -> torch.Tensor:
    """Integer depths `uint8 [..., D]` in `1..most` summing to `total` per row, about `level + w` (reverse
    water-filling, `codecs.adaptive.allocate_bits`; `level` fp32 `[..., D]`, finite).

    The water level `w` is bisected to where `sum(clamp(level + w, 1, most))` reaches `total`, each sum taken in
    float64, where fp32 values in `[1, most]` add up exactly in any order (so every implementation takes the same
    steps); the bits left over go to the largest fractional depths (the lower channel first on ties)."""
    dim = level.shape[-1]
    below = torch.full_like(level[..., :1], -4.0 * most) - level.amax(-1, keepdim=True)
    above = torch.full_like(below, 4.0 * most) - level.amin(-1, keepdim=True)
    for _ in range(WATER_LEVEL_STEPS):
        middle = (below + above) / 2
        short = (level + middle).clamp(1, most).double().sum(-1, keepdim=True) < total
        below, above = torch.where(short, middle, below), torch.where(short, above, middle)
    depth = (level + above).clamp(1, most)
    base = depth.floor()
    left = (total - base.sum(-1, keepdim=True)).clamp(min=0)
    fraction = (depth - base).masked_fill(base >= most, -1.0)
    order = torch.sort(fraction, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(dim, device=level.device).expand_as(order))
    bits = base + (rank < left).to(base.dtype)
    excess = bits.sum(-1, keepdim=True) - total  # float edge cases: take bits back from the largest depths
    if (excess > 0).any():
        order = torch.sort(bits, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(dim, device=level.device).expand_as(order))
        bits = bits - (rank < excess.clamp(min=0)).to(bits.dtype)
    return bits.to(torch.uint8)


# --- the adaptive keys' coding of complete groups -----------------------------------------------------------------


def allocate_bits(score: torch.Tensor, total: int, allocate=allocate_depths) -> torch.Tensor:
    """Integer depths in 1..8 per entry of the last dimension `[..., D]`, summing to `total` in every row, about
    `total / D + log2(sqrt(score)) - mean` (reverse water-filling of a uniform quantizer's error `score * 2**-2b`).

    `score` is each channel's error weight at one bit (its range squared times its query weight); non-finite or zero
    scores get the least. Deterministic: the water level is found by bisection, then the bits left over go to the
    largest fractional depths (the lower channel index first on ties; `allocate`: `allocate_depths` or a kernel of
    its signature).
    """
    dim = score.shape[-1]
    if not dim <= total <= MAX_BITS * dim:
        raise ValueError(f"{total} bits cannot be spread over {dim} channels at 1 to {MAX_BITS} bits each")
    finite = torch.isfinite(score) & (score > 0)
    level = torch.where(finite, score, torch.ones_like(score)).log2() * 0.5
    lowest = level.masked_fill(~finite, float("inf")).amin(-1, keepdim=True).clamp(max=0) - 2 * MAX_BITS
    level = torch.where(finite, level, lowest.expand_as(level))
    return allocate(level, total, MAX_BITS)


# Fractions of a channel's range given up at its low and high ends, tried in every pair: each channel of a group keeps
# the clipped range that codes its tokens with the least squared error (the encoder's choice; the decoder reads low and
# step as before). Extremes of a few tokens otherwise stretch the step of all: at 3 bits per key (kf=64) the clipping
# cuts the keys' KL divergence by a quarter on SmolLM2 and by 40 % on Gemma 3 (validation text; docs/codec.md).
CLIP_FRACTIONS = (0.0, 0.03, 0.06, 0.1, 0.15, 0.2)
CLIPS = torch.tensor([(a, b) for a in CLIP_FRACTIONS for b in CLIP_FRACTIONS])
# The same candidates as the kernels take them (candidate i: low CLIP_LOW[i // 6], high CLIP_KEEP[i % 6]): the fp32
# fractions given up at the low end, and 1 - the fraction given up at the high end as fp32 computes it.
CLIP_LOW = tuple(float(a) for a in CLIPS[:: len(CLIP_FRACTIONS), 0])
CLIP_KEEP = tuple(float(k) for k in (1 - CLIPS[: len(CLIP_FRACTIONS), 1]))
CLIP_ELEMENTS = 1 << 20  # candidate codes per pass of the encoder: groups are coded in chunks of ~4 MB


@torch.no_grad()  # codes carry no gradient, and the search works in place (even when a forward records autograd)
def clipped_codes(x: torch.Tensor, low: torch.Tensor, span: torch.Tensor, levels: torch.Tensor, clips: torch.Tensor):
    """Codes `uint8 [..., group, D]`, low and step (fp16 `[..., D]`) of groups `x` `[..., group, D]` at `levels + 1`
    levels per channel, each channel over the candidate range of `clips` (rows of `CLIPS`) that reconstructs it best.

    The candidates' errors are computed in place in one `[..., group, D, candidates]` buffer (the search is bound by
    memory traffic); the chosen candidate's codes are then computed again, by the same arithmetic."""
    wanted_low, highs = candidate_ends(low, span, clips)
    lows = wanted_low.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    steps = ((highs - lows.float()) / levels.unsqueeze(-1)).clamp(0, FP16_MAX).to(torch.float16)  # [..., D, C]
    codes, low, step, _ = best_candidate(x, lows, steps, levels)  # ties (and NaN) keep the whole range
    return codes, low, step


def candidate_ends(low: torch.Tensor, span: torch.Tensor, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ends each candidate of `clips` (rows of `CLIPS`: the fractions given up at the low and the high end) wants
    for channels from `low` over `span` `[..., D]`: fp32 `[..., D, C]` each."""
    clips = clips.to(low.device)
    return low.unsqueeze(-1) + clips[:, 0] * span.unsqueeze(-1), low.unsqueeze(-1) + span.unsqueeze(-1) * (
        1 - clips[:, 1]
    )


@torch.no_grad()
def best_candidate(x: torch.Tensor, lows: torch.Tensor, steps: torch.Tensor, levels: torch.Tensor):
    """Of the candidate ranges (`lows`, `steps` fp16 `[..., D, C]`) for groups `x` `[..., group, D]` at `levels`
    `[..., D]`, the one of least squared error per channel (ties and NaN: the first; the errors computed in place in
    one `[..., group, D, C]` buffer): the codes uint8 `[..., group, D]` against it, its low and step `[..., D]` and its
    index `[..., D, 1]`."""
    step_f, low_f = steps.float().unsqueeze(-3), lows.float().unsqueeze(-3)  # [..., 1, D, C]
    error = _grid_codes(x.unsqueeze(-1), low_f, step_f, levels.unsqueeze(-2).unsqueeze(-1))
    error.mul_(step_f).add_(low_f).sub_(x.unsqueeze(-1)).square_()
    best = error.sum(-3).nan_to_num_(float("inf")).argmin(-1, keepdim=True)
    low, step = lows.gather(-1, best).squeeze(-1), steps.gather(-1, best).squeeze(-1)
    codes = _grid_codes(x, low.float().unsqueeze(-2), step.float().unsqueeze(-2), levels.unsqueeze(-2))
    return codes.to(torch.uint8), low, step, best


def _grid_codes(x: torch.Tensor, low: torch.Tensor, step: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Float codes of `x` on the grid `low + k * step`, k in 0..top (a new tensor, then modified in place)."""
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    codes = (x - low).mul_(inverse).round_().nan_to_num_(0.0).clamp_min_(0)
    return torch.minimum(codes, top, out=codes)


def encode_groups(
    x: torch.Tensor,
    weights: torch.Tensor | None,
    total: int,
    clip_range: bool,
    allocate=allocate_depths,
    pack=_pack_planes,
    clip=clipped_codes,
    chunked: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The adaptive keys' coding (`codecs.adaptive`) of groups `x` fp32 `[B, H, G, group, D]`: per group and channel
    a depth (`allocate_bits` of the range squared times `weights` fp32 `[B, H, G, D]`, the queries' mean pair
    energies, or the range alone when None), the clipped range that codes the channel best (`clipped_codes`; only the
    whole range without `clip_range`), and the codes as bit planes. Returns (planes, packed depths, low, step);
    `allocate`, `pack` and `clip` are `allocate_depths`, `quant.bitplanes.pack_planes` and `clipped_codes` or
    kernels of their signatures (`clip` may return other range state than low and step: it is returned as given).
    `chunked`: whether `clip` keeps a buffer of every candidate, so groups go to it in chunks of `CLIP_ELEMENTS`
    candidate codes (default: for `clipped_codes`; a kernel keeps none and takes them all in one pass)."""
    low, high = x.amin(3), x.amax(3)
    span = high - low
    score = span.pow(2) if weights is None else span.pow(2) * weights
    depths = allocate_bits(score, total, allocate)
    levels = ((1 << depths.long()) - 1).float()
    clips = CLIPS if clip_range else CLIPS[:1]  # the first candidate is the whole range
    chunk = max(1, CLIP_ELEMENTS // max(x[:, :, :1].numel() * len(clips), 1))  # groups per pass of the reference
    chunk = chunk if (clip is clipped_codes if chunked is None else chunked) else x.shape[2]
    parts = [
        clip(*(t[:, :, g : g + chunk] for t in (x, low, span, levels)), clips) for g in range(0, x.shape[2], chunk)
    ]
    codes, low, step = (torch.cat(t, dim=2) for t in zip(*parts, strict=True))
    return pack(codes, depths), pack_4bit(depths), low, step


def code_groups(
    tail: torch.Tensor,
    pad: int,
    groups: int,
    weights: torch.Tensor | None,
    total: int,
    clip_range: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    at: int,
    allocate=allocate_depths,
    pack=_pack_planes,
    clip=clipped_codes,
    chunked: bool | None = None,
) -> None:
    """Code the first `groups` complete groups of an adaptive stream's raw tail into rows `at:at + groups` of its
    storage (`encode_groups`).

    Args:
        tail: fp16 `[B, H, t, D]`, the raw tokens; the first group starts `pad` slots before the first of them (the
            sink tokens' slots, filled with copies of it: they change no range, and are never read).
        weights: fp32 `[B, H, groups, D]` or None (see `encode_groups`).
        total: bits per token of a group (`bits * D`).
        out: planes `uint8 [B, H, rows, total, group / 8]`, packed depths `uint8 [B, H, rows, D / 2]`, low and step
            fp16 `[B, H, rows, D]`: storage with room for the new rows (or what `clip` returns in their place).
        allocate, pack, clip, chunked: as `encode_groups`.
    """
    group = out[0].shape[-1] * 8
    batch, heads, _, dim = tail.shape
    x = tail[:, :, : groups * group - pad].float()
    if pad:
        x = torch.cat([x[:, :, :1].expand(batch, heads, pad, dim), x], dim=2)
    x = x.view(batch, heads, groups, group, dim)
    coded = encode_groups(x, weights, total, clip_range, allocate, pack, clip, chunked)
    for stored, rows in zip(out, coded, strict=True):
        stored[:, :, at : at + groups] = rows


# --- decoding stored streams --------------------------------------------------------------------------------------


def check_range(start: int, end: int, length: int) -> None:
    if not 0 <= start <= end <= length:
        raise ValueError(f"token range [{start}, {end}) is outside the {length} stored tokens")


def slice_seq(q: QuantizedTensor | torch.Tensor, start: int, end: int) -> QuantizedTensor | torch.Tensor:
    """Rows `start:end` along the sequence dimension (2) of a tensor or `QuantizedTensor`."""
    if isinstance(q, QuantizedTensor):
        return q.map(lambda t: t[:, :, start:end])
    return q[:, :, start:end]


def long_term_reference(
    means: torch.Tensor | None, snapshots, positions: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """The long-term (intra) reference of the tokens at stream `positions`: the newest mean snapshot taken before
    each (zeros where none exists yet, or without `means`). fp32 `[batch, heads, n, dim]` (`shape` is the
    `[batch, heads, _, dim]` of the stream)."""
    batch, heads, _, dim = shape
    device = positions.device
    if means is None or not positions.numel():
        return torch.zeros(batch, heads, positions.numel(), dim, device=device)
    # A gather from a table whose row 0 is the zero reference: no value is read back to the host (no sync).
    index = (snapshots.counts(positions) - 1).clamp(max=means.shape[2] - 1)
    table = torch.cat([torch.zeros_like(means[:, :, :1]), means], dim=2).float()
    return table.index_select(2, (index + 1).to(table.device))


def _delta_positions(count: int, kf: int, device: torch.device) -> torch.Tensor:
    """Stream positions of the first `count` non-keyframe tokens (offsets 1..kf-1 of each group)."""
    index = torch.arange(count, device=device)
    return (index // (kf - 1)) * kf + index % (kf - 1) + 1


def decode_delta(stream: DeltaStream, start: int, end: int) -> torch.Tensor:
    """Tokens `start:end` of a delta stream; only the keyframe groups overlapping the range are decoded."""
    kf = stream.kf
    first, last = start // kf, -(-end // kf)
    keys = dequantize(slice_seq(stream.keyframes, first, last))
    batch, heads, groups, dim = keys.shape
    values = torch.zeros(batch, heads, groups * kf, dim, dtype=torch.float32, device=keys.device)
    values.view(batch, heads, groups, kf, dim)[:, :, :, 0] = keys
    flags = None
    if stream.deltas is not None:
        stored = slice_seq(stream.deltas, first * (kf - 1), last * (kf - 1))
        deltas = dequantize(stored)
        position = _delta_positions(deltas.shape[2], kf, keys.device)  # from the first group's keyframe
        if stream.intra:
            token_flags = expand_blocks(block_flags(stored), stored.fmt.block_size, dim)
            if stream.means is not None:
                long_term = long_term_reference(stream.means, stream.snapshots, position + first * kf, keys.shape)
                deltas = deltas + token_flags * long_term
            flags = torch.zeros(batch, heads, groups * kf, dim, dtype=torch.bool, device=keys.device)
            flags[:, :, position] = token_flags
            flags = flags.view(batch, heads, groups, kf, dim)
        values[:, :, position] = deltas
    grouped = values.view(batch, heads, groups, kf, dim)
    if stream.reference == "keyframe":
        recon = grouped + grouped[:, :, :, :1]
        recon[:, :, :, 0] = grouped[:, :, :, 0]
        recon = recon if flags is None else torch.where(flags, grouped, recon)
    elif flags is None:
        recon = grouped.cumsum(dim=3)
    else:  # segmented prefix sum: every intra block (and the keyframe) restarts the running sum of its channels
        recon = segmented_prefix_sum(grouped, flags, dim=3)
    return recon.reshape(batch, heads, groups * kf, dim)[:, :, start - first * kf : end - first * kf]


def decode_channel(stream: ChannelStream, start: int, end: int) -> torch.Tensor:
    """Tokens `start:end` of a KIVI-style stream (only the groups overlapping the range are dequantized, to fp16
    values as `decode_groups`: what a crop puts back into the fp16 tail)."""
    group = stream.group
    coded = stream.length - stream.tail.shape[2]
    first, last = start // group, min(-(-end // group), coded // group)
    parts = []
    if last > first:
        blocks = saturate_fp16(dequantize(slice_seq(stream.groups, first, last))).float()  # [B, H, G, D, group]
        batch, heads, groups, dim, _ = blocks.shape
        parts.append(blocks.transpose(3, 4).reshape(batch, heads, groups * group, dim))
    parts.append(stream.tail.float())
    return torch.cat(parts, dim=2)[:, :, start - first * group : end - first * group]


def decode_groups(planes: torch.Tensor, bits: torch.Tensor, low: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Values of whole adaptive groups: planes `[..., P, group / 8]`, packed depths `[..., dim / 2]`, low and step
    `[..., dim]` to fp32 `[..., group, dim]` (`low + code * step` rounded to fp16: a coded token's value is one the
    fp16 tail can hold, so a crop that moves a cut group's tokens back into the tail leaves them as they were)."""
    codes = unpack_planes(planes, unpack_4bit(bits).to(torch.int64))
    return saturate_fp16(low.float().unsqueeze(-2) + codes.float() * step.float().unsqueeze(-2)).float()


def decode_adaptive(stream: AdaptiveStream, start: int, end: int, groups=decode_groups) -> torch.Tensor:
    """Tokens `start:end` of an adaptive per-channel stream (only the groups overlapping the range are decoded, by
    `groups`: `decode_groups` or a kernel of the same signature)."""
    group, offset = stream.group, stream.offset
    coded = 0 if stream.planes is None else stream.planes.shape[2] * group - offset  # tokens in coded groups
    parts, first_slot = [], 0
    if start < coded:
        first, last = (start + offset) // group, -(-(min(end, coded) + offset) // group)
        pick = (t[:, :, first:last] for t in (stream.planes, stream.bits, stream.low, stream.step))
        values = groups(*pick)  # [B, H, G, group, D]
        batch, heads, groups_, _, dim = values.shape
        parts.append(values.reshape(batch, heads, groups_ * group, dim))
        first_slot = first * group
    else:
        first_slot = coded + offset
    parts.append(stream.tail.float())
    slots = torch.cat(parts, dim=2)
    return slots[:, :, start + offset - first_slot : end + offset - first_slot]


def decode_stream(stream: StreamLayout, start: int, end: int) -> torch.Tensor:
    """Reconstruct tokens `start <= t < end` of a stored stream, `[batch, heads, end - start, dim]` in fp32, in the
    original basis (a rotated stream is rotated back)."""
    check_range(start, end, stream.length)
    if isinstance(stream, PlainStream):
        out = dequantize(slice_seq(stream.blocks, start, end))
    elif isinstance(stream, DeltaStream):
        out = decode_delta(stream, start, end)
    elif isinstance(stream, ChannelStream):
        out = decode_channel(stream, start, end)
    elif isinstance(stream, AdaptiveStream):
        out = decode_adaptive(stream, start, end)
    elif isinstance(stream, BasisStream):
        tables = basis.BasisTables(stream.mean, stream.basis, stream.spread, stream.bits, stream.fmt)
        out = basis.decode(stream.rows[:, :, start:end], tables)
    else:
        raise TypeError(f"not a stream layout: {type(stream).__name__}")
    return rotate(out, inverse=True) if stream.rotation else out


def decode_into(
    stream: StreamLayout,
    out: torch.Tensor,
    rope: RopeAngles | None = None,
    order: torch.Tensor | None = None,
    chunk: int = CHUNK_TOKENS,
    decode=decode_stream,
) -> None:
    """Every token of a stored stream decoded into `out` `[batch, heads, length, dim]` (any float dtype: converted,
    fp16 saturating as `quant.saturate_fp16`), `chunk` tokens at a time (the bound on transient memory): keys with
    `rope` re-applied (RoPE of the stream's tokens) and put back in the model's channel order (`order`: canonical
    channel c is the model's `order[c]`; None: the same). What a prefill's attention reads of the stream. `decode`:
    `decode_stream` or a kernel of its signature."""
    inverse = None if order is None else order.argsort()
    for start in range(0, stream.length, chunk):
        end = min(start + chunk, stream.length)
        x = decode(stream, start, end)
        if rope is not None:
            cos, sin = rope.cos_sin(start, end)
            x = rotate_pairs(x, cos[:, None], sin[:, None])
        if inverse is not None:
            x = x[..., inverse]
        out[:, :, start:end] = saturate_fp16(x) if out.dtype == torch.float16 else x


# --- attention straight from storage ------------------------------------------------------------------------------


def stream_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    keys: StreamLayout,
    values: StreamLayout,
    *,
    rope: RopeAngles | None,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
    chunk: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Attention over a cache layer's raw sink tokens followed by its stored stream, read chunk by chunk.

    Args:
        query: fp32 `[batch, kv_heads, group * n_queries, dim]`; row `g * n_queries + i` is query `i` of the kv
            head's `g`-th query head.
        sink_keys, sink_values: `[batch, kv_heads, sinks, dim]` raw tokens (keys with RoPE); sinks may be 0.
        keys, values: the stored streams (same length; keys before RoPE, in the canonical order, when `rope` is given).
        rope: the RoPE of every stored key (positions and frequencies of the pairs `c, c + dim/2`), or None.
        mask: bool `[batch, n_queries, sinks + stream tokens]`, True where query `i` may attend; None: causal, token
            `u` (sinks counted) visible to query `i` when `u <= causal_offset + i`.
        scale: softmax scale.
        chunk: stream tokens reconstructed at a time (the bound on transient memory).

    Returns:
        fp32 `[batch, kv_heads, rows, value_dim]`; a row that may attend no token gets zeros.
    """
    batch, heads, rows, dim = query.shape
    sinks = sink_keys.shape[2]
    grouped = query.reshape(batch, heads * (rows // n_queries), n_queries, dim)
    state = OnlineSoftmax(grouped, scale, mask[:, None] if mask is not None else None, causal_offset + n_queries)
    if sinks:
        state.add(sink_keys, sink_values)
    for start in range(0, keys.length, chunk):
        end = min(start + chunk, keys.length)
        chunk_keys = decode_stream(keys, start, end)
        if rope is not None:
            cos, sin = rope.cos_sin(start, end)
            chunk_keys = rotate_pairs(chunk_keys, cos[:, None], sin[:, None])
        state.add(chunk_keys, decode_stream(values, start, end), start=sinks + start)
    return state.result().reshape(batch, heads, rows, -1)


# --- eviction: the kept tokens stored, attended, and what SnapKV evicts -------------------------------------------

QUERY_CHUNK = 256  # queries attended at a time over the kept tokens (bounds the score buffer)


def keep_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    target: KeptStream,
    at: int,
    position: int,
    pending: torch.Tensor | None = None,
) -> None:
    """New tokens `[batch, heads, n, dim]` (any float dtype) stored in the slots `at...` of `target`'s buffers (which
    reach that far), saturated to fp16, with positions `position...`; first, the slots `pending` (int64
    `[batch, heads, k]`) are marked evicted (-1)."""
    if pending is not None:
        target.index.scatter_(2, pending, -1)
    n = keys.shape[2]
    target.keys[:, :, at : at + n] = saturate_fp16(keys)
    target.values[:, :, at : at + n] = saturate_fp16(values)
    target.index[:, :, at : at + n] = torch.arange(position, position + n, dtype=torch.int32, device=keys.device)


def compact_kept(kept: KeptStream, pending: torch.Tensor | None, target: KeptStream) -> None:
    """The tokens `kept` holds, less the slots `pending` (int64 `[batch, heads, k]`, or None), written in order into
    the first `kept.live` slots of `target`'s buffers (keys, values and positions)."""
    index = kept.index if pending is None else kept.index.scatter(2, pending, -1)
    slots, live = kept.slots, kept.live
    place = torch.arange(kept.first, slots, device=index.device)
    order = torch.where(index[:, :, kept.first :] >= 0, place, slots).sort(dim=-1).values[..., :live]
    for stored, into in ((kept.keys, target.keys), (kept.values, target.values)):
        into[:, :, :live] = stored.gather(2, order[..., None].expand(*order.shape, stored.shape[-1]))
    target.index[:, :, :live] = index.gather(2, order)


def kept_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    kept: KeptStream,
    mask: torch.Tensor | None,
    scale: float,
    query_position: int,
    observe_from: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over an evicting cache's raw sinks (positions 0...) and the tokens it keeps, in fp32, and what SnapKV
    observes of it.

    Args:
        query: `[batch, q_heads, n, dim]`, queries at positions `query_position...`.
        sink_keys, sink_values: `[batch, kv_heads, sinks, dim]` (sinks may be 0).
        kept: the kept tokens (`KeptStream`).
        mask: bool `[batch, 1 | q_heads, n, positions]` over every position (a token's column is its position), or
            None: causal.
        observe_from: with it, SnapKV's observation is returned: the softmax weights of queries `observe_from...` on
            each slot, summed over them and the query heads of its kv head (fp32 `[batch, kv_heads, slots]`, 0 where
            evicted).

    Returns:
        fp32 `[batch, q_heads, n, dim]` (a query that may attend no token gets zeros), and the observation or None.
    """
    batch, q_heads, n, dim = query.shape
    kv_heads, slots = kept.keys.shape[1], kept.slots
    group = q_heads // kv_heads
    sinks = sink_keys.shape[2]
    index = kept.index.clone()
    index[:, :, : kept.first] = -1
    sink_positions = torch.arange(sinks, dtype=torch.int32, device=query.device).expand(batch, kv_heads, sinks)
    positions = torch.cat([sink_positions, index], dim=2)
    keys = torch.cat([sink_keys.float(), kept.keys.float()], dim=2)
    values = torch.cat([sink_values.float(), kept.values.float()], dim=2)
    q = query.float().view(batch, kv_heads, group, n, dim)
    outputs, observed = [], None
    for start in range(0, n, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, n)
        allowed = _kept_allowed(mask, positions, query_position, start, end, group)  # [B, H, g | 1, c, m]
        scores = torch.einsum("bhgcd,bhmd->bhgcm", q[:, :, :, start:end], keys) * scale
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).masked_fill(~allowed, 0.0)
        outputs.append(torch.einsum("bhgcm,bhmd->bhgcd", weights, values))
        first = max(start, observe_from) if observe_from is not None else end
        if end > first:
            seen = weights[:, :, :, first - start :, sinks:].sum((2, 3))
            observed = seen if observed is None else observed + seen
    if observe_from is not None and observed is None:
        observed = query.new_zeros(batch, kv_heads, slots, dtype=torch.float32)
    return torch.cat(outputs, dim=3).view(batch, q_heads, n, values.shape[-1]), observed


def _kept_allowed(mask, positions: torch.Tensor, query_position: int, start: int, end: int, group: int):
    """bool `[batch, kv_heads, group | 1, end - start, slots]`: which of queries `start:end` may attend each token
    (`positions` `[batch, kv_heads, m]`, -1: evicted)."""
    batch, heads, _ = positions.shape
    alive = (positions >= 0)[:, :, None, None, :]
    at = positions.long().clamp(min=0)[:, :, None, None, :]
    if mask is None:
        last = query_position + torch.arange(start, end, device=positions.device)
        return alive & (at <= last[None, None, None, :, None])
    mask = mask[:, :, start:end]
    mask = mask.reshape(batch, heads, group, *mask.shape[2:]) if mask.shape[1] != 1 else mask[:, :, None]
    gather = at.expand(batch, heads, mask.shape[2], end - start, at.shape[-1])
    return alive & mask.expand(batch, heads, *mask.shape[2:]).gather(-1, gather)


def observed_importance(observation: Observation, kept: KeptStream) -> torch.Tensor:
    """SnapKV's observation (`Observation`: the attention kernel's scores and softmax statistics of each query row,
    over the slots of `kept` from `kept.first` on) as `kept_attention` returns it, the observed queries' rows summed:
    fp32 `[batch, heads, slots]`."""
    heads, first = kept.index.shape[1], kept.first
    rows = [r for r in range(observation.rows) if r % observation.n_queries >= observation.observe_from]
    scores = observation.scores[:, rows, first:]  # the observed queries' rows
    maximum = observation.maximum[:, rows, None]
    total = observation.total[:, rows, None]
    safe = torch.where(maximum == float("-inf"), torch.zeros_like(maximum), maximum)
    weights = torch.where(total > 0, torch.exp(scores - safe) / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return torch.nn.functional.pad(weights.sum(1), (first, 0)).view(-1, heads, kept.slots)


def snapkv_evicted(
    kept: KeptStream, observed: torch.Tensor | Observation, drop: int, recent: int, kernel: int
) -> torch.Tensor:
    """The slots SnapKV evicts, int64 `[batch, heads, drop]`: the kept tokens in the order of their positions, each
    one's observed weight (`kept_attention`'s observation, or the kernel's `Observation`) max-pooled over `kernel`
    neighbours in that order (a NaN weight pools to NaN, as max_pool1d gives it), the last `recent` never chosen;
    the `drop` lowest, the oldest first among equals, NaN counted as +inf (after every number)."""
    batch, heads, slots = kept.index.shape
    if isinstance(observed, Observation):
        observed = observed_importance(observed, kept)
    live = kept.live
    place = torch.arange(kept.first, slots, device=kept.index.device)
    order = torch.where(kept.index[:, :, kept.first :] >= 0, place, slots).sort(dim=-1).values[..., :live]
    weight = observed.gather(2, order)
    score = torch.nn.functional.max_pool1d(
        weight.reshape(batch * heads, 1, live), kernel, stride=1, padding=kernel // 2
    ).view(batch, heads, live)
    score = score.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    score[:, :, live - recent :] = float("inf")
    chosen = score.sort(dim=-1, stable=True).indices[..., :drop]
    return order.gather(2, chosen)


# --- the residual cache and weight skip ---------------------------------------------------------------------------


def quantize_latent(latent: torch.Tensor, bits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes `uint8 [..., code bytes]` and fp16 scales `[..., kept groups]` of a latent
    `[..., len(bits) * GROUP]`, each group of `GROUP` components at its depth (`quant.bitpack`; 0 = dropped): the
    residual cache's encoding, the inverse of `dequantize_latent`."""
    from ..quant.bitpack import GROUP, pack_bits, quantize_group

    groups = latent.reshape(*latent.shape[:-1], latent.shape[-1] // GROUP, GROUP)
    packed, scales = [], []
    for g, b in enumerate(bits):
        if b:
            codes, scale = quantize_group(groups[..., g, :], b)
            packed.append(pack_bits(codes, b))
            scales.append(scale)
    return torch.cat(packed, dim=-1), torch.stack(scales, dim=-1)


def dequantize_latent(packed: torch.Tensor, scales: torch.Tensor, bits: list[int]) -> torch.Tensor:
    """The residual cache's latent from its packed groups (the first step of residual reconstruction).

    Args:
        packed: `uint8 [..., code_bytes]`: group after group, each of `GROUP` codes packed at its bit depth.
        scales: `float16 [..., kept groups]`: one scale per group whose depth is not 0.
        bits: bit depth of every latent group (0 = dropped, decodes as zeros).

    Returns:
        fp32 `[..., len(bits) * GROUP]`.
    """
    from ..quant.bitpack import GROUP, dequantize_group, unpack_bits

    lead = packed.shape[:-1]
    latent = torch.zeros(*lead, len(bits), GROUP, device=packed.device)
    offset = kept = 0
    for g, b in enumerate(bits):
        if b:
            nbytes = GROUP * b // 8
            codes = unpack_bits(packed[..., offset : offset + nbytes], b)
            latent[..., g, :] = dequantize_group(codes, scales[..., kept], b)
            offset, kept = offset + nbytes, kept + 1
    return latent.reshape(*lead, len(bits) * GROUP)


def latent_attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    rope: RopeAngles | None,
    allowed: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    bits: list[int],
    scale: float,
    key_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax statistics of queries over a chunk of tokens whose values stay packed latents (the residual cache's
    decode attention; the caller applies the value decoder once to `acc`).

    Args:
        rows: queries `[batch, kv_heads, rows, dim]` fp32 (the query heads and positions reading each kv head).
        keys: `[batch, tokens, kv_heads * dim]` fp32 or bf16, before RoPE, less `key_mean`.
        rope: the RoPE of these tokens' keys (`positions` `[batch, tokens]`), or None: no RoPE.
        allowed: bool `[batch, kv_heads, rows, tokens]`, or None: every key visible.
        codes, scales, bits: the value latents as `dequantize_latent` reads them, `[batch, tokens, ...]`.
        scale: softmax scale.
        key_mean: fp32 `[kv_heads * dim]` added to every key (in fp32), or None.

    Returns:
        max `[batch, kv_heads, rows]` of the scores (-inf where nothing is visible), weight (sum of
        `exp(score - max)`) and acc `[batch, kv_heads, rows, latent]` (the latents summed with those weights).
    """
    batch, heads, n_rows, dim = rows.shape
    keys = keys.float() if key_mean is None else keys.float() + key_mean.float()
    keys = keys.view(batch, keys.shape[1], heads, dim).transpose(1, 2)
    if rope is not None:
        cos, sin = rope.cos_sin()
        keys = rotate_pairs(keys, cos[:, None], sin[:, None])
    scores = (rows.float() @ keys.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    maximum = scores.amax(-1)
    p = torch.exp(scores - torch.where(maximum == float("-inf"), torch.zeros_like(maximum), maximum)[..., None])
    latent = dequantize_latent(codes, scales, bits)  # [batch, tokens, latent]
    acc = (p.flatten(1, 2) @ latent).view(batch, heads, n_rows, -1)
    return maximum, p.sum(-1), acc


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """`[batch, heads, n, dim]` -> `[batch, n, heads * dim]` (a token's heads together, as the residual coder takes
    them)."""
    return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def write_raw(
    keys: torch.Tensor, values: torch.Tensor, key_target: torch.Tensor, value_target: torch.Tensor, at: int
) -> None:
    """Raw tokens `[batch, heads, n, dim]` into rows `at...` of the targets, in their dtype (fp16: saturating,
    `quant.saturate_fp16`)."""
    for x, target in ((keys, key_target), (values, value_target)):
        target[:, :, at : at + x.shape[2]] = saturate_fp16(x) if target.dtype == torch.float16 else x.to(target.dtype)


def encode_latent_into(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor | None,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    coder: LatentCoder,
    bits: tuple[int, ...],
    target: LatentStream,
    at: int,
    undo=undo_rope,
    quantize=quantize_latent,
) -> None:
    """The residual cache's coding of raw tokens (no references): keys `[batch, heads, n, dim]` as the model gives
    them (after RoPE, at `positions` `[batch, n]`; turned back first when `freqs` is given), values alike; each token's
    latent (`coder`: its residual less the mean, times the encoder) quantized group by group at its depth (`bits`, as
    `quantize_latent`) into rows `at...` of `target`'s codes and scales (buffers that reach that far). `undo` and
    `quantize`: the ops used (the dispatched ones on the CPU)."""
    keys = keys.float() if freqs is None else undo(keys.float(), positions, freqs, order)
    key_latent = (_tokens(keys) - coder.key_mean) @ coder.key_encoder
    value_latent = (_tokens(values.float()) - coder.value_mean) @ coder.value_encoder
    packed, scales = quantize(torch.cat([key_latent, value_latent], dim=-1), [b for b in bits if b])
    n = packed.shape[1]
    target.codes[:, at : at + n] = packed
    target.scales[:, at : at + n] = scales


def latent_stream_attention(
    query: torch.Tensor,
    raw: list[tuple[torch.Tensor, torch.Tensor, int]],
    stream: LatentStream,
    coder: LatentCoder,
    rope: RopeAngles | None,
    order: torch.Tensor | None,
    coded_column: int,
    mask: torch.Tensor | None,
    n_queries: int,
    causal_offset: int,
    scale: float,
) -> torch.Tensor:
    """Attention over a residual layer's raw tokens and its coded ones (decoded: keys `latent @ key_decoder + mean`,
    canonical and before RoPE, turned forward by `rope` and back to the model's channel order; values alike, without
    RoPE), in fp32.

    Args:
        query: `[batch, kv_heads, group * n_queries, dim]` (model order; row `g * n_queries + i` is query `i`).
        raw: (keys, values, first mask column) of each raw part (`[batch, kv_heads, t, dim]`, keys after RoPE).
        stream, coder: the coded tokens and the layer's coder; their mask columns start at `coded_column`.
        rope: the coded tokens' RoPE (positions `[batch, tokens]`), or None; `order`: the canonical channel order.
        mask: bool `[batch, n_queries, columns]`, or None: causal, column `u` visible to query `i` when
            `u <= causal_offset + i`.

    Returns:
        fp32 `[batch, kv_heads, rows, dim]`; a row that may attend no token gets zeros.
    """
    batch, heads, rows, dim = query.shape
    grouped = query.reshape(batch, heads * (rows // n_queries), n_queries, dim)
    state = OnlineSoftmax(grouped, scale, mask[:, None] if mask is not None else None, causal_offset + n_queries)
    for keys, values, column in raw:
        if keys.shape[2]:
            state.add(keys, values, start=column)
    kept = [b for b in stream.bits if b]
    latent = dequantize_latent(stream.codes, stream.scales, kept)
    key_latent, value_latent = latent.split([coder.key_decoder.shape[0], coder.value_decoder.shape[0]], dim=-1)
    keys = _heads(key_latent @ coder.key_decoder.float() + coder.key_mean, heads)
    values = _heads(value_latent @ coder.value_decoder.float() + coder.value_mean, heads)
    if rope is not None:
        cos, sin = rope.cos_sin()
        keys = rotate_pairs(keys, cos[:, None], sin[:, None])
    if order is not None:
        keys = keys[..., order.argsort()]
    state.add(keys, values, start=coded_column)
    return state.result().reshape(batch, heads, rows, -1)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[batch, n, heads * dim]` -> `[batch, heads, n, dim]`."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def kept_channels(x: torch.Tensor, scale: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """Weight skip's rule: input channel `i` is kept when `|x_i| * scale_i >= threshold` for some row of `x`
    [..., in] (`scale` None: 1); `threshold=0` keeps every channel with a nonzero score. bool [in]."""
    score = x.reshape(-1, x.shape[-1]).float().abs()
    if scale is not None:
        score = score * scale.float()
    return (score >= threshold if threshold > 0 else score != 0).any(0)


def sparse_matvec(
    x: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, int]:
    """`x @ wt + bias` reading only the rows of `wt` of the kept input channels (`kept_channels`).

    Args:
        x: [..., in] activations.
        wt: [in, out]: the linear layer's weight stored input-major (the transpose of `nn.Linear.weight`).
        bias: [out] or None.
        scale, threshold: the rule of `kept_channels`.

    Returns:
        `[..., out]` in x's dtype (summed in fp32), and the number of kept channels.
    """
    keep = kept_channels(x, scale, threshold)
    out = x.float()[..., keep] @ wt[keep].float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), int(keep.sum())
