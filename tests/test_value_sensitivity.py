"""The value-sensitivity measurement's coding (benchmarks/value_sensitivity.py): what it does to values is what it
says, so the KL it reports is the KL of that coding."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import value_sensitivity as vs

from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.quant import dequantize, quantize


def test_values_are_coded_as_the_cache_codes_them_sinks_raw_heads_and_tokens_chosen():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 3, 40, 64, generator=g)
    out = vs.coded(values, "q3_0")
    assert torch.equal(out[:, :, : vs.SINKS], values[:, :, : vs.SINKS])
    want = rotate(dequantize(quantize(rotate(values[:, :, vs.SINKS :]), "q3_0", True)))
    torch.testing.assert_close(out[:, :, vs.SINKS :], want)
    one = vs.coded(values, "q3_0", heads=[1])
    assert torch.equal(one[:, [0, 2]], values[:, [0, 2]]) and torch.equal(one[:, 1], out[:, 1])
    keep = torch.zeros(1, 3, 40, dtype=torch.bool)
    keep[:, :, 10] = True
    mixed = vs.coded(values, "q3_0", keep=keep)
    high = rotate(dequantize(quantize(rotate(values[:, :, vs.SINKS :]), "q8_0")))
    torch.testing.assert_close(mixed[:, :, 10], high[:, :, 10 - vs.SINKS])
    assert (mixed[:, :, 10] - values[:, :, 10]).abs().max() < (out[:, :, 10] - values[:, :, 10]).abs().max()


def test_levels_searched_scale_is_never_worse_and_fitted_gaussian_levels_are_lloyd_max():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(64, 128, generator=g)
    levels = vs.gaussian_levels()
    error = lambda x: (x - r).reshape(-1, vs.BLOCK).pow(2).sum(-1)  # noqa: E731
    assert torch.all(error(vs.block_levels(r, levels, True)) <= error(vs.block_levels(r, levels)) + 1e-6)
    values = torch.randn(1, 2, 40, 64, generator=g)
    plain, searched = vs.coded(values, "q3_0", levels=levels), vs.coded(values, "q3_0", levels=levels, search=True)
    assert (searched - values).pow(2).sum() < (plain - values).pow(2).sum()
    fitted = vs.fitted_levels(torch.randn(400_000, generator=g))
    torch.testing.assert_close(fitted, levels, atol=0.02, rtol=0)
