"""The compiled CPU encode kernels against their references, byte for byte (attention parity: test_attention.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hf_deltakv import kernels
from hf_deltakv.kernels import key_grid
from hf_deltakv.kernels.cpu import extension
from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.quant import QuantizedTensor

FORMATS = ["q4_0", "q4_0_16", "q4_1", "q4_1_16", "q8_0"]  # the delta codec's blocks too
QUANTIZED = [*FORMATS, "q3_0"]  # what the C++ quantizer codes
SEARCHED = ("q4_0", "q4_0_16", "q3_0")  # formats with a searched scale
values = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def _same_bytes(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert a.fmt.name == b.fmt.name and a.dim == b.dim
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_extension_builds():
    assert extension() is not None, "CI must build the CPU kernels (C++ compiler + ninja)"


@settings(max_examples=80, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 5), st.sampled_from([32, 64, 96])), elements=values),
    st.sampled_from(QUANTIZED),
    st.booleans(),
)
def test_quantize_kernel_is_byte_identical(x, fmt, search):
    t = torch.from_numpy(x + np.float32(0.0))
    search = search and fmt in SEARCHED  # the scale search: an encoder option of the symmetric formats
    _same_bytes(kernels.quantize(t, fmt, search), kernels.reference.quantize(t, fmt, search))


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_kernel_on_edge_blocks(fmt):
    x = torch.zeros(9, 32)
    x[6:] = torch.randn(3, 32)
    x[6, 4], x[7, 9], x[8, 0] = float("nan"), float("inf"), -float("inf")  # NaN: codes zeros; both: a NaN scale
    x[1] = 1.1754944e-38  # reciprocal scale overflows
    x[2, 3] = 1e9  # scale saturates at the fp16 maximum
    x[3] = torch.linspace(-5, 5, 32)  # ties in |x|: the first maximum wins
    x[4, ::2] = -2.0
    x[5] = 7.5
    _same_bytes(kernels.quantize(x, fmt), kernels.reference.quantize(x, fmt))
    if fmt in SEARCHED:
        _same_bytes(kernels.quantize(x, fmt, True), kernels.reference.quantize(x, fmt, True))
    big = torch.randn(700, 3, 64)  # a prefill: rows spread over threads
    _same_bytes(kernels.quantize(big, fmt), kernels.reference.quantize(big, fmt))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(FORMATS), st.booleans(), st.floats(0.01, 3.0))
def test_code_delta_kernel_is_byte_identical(seed, fmt, intra, spread):
    """Inter/intra choice per block, the flag in the scale's lowest bit and the reconstruction, as the reference."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3, 4, 64, generator=g) * 2
    long_term = base + torch.randn(3, 4, 64, generator=g) * spread
    x = base + torch.randn(3, 4, 64, generator=g) * spread * torch.rand(3, 4, 1, generator=g)
    got, got_recon = kernels.code_delta(x, base, long_term, fmt, intra)
    want, want_recon = kernels.reference.code_delta(x, base, long_term, fmt, intra)
    _same_bytes(got, want)
    assert torch.equal(got_recon, want_recon)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1), st.sampled_from(QUANTIZED), st.booleans(), st.integers(0, 5), st.sampled_from([1, 3]),
    st.sampled_from([0, 64]),
)  # fmt: skip
def test_quantize_at_writes_the_bytes_of_quantize_into_the_room(seed, fmt, search, at, n, rotation):
    """New tokens (a decoded one per head, or a prefill's) quantized in place into storage with room (strided rows),
    rotated first or not: the bytes of the reference (`quantize`, of `hadamard.rotate` when rotated); the rows around
    them untouched."""
    search = search and fmt in SEARCHED
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, n, 64, generator=g) * torch.rand(2, 3, n, 1, generator=g) * 10
    x[0, 1, 0, :5] = torch.tensor([0.0, -0.0, 1e-30, 6e4, -7e4])  # zeros, a subnormal, values past fp16's range
    want = kernels.reference.quantize(rotate(x) if rotation else x, fmt, search)
    rows = at + n + 2
    storage = want.map(lambda t: torch.full((2, 3, rows, *t.shape[3:]), 7, dtype=t.dtype))
    spec = storage.map(torch.clone)
    kernels.quantize_at(x, fmt, search, storage, at, rotation)
    kernels.reference.quantize_at(x, fmt, search, spec, at, rotation)
    _same_bytes(storage, spec)
    _same_bytes(storage.map(lambda t: t[:, :, at : at + n]), want)
    strided = want.map(lambda t: torch.zeros(2, 3, n + 1, *t.shape[3:], dtype=t.dtype))
    kernels.quantize_at(x.transpose(-1, 0).contiguous().transpose(-1, 0), fmt, search, strided, 1, rotation)
    _same_bytes(strided.map(lambda t: t[:, :, 1:]), want)
    untouched = [r for r in range(rows) if not at <= r < at + n]
    for t in storage.tensors():
        assert torch.equal(t[:, :, untouched], torch.full_like(t[:, :, untouched], 7))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([1, 2, 5, 300]), st.sampled_from([0, 70_000, 2**30]))
def test_undo_rope_kernel_is_the_reference(seed, reorder, n, start):
    """Keys turned back by their RoPE in the C++ kernel: the reference's floats exactly (its operations, in its order),
    with a channel order, one token or a prefill's, batch rows at other positions, large positions included."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, n, 64, generator=g) * 30
    positions = torch.arange(start, start + n, dtype=torch.int32).repeat(2, 1)
    positions[1] += torch.randint(0, 1000, (1,), generator=g).to(torch.int32)
    freqs = 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    freqs[-3:] = 0.0  # pairs RoPE leaves alone
    order = torch.randperm(64, generator=g) if reorder else None
    got = kernels.undo_rope(keys, positions, freqs, order)
    assert torch.equal(got, kernels.reference.undo_rope(keys, positions, freqs, order))


def test_q3_0_is_coded_by_the_kernel(monkeypatch):
    """q3_0 (values below 4 bits) is quantized in C++ as a prefill and as a decoding step's token, never by the
    PyTorch reference."""
    x = torch.randn(2, 3, 1, 64)
    want = kernels.reference.quantize(x, "q3_0", True)
    target = want.map(lambda t: torch.zeros(2, 3, 4, *t.shape[3:], dtype=t.dtype))

    def refused(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(kernels.reference, "quantize", refused)
    _same_bytes(kernels.quantize(x, "q3_0", True), want)
    kernels.quantize_at(x, "q3_0", True, target, 2)
    _same_bytes(target.map(lambda t: t[:, :, 2:3]), want)


def test_forced_reference_skips_the_encode_kernels(monkeypatch):
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")
    monkeypatch.setattr("hf_deltakv.kernels.cpu.encode.quantize", None)  # would raise if called
    x = torch.randn(2, 32)
    _same_bytes(kernels.quantize(x, "q4_0"), kernels.reference.quantize(x, "q4_0"))


@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([8, 16, 32, 64]), dim=st.sampled_from([2, 8, 64]), seed=st.integers(0, 999))
def test_bit_planes_kernels_match_the_reference(group, dim, seed):
    """Packing (encode) and decoding whole adaptive groups in C++ against quant.bitplanes / reference."""
    from hf_deltakv.codecs.adaptive import allocate_bits
    from hf_deltakv.kernels.reference import decode_groups
    from hf_deltakv.quant import pack_4bit
    from hf_deltakv.quant.bitplanes import pack_planes

    g = torch.Generator().manual_seed(seed)
    depths = allocate_bits(torch.rand(2, 3, dim, generator=g) * 100, 4 * dim)
    codes = (torch.rand(2, 3, group, dim, generator=g) * (2 ** depths.unsqueeze(-2).float())).floor().to(torch.uint8)
    planes = kernels.pack_planes(codes, depths)
    assert torch.equal(planes, pack_planes(codes, depths))
    low, step = torch.randn(2, 3, dim).half(), torch.rand(2, 3, dim).half()
    want = decode_groups(planes, pack_4bit(depths), low, step)
    got = extension().decode_planes(*(t.flatten(0, 1) for t in (planes, pack_4bit(depths), low, step)))
    assert torch.equal(got.view_as(want), want)


def _same_clipped(x, levels, clips):
    """The C++ range search gives the reference's bytes, for today's fp16 ranges (`clipped_codes`) and for the grid's
    (`key_grid.clipped_codes` searched by `best_candidate`; the grid fitted on the first half of the tokens, so that
    the rest reach beyond it and are clipped at its ends)."""
    low, span = x.amin(-2), x.amax(-2) - x.amin(-2)
    want = kernels.reference.clipped_codes(x, low, span, levels, clips)
    got = kernels.clipped_codes(x, low, span, levels, clips)
    group, dim = x.shape[-2:]
    xs = x.reshape(1, -1, 1, group, dim)  # as the codec's groups [B, H, G, group, D]
    ranges = tuple(t.reshape(1, -1, 1, dim) for t in (low, span, levels))
    grid = key_grid.fit_base(xs[:, :, 0, : max(1, group // 2)])
    want_grid = key_grid.clipped_codes(xs, *ranges, clips, *grid)
    got_grid = key_grid.clipped_codes(xs, *ranges, clips, *grid, search=kernels.best_candidate)
    for a, b in zip(want + want_grid, got + got_grid, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([(8, 32), (16, 64), (32, 64), (64, 64), (32, 128), (64, 256)]),
    st.booleans(),
    st.floats(1e-3, 1e4),
)
def test_clipped_codes_kernel_gives_the_reference_bytes(seed, shape, clip, spread):
    """The adaptive keys' range search in C++: the reference's codes, low and step (every candidate of CLIPS, or the
    whole range alone), on fp16-valued groups with outlier channels and depths from 1 to 8 bits."""
    from hf_deltakv.codecs.adaptive import MAX_BITS

    group, dim = shape
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, group, dim, generator=g) * torch.rand(dim, generator=g) * spread).cumsum(-2)
    x[..., ::7] *= 30  # outlier channels: wide ranges that clipping narrows
    x[..., 0, 1::5] += spread * 50  # one extreme token in some channels
    levels = ((1 << torch.randint(1, MAX_BITS + 1, (2, 3, dim), generator=g)) - 1).float()
    _same_clipped(x.half().float(), levels, kernels.reference.CLIPS if clip else kernels.reference.CLIPS[:1])


def test_clipped_codes_kernel_on_edge_groups():
    """Constant channels (zero span and step), ties between candidates, non-finite values and fp16's extremes."""
    x = torch.randn(4, 32, 16)
    x[0, :, 0] = 3.0  # constant: every candidate the same, the first kept
    x[0, :, 1] = 0.0
    x[1, 5, 2] = float("nan")
    x[1, 6, 3] = float("inf")
    x[1, 7, 4] = -float("inf")
    x[2, :, 5] = torch.linspace(-65504, 65504, 32)  # fp16's range: the step saturates
    x[3] = x[3].round()  # integers: exact grids, ties between candidates' errors
    levels = torch.full((4, 16), 3.0)
    levels[:, ::3] = 255.0
    _same_clipped(x, levels, kernels.reference.CLIPS)
    _same_clipped(x, levels, kernels.reference.CLIPS[:1])


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 16, 64, 256]), st.floats(1e-6, 1e5))
def test_grid_ranges_kernel_gives_the_reference_bytes(seed, dim, scale):
    """The grid's fp16 low and step (`key_grid.ranges`, derived at every read) in C++: the reference's bytes, from
    views of storage with room (strided rows), depths 1-8 (and 0), codes 0-255, grids up to fp16's range and beyond
    (the ends saturate)."""
    from hf_deltakv.quant import pack_4bit, unpack_4bit

    g = torch.Generator().manual_seed(seed)
    room = torch.randint(0, 256, (2, 3, 9, dim), generator=g, dtype=torch.uint8)
    low_code, high_code = room[:, :, :6], room[:, :, 2:8].maximum(room[:, :, :6])  # views of buffers with room
    depths = pack_4bit(torch.randint(0, 9, (2, 3, 9, dim), generator=g, dtype=torch.uint8))[:, :, :6]
    origin = torch.randn(2, 3, dim, generator=g) * scale
    unit = torch.rand(2, 3, dim, generator=g) * scale / 100
    origin[0, 0, 0], unit[0, 0, 0] = 6.0e4, 50.0  # (an end beyond fp16's range: saturated)
    levels = (1 << unpack_4bit(depths).long()) - 1
    want = key_grid.ranges(low_code, high_code, levels, origin, unit)
    got = kernels.grid_ranges(low_code, high_code, depths, origin, unit)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype == torch.float16 and torch.equal(a.view(torch.int16), b.view(torch.int16))


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([2, 8, 64, 256]), st.floats(1.0, 8.0), st.floats(1e-3, 1e6))
def test_allocate_depths_kernel_gives_the_reference_depths(seed, dim, bits, spread):
    """The adaptive keys' bit allocation in C++: the reference's depths exactly (the bisection's sums are exact in
    float64; ties go to the lower channel), for budgets from the lowest depths to the highest."""
    from hf_deltakv.codecs.adaptive import MAX_BITS

    g = torch.Generator().manual_seed(seed)
    level = (torch.rand(5, dim, generator=g) * spread).log2() * 0.5
    level[0] = 0.0  # every channel alike: the sum jumps at one level, the leftover bits go by channel order
    level[1, : dim // 2] = level[1, dim // 2 :]  # pairs of equal levels (RoPE pairs share their query weight)
    total = max(dim, min(MAX_BITS * dim, round(bits * dim)))
    want = kernels.reference.allocate_depths(level, total, MAX_BITS)
    assert torch.equal(want.sum(-1, dtype=torch.int64), torch.full((5,), total))
    assert torch.equal(kernels.allocate_depths(level, total, MAX_BITS), want)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([(9, 3), (14, 2), (4, 1), (8, 8), (16, 2), (40, 2)]),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)
def test_query_energy_kernel_is_the_reference(seed, heads, rows, one_position, reorder):
    """The queries' channel energies per kv head in C++: the reference's floats exactly, for GQA groups of 1 to 20
    heads, several rows (positions, or packed heads of one position) and a channel order."""
    q_heads, kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(2, q_heads, rows, 64, generator=g) * torch.rand(2, q_heads, rows, 1, generator=g) * 20
    order = torch.randperm(64, generator=g) if reorder else None
    want = kernels.reference.query_energy(query, order, kv_heads, one_position)
    assert torch.equal(kernels.query_energy(query, order, kv_heads, one_position), want)
    bf16 = query.bfloat16()
    assert torch.equal(kernels.query_energy(bf16, order, kv_heads, one_position),
                       kernels.reference.query_energy(bf16, order, kv_heads, one_position))  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1), st.sampled_from(QUANTIZED), st.booleans(), st.sampled_from([0, 64]), st.booleans(),
    st.sampled_from(["none", "rope", "reordered"]), st.sampled_from([torch.float32, torch.bfloat16]),
)  # fmt: skip
def test_append_token_kernel_writes_the_reference_bytes(seed, fmt, search, rotation, given_ids, rope, dtype):
    """A decoding step's token into a preallocated DeltaKVCache layer in one C++ call (`kernels.append_token`): the
    position, the key turned back by its RoPE and saturated into the raw tail, the value quantized into its row, the
    count advanced; every buffer byte for byte as `reference.append_token` leaves it (keys past fp16's range, zeros,
    a subnormal), the rows around untouched."""
    search = search and fmt in SEARCHED
    g = torch.Generator().manual_seed(seed)
    batch, heads, dim, sinks, held, capacity = 2, 3, 64, 4, 9, 16
    key, value = ((torch.randn(batch, heads, 1, dim, generator=g) * 20).to(dtype) for _ in range(2))
    key[0, 1, 0, :5] = torch.tensor([0.0, -0.0, 1e-30, 7e4, -1e6]).to(dtype)  # past fp16's range: saturated
    value[1, 0, 0, :4] = torch.tensor([0.0, -0.0, 6e4, -7e4]).to(dtype)
    ids = torch.tensor([[40_000], [17]]) if given_ids else None
    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2)) if rope != "none" else None
    order = torch.randperm(dim, generator=g) if rope == "reordered" else None
    shapes = kernels.reference.quantize(torch.zeros(batch, heads, 1, dim), fmt, search)
    storage = {
        "positions": torch.full((batch, capacity), -3, dtype=torch.int32),
        "counts": torch.tensor([held, 1, 0, 0]),
        "tail": torch.full((batch, heads, 8, dim), 5.0, dtype=torch.float16),
        "values": shapes.map(lambda t: torch.full((batch, heads, capacity, *t.shape[3:]), 7, dtype=t.dtype)),
    }
    spec = {name: t.map(torch.clone) if name == "values" else t.clone() for name, t in storage.items()}
    for append, s in ((kernels.append_token, storage), (kernels.reference.append_token, spec)):
        append(key, value, ids, s["positions"], freqs, order, s["counts"], s["tail"], 2, sinks, s["values"], fmt,
               search, rotation)  # fmt: skip
    for name in ("positions", "counts", "tail"):
        assert torch.equal(storage[name].view(torch.uint8), spec[name].view(torch.uint8)), name
    _same_bytes(storage["values"], spec["values"])
    assert storage["counts"].tolist() == [held + 1, 1, 0, 0]
    assert torch.equal(storage["tail"][:, :, [0, 1, *range(3, 8)]], torch.full((batch, heads, 7, dim), 5.0).half())
    assert storage["tail"].isfinite().all()
    for t in storage["values"].tensors():  # only row held - sinks written
        others = [r for r in range(capacity) if r != held - sinks]
        assert torch.equal(t[:, :, others], torch.full_like(t[:, :, others], 7))


def test_append_token_is_one_kernel_call_unless_the_reference_is_forced(monkeypatch):
    """On the CPU `kernels.append_token` never runs the reference's steps (one C++ call); `HF_DELTAKV_KERNELS=reference`
    runs them."""
    calls = []
    monkeypatch.setattr(kernels.reference, "append_token", lambda *args: calls.append(args))
    storage = kernels.reference.quantize(torch.zeros(1, 2, 8, 64), "q4_0").map(torch.zeros_like)
    counts = torch.tensor([4, 0, 0, 0])
    args = (torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), None, torch.zeros(1, 8, dtype=torch.int32), None,
            None, counts, torch.zeros(1, 2, 4, 64, dtype=torch.float16), 0, 4, storage, "q4_0", False, 0)  # fmt: skip
    kernels.append_token(*args)
    assert not calls and counts[0] == 5 and storage.codes[:, :, 0].any()
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")
    kernels.append_token(*args)
    assert len(calls) == 1
