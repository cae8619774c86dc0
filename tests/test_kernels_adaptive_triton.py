"""The default cache's Triton kernels (the GPU path) against their PyTorch references, on the CPU under
TRITON_INTERPRET=1 (set in conftest): the appends, the group coding, the decoding attention, the reconstruction and
the row copies. Small odd shapes; the kernels that follow the references' operations are held to their bytes."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.codecs import PlainCodec, RotatedCodec
from hf_deltakv.codecs.adaptive import AdaptiveChannelCodec
from hf_deltakv.kernels import reference
from hf_deltakv.kernels.layout import RopeAngles
from hf_deltakv.quant import QuantizedTensor, get_format

from .conftest import attend_by_name

pytest.importorskip("triton", reason="needs the triton extra")

FREQS = {d: 10000.0 ** -(torch.arange(d // 2, dtype=torch.float64) / (d // 2)) for d in (32, 64, 128)}


def _strided(x: torch.Tensor) -> torch.Tensor:
    """`x` `[B, H, n, D]` laid out as a model's projection leaves it: heads inside tokens."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["rope", "order", "none"])
@pytest.mark.parametrize("n", [1, 5, 37])  # one program; a tile with rows past the end; several tiles
def test_undo_rope_into_gives_the_reference_bytes(dtype, case, n):
    from hf_deltakv.kernels.triton.append import undo_rope_into

    g = torch.Generator().manual_seed(3)
    keys = _strided((torch.randn(2, 3, n, 64, generator=g) * 4).to(dtype))
    keys[0, 0, 0, :3] = torch.tensor([1e6, float("nan"), -float("inf")]).to(dtype)  # saturated, NaN kept
    positions = torch.randint(0, 1 << 30, (2, n + 4), generator=g).to(torch.int32)[:, 2 : 2 + n]
    order = torch.randperm(64, generator=g) if case == "order" else None
    freqs = FREQS[64] if case != "none" else None
    want, got = (torch.zeros(2, 3, n + 7, 64, dtype=torch.float16) for _ in range(2))
    reference.undo_rope_into(keys, positions, freqs, order, want, 4)
    undo_rope_into(keys, positions, freqs, order, got, 4)
    assert _same(got, want)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_0_16", "q3_0", "q4_1", "q4_1_16", "q8_0", "f16"])
@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("rotation", [0, 64])
@pytest.mark.parametrize("n", [4, 37])  # one tile; several, the last with rows past the end
def test_quantize_at_rotates_and_quantizes_to_the_reference_bytes(fmt, search, rotation, n):
    """Every format's appends: the bytes of `quant.quantize` (rotated first), non-finite and out-of-fp16-range values
    included; a scale search asked of a format without one is refused as the reference refuses it."""
    from hf_deltakv.kernels.triton.append import quantize_at, serves_quantize

    g = torch.Generator().manual_seed(rotation + search)
    x = _strided((torch.randn(2, 3, n, 64, generator=g) * 3).to(torch.bfloat16))
    x[0, 0, 0, 5], x[1, 1, 1, 40], x[0, 1, 2] = float("nan"), float("inf"), 0.0  # NaN and inf blocks, a zero row
    x[1, 2, 3, :2] = 2.5  # ties of magnitude: the first is the block's peak
    x[0, 2, 1, :2] = torch.tensor([float("inf"), -float("inf")])  # both infinities in one block
    x[1, 0, 2, 33] = 1e6  # beyond fp16: saturated scales (and f16 values)
    fm = get_format(fmt)
    assert serves_quantize(fmt, 64)
    want, got = (QuantizedTensor.empty(fm, (2, 3, n + 3), 64, "cpu") for _ in range(2))
    for t in (want, got):
        for part in t.tensors():
            part.zero_()
    if search and fmt not in ("q4_0", "q4_0_16", "q3_0"):
        for quantizer in (reference.quantize_at, quantize_at):
            with pytest.raises(ValueError, match="search_scale"):
                quantizer(x, fmt, search, got, 2, rotation)
        return
    reference.quantize_at(x, fmt, search, want, 2, rotation)
    quantize_at(x, fmt, search, got, 2, rotation)
    for have, spec in zip(got.tensors(), want.tensors(), strict=True):
        assert _same(have, spec)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_query_energy_is_added_as_the_reference_adds_it(group, packed):
    from hf_deltakv.kernels.triton.append import add_query_energy

    g = torch.Generator().manual_seed(group)
    query = torch.randn(2, 2 * group, 1, 32, generator=g).to(torch.bfloat16)
    if packed:  # transformers' layout for one decoded token's GQA heads
        query = query.reshape(2, 2, group, 32)
    order = torch.randperm(32, generator=g)
    total = torch.rand(2, 2, 32, generator=g)
    for start in (None, total):
        assert _same(add_query_energy(query, order, 2, start), reference.add_query_energy(query, order, 2, start))
        assert _same(add_query_energy(query, None, 2, start), reference.add_query_energy(query, None, 2, start))


@pytest.mark.parametrize("group", [1, 3])
def test_a_chunks_query_energies_are_summed_as_the_reference_sums_them(group):
    """A chunk's running sums (one per position), from queries laid out as transformers passes them (heads and
    positions transposed: not contiguous)."""
    from hf_deltakv.kernels.triton.append import add_query_energies

    g = torch.Generator().manual_seed(group)
    query = torch.randn(2, 7, 2 * group, 32, generator=g).to(torch.bfloat16).transpose(1, 2)  # [B, heads, 7, D]
    order = torch.randperm(32, generator=g)
    total = torch.rand(2, 2, 32, generator=g)
    for start in (None, total):
        # positions first...first + 6; the sums before the group starts crossed (8 / 2, 4, 6 / none), then the total
        for channels, first, group, kept in ((order, 5, 8, 2), (None, 0, 2, 4), (order, 9, 8, 1)):
            want = reference.add_query_energies(query, channels, 2, start, first, group)
            got = add_query_energies(query, channels, 2, start, first, group)
            assert want.shape == (2, 2, kept, 32) and _same(got, want)
    whole = reference.add_query_energies(query, None, 2, total, 5, 1)  # every position a group start: every sum
    assert torch.allclose(whole[:, :, -1], total + reference.query_energy(query, None, 2, False).sum(2))


def _coded_rows(batch, heads, rows, total, group, dim):
    return (torch.zeros(batch, heads, rows, total, group // 8, dtype=torch.uint8),
            torch.zeros(batch, heads, rows, dim // 2, dtype=torch.uint8),
            torch.zeros(batch, heads, rows, dim, dtype=torch.float16),
            torch.zeros(batch, heads, rows, dim, dtype=torch.float16))  # fmt: skip


@pytest.mark.parametrize(
    ("dim", "group", "bits", "groups", "pad", "weights", "clip"),
    [(32, 32, 4.0, 1, 0, False, True), (64, 16, 2.75, 2, 4, True, True), (32, 8, 5.25, 2, 3, True, False),
     (32, 64, 3.0, 1, 4, False, True), (128, 32, 4.0, 1, 4, True, True)],
)  # fmt: skip
def test_group_coding_gives_the_reference_bytes(dim, group, bits, groups, pad, weights, clip):
    from hf_deltakv.kernels.triton.adaptive_code import code_groups

    g = torch.Generator().manual_seed(dim + group)
    total = int(bits * dim)
    tail = (torch.randn(2, 2, groups * group + 3, dim, generator=g) * torch.rand(dim, generator=g) * 5).cumsum(2)
    tail[:, :, :, ::7] *= 30  # outlier channels: wide ranges, more bits
    tail = tail.half()
    w = torch.rand(2, 2, groups, dim, generator=g) if weights else None
    want, got = _coded_rows(2, 2, groups + 2, total, group, dim), _coded_rows(2, 2, groups + 2, total, group, dim)
    reference.code_groups(tail, pad, groups, w, total, clip, want, 1)
    code_groups(tail, pad, groups, w, total, clip, got, 1)
    for a, b in zip(want, got, strict=True):
        assert _same(b, a)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_group_coding_keeps_nan_and_infinity_as_the_reference(value):
    """A NaN or infinite key codes as the reference codes it: its channel's low and step NaN where the reference's are
    (`tl.minimum`/`tl.maximum` would have returned the clamp's bound), the same depths, planes and ranges elsewhere."""
    from hf_deltakv.kernels.triton.adaptive_code import code_groups

    from .conftest import same_bits

    g = torch.Generator().manual_seed(5)
    dim, group, groups, pad, total = 32, 8, 2, 3, 4 * 32
    tail = (torch.randn(2, 2, groups * group + 3, dim, generator=g) * 3).half()
    tail[0, 0, 5, 3] = value  # one element of a channel
    tail[1, 1, 7, :] = value  # a whole token
    want, got = _coded_rows(2, 2, groups + 2, total, group, dim), _coded_rows(2, 2, groups + 2, total, group, dim)
    reference.code_groups(tail, pad, groups, None, total, True, want, 1)
    code_groups(tail, pad, groups, None, total, True, got, 1)
    assert want[2].isnan().any() or value == value  # a NaN channel's low is NaN (not a bound of the clamp)
    for a, b in zip(want, got, strict=True):
        assert same_bits(b, a)


def _streams(batch, heads, length, dim, group, pad, fmt, rotate, g, tail_only=False):
    keys = AdaptiveChannelCodec(group=group, bits=4.0, offset=pad)
    values = RotatedCodec(PlainCodec(fmt, search_scale=fmt == "q4_0")) if rotate else PlainCodec(fmt)
    x = torch.randn(batch, heads, length, dim, generator=g).cumsum(2) / 4
    keys.append(x)
    values.append(torch.randn(batch, heads, length, dim, generator=g))
    if not tail_only:
        keys.flush()
    return keys.layout() if not tail_only else _unflushed(keys), values.layout()


def _unflushed(codec):
    from hf_deltakv.kernels.layout import AdaptiveStream

    return AdaptiveStream(None, None, None, None, codec.tail, codec.group, codec.pad, codec.tail.shape[-1],
                          codec.length)  # fmt: skip


@pytest.mark.parametrize(
    ("batch", "heads", "group_size", "dim", "length", "kf", "pad", "fmt", "rotate", "rope", "masked", "sinks", "dtype"),
    [
        (1, 2, 4, 32, 70, 32, 4, "q4_0", True, "rope", False, 4, torch.float32),
        (2, 1, 3, 64, 100, 16, 0, "q4_0", True, "rope", True, 2, torch.bfloat16),
        (1, 2, 1, 64, 40, 8, 3, "q8_0", False, None, False, 0, torch.float16),
        (2, 2, 7, 128, 150, 64, 4, "q4_1", True, "rope", True, 4, torch.float32),
        (1, 1, 2, 32, 5, 32, 4, "q4_0", True, "rope", False, 4, torch.float32),
        (1, 1, 2, 32, 60, 32, 4, "q4_0", True, "gaps", True, 4, torch.float32),
    ],
)  # fmt: skip
def test_adaptive_attention_matches_the_reference(
    batch, heads, group_size, dim, length, kf, pad, fmt, rotate, rope, masked, sinks, dtype
):
    """Coded groups, a raw tail (or the tail alone), sinks, GQA, left padding, RoPE from consecutive positions or
    from positions with gaps and repeats (every angle computed), queries in the model's dtype."""
    from hf_deltakv.kernels.triton.adaptive_attention import adaptive_attention, supports

    g = torch.Generator().manual_seed(length + dim)
    keys, values = _streams(batch, heads, length, dim, kf, pad, fmt, rotate, g)
    query = torch.randn(batch, heads, group_size, dim, generator=g).to(dtype)
    sink_keys = torch.randn(batch, heads, sinks, dim, generator=g).half()
    sink_values = torch.randn(batch, heads, sinks, dim, generator=g).half()
    angles = None
    if rope:
        positions = (sinks + torch.arange(length)).expand(batch, length).to(torch.int32).contiguous()
        if rope == "gaps":
            positions = torch.randint(0, 30000, (batch, length), generator=g).to(torch.int32)
            positions[:, 10:20] = positions[:, 9:10]
        angles = RopeAngles(positions, FREQS[dim])
    mask = None
    if masked:
        mask = torch.ones(batch, 1, sinks + length, dtype=torch.bool)
        mask[0, :, : sinks + 9] = False  # left padding of the first row
        mask[-1, :, sinks + 3 :: 5] = False
    assert supports(keys, values, mask)
    want = attend_by_name(reference.stream_attention, query.float(), sink_keys, sink_values, keys, values, angles, mask,
                          1, sinks + length - 1, dim**-0.5)  # fmt: skip
    got = adaptive_attention(query, sink_keys, sink_values, keys, values, rope=angles, mask=mask, scale=dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_adaptive_attention_over_a_tail_only_and_nothing_visible():
    from hf_deltakv.kernels.triton.adaptive_attention import adaptive_attention

    g = torch.Generator().manual_seed(0)
    keys, values = _streams(1, 2, 20, 32, 32, 4, "q4_0", True, g, tail_only=True)
    query = torch.randn(1, 2, 2, 32, generator=g)
    none = torch.zeros(1, 2, 0, 32)
    want = attend_by_name(reference.stream_attention, query, none, none, keys, values, None, None, 1, 19, 0.2)
    got = adaptive_attention(query, none, none, keys, values, rope=None, mask=None, scale=0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    hidden = torch.zeros(1, 1, 20, dtype=torch.bool)
    got = adaptive_attention(query, none, none, keys, values, rope=None, mask=hidden, scale=0.2)
    assert torch.equal(got, torch.zeros_like(query))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_reconstruction_writes_the_reference_history_in_the_model_dtype(dtype, fmt):
    from hf_deltakv.kernels.triton.reconstruct import decode_into, serves

    g = torch.Generator().manual_seed(len(fmt))
    keys, values = _streams(2, 2, 75, 64, 16, 4, fmt, True, g)
    angles = RopeAngles((4 + torch.arange(75)).expand(2, 75).to(torch.int32).contiguous(), FREQS[64])
    order = torch.randperm(64, generator=g)
    for stream, rope, channels in ((keys, angles, order), (values, None, None)):
        want, got = torch.zeros(2, 2, 75, 64, dtype=dtype), torch.zeros(2, 2, 75, 64, dtype=dtype)
        assert serves(stream, got)
        reference.decode_into(stream, want, rope, channels)
        decode_into(stream, got, rope, channels)
        if rope is None:  # values: the reference's operations, the same bits
            assert _same(got, want)
        else:  # keys: RoPE's angles by fp32 polynomials (within ~2e-7 of the reference's float64 ones)
            torch.testing.assert_close(
                got.float(), want.float(), atol=1e-5, rtol=2e-6 if dtype == torch.float32 else 1e-2
            )


def test_row_copies_in_one_launch():
    from hf_deltakv.kernels.triton.copy import copy_rows

    g = torch.Generator().manual_seed(0)
    pairs, expected = [], []
    for shape, dtype in [((2, 3, 5, 4, 16), torch.uint8), ((2, 3, 5, 4), torch.float16), ((1, 2, 7, 64), torch.float16),
                         ((3, 1, 9), torch.int32), ((2, 3, 0, 8), torch.float16)]:  # fmt: skip
        grown = list(shape)
        grown[2] += 6
        src = (torch.rand(*grown, generator=g) * 100).to(dtype)[:, :, : shape[2]]
        pairs.append((src, torch.zeros(*grown, dtype=dtype)))
        expected.append(torch.zeros(*grown, dtype=dtype))
        expected[-1][:, :, : shape[2]] = src
    assert copy_rows(pairs) == []
    assert all(torch.equal(dst, want) for (_, dst), want in zip(pairs, expected, strict=True))


@pytest.mark.parametrize(
    ("keys_kind", "n", "group_size", "dim", "length", "masked", "rope"),
    [
        ("adaptive", 3, 3, 64, 100, False, "rope"),  # a chunk of 3: one block of 16 rows (9 used)
        ("adaptive", 17, 2, 32, 90, True, "gaps"),  # 34 rows: 3 blocks, left padding
        ("adaptive", 64, 1, 32, 130, False, None),  # the most queries the kernels take
        ("q4_0", 5, 4, 64, 60, True, "rope"),  # plain keys before RoPE
        ("q8_0", 9, 2, 32, 40, False, None),
        ("kivi", 6, 3, 32, 75, False, "rope"),  # KIVI-style keys (groups and a tail)
        ("kivi", 4, 2, 64, 70, True, None),
    ],
)  # fmt: skip
def test_a_chunk_of_queries_matches_the_reference(keys_kind, n, group_size, dim, length, masked, rope):
    """Several queries per head (a chunked prefill, assisted decoding's candidates: row `g * n + i` is query `i` of
    head `g`), each seeing the tokens up to its own position, or its own row of the mask: the split kernels in blocks
    of query rows, the merge folding the tail and sinks per row."""
    from hf_deltakv.codecs import ChannelGroupCodec
    from hf_deltakv.kernels.triton import stream_attention

    batch, heads, sinks = 2, 2, 3
    g = torch.Generator().manual_seed(n * dim + length)
    if keys_kind == "adaptive":
        keys, values = _streams(batch, heads, length, dim, 32, sinks, "q4_0", True, g)
    else:
        codec = ChannelGroupCodec("q4_1") if keys_kind == "kivi" else PlainCodec(keys_kind)
        value_codec = RotatedCodec(PlainCodec("q4_0"))
        codec.append(torch.randn(batch, heads, length, dim, generator=g))
        value_codec.append(torch.randn(batch, heads, length, dim, generator=g))
        keys, values = codec.layout(), value_codec.layout()
    query = torch.randn(batch, heads, group_size * n, dim, generator=g)
    sink_keys = torch.randn(batch, heads, sinks, dim, generator=g).half()
    sink_values = torch.randn(batch, heads, sinks, dim, generator=g).half()
    angles = None
    if rope:
        positions = (sinks + torch.arange(length)).expand(batch, length).to(torch.int32).contiguous()
        if rope == "gaps":
            positions = torch.randint(0, 30000, (batch, length), generator=g).to(torch.int32)
        angles = RopeAngles(positions, FREQS[dim])
    offset = sinks + length - n  # the chunk's queries are the last n tokens
    mask = None
    if masked:  # causal rows, left padding in the first sequence, a hole in the last
        mask = torch.ones(n, sinks + length, dtype=torch.bool).tril(offset).expand(batch, n, -1).clone()
        mask[0, :, 1 : sinks + 9] = False
        mask[-1, :, sinks + 20 : sinks + 26] = False
    args = (query, sink_keys, sink_values, keys, values, angles, mask, n, offset, dim**-0.5)
    want = attend_by_name(reference.stream_attention, *args)
    got = attend_by_name(stream_attention, *args)  # what the dispatch sends a CUDA device's chunk to (None: not served)
    assert got is not None
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
