"""Block formats against llama.cpp's reference quantizers (gguf.quants), byte for byte, and their edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hf_deltakv.quant import (
    FORMATS,
    BlockFormat,
    Kind,
    dequantize,
    get_format,
    pack_3bit,
    pack_4bit,
    quantize,
    unpack_3bit,
    unpack_4bit,
)

gguf_quants = pytest.importorskip("gguf.quants")
GGMLQuantizationType = pytest.importorskip("gguf").GGMLQuantizationType

GGML = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def as_llama_bytes(q) -> np.ndarray:
    """Lay our packed storage out as llama.cpp blocks: fp16 scale (, fp16 min), then codes."""
    parts = [q.scales.view(torch.uint8).reshape(*q.scales.shape, 2)]
    if q.mins is not None:
        parts.append(q.mins.view(torch.uint8).reshape(*q.mins.shape, 2))
    parts.append(q.codes)
    blocks = torch.cat(parts, dim=-1)
    return blocks.reshape(*blocks.shape[:-2], -1).numpy()


def test_declared_sizes():
    assert [FORMATS[n].bytes_per_block for n in ("q4_0", "q4_1", "q8_0")] == [18, 20, 34]
    assert FORMATS["q4_0"].bits_per_element == 4.5
    with pytest.raises(ValueError, match="not the declared"):
        BlockFormat("bad", Kind.Q4_SYM, bits=4, block_size=32, scale_bytes=2, bytes_per_block=19)


def test_unknown_format_names_allowed():
    with pytest.raises(ValueError, match="q4_0"):
        get_format("q3_k")
    with pytest.raises(ValueError, match="allowed"):
        quantize(torch.zeros(32), "int4")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_codes_are_packed_bytes(fmt):
    q = quantize(torch.randn(3, 64), fmt)
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float16
    assert q.nbytes() == 3 * 2 * FORMATS[fmt].bytes_per_block


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy overflows on blocks near 1e-38, by design
@settings(max_examples=60, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([32, 64, 128])), elements=finite),
    st.sampled_from(["q4_0", "q4_1", "q8_0"]),
)
def test_bytes_match_llama_cpp(x, fmt):
    # gguf-py's numpy min can return -0.0 where ggml's C loop (and we) keep +0.0; both decode alike.
    x = x + np.float32(0.0)
    q = quantize(torch.from_numpy(x), fmt)
    reference = gguf_quants.quantize(x, GGML[fmt])
    np.testing.assert_array_equal(as_llama_bytes(q), reference)
    np.testing.assert_array_equal(dequantize(q).numpy(), gguf_quants.dequantize(reference, GGML[fmt]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy overflows on purpose here
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_tiny_blocks_whose_reciprocal_scale_overflows_match_llama_cpp(fmt):
    """Found by hypothesis: a block of values near 1e-38 has a scale whose reciprocal overflows to inf."""
    for x in (np.full((1, 32), 1.1754944e-38, np.float32), np.linspace(1e-39, 3e-38, 32, dtype=np.float32)[None]):
        np.testing.assert_array_equal(
            as_llama_bytes(quantize(torch.from_numpy(x), fmt)), gguf_quants.quantize(x, GGML[fmt])
        )


@settings(max_examples=40, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 100)), elements=finite),
    st.sampled_from(["q4_0", "q4_1", "q8_0", "f16", "q3_0"]),
)
def test_any_last_dimension_round_trips_within_one_step(x, fmt):
    t = torch.from_numpy(x)
    q = quantize(t, fmt)
    y = dequantize(q)
    assert y.shape == t.shape
    # Error of one element is at most one quantization step of its block (fp16 rounding of the scale included).
    step = {"q4_0": 1 / 8, "q4_1": 1 / 15, "q8_0": 1 / 127, "f16": 2**-10, "q3_0": 1 / 4}[fmt]
    span = t.abs().max().item() * (2 if fmt == "q4_1" else 1)
    assert (y - t).abs().max().item() <= step * span * 1.01 + 1e-6


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q3_0"])
def test_zero_and_constant_blocks(fmt):
    zeros = torch.zeros(2, 32)
    assert torch.equal(dequantize(quantize(zeros, fmt)), zeros)
    const = torch.full((1, 32), 3.0)
    err = (dequantize(quantize(const, fmt)) - const).abs().max().item()
    assert err <= 3.0 / 8 * 1.001  # q4_1 is exact; symmetric formats may round
    if fmt == "q4_1":
        assert err == 0.0


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16", "q3_0"])
def test_non_finite_input_poisons_its_block(fmt):
    x = torch.randn(3, 64)
    x[0, 3], x[1, 40], x[2, 10] = float("nan"), float("inf"), -float("inf")
    y = dequantize(quantize(x, fmt))
    if fmt == "f16":
        assert math.isnan(y[0, 3]) and y[1, 40] == float("inf") and y[2, 10] == -float("inf")
        return
    assert torch.isnan(y[0, :32]).all() and torch.isnan(y[1, 32:]).all() and torch.isnan(y[2, :32]).all()
    # Other blocks decode normally.
    assert torch.isfinite(y[0, 32:]).all() and torch.isfinite(y[1, :32]).all()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16", "q3_0"])
def test_huge_values_saturate_instead_of_inf(fmt):
    x = torch.zeros(1, 32)
    x[0, 0] = 1e30
    y = dequantize(quantize(x, fmt))
    assert torch.isfinite(y).all()
    assert y[0, 0] > 6e4


def test_wrong_dtype_is_refused():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.arange(32), "q4_0")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    x = torch.randn(4, 64)
    ours = quantize(x.to(dtype), "q4_0")
    again = quantize(x.to(dtype).float(), "q4_0")
    assert torch.equal(ours.codes, again.codes) and torch.equal(ours.scales, again.scales)


@settings(max_examples=30, deadline=None)
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.sampled_from([2, 32, 64])), elements=st.integers(0, 15)))
def test_pack_unpack_round_trip(codes):
    t = torch.from_numpy(codes)
    packed = pack_4bit(t)
    assert packed.shape[-1] == t.shape[-1] // 2
    assert torch.equal(unpack_4bit(packed), t)


@settings(max_examples=30, deadline=None)
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.just(32)), elements=st.integers(0, 7)))
def test_pack_3bit_round_trip(codes):
    t = torch.from_numpy(codes)
    packed = pack_3bit(t)
    assert packed.shape[-1] == 12 and torch.equal(unpack_3bit(packed), t)


def test_q3_0_layout():
    """The bytes the C++ kernel reads: code 8i + j has its low bits at bits 2i of byte j, its high bit at bit j of
    byte 8 + i; codes are offset by 4 and the scale is the signed absmax / -4 (q4_0's rule with 3 bits)."""
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[9] = 5  # i = 1, j = 1: low bits 01 at bits 2-3 of byte 1, high bit at bit 1 of byte 9
    assert pack_3bit(codes).tolist() == [0, 4, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0]
    x = torch.linspace(-1, 0.5, 32)
    q = quantize(x, "q3_0")
    assert q.nbytes() == FORMATS["q3_0"].bytes_per_block == 14 and q.scales.item() == 0.25
    assert unpack_3bit(q.codes)[0, 0] == 0 and torch.equal(dequantize(q)[0], torch.tensor(-1.0))


@settings(max_examples=40, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])), elements=finite),
    st.sampled_from(["q4_0", "q4_0_16", "q3_0"]),
)
def test_scale_search_never_adds_error(x, fmt):
    """The searched scale keeps llama.cpp's first candidate unless another decodes the block closer."""
    t = torch.from_numpy(x)
    plain = (dequantize(quantize(t, fmt)) - t).double().pow(2).view(t.shape[0], -1, get_format(fmt).block_size)
    searched = (dequantize(quantize(t, fmt, search_scale=True)) - t).double().pow(2).view_as(plain)
    assert (searched.sum(-1) <= plain.sum(-1) * (1 + 1e-9) + 1e-12).all()
