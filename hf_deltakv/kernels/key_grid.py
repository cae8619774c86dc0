"""Keys' ranges on a per-channel grid (issue 61, item 3): the PyTorch reference of
`DeltaKVCache(key_ranges="grid8")`.

The adaptive keys (`codecs.adaptive`) hold, per group of tokens and channel, a range and a depth. Today's range is an
fp16 low and an fp16 step (32 bits; 36 with the 4-bit depth: 0.56 bits a key element at kf=64). On the grid it is a
byte for its low and a byte for its high: codes 0..`GRID_CODES` on a grid fitted per sequence, kv head and channel
from the first tokens the stream codes (a prompt's), reaching `GRID_MARGIN` of their range below their least and as
much above their most (`fit_base`: an fp32 origin and unit a channel, held per sequence). A group's low rounds down
onto the grid and its high up; where the group reaches beyond the grid's ends it is clipped there. 20 bits a channel
and group with the depth: 0.31 bits a key element at kf=64. `benchmarks/key_side.py` measured what it costs in KL
(`grid8`).

The range the kernels read is derived from the codes (`ranges`: fp16 low and step, today's form), and a group's codes
are computed against exactly those fp16 values, so every kernel decodes a grid-coded group as it decodes today's.
The clipped candidates of `reference.CLIPS` are searched through the grid's rounding (`clipped_codes`, the
signature of `reference.clipped_codes` with the base added).
"""

from __future__ import annotations

import torch

from ..quant import FP16_MAX
from .reference import best_candidate, candidate_ends

GRID_CODES = 255  # the grid's last code: a range's low and high a byte each
GRID_MARGIN = 2.0  # the grid reaches this share of the fitted range below its least and above its most: a prompt of
# a few dozen tokens under-reaches what follows (at 0.25, fitted on 60 tokens, SmolLM2's KL at 4-8K was 2.9x today's
# ranges', `long_context_key_grid_short_margin025.json`; at 1 a spread that doubles after the prompt still clips,
# tested); at 1K prompts margins of 0.25 to 3 measured alike through the cache
SPAN_FLOOR = 1e-3  # a channel's fitted range is at least this share of the head's widest (a channel constant in the
# prompt still gets a grid), and at least `ABSOLUTE_FLOOR`
ABSOLUTE_FLOOR = 2.0**-14


def fit_base(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of keys `[..., T, D]` (the finite ones; none: a range of 0 at 0): its origin and unit, fp32
    `[..., D]`, from `GRID_MARGIN` of each channel's range below its least to as much above its most in `GRID_CODES`
    steps."""
    x = keys.float()
    finite = torch.isfinite(x)
    least = torch.where(finite, x, float("inf")).amin(-2)
    most = torch.where(finite, x, float("-inf")).amax(-2)
    seen = finite.any(-2)
    least, most = torch.where(seen, least, 0.0), torch.where(seen, most, 0.0)
    span = most - least
    floor = (SPAN_FLOOR * span.amax(-1, keepdim=True)).clamp_min(ABSOLUTE_FLOOR)
    middle, span = (least + most) / 2, torch.maximum(span, floor)
    reach = (1 + 2 * GRID_MARGIN) * span
    return middle - reach / 2, reach / GRID_CODES


def _values(low_code, high_code, levels, origin, unit) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 low and step of grid codes (float tensors, broadcast together)."""
    low = (origin + low_code * unit).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    step = ((origin + high_code * unit - low.float()) / levels).clamp(0, FP16_MAX).to(torch.float16)
    return low, step


def ranges(
    low_code: torch.Tensor, high_code: torch.Tensor, levels: torch.Tensor, origin: torch.Tensor, unit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels read of grid-coded groups: fp16 low and step `[B, H, G, D]` of codes uint8 `[B, H, G, D]`,
    levels (`2^depth - 1`, `[B, H, G, D]`) and the grid (`[B, H, D]`). The high decodes to `origin + high * unit`;
    the step spans from the fp16 low to it."""
    origin, unit = origin.float().unsqueeze(2), unit.float().unsqueeze(2)
    return _values(low_code.float(), high_code.float(), levels.float(), origin, unit)


@torch.no_grad()
def clipped_codes(x, low, span, levels, clips, origin, unit, search=best_candidate):
    """`reference.clipped_codes` with the range on the grid `origin`, `unit` fp32 `[B, H, D]`: groups `x` fp32
    `[B, H, G, group, D]`; each candidate of `clips` rounded outward onto the grid (clipped at its ends), the one of
    least squared error kept (`reference.best_candidate`). Returns codes uint8 `[B, H, G, group, D]` (against `ranges`
    of the kept grid codes) and the grid codes of low and high, uint8 `[B, H, G, D]`. It keeps every candidate's
    error, as the reference does: `reference.encode_groups(..., chunked=True)` gives it the groups in chunks."""
    o, u = origin.float()[:, :, None, :, None], unit.float()[:, :, None, :, None]
    wanted_low, wanted_high = candidate_ends(low, span, clips)  # [B, H, G, D, C]
    low_code = ((wanted_low - o) / u).floor().nan_to_num(0.0).clamp(0, GRID_CODES)
    high_code = torch.maximum(((wanted_high - o) / u).ceil().nan_to_num(GRID_CODES).clamp(0, GRID_CODES), low_code)
    lows, steps = _values(low_code, high_code, levels.unsqueeze(-1), o, u)
    codes, _, _, best = search(x, lows, steps, levels)
    pick = lambda t: t.gather(-1, best).squeeze(-1).to(torch.uint8)  # noqa: E731
    return codes, pick(low_code), pick(high_code)
