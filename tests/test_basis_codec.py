"""The basis codec's reference (`kernels/basis.py`, issue 61): rows in the fallback format's bytes, the coding that
errs less in each, its flag in the first scale's lowest bit, the map's coder (`benchmarks/value_basis.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_deltakv.kernels import basis
from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.quant import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_gaussian_quantizers_are_the_known_optimal_uniform_ones():
    steps, errors = basis.gaussian_quantizers()
    assert steps[1] == pytest.approx(1.596, abs=2e-3) and errors[1] == pytest.approx(0.3634, abs=1e-3)
    assert steps[2] == pytest.approx(0.996, abs=2e-3) and errors[2] == pytest.approx(0.1188, abs=1e-3)
    for bits in range(1, basis.MAX_BITS):
        assert errors[bits + 1] < errors[bits] and steps[bits + 1] < steps[bits]
    assert errors[7] == pytest.approx(3.04e-4, rel=0.02) and errors[8] == pytest.approx(8.77e-5, rel=0.02)


def test_allocation_spends_the_budget_by_reverse_water_filling():
    spread = torch.tensor([16.0, 4.0, 1.0, 0.25, 1e-6, 0.0])
    bits = basis.allocate(spread, 9)
    assert int(bits.sum()) == 9 and bits.tolist() == sorted(bits.tolist(), reverse=True)
    assert bits[-1] == 0 and bits[-2] == 0  # (what carries nothing gets nothing)
    assert bits[0] - bits[1] == 1  # (a factor 4 of variance is about one bit)
    flat = basis.allocate(torch.ones(64), 208)
    assert set(flat.tolist()) == {3, 4} and int(flat.sum()) == 208
    assert basis.allocate(torch.ones(4), 100).tolist() == [basis.MAX_BITS] * 4
    # a row is the fallback's blocks: 3.5 bits a value at q3_0, the basis coding's scale out of them
    assert basis.row_bytes("q3_0", 64) == 28 and basis.code_bits("q3_0", 64) == 208
    assert basis.row_bytes("q4_0", 128) == 72 and basis.code_bits("q4_0", 256) == 4.5 * 256 - 16


def _values(seed: int, heads: int, tokens: int, dim: int, steep: float) -> torch.Tensor:
    """Values in a few strong directions of each head (a spectrum `steep` decades deep), mixed, off-centre."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0]
    spread = torch.logspace(0.5, 0.5 - steep, dim)
    return (torch.randn(heads, tokens, dim, generator=g) * spread) @ mixing.transpose(1, 2) + 0.3


def _blocks(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return rotate(dequantize(quantize(rotate(x), fmt, search_scale=True)))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), dim=st.sampled_from([32, 64, 128]), fmt=st.sampled_from(["q3_0", "q4_0"]),
       steep=st.floats(0.0, 3.0), outliers=st.integers(0, 3), zeros=st.booleans())  # fmt: skip
def test_each_row_decodes_to_the_coding_that_errs_less(seed, dim, fmt, steep, outliers, zeros):
    heads, tokens = 2, 40
    x = _values(seed, heads, tokens, dim, steep)
    tables = basis.fit_tables(x[:, outliers + 1 :], fmt)  # (fitted without the first tokens)
    g = torch.Generator().manual_seed(seed + 1)
    x[:, :outliers] += 6.0 * torch.randn(heads, outliers, dim, generator=g)  # (far out of what the fit saw)
    if zeros:
        x[:, -1] = 0.0
    rows = basis.encode(x, tables)
    assert rows.dtype == torch.uint8 and rows.shape == (heads, tokens, basis.row_bytes(fmt, dim))
    assert tables.bits.long().sum(-1).tolist() == [basis.code_bits(fmt, dim)] * heads
    decoded = basis.decode(rows, tables)
    assert torch.isfinite(decoded).all()
    error = (decoded - x).pow(2).sum(-1)
    block_error = (_blocks(x, fmt) - x).pow(2).sum(-1)
    # (the blocks' first scale loses its lowest bit to the flag: at most a unit of its last place)
    assert (error <= block_error * 1.01 + 1e-6).all()
    flag = basis.is_basis(rows)
    torch.testing.assert_close(decoded[flag], basis.decode_basis(rows, tables)[flag], rtol=0, atol=0)
    if zeros:
        assert float(error[:, -1].max()) < 1e-6


def test_the_flag_is_the_first_scales_lowest_bit_and_the_blocks_keep_their_bytes():
    x = _values(7, 2, 64, 64, 2.0)
    tables = basis.fit_tables(x, "q3_0")
    x[:, 3] += 8.0 * torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    rows = basis.encode(x, tables)
    flag = basis.is_basis(rows)
    assert flag.any() and not flag.all()  # (the far tokens take the blocks, the rest the basis)
    first = rows[..., :2].contiguous().view(torch.int16)[..., 0]
    assert torch.equal((first & 1).bool(), flag)
    blocks = quantize(rotate(x), "q3_0", search_scale=True)
    per_block = rows.unflatten(-1, (2, 14))
    fallen = ~flag
    assert torch.equal(per_block[..., 2:][fallen], blocks.codes[fallen])  # (the codes as the format gives them)
    stored = per_block[..., :2].contiguous().view(torch.float16)[..., 0][fallen]  # [n, blocks]
    assert torch.equal(stored[:, 1], blocks.scales[fallen][:, 1])
    assert torch.equal(stored[:, 0].view(torch.int16), blocks.scales[fallen][:, 0].view(torch.int16) & ~1)


def test_the_basis_coding_is_the_maps_coder():
    """The rows decode as the map's simulated coder (`value_basis.Fallback` of `fit(..., "basis", scale="max",
    floor=2)`) within the rounding of the tables to fp16 and of the flag bit: the KL the map reports is this codec's."""
    import value_basis as vb

    x = _values(4, 2, 512, 64, 2.0)
    x[:, 7] += 4.0
    fitted = x[:, 8:].double()
    stats = {"count": fitted.shape[1], "sum": fitted.sum(1), "outer": fitted.transpose(1, 2) @ fitted}
    simulated = vb.Fallback(vb.fit(stats, 3.5, "basis", scale="max", floor=2), "q3_0")(x[None])[0]
    decoded = basis.decode(basis.encode(x, basis.fit_tables(x[:, 8:], "q3_0")), basis.fit_tables(x[:, 8:], "q3_0"))
    errors = [float((y - x).pow(2).sum() / x.pow(2).sum()) for y in (decoded, simulated, _blocks(x, "q3_0"))]
    assert errors[0] == pytest.approx(errors[1], rel=0.01)
    assert errors[0] < 0.2 * errors[2]


def test_given_directions_are_kept_and_non_finite_rows_take_the_blocks():
    x = _values(9, 1, 128, 32, 1.0)
    other = torch.linalg.qr(torch.randn(1, 32, 32, generator=torch.Generator().manual_seed(10)))[0]
    tables = basis.fit_tables(x, "q3_0", basis=other)
    assert torch.equal(tables.basis, other.half())
    x[0, 5, 3] = float("nan")
    x[0, 6] = 3e37  # (finite, far past fp16: saturated, finite out)
    fitted = basis.fit_tables(x, "q3_0")  # (the token that is not finite left out of the fit)
    assert all(torch.isfinite(t.float()).all() for t in fitted.tensors())
    assert torch.equal(fitted.mean, basis.fit_tables(torch.cat([x[:, :5], x[:, 6:]], 1), "q3_0").mean)
    rows = basis.encode(x, tables)
    decoded = basis.decode(rows, tables)
    assert not basis.is_basis(rows)[0, 5] and torch.isnan(decoded[0, 5]).any()
    assert torch.isfinite(decoded[0, 6]).all() and torch.isfinite(decoded[0, 7:]).all()


def _codec_input(seed: int = 11, tokens: int = 100) -> torch.Tensor:
    x = torch.stack([_values(seed + b, 3, tokens, 64, 2.0) for b in range(2)])  # [2, 3, T, 64]
    x[:, :, 90] += 6.0 * torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(seed))  # (far out: the blocks)
    return x


def test_the_codec_stores_rows_and_fitted_tables_and_counts_every_byte():
    from hf_deltakv.codecs.basis import BasisCodec

    x = _codec_input()
    codec = BasisCodec("q3_0")
    codec.append(x[:, :, :80])  # (the prompt: the tables fitted on it)
    tables = codec.tables()
    assert tables.basis.shape == (2, 3, 64, 64) and tables.basis.dtype == torch.float16
    rows = basis.encode(x[:, :, :80], basis.fit_tables(x[:, :, :80], "q3_0"))
    assert torch.equal(codec.rows, rows)
    assert codec.nbytes() == rows.numel() + sum(t.numel() * t.element_size() for t in tables.tensors())
    for t in range(80, 100):  # (decoding steps: the prompt's tables, a row each)
        codec.append(x[:, :, t : t + 1])
    expected = basis.decode(basis.encode(x, tables), tables)
    torch.testing.assert_close(codec.decode(), expected, rtol=0, atol=0)
    torch.testing.assert_close(codec.decode_range(30, 45), expected[:, :, 30:45], rtol=0, atol=0)
    assert basis.is_basis(codec.rows).float().mean() > 0.8 and not basis.is_basis(codec.rows)[:, :, 90].any()


def test_crops_drops_and_batch_reorders_keep_the_rows_and_tables():
    from hf_deltakv.codecs.basis import BasisCodec

    x = _codec_input()
    codec = BasisCodec("q4_0")
    codec.append(x)
    whole = codec.decode()
    codec.map_batch(lambda t: t.flip(0))
    torch.testing.assert_close(codec.decode(), whole.flip(0), rtol=0, atol=0)
    codec.truncate(60)
    codec.drop_front(codec.droppable(10))
    assert codec.length == 50
    torch.testing.assert_close(codec.decode(), whole.flip(0)[:, :, 10:60], rtol=0, atol=0)
    with pytest.raises(ValueError, match="head width 32"):
        codec.append(x[:, :, :3, :32])  # (another head width: refused, the codec as it was)
    assert codec.length == 50 and codec.rows.shape[2] == 50
    codec.truncate(0)  # (nothing left: the next prompt is fitted anew)
    codec.append(x[:, :, :20] * 3)
    assert torch.equal(codec.spread, basis.fit_tables(x[:, :, :20] * 3, "q4_0").spread)


def test_delta_cache_takes_basis_values_and_codes_them_no_worse_than_the_blocks():
    """`DeltaKVCache(values="basis-q3_0")` generates; its first layer's values (the same inputs in both caches) err no
    more than `values="q3_0"`'s, row for row, and the refusals are clear."""
    from hf_deltakv import DeltaKVCache, StaticDeltaKVCache
    from hf_deltakv.codecs.basis import BasisCodec

    from .conftest import tiny_model

    model = tiny_model()
    ids = torch.randint(1, 100, (2, 40), generator=torch.Generator().manual_seed(12))
    exact = model(ids, use_cache=True).past_key_values.layers[0].values.float()
    errors = []
    for values in ("basis-q3_0", "q3_0"):
        cache = DeltaKVCache(kf=8, values=values, model=model)
        model(ids, past_key_values=cache)
        stream = cache.layers[0].value_codec
        assert isinstance(stream, BasisCodec) == (values == "basis-q3_0")
        errors.append((stream.decode() - exact[:, :, 4:]).pow(2).sum(-1))
    assert (errors[0] <= errors[1] * 1.01 + 1e-9).all()
    out = model.generate(ids, cache=DeltaKVCache(kf=8, values="basis-q3_0", model=model), max_new_tokens=12,
                         do_sample=False)  # fmt: skip
    assert out.shape == (2, 52)
    with pytest.raises(ValueError, match="basis-q3_0"):
        DeltaKVCache(values="basis-q2_0")
    with pytest.raises(ValueError, match="max_cache_len serves"):  # (no compiled form yet)
        model(ids, past_key_values=StaticDeltaKVCache(kf=8, values="basis-q3_0", max_cache_len=64, model=model))


def test_a_saved_cache_loads_its_rows_and_tables(tmp_path):
    from hf_deltakv import DeltaKVCache

    from .conftest import tiny_model

    model = tiny_model()
    ids = torch.randint(1, 100, (2, 30), generator=torch.Generator().manual_seed(13))
    cache = DeltaKVCache(kf=8, values="basis-q3_0", model=model)
    model(ids, past_key_values=cache)
    loaded = DeltaKVCache.load(cache.save(tmp_path / "cache.safetensors"), model)
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        for name in a.value_codec.state_names():
            assert torch.equal(getattr(a.value_codec, name), getattr(b.value_codec, name)), name
        assert a.value_codec.nbytes() == b.value_codec.nbytes()
