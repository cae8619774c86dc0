"""The residual cache's Triton kernels (`kernels/triton/residual.py`) against their PyTorch references, under the
interpreter: the raw window's writes (the same bytes), the coding of tokens into packed latent groups (the same
bytes, but for a code whose fp32 product lies within rounding of a step boundary) and the attention over raw and coded
tokens (within fp32 rounding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_deltakv.kernels import LatentCoder, LatentStream, RopeAngles, reference
from hf_deltakv.quant.bitpack import GROUP

pytest.importorskip("triton", reason="needs the triton extra")

BITS = (6, 0, 3, 4, 5, 0, 8, 2)  # keys' four groups, then values' (every depth, groups dropped on both sides)


def _coder(heads: int, dim: int, bits: tuple[int, ...], seed: int) -> LatentCoder:
    g = torch.Generator().manual_seed(seed)
    stream = heads * dim
    half = len(bits) // 2
    kept = [sum(1 for b in part if b) * GROUP for part in (bits[:half], bits[half:])]
    return LatentCoder(torch.randn(stream, generator=g) * 0.1, torch.randn(stream, generator=g) * 0.1,
                       torch.randn(stream, kept[0], generator=g) / stream**0.5,
                       torch.randn(stream, kept[1], generator=g) / stream**0.5,
                       torch.randn(kept[0], stream, generator=g) / kept[0] ** 0.5,
                       torch.randn(kept[1], stream, generator=g) / kept[1] ** 0.5)  # fmt: skip


def _target(batch: int, rows: int, bits: tuple[int, ...]) -> LatentStream:
    kept = [b for b in bits if b]
    return LatentStream(torch.zeros(batch, rows, sum(GROUP * b // 8 for b in kept), dtype=torch.uint8),
                        torch.zeros(batch, rows, len(kept), dtype=torch.float16), bits)  # fmt: skip


@pytest.mark.parametrize(("dtype", "target"), [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_window_is_written_as_the_reference_writes_it(dtype, target):
    from hf_deltakv.kernels.triton.residual import write_raw

    keys = (torch.randn(2, 3, 5, 32) * 3).to(dtype)
    keys[0, 0, 0, :3] = torch.tensor([1e6, -1e6, float("nan")])  # fp16 saturates, NaN stays
    values = torch.randn(2, 3, 5, 32).to(dtype)
    want = [torch.zeros(2, 3, 12, 32, dtype=target) for _ in range(2)]
    got = [t.clone() for t in want]
    reference.write_raw(keys, values, *want, 4)
    write_raw(keys, values, *got, 4)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize(("n", "rope", "order"), [(16, True, False), (21, True, True), (3, False, False)])
def test_coding_matches_the_reference(n, rope, order):
    from hf_deltakv.kernels.triton.residual import encode_latent_into

    heads, dim = 3, 32
    g = torch.Generator().manual_seed(n)
    keys = torch.randn(2, heads, n, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(2, heads, n, dim, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 5000, (2, n), generator=g) if rope else None
    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2)) if rope else None
    channel_order = torch.randperm(dim, generator=g) if order else None
    coder = _coder(heads, dim, BITS, n)
    want, got = _target(2, n + 7, BITS), _target(2, n + 7, BITS)
    reference.encode_latent_into(keys, values, positions, freqs, channel_order, coder, BITS, want, 5)
    encode_latent_into(keys, values, positions, freqs, channel_order, coder, BITS, got, 5)
    assert torch.equal(got.scales.view(torch.int16), want.scales.view(torch.int16))
    kept = [b for b in BITS if b]
    a = reference.dequantize_latent(got.codes, got.scales, kept)
    b = reference.dequantize_latent(want.codes, want.scales, kept)
    steps = torch.repeat_interleave(want.scales.float(), GROUP, dim=-1)
    moved = (a - b).abs()
    assert (moved <= steps * 1.001).all()  # a code at most one step away ...
    assert (moved > 0).float().mean() < 0.002  # ... where the fp32 product lies at a rounding boundary (rare)
    assert torch.equal(got.codes[:, :5], want.codes[:, :5]) and not got.codes[:, :5].any()  # rows before `at` kept


def test_coding_keeps_nan_as_the_reference():
    """A NaN key or an infinite value makes the latent groups it reaches NaN-scaled, as the reference's amax makes
    them (the kernel's max skips NaN), with the reference's codes."""
    from hf_deltakv.kernels.triton.residual import encode_latent_into

    from .conftest import same_bits

    heads, dim, n = 3, 32, 16
    g = torch.Generator().manual_seed(n)
    keys = torch.randn(2, heads, n, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(2, heads, n, dim, generator=g).to(torch.bfloat16)
    keys[0, 1, 2, 5], values[1, 0, 7, 3] = float("nan"), float("inf")
    coder = _coder(heads, dim, BITS, n)
    want, got = _target(2, n + 7, BITS), _target(2, n + 7, BITS)
    reference.encode_latent_into(keys, values, None, None, None, coder, BITS, want, 5)
    encode_latent_into(keys, values, None, None, None, coder, BITS, got, 5)
    assert want.scales.isnan().any() and same_bits(got.scales, want.scales) and torch.equal(got.codes, want.codes)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "tokens", "sinks", "window", "rope", "masked", "n"),
    [(3, 1, 64, 45, 4, 7, True, False, 1), (4, 2, 32, 300, 0, 16, True, True, 1), (2, 2, 32, 20, 2, 0, False, False, 1),
     (3, 1, 64, 45, 4, 7, True, False, 5), (4, 2, 32, 60, 2, 16, True, True, 12),
     (9, 3, 64, 70, 4, 5, True, True, 1)],  # (SmolLM2's heads: three kv heads in one program, padded to four)
)  # fmt: skip
def test_attention_over_raw_and_coded_tokens_matches_the_reference(
    q_heads, kv_heads, dim, tokens, sinks, window, rope, masked, n
):
    from hf_deltakv.kernels.triton.residual import latent_stream_attention

    batch = 2
    g = torch.Generator().manual_seed(tokens)
    coder = _coder(kv_heads, dim, BITS, tokens)
    if kv_heads == 3:  # decoders in fp16, as `residual.attention.latent_coder` keeps a checkpoint's
        halves = {name: getattr(coder, name).half() for name in ("key_decoder", "value_decoder")}
        coder = dataclasses.replace(coder, **halves)
    stream = _target(batch, tokens, BITS)
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=g)
    reference.encode_latent_into(keys, torch.randn_like(keys), None, None, None, coder, BITS, stream, 0)
    raw = [(torch.randn(batch, kv_heads, t, dim, generator=g).half(), torch.randn(batch, kv_heads, t, dim,
            generator=g).half(), column) for t, column in ((sinks, 0), (window, sinks + tokens))]  # fmt: skip
    angles = None
    order = None
    if rope:
        freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
        angles = RopeAngles(torch.arange(sinks, sinks + tokens).expand(batch, -1).to(torch.int32), freqs)
        order = torch.randperm(dim, generator=g)
    query = torch.randn(batch, kv_heads, q_heads // kv_heads * n, dim, generator=g)  # (a chunk: row g * n + i)
    columns = sinks + tokens + window
    offset = columns - n  # the queries are the last n tokens (several: a chunk, causal among them)
    mask = None
    if masked:
        mask = torch.ones(n, columns, dtype=torch.bool).tril(offset).expand(batch, n, columns).clone()
        mask[0, :, :3] = False
        mask[1, :, 40:55] = False
    scale = dim**-0.5
    want = reference.latent_stream_attention(query, raw, stream, coder, angles, order, sinks, mask, n, offset, scale)
    got = latent_stream_attention(query, raw, stream, coder, angles, order, sinks, mask, scale, n, offset)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_the_built_in_decoders_are_read_in_fp16_and_fitted_ones_in_fp32():
    """A checkpoint stored in fp16 is read at half the bytes with the same values; fp32 weights stay fp32."""
    from hf_deltakv.residual import load_compressor
    from hf_deltakv.residual.attention import latent_coder

    compressor = load_compressor("smollm2-135m")
    layer, bits = compressor.layers[1], tuple(compressor.config.bits[1])
    coder = latent_coder(layer, bits)
    assert coder.key_decoder.dtype == coder.value_decoder.dtype == torch.float16
    assert coder.key_encoder.dtype == torch.float32
    with torch.no_grad():
        layer.key_decoder.add_(1e-4)  # (no longer fp16 values: a new coder, in fp32)
    assert latent_coder(layer, bits).key_decoder.dtype == torch.float32
