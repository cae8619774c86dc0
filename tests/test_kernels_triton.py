"""Every Triton kernel against its PyTorch reference on odd shapes (on the CPU under TRITON_INTERPRET=1, set in
conftest; small shapes, as the interpreter is slow). Inputs are made in bf16 and computed in fp32."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.codecs import PlainCodec, RotatedCodec
from hf_deltakv.kernels import reference

from .conftest import delta_codec, rope_angles

pytest.importorskip("triton", reason="needs the triton extra")


@pytest.mark.parametrize(
    ("batch", "n_out", "n_in", "threshold", "bias"),
    [(1, 7, 45, 0.5, True), (3, 65, 96, 0.0, False), (2, 130, 33, 1.0, True)],
)
def test_sparse_matvec_matches_reference(batch, n_out, n_in, threshold, bias):
    from hf_deltakv.kernels.triton.sparse_matvec import sparse_matvec

    torch.manual_seed(n_in)
    x = torch.randn(batch, n_in, dtype=torch.bfloat16).float()
    x[:, ::5] = 0  # channels zero in every row: skipped even at threshold 0
    wt = torch.randn(n_in, n_out, dtype=torch.bfloat16).float()
    b = torch.randn(n_out, dtype=torch.bfloat16).float() if bias else None
    scale = torch.rand(n_in) + 0.5
    expected, kept = reference.sparse_matvec(x, wt, b, scale, threshold)
    got, got_kept = sparse_matvec(x, wt, b, scale, threshold)
    assert got_kept == kept < n_in
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sparse_matvec_never_reads_skipped_rows_and_with_nothing_kept_is_the_bias():
    from hf_deltakv.kernels.triton.sparse_matvec import sparse_matvec

    x, wt, b = torch.randn(1, 20), torch.randn(20, 5), torch.randn(5)
    x[0, 10:] = 0
    wt[10:] = float("nan")  # would poison any product that read them
    expected, _ = reference.sparse_matvec(x[:, :10], wt[:10], b, None, 0.0)
    torch.testing.assert_close(sparse_matvec(x, wt, b, None, 0.0)[0], expected, atol=1e-5, rtol=1e-5)
    got, kept = sparse_matvec(torch.zeros(1, 20), wt, b, None, 0.0)
    assert kept == 0
    torch.testing.assert_close(got, b[None])


@pytest.mark.parametrize(("fmt", "search"), [("q4_0", False), ("q4_0", True), ("q3_0", True), ("q4_1", False),
                                             ("q8_0", False), ("q4_0_16", False), ("q4_1_16", False)])  # fmt: skip
@pytest.mark.parametrize("shape", [(3, 5, 40), (1, 64), (2, 1, 3, 7)])
def test_quantize_is_byte_identical(fmt, search, shape):
    """Every format's codes and scales are the reference's bytes, NaN, ±inf and values past fp16 included (a block
    holding NaN codes zeros, one holding ±inf codes what the reference's infinite scale gives, both a NaN scale)."""
    from hf_deltakv.kernels.triton import quantize as kernel
    from hf_deltakv.quant import quantize

    torch.manual_seed(sum(shape))
    x = (torch.randn(shape, dtype=torch.bfloat16) * 3).float()
    x[..., 0] = 0.0  # exact zeros and ties of magnitude are part of the spec
    flat = x.view(-1)
    if flat.numel() >= 64:
        flat[3], flat[17], flat[40], flat[41] = float("nan"), float("inf"), -float("inf"), 1e38
    expected = quantize(x, fmt, search)
    got = kernel.quantize(x, fmt, search)
    for name in ("codes", "scales", "mins"):
        want, have = getattr(expected, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            assert have.shape == want.shape and have.dtype == want.dtype, name
            assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), name


def test_quantize_kernel_marks_non_finite_blocks_nan():
    from hf_deltakv.kernels.triton import quantize as kernel
    from hf_deltakv.quant import dequantize

    x = torch.randn(2, 64)
    x[0, 3] = float("inf")
    x[1, 40] = float("nan")
    out = dequantize(kernel.quantize(x, "q4_0"))
    assert out[0, :32].isnan().all() and out[1, 32:].isnan().all()
    assert out[0, 32:].isfinite().all() and out[1, :32].isfinite().all()


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "batch", "q_heads", "kv_heads", "tokens", "dim", "masked", "rotated", "rope"),
    [
        ("q4_0", "q4_0", 1, 3, 1, 37, 64, False, True, None),
        ("q4_1", "q4_1", 2, 4, 2, 50, 32, True, True, None),
        ("q8_0", "q8_0", 1, 2, 2, 19, 64, False, False, None),
        ("f16", "f16", 1, 2, 1, 21, 32, True, False, "rope"),
        ("q3_0", "q4_0", 1, 4, 2, 33, 64, False, False, "rope-gaps"),
        ("q4_0_16", "q8_0", 2, 2, 1, 25, 64, True, True, "rope"),
        ("q4_1_16", "f16", 1, 2, 1, 9, 256, False, False, None),
    ],
)
def test_plain_decode_attention_matches_reference(k_fmt, v_fmt, batch, q_heads, kv_heads, tokens, dim, masked,
                                                  rotated, rope):  # fmt: skip
    """The plain streams' kernels (split, then merge with the raw sinks) against the reference over the same storage:
    each format for keys and for values, mixed formats, rotated keys and values (the query turned instead of the
    keys, or, before RoPE, the keys turned back), keys before RoPE (consecutive and scattered positions), left
    padding, head dims 32-256 and one or three splits."""
    from hf_deltakv.kernels.triton.decode_attention import plain_attention, supports

    torch.manual_seed(tokens)
    group, sinks = q_heads // kv_heads, 2
    query = torch.randn(batch, kv_heads, group, dim, dtype=torch.bfloat16).float()
    wrap = RotatedCodec if rotated else (lambda codec: codec)
    keys, values = wrap(PlainCodec(k_fmt)), wrap(PlainCodec(v_fmt))
    keys.append(torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16).float())
    values.append(torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16).float())
    angles = rope_angles(batch, tokens, dim, torch.Generator().manual_seed(tokens), rope) if rope else None
    mask = None
    if masked:  # left padding in the first sequence, a sink included
        mask = torch.ones(batch, 1, sinks + tokens, dtype=torch.bool)
        mask[0, :, 1 : sinks + 7] = False
    assert supports(keys.layout(), values.layout(), mask)
    sink_keys, sink_values = torch.randn(batch, kv_heads, sinks, dim), torch.randn(batch, kv_heads, sinks, dim)
    args = (query, sink_keys, sink_values, keys.layout(), values.layout())
    expected = reference.stream_attention(*args, rope=angles, mask=mask, n_queries=1, causal_offset=sinks + tokens - 1,
                                          scale=dim**-0.5)  # fmt: skip
    for splits in (1, 3):
        got = plain_attention(*args, rope=angles, mask=mask, scale=dim**-0.5, splits=splits)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("k_fmt", "v_fmt", "batch", "q_heads", "kv_heads", "chunks", "dim", "masked", "rope"),
    [
        ("q4_1", "q4_1", 2, 4, 2, (40, 1, 30), 32, True, None),  # groups then a tail, in buffers with room
        ("q4_0", "q4_0", 1, 3, 1, (64,), 64, False, "rope"),  # whole groups only, keys before RoPE
        ("q8_0", "q3_0", 1, 2, 1, (13,), 64, False, "rope-gaps"),  # the tail only
        ("q4_1", "f16", 1, 2, 2, (70, 1), 128, True, None),
        ("q4_0", "q8_0", 1, 2, 1, (33,), 256, False, "rope"),
    ],
)
def test_kivi_decode_attention_matches_reference(k_fmt, v_fmt, batch, q_heads, kv_heads, chunks, dim, masked, rope):
    """KIVI-style keys (per-channel blocks of 32 tokens and the fp16 tail) through the plain kernel: against the
    reference over the same storage, with groups and a tail, whole groups, the tail alone, before RoPE or after."""
    from hf_deltakv.codecs import ChannelGroupCodec
    from hf_deltakv.kernels.triton.decode_attention import plain_attention, supports

    tokens = sum(chunks)
    torch.manual_seed(tokens + dim)
    group, sinks = q_heads // kv_heads, 1
    query = torch.randn(batch, kv_heads, group, dim, dtype=torch.bfloat16).float()
    keys, values = ChannelGroupCodec(k_fmt), PlainCodec(v_fmt)
    x = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16).float() * torch.linspace(0.2, 4, dim)
    y = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16).float()
    begin = 0
    for n in chunks:
        keys.append(x[:, :, begin : begin + n])
        values.append(y[:, :, begin : begin + n])
        begin += n
    angles = rope_angles(batch, tokens, dim, torch.Generator().manual_seed(tokens), rope) if rope else None
    mask = None
    if masked:
        mask = torch.ones(batch, 1, sinks + tokens, dtype=torch.bool)
        mask[-1, :, : sinks + 5] = False
    assert supports(keys.layout(), values.layout(), mask)
    sink_keys, sink_values = torch.randn(batch, kv_heads, sinks, dim), torch.randn(batch, kv_heads, sinks, dim)
    args = (query, sink_keys, sink_values, keys.layout(), values.layout())
    expected = reference.stream_attention(*args, rope=angles, mask=mask, n_queries=1, causal_offset=sinks + tokens - 1,
                                          scale=dim**-0.5)  # fmt: skip
    for splits in (1, 2):
        got = plain_attention(*args, rope=angles, mask=mask, scale=dim**-0.5, splits=splits)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_plain_decode_attention_reads_storage_through_its_strides():
    """Storage with room for appends (a view of a longer buffer, not contiguous over batch x heads) is read in place:
    the same output as from a compact copy."""
    from hf_deltakv.kernels.layout import PlainStream
    from hf_deltakv.kernels.triton.decode_attention import plain_attention, supports
    from hf_deltakv.quant import quantize

    torch.manual_seed(0)
    batch, kv_heads, group, dim, tokens, room = 2, 2, 2, 32, 20, 32
    full = [quantize(torch.randn(batch, kv_heads, room, dim), fmt) for fmt in ("q4_1", "q8_0")]
    views = [q.map(lambda t: t[:, :, :tokens]) for q in full]
    compact = [q.map(lambda t: t.contiguous()) for q in views]
    assert not views[0].codes.is_contiguous()
    query, sink = torch.randn(batch, kv_heads, group, dim), torch.zeros(batch, kv_heads, 0, dim)
    outs = []
    for k, v in (views, compact):
        streams = (PlainStream(k, dim, tokens), PlainStream(v, dim, tokens))
        assert supports(*streams, None)
        outs.append(plain_attention(query, sink, sink, *streams, rope=None, mask=None, scale=0.3))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("bits", [[4, 0, 2, 8], [3, 5, 6, 0, 0, 2], [0, 8]])
@pytest.mark.parametrize("lead", [(1,), (2, 5)])
def test_dequantize_latent_matches_reference(bits, lead):
    from hf_deltakv.kernels.triton.latent import dequantize_latent
    from hf_deltakv.quant.bitpack import GROUP
    from hf_deltakv.residual.codec import quantize_latent

    torch.manual_seed(len(bits) + len(lead))
    latent = torch.randn(*lead, len(bits) * GROUP, dtype=torch.bfloat16).float() * 3
    packed, scales = quantize_latent(latent, bits)
    expected = reference.dequantize_latent(packed, scales, bits)
    torch.testing.assert_close(dequantize_latent(packed, scales, bits), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="bit depths"):
        dequantize_latent(packed, scales, [*bits, 4])


@pytest.mark.parametrize(
    ("streams", "groups", "kf", "dim", "block", "intra"),
    [(2, 3, 5, 64, 16, True), (1, 2, 4, 64, 32, True), (3, 1, 6, 32, 16, False), (1, 2, 1, 64, 16, True)],
)
def test_delta_encode_matches_reference(streams, groups, kf, dim, block, intra):
    from hf_deltakv.kernels.triton.delta_encode import delta_encode_groups

    torch.manual_seed(kf * dim)
    walk = torch.randn(streams, groups, kf, dim, dtype=torch.bfloat16).float().cumsum(2)
    walk[..., :4] *= 20  # outlier channels
    long_term = torch.randn_like(walk) if intra else None
    keyframes = walk[:, :, 0] + 0.01 * torch.randn(streams, groups, dim)
    want = reference.delta_encode_groups(walk, long_term, keyframes, block)
    got = delta_encode_groups(walk, long_term, keyframes, block)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e38])
@pytest.mark.parametrize("intra", [True, False])
def test_delta_encode_codes_non_finite_and_huge_tokens_as_the_reference(value, intra):
    """A NaN or infinite element makes its block's scale NaN (and a NaN block's codes zero) as `quant.quantize` does,
    and the closed loop carries the NaN on as the reference's does; values past fp16 saturate the scale."""
    from hf_deltakv.kernels.triton.delta_encode import delta_encode_groups

    from .conftest import same_bits

    torch.manual_seed(0)
    walk = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16).float().cumsum(2)
    walk[0, 1, 2, 5] = value  # a delta token
    walk[1, 0, 0, 40] = value  # a keyframe
    long_term = torch.randn_like(walk) if intra else None
    keyframes = walk[:, :, 0] + 0.01 * torch.randn(2, 3, 64)
    want = reference.delta_encode_groups(walk, long_term, keyframes, 16)
    got = delta_encode_groups(walk, long_term, keyframes, 16)
    assert torch.equal(got[0], want[0]) and same_bits(got[1], want[1])
    assert torch.equal(got[2].isnan(), want[2].isnan()) and torch.equal(got[2].isinf(), want[2].isinf())
    torch.testing.assert_close(got[2].nan_to_num(0.0), want[2].nan_to_num(0.0), atol=1e-5, rtol=1e-5)
    assert want[1].isnan().any() == (value != 1e38)


@pytest.mark.parametrize("options", [{"kf": 4}, {"kf": 8, "delta_format": "q4_0"}, {"kf": 5, "intra": False}])
def test_delta_codec_prefill_through_the_kernel_matches_the_loop(monkeypatch, options):
    """DeltaCodec takes the fused encode kernel on GPUs; forced here (interpreter) it must store the same bytes."""
    import hf_deltakv.kernels

    torch.manual_seed(0)
    x = torch.randn(2, 3, 43, 64, dtype=torch.bfloat16).float().cumsum(2)
    step = torch.randn(2, 3, 1, 64)
    plain = delta_codec(**{"delta_format": "q4_0_16", **options})
    plain.append(x)
    plain.append(step)
    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    fused = delta_codec(**{"delta_format": "q4_0_16", **options})
    fused.append(x)
    fused.append(step)
    for name in ("keyframes", "deltas"):
        a, b = getattr(plain, name), getattr(fused, name)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.int16), b.scales.view(torch.int16))
    torch.testing.assert_close(plain.reference_state, fused.reference_state, atol=1e-5, rtol=1e-5)
    assert plain.nbytes() == fused.nbytes()


@pytest.mark.parametrize(
    ("options", "dim", "rope", "rotation", "strided", "poison"),
    [
        ({"kf": 8}, 64, "rope", 64, True, True),  # the default's keys: RoPE undone, rotated, mean references, intra
        ({"kf": 16, "delta_format": "q4_0_16"}, 32, "order", 32, False, False),
        ({"kf": 4, "intra": False}, 64, None, 0, True, True),
        ({"kf": 8, "reference": "keyframe", "mean_reference": False}, 32, "rope", 0, False, False),
    ],
)
def test_delta_tokens_kernel_stores_the_reference_bytes(monkeypatch, options, dim, rope, rotation, strided, poison):
    """Decoding steps of the token-delta codec in one kernel each (`kernels.delta_tokens`): RoPE undone, rotated, the
    running sum and its mean snapshots, keyframes and closed-loop deltas written into the storage's room; steps of
    one token and chunks, across keyframes and snapshots, give the bytes the reference gives (the same rounding);
    with `poison`, NaN and an infinite element among the decoded tokens carried as the reference does."""
    import hf_deltakv.kernels
    from hf_deltakv.kernels.hadamard import rotate
    from hf_deltakv.kernels.triton import delta_encode

    from .conftest import same_bits

    launches = []
    kernel = delta_encode.delta_tokens
    monkeypatch.setattr(delta_encode, "delta_tokens", lambda *args: launches.append(1) or kernel(*args))
    g = torch.Generator().manual_seed(dim + options["kf"])
    prompt, chunks = 21, [1, 2, 1, 9, 1, 14, 1, 16]  # crosses keyframes and the snapshots at 32 and 64 tokens
    steps = sum(chunks)
    x = (torch.randn(2, 3, prompt + steps, dim, generator=g, dtype=torch.float64).cumsum(2) / 4).to(torch.bfloat16)
    if poison:  # (rotated, the infinite element turns its whole token ±inf: every element codes 0, as the reference)
        x[0, 1, prompt + 3, 5], x[1, 2, prompt + 12, 7] = float("nan"), float("inf")
    if strided:  # heads inside tokens, as the model's projection leaves them
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    positions = torch.arange(prompt + steps)[None].repeat(2, 1) + torch.tensor([[0], [7]])
    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    order = torch.randperm(dim, generator=g) if rope == "order" else None
    turn = lambda a, b: None if rope is None else (positions[:, a:b], freqs, order)  # noqa: E731
    codecs = []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
            monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
        codec = delta_codec(**options)
        undone = x[:, :, :prompt].float() if rope is None else reference.undo_rope(x[:, :, :prompt], *turn(0, prompt))
        codec.append(rotate(undone) if rotation else undone)
        sizes = chunks if fused else [1] * steps  # (the reference path a token at a time)
        at = prompt
        for size in sizes:
            codec.append_turned(x[:, :, at : at + size], turn(at, at + size), rotation)
            at += size
        codecs.append(codec)
    plain, fused = codecs
    assert len(launches) == len(chunks)  # every step in the kernel
    for name in ("keyframes", "deltas"):
        a, b = getattr(plain, name), getattr(fused, name)
        assert torch.equal(a.codes, b.codes), name
        assert same_bits(a.scales, b.scales), name
    for name in ("reference_state", "running_sum", "means"):
        a, b = getattr(plain, name), getattr(fused, name)
        assert (a is None) == (b is None) and (a is None or same_bits(a, b)), name
    assert not poison or plain.deltas.scales.isnan().any()


@pytest.mark.parametrize(
    ("kf", "dim", "tokens", "rotate", "rope", "intra", "values", "masked", "per_split", "n"),
    [
        (16, 32, 45, True, "rope", True, "q4_0", True, 1, 1),
        (16, 64, 77, False, "rope", True, "q8_0", False, None, 1),
        (32, 32, 70, True, None, False, "q4_1", False, 2, 1),
        (16, 32, 16, True, "rope-gaps", True, "q4_0", False, None, 1),
        (16, 128, 40, True, "rope", True, "q4_0", True, None, 5),  # a chunk of 5 queries
    ],
)
def test_fused_delta_attention_matches_reference(kf, dim, tokens, rotate, rope, intra, values, masked, per_split, n):
    """The token-delta cache's decoding attention (segmented scan, un-rotation by butterflies, RoPE from the
    positions, the storage read through its strides, the sinks merged) against `reference.stream_attention`."""
    from hf_deltakv.kernels.triton.delta_attention import delta_attention, supports

    torch.manual_seed(tokens + dim)
    batch, kv_heads, group = 2, 2, 3
    x = (torch.randn(batch, kv_heads, tokens, dim).cumsum(2) * 0.2 + torch.randn(dim) * 3).bfloat16().float()
    v = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16).float()

    def wrap(codec):
        return RotatedCodec(codec) if rotate else codec

    key_codec = wrap(delta_codec(kf=kf, delta_format="q4_0_16", keyframe_format="q8_0", intra=intra))
    value_codec = wrap(PlainCodec(values))
    key_codec.append(x[:, :, :9])
    for t in range(9, tokens):
        key_codec.append(x[:, :, t : t + 1])
    value_codec.append(v)
    keys, stored = key_codec.layout(), value_codec.layout()
    sinks = 2
    mask = None
    if masked:
        mask = torch.ones(n, sinks + tokens, dtype=torch.bool).tril(sinks + tokens - n).expand(batch, n, -1).clone()
        mask[0, :, sinks : sinks + 5] = False
    assert supports(keys, stored, mask, n)
    query = torch.randn(batch, kv_heads, group * n, dim, dtype=torch.bfloat16).float()
    angles = rope_angles(batch, tokens, dim, torch.Generator().manual_seed(1), rope) if rope else None
    sink_kv = torch.randn(batch, kv_heads, sinks, dim)
    args = (query, sink_kv, sink_kv, keys, stored)
    options = dict(rope=angles, mask=mask, n_queries=n, causal_offset=sinks + tokens - n, scale=0.2)
    expected = reference.stream_attention(*args, **options)
    got = delta_attention(*args, **options, groups_per_split=per_split)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("keys_kind", ["delta", "plain"])
def test_dispatch_sends_streams_to_the_triton_kernels_and_merges_the_sinks(monkeypatch, keys_kind):
    """`kernels.stream_attention` on a Triton device (faked: the interpreter runs on the CPU): a Triton kernel over the
    stream, then the raw sinks merged in, equal to the reference over sinks and stream."""
    import hf_deltakv.kernels as kernels
    from hf_deltakv.kernels.triton import decode_attention, delta_attention

    torch.manual_seed(5)
    batch, kv_heads, group, dim, tokens, sinks = 1, 2, 2, 32, 40, 3
    keys = RotatedCodec(delta_codec(kf=16) if keys_kind == "delta" else PlainCodec("q4_0"))
    values = RotatedCodec(PlainCodec("q4_0"))
    keys.append(torch.randn(batch, kv_heads, tokens, dim).cumsum(2) * 0.3)
    values.append(torch.randn(batch, kv_heads, tokens, dim))
    query = torch.randn(batch, kv_heads, group, dim)
    sink_keys, sink_values = torch.randn(batch, kv_heads, sinks, dim), torch.randn(batch, kv_heads, sinks, dim)
    rope = rope_angles(batch, tokens, dim, torch.Generator().manual_seed(2))
    args = (query, sink_keys, sink_values, keys.layout(), values.layout())
    options = dict(rope=rope, mask=None, n_queries=1, causal_offset=sinks + tokens - 1, scale=0.25)
    expected = reference.stream_attention(*args, **options)
    called = []
    module, name = (
        (delta_attention, "delta_attention") if keys_kind == "delta" else (decode_attention, "plain_attention")
    )
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: called.append(1) or original(*a, **k))
    monkeypatch.setattr(kernels, "use_triton", lambda device: True)
    torch.testing.assert_close(kernels.stream_attention(*args, **options), expected, atol=1e-4, rtol=1e-4)
    assert called
