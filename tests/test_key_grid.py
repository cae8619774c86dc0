"""Keys' ranges on a per-channel grid (`kernels/key_grid.py`, `DeltaKVCache(key_ranges="grid8")`, issue 61 item 3):
a byte for a group's low and high, the fp16 ranges the kernels read derived from them, the codes computed against
those; every byte counted; the map's coder (`benchmarks/key_side.py`) is this one."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_deltakv.codecs.adaptive import AdaptiveChannelCodec
from hf_deltakv.kernels import key_grid, reference
from hf_deltakv.quant import nbytes_of, unpack_4bit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _keys(seed: int, tokens: int = 256, heads: int = 3, dim: int = 32) -> torch.Tensor:
    """Pre-RoPE-like keys: channels of very different ranges, one far off centre, slowly drifting."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, tokens, dim, generator=g) * torch.logspace(-1.5, 1, dim)
    x[..., 5] += 20.0
    return x + torch.linspace(0, 0.3, tokens)[:, None]


def test_the_grid_reaches_a_margin_beyond_the_fitted_range_and_floors_constant_channels():
    x = _keys(0)
    x[..., 7] = 2.0  # (a channel constant in the prompt)
    x[0, 0, 3, 9] = float("inf")  # (non-finite tokens are left out of the fit)
    origin, unit = key_grid.fit_base(x)
    finite = torch.where(torch.isfinite(x), x, float("nan"))
    least, most = finite.nan_to_num(float("inf")).amin(2), finite.nan_to_num(float("-inf")).amax(2)
    span = most - least
    top = origin + key_grid.GRID_CODES * unit
    wide = span > 1e-3 * span.amax(-1, keepdim=True)
    torch.testing.assert_close((least - origin)[wide], (key_grid.GRID_MARGIN * span)[wide], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((top - most)[wide], (key_grid.GRID_MARGIN * span)[wide], rtol=1e-4, atol=1e-5)
    assert (unit[..., 7] > 0).all() and (origin[..., 7] < 2.0).all() and (top[..., 7] > 2.0).all()
    assert torch.isfinite(origin).all() and torch.isfinite(unit).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), bits=st.sampled_from([2.0, 2.75, 3.0, 4.0]), clip=st.booleans())
def test_grid_groups_decode_to_their_codes_against_the_derived_fp16_ranges(seed, bits, clip):
    x = _keys(seed, tokens=128).view(2, 3, 4, 32, 32)
    weights = torch.rand(2, 3, 4, 32, generator=torch.Generator().manual_seed(seed)) + 0.1
    origin, unit = key_grid.fit_base(x.flatten(2, 3))  # (every group within the grid: see the test of drift below)
    grid = functools.partial(key_grid.clipped_codes, origin=origin, unit=unit)
    total = int(bits * 32)
    planes, depths, low_code, high_code = reference.encode_groups(x, weights, total, clip, clip=grid)
    assert low_code.dtype == high_code.dtype == torch.uint8 and (low_code <= high_code).all()
    levels = (1 << unpack_4bit(depths).long()) - 1
    low, step = key_grid.ranges(low_code, high_code, levels, origin, unit)
    decoded = reference.decode_groups(planes, depths, low, step)
    # the codes are the nearest on the derived range, clamped to it (as `reference.encode_groups` codes)
    low_f, step_f = low.float().unsqueeze(-2), step.float().unsqueeze(-2)
    codes = ((x - low_f) / step_f).round().clamp(min=0)
    nearest = low_f + torch.minimum(codes, levels.unsqueeze(-2).float()) * step_f
    torch.testing.assert_close(decoded, nearest.half().float(), rtol=0, atol=0)
    # today's fp16 ranges err less, but not by much: the grid's rounding costs a few % of squared error
    fp16 = reference.decode_groups(*reference.encode_groups(x, weights, total, clip))
    ours, theirs = (decoded - x).pow(2).sum(), (fp16 - x).pow(2).sum()
    assert theirs * 0.98 <= ours <= theirs * 1.25


def test_a_group_beyond_the_grid_is_clipped_at_its_ends():
    x = _keys(6, tokens=64).view(2, 3, 2, 32, 32)
    origin, unit = key_grid.fit_base(x[:, :, 0])
    x[:, :, 1] = x[:, :, 1] * 3 + 50.0  # (the second group far above what the prompt held)
    grid = functools.partial(key_grid.clipped_codes, origin=origin, unit=unit)
    planes, depths, lo, hi = reference.encode_groups(x, None, 96, True, clip=grid)
    low, step = key_grid.ranges(lo, hi, (1 << unpack_4bit(depths).long()) - 1, origin, unit)
    decoded = reference.decode_groups(planes, depths, low, step)
    top = (origin + key_grid.GRID_CODES * unit).unsqueeze(2).unsqueeze(2)
    assert (decoded <= top.half().float() * (1 + 1e-3) + 1e-3).all() and torch.isfinite(decoded).all()
    assert (hi[:, :, 1] == key_grid.GRID_CODES).float().mean() > 0.9


def test_the_maps_grid8_coder_is_this_one():
    import key_side as ks

    x = _keys(3, tokens=128).view(2, 3, 4, 32, 32)
    weights = torch.ones(2, 3, 4, 32)
    prompt = x[:, :, :2].flatten(2, 3)
    origin, unit = key_grid.fit_base(prompt)
    grid = functools.partial(key_grid.clipped_codes, origin=origin, unit=unit)
    planes, depths, lo, hi = reference.encode_groups(x, weights, 96, True, clip=grid)
    low, step = key_grid.ranges(lo, hi, (1 << unpack_4bit(depths).long()) - 1, origin, unit)
    ours = reference.decode_groups(planes, depths, low, step)
    theirs = ks.code_groups(x, weights, 3.0, "grid8", (prompt.amin(2), prompt.amax(2)))
    assert ((ours - x).pow(2).sum() / (theirs - x).pow(2).sum() - 1).abs() < 0.02


def test_the_codec_holds_a_byte_a_range_end_and_counts_every_byte():
    x = _keys(4, tokens=260)
    grid, fp16 = (AdaptiveChannelCodec(group=32, bits=3.0, offset=4, ranges=r) for r in ("grid8", "fp16"))
    for codec in (grid, fp16):
        codec.append(x[:, :, :100])  # (a prompt: the grid fitted on it, at its first read)
        codec.flush()
        for t in range(100, 252):
            codec.append(x[:, :, t : t + 1])
        codec.flush()
    assert grid.coded == fp16.coded == 8 and grid.low is None and grid.low_code.dtype == torch.uint8
    torch.testing.assert_close(grid.origin, key_grid.fit_base(x[:, :, :100].half())[0])
    # two bytes a channel and group for fp16's four (buffers with the same room), and the grid: two fp32 a channel
    ranges, codes = nbytes_of([fp16.low, fp16.step]), nbytes_of([grid.low_code, grid.high_code])
    assert codes * 2 == ranges and nbytes_of([grid.origin, grid.unit]) == 2 * 2 * 3 * 32 * 4
    assert grid.nbytes() == fp16.nbytes() - ranges + codes + nbytes_of([grid.origin, grid.unit])
    error = [(c.decode() - x[:, :, :252]).pow(2).sum() for c in (grid, fp16)]
    assert error[1] * 0.98 <= error[0] <= error[1] * 1.25


def test_crops_drops_reorders_and_a_new_prompt_keep_the_codec_consistent():
    x = _keys(5, tokens=200)
    codec = AdaptiveChannelCodec(group=32, bits=3.0, offset=0, ranges="grid8")
    codec.append(x)
    codec.flush()
    whole = codec.decode()
    codec.map_batch(lambda t: t.flip(0))
    torch.testing.assert_close(codec.decode(), whole.flip(0), rtol=0, atol=0)
    codec.truncate(150)  # (a cut inside group 4: its kept tokens back to the raw tail)
    torch.testing.assert_close(codec.decode(), whole.flip(0)[:, :, :150], rtol=0, atol=0)
    codec.drop_front(codec.droppable(40))
    assert codec.length == 118
    torch.testing.assert_close(codec.decode(), whole.flip(0)[:, :, 32:150], rtol=0, atol=0)
    codec.truncate(0)
    assert codec.origin is None
    codec.append(x[:, :, :70] * 4)
    codec.flush()
    torch.testing.assert_close(codec.origin, key_grid.fit_base((x[:, :, :70] * 4).half())[0])


def test_delta_cache_takes_grid_ranges_and_refuses_where_it_cannot(tmp_path):
    from hf_deltakv import DeltaKVCache, StaticDeltaKVCache

    from .conftest import tiny_model

    model = tiny_model()
    ids = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(14))
    caches = {r: DeltaKVCache(kf=8, key_bits=3, model=model, key_ranges=r) for r in ("fp16", "grid8")}
    for cache in caches.values():
        model(ids, past_key_values=cache)
    assert caches["grid8"].layers[0].key_codec.ranges == "grid8"
    assert caches["grid8"].nbytes() < caches["fp16"].nbytes()
    out = model.generate(ids, cache=DeltaKVCache(kf=8, key_bits=3, model=model, key_ranges="grid8"),
                         max_new_tokens=12, do_sample=False)  # fmt: skip
    assert out.shape == (2, 52)
    loaded = DeltaKVCache.load(caches["grid8"].save(tmp_path / "cache.safetensors"), model)
    for a, b in zip(caches["grid8"].layers, loaded.layers, strict=True):
        for name in a.key_codec.state_names():
            left, right = getattr(a.key_codec, name), getattr(b.key_codec, name)
            assert (left is None and right is None) or torch.equal(left, right), name
    with pytest.raises(ValueError, match="key ranges must be one of"):
        DeltaKVCache(key_ranges="fp8")
    with pytest.raises(ValueError, match="apply to keys='channel' only"):
        DeltaKVCache(keys="token", key_ranges="grid8")
    with pytest.raises(ValueError, match="bits= budgets fp16 key ranges"):
        DeltaKVCache(kf=64, bits=3.5, model=model, key_ranges="grid8")
    with pytest.raises(ValueError, match="max_cache_len serves"):  # (no compiled form yet)
        model(ids, past_key_values=StaticDeltaKVCache(kf=8, key_ranges="grid8", max_cache_len=64, model=model))


def test_a_grid_fitted_on_a_short_prompt_reaches_the_keys_after_it():
    """A prompt of a few dozen tokens sees less of each channel's range than the tokens after it reach (here 28 tokens,
    the first group of kf=32 past the sinks, then 480 more whose spread grows to twice the prompt's): the grid's margin
    holds them without clipping, at nearly the squared error of today's fp16 ranges (margins of 0.25 and 1 clipped 42 %
    and 2 % of the ends here, at 69x and 1.6x that error)."""
    g = torch.Generator().manual_seed(11)
    tokens = 512
    x = torch.randn(1, 2, tokens, 32, generator=g) * torch.logspace(-1, 1, 32) * torch.linspace(1, 2, tokens)[:, None]
    x[..., 3] += 10.0
    origin, unit = key_grid.fit_base(x[:, :, :28])
    groups = x.view(1, 2, tokens // 32, 32, 32)
    grid = functools.partial(key_grid.clipped_codes, origin=origin, unit=unit)
    planes, depths, lo, hi = reference.encode_groups(groups, None, 128, True, clip=grid)
    low, step = key_grid.ranges(lo, hi, (1 << unpack_4bit(depths).long()) - 1, origin, unit)
    ours = (reference.decode_groups(planes, depths, low, step) - groups).pow(2).sum()
    theirs = (reference.decode_groups(*reference.encode_groups(groups, None, 128, True)) - groups).pow(2).sum()
    assert (lo == 0).float().mean() < 0.05 and (hi == key_grid.GRID_CODES).float().mean() < 0.05
    assert ours <= 1.25 * theirs
