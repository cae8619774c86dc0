"""The value-basis map's coders (benchmarks/value_basis.py): the quantizers, the bit allocation and the bases do what
the script says, so the KL it reports is the KL of those coders."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import value_basis as vb


def test_predicted_gains_are_zero_for_a_flat_spectrum_and_grow_with_its_spread():
    assert vb.am_gm_bits(torch.ones(64)) == pytest.approx(0.0, abs=1e-9)
    assert vb.predicted_gain(torch.ones(64), 3.5) == pytest.approx(0.0, abs=1e-9)
    spread = torch.tensor([4.0, 1.0] * 32)
    assert vb.am_gm_bits(spread) == pytest.approx(0.5 * math.log2(2.5 / 2.0))
    steep = torch.logspace(0, -3, 64)
    assert vb.predicted_gain(steep, 3.5) > vb.predicted_gain(spread, 3.5) > 0


def _statistics(x: torch.Tensor) -> dict:
    """What the probe records of values `[H, T, D]`."""
    x = x.double()
    return {"count": x.shape[1], "sum": x.sum(1), "outer": x.transpose(1, 2) @ x}


def test_a_basis_codes_structured_values_better_than_the_rotation_at_the_same_bits():
    g = torch.Generator().manual_seed(2)
    heads, tokens, dim = 2, 2048, 64
    mixing = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0]
    spread = torch.logspace(1, -1.5, dim)  # (a few strong directions, many weak)
    x = (torch.randn(heads, tokens, dim, generator=g) * spread) @ mixing.transpose(1, 2) + 3.0
    stats = _statistics(x)

    def error(kind: str, rate: float = 3.5) -> float:
        coder = vb.fit(stats, rate, kind, torch.eye(dim, dtype=torch.float64).expand(heads, dim, dim))
        return float((coder(x[None]) - x[None]).pow(2).sum() / (x - x.mean(1, keepdim=True)).pow(2).sum())

    assert error("basis") < 0.5 * error("mean+norm-rot")
    assert error("basis") < error("basis-flat")  # (the allocation pays, not the directions alone)
    assert error("mean+norm-rot") < error("norm-rot")  # (the mean 3.0 is most of the energy)
    assert error("basis-wo") == pytest.approx(error("basis"), rel=1e-3)  # (the identity metric: the same basis)
    assert error("basis", 8.25) < 1e-3  # (8 bits a direction: nearly exact)
    bits = vb.fit(stats, 3.5, "basis").bits
    assert bits.sum(-1).tolist() == [vb.budget(3.5, dim)] * heads


def test_the_output_metric_is_the_sum_of_the_query_heads_blocks():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = torch.nn.Linear(4 * 8, 16, bias=False)

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.self_attn = Attention()
    model.model.layers = torch.nn.ModuleList([layer])
    w = layer.self_attn.o_proj.weight.detach().double()
    metric = vb.output_metric(model, 0, 2, 8)  # (4 query heads of 8 channels, 2 kv heads)
    blocks = [w[:, q * 8 : (q + 1) * 8] for q in range(4)]
    torch.testing.assert_close(metric[1], blocks[2].T @ blocks[2] + blocks[3].T @ blocks[3])


def test_both_scales_code_near_the_values_and_the_floor_drops_no_direction():
    g = torch.Generator().manual_seed(3)
    heads, tokens, dim = 1, 1024, 64
    spread = torch.logspace(0.5, -1.5, dim)
    x = torch.randn(heads, tokens, dim, generator=g) * spread
    stats = _statistics(x)
    for scale in ("rms", "max"):
        coder = vb.fit(stats, 3.5, "basis", scale=scale, floor=2)
        assert int(coder.bits.min()) == 2 and int(coder.bits.sum()) == vb.budget(3.5, dim)
        near = float((coder(x[None])[0] - x).pow(2).sum() / (x - x.mean(1, keepdim=True)).pow(2).sum())
        assert near < 0.05
    assert float(vb.fit(stats, 8.25, "basis", scale="max")(x[None]).sub(x).pow(2).mean()) < 1e-4


def test_the_fallback_codes_each_token_the_way_that_errs_less():
    """A token far out in a direction the fit barely saw is coded badly in the basis (its scale coarsens every
    direction); the fallback takes the rotated blocks for it and keeps the basis for the rest."""
    g = torch.Generator().manual_seed(4)
    heads, tokens, dim = 1, 512, 64
    spread = torch.logspace(0.5, -1.5, dim)
    mixing = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0]
    x = (torch.randn(heads, tokens, dim, generator=g) * spread) @ mixing.T
    x[:, 7] += 4.0 * mixing[:, -1]  # (far out in the weakest direction)
    coder = vb.fit(_statistics(x[:, 8:]), 3.5, "basis", scale="max", floor=2)  # (fitted on the later tokens)
    fallback = vb.Fallback(coder, vb.FALLBACK[3.5])
    both = [c(x[None])[0] for c in (coder, fallback)]
    blocks = vb.rotated_blocks(x, "q3_0")
    errors = [(y - x).pow(2).sum(-1) for y in (*both, blocks)]
    torch.testing.assert_close(errors[1], torch.minimum(errors[0], errors[2]))
    assert errors[0][0, 7] > 4 * errors[2][0, 7]  # (the outlier: the blocks' error is far smaller)
    assert 0 < fallback.fallen < 0.5 * tokens and fallback.tokens == tokens  # (the basis keeps most tokens)
    assert float(errors[1].sum()) < 0.8 * float(errors[2].sum())


def test_given_directions_keep_them_and_fit_the_spreads_and_bits():
    """`directions` (another fit's basis, a per-model table): the coder keeps them, its spreads are the window's
    variance along them, and with the window's own eigenvectors it is the window's own fit."""
    g = torch.Generator().manual_seed(5)
    heads, tokens, dim = 2, 1024, 32
    mixing = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0]
    x = (torch.randn(heads, tokens, dim, generator=g) * torch.logspace(0.5, -1.5, dim)) @ mixing.transpose(1, 2)
    stats = _statistics(x)
    other = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g, dtype=torch.float64))[0]
    coder = vb.fit(stats, 3.5, "basis", directions=other, scale="max", floor=2)
    torch.testing.assert_close(coder.forward, other.transpose(1, 2).float())
    centred = x.double() - x.double().mean(1, keepdim=True)
    variance = (centred @ other).pow(2).mean(1)  # [H, D]: along each given direction
    torch.testing.assert_close(coder.spread.double(), variance.sqrt(), rtol=1e-4, atol=1e-6)
    assert coder.bits.sum(-1).tolist() == [vb.budget(3.5, dim)] * heads and int(coder.bits.min()) == 2
    own = torch.linalg.eigh(stats["outer"] / tokens - torch.einsum("hd,he->hde", *[stats["sum"] / tokens] * 2))[1]
    errors = [float((c(x[None])[0] - x).pow(2).sum()) for c in (
        vb.fit(stats, 3.5, "basis", directions=own, scale="max", floor=2), vb.fit(stats, 3.5, "basis", scale="max",
                                                                                   floor=2), coder)]  # fmt: skip
    assert errors[0] == pytest.approx(errors[1], rel=1e-4)
    assert errors[0] < 0.7 * errors[2]  # (random directions carry no structure: the allocation has nothing to use)


def test_an_int8_basis_codes_nearly_as_the_fp16_one():
    g = torch.Generator().manual_seed(6)
    heads, tokens, dim = 1, 1024, 64
    mixing = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0]
    x = (torch.randn(heads, tokens, dim, generator=g) * torch.logspace(0.5, -1.5, dim)) @ mixing.transpose(1, 2)
    matrix = mixing.double().transpose(1, 2)
    rounded = vb.int8_rows(matrix)
    step = matrix.abs().amax(-1, keepdim=True) / 127
    assert float(((rounded - matrix).abs() / step).max()) <= 0.5 + 1e-3 and not torch.equal(rounded, matrix)
    assert len(torch.unique(torch.round(rounded[0, 0] / (rounded[0, 0].abs().max() / 127)))) <= 255
    stats = _statistics(x)
    errors = [float((vb.fit(stats, 3.5, "basis", scale="max", floor=2, table=t)(x[None])[0] - x).pow(2).sum())
              for t in ("fp16", "int8")]  # fmt: skip
    assert errors[0] < errors[1] < 1.1 * errors[0]


def test_per_sequence_tables_are_counted_in_bytes_and_spread_over_the_tokens():
    from hf_deltakv.codecs.basis import BasisCodec

    codec = BasisCodec("q3_0")
    codec.append(torch.randn(1, 1, 40, 64, generator=torch.Generator().manual_seed(7)))
    held = sum(t.numel() * t.element_size() for t in codec.tables().tensors())  # (what the codec holds a head)
    assert vb.table_bytes("basis", 64, "sequence") == held == 2 * 64 * 64 + 2 * 2 * 64 + 64
    assert vb.table_bytes("basis", 64, "sequence", "int8") == 64 * 64 + 2 * 64 + 2 * 2 * 64 + 64
    assert vb.table_bytes("basis", 64, "spreads") == 2 * 2 * 64 + 64
    assert vb.sequence_table({"variant": "basis/scale=max+fallback@3.5 (spreads: prefix)"}, 64) == 2 * 2 * 64 + 64
    assert vb.sequence_table({"variant": "basis/table=int8+fallback@3.5 (prefix)"}, 64) == 64 * 64 + 6 * 64 + 64
    assert vb.table_bytes("basis", 64, "model") == 0 and vb.table_bytes("norm-rot", 64, "sequence") == 0
    # a prompt of 1,020 coded tokens at head_dim 64 carries its fp16 basis at about one bit a value more
    assert vb.with_tables(3.5, vb.table_bytes("basis", 64, "sequence"), 64, 1020) == pytest.approx(4.543, abs=1e-3)
    assert vb.with_tables(3.5, 0, 64, 1020) == 3.5
