"""The key side-information map's formats (benchmarks/key_side.py): today's variant codes as the key codec's reference
does, and each cheaper variant stores a range that covers what it was asked to (rounded outward) or clips it only
where its format cannot reach, so the KL the map reports is the KL of those formats."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import key_side as ks

from hf_deltakv.kernels import reference


def _groups(seed: int, shape=(1, 2, 3, 64, 16)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-1, 1, shape[-1])
    x[..., 3] += 5.0  # (an offset channel, as Qwen's key biases make)
    return x


def test_todays_variant_decodes_as_the_key_codecs_reference():
    x = _groups(0)
    weights = torch.rand(x.shape[:3] + x.shape[-1:], generator=torch.Generator().manual_seed(1)) + 0.1
    ours = ks.code_groups(x, weights, 3.0, "fp16", None)
    planes, depths, low, step = reference.encode_groups(x, weights, 3 * x.shape[-1], clip_range=True)
    theirs = reference.decode_groups(planes, depths, low, step)
    assert torch.allclose(ours, theirs, rtol=2e-3, atol=1e-3)


@settings(max_examples=60, deadline=None)
@given(x=st.floats(1e-6, 1e6), up=st.booleans())
def test_the_minifloat_rounds_the_asked_way_within_its_mantissa(x, up):
    y = float(ks.minifloat(torch.tensor([x], dtype=torch.float64), up)[0])
    assert (y >= x) if up else (y <= x)
    assert abs(y - x) <= x * 2.0**-ks.FP8_MANTISSA
    assert float(ks.minifloat(torch.tensor([y], dtype=torch.float64), not up)[0]) == y  # a grid point stays


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), variant=st.sampled_from(["fp8-step", "fp8", "grid8", "grid6", "grid4"]),
       depth=st.integers(1, 8))  # fmt: skip
def test_a_stored_range_covers_the_asked_range_unless_its_grid_ends_first(seed, variant, depth):
    g = torch.Generator().manual_seed(seed)
    base_low, base_high = torch.randn(8, generator=g, dtype=torch.float64), torch.rand(8, generator=g).double()
    base = (base_low, base_low + 0.1 + 3 * base_high)
    span = base[1] - base[0]
    low = base[0] + (torch.rand(8, generator=g, dtype=torch.float64) * 1.4 - 0.2) * span
    high = low + torch.rand(8, generator=g, dtype=torch.float64) * span
    levels = torch.full((8,), float((1 << depth) - 1), dtype=torch.float64)
    stored_low, step = ks.stored_range(variant, low, high, levels, base)
    stored_high = stored_low + step * levels
    eps = 1e-9 * (1 + low.abs() + high.abs())
    if variant.startswith("grid"):
        reach = (base[0] - ks.MARGIN * span, base[1] + ks.MARGIN * span)
        assert (stored_low >= reach[0] - eps).all() and (stored_high <= reach[1] + eps).all()
        inside = (low >= reach[0]) & (high <= reach[1])
        assert (stored_low[inside] <= low[inside] + eps[inside]).all()
        assert (stored_high[inside] >= high[inside] - eps[inside]).all()
        unit = (1 + 2 * ks.MARGIN) * span / ((1 << int(variant.removeprefix("grid"))) - 1)
        assert (low[inside] - stored_low[inside] <= unit[inside] + eps[inside]).all()  # outward by one unit at most
    elif variant == "fp8":
        assert (stored_low <= low + eps).all() and (stored_high >= high - eps).all()
    else:  # (low in fp16, to the nearest, as today's)
        assert torch.equal(stored_low, low.half().double()) and (stored_high >= high - eps).all()


def test_cheaper_side_information_costs_squared_error_at_the_same_code_bits():
    x = _groups(2)
    weights = torch.ones(x.shape[:3] + x.shape[-1:])
    prompt = x.flatten(2, 3)[:, :, : x.shape[2] * x.shape[3] // 2]
    base = (prompt.amin(2), prompt.amax(2))
    error = {v: float((ks.code_groups(x, weights, 3.0, v, base) - x).square().sum()) for v in ks.VARIANTS}
    assert error["fp16"] <= error["fp8-step"] <= error["fp8"] * 1.001
    assert error["grid8"] <= error["grid6"] <= error["grid4"] <= error["static"]
    assert error["grid8"] < 1.1 * error["fp16"]
