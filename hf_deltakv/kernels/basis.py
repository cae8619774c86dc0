"""Values coded in each kv head's own directions, with a per-token fallback to the rotated blocks (issue 61): the
PyTorch reference every kernel of this coding is to follow. `DeltaKVCache(values="basis-q3_0")` stores values this
way (`codecs/basis.py`; no C++ or Triton kernel reads it yet); `benchmarks/value_basis.py` measures the same coder
(its `+fallback` variants), and the tests hold the two together.

A head's **tables** (`BasisTables`): its mean value, an orthonormal basis (the eigenvectors of its values'
covariance: fitted from a prompt's values, or calibrated per model), the spread of the values along each direction
and the bits each direction gets (`allocate`: reverse water-filling, `floor` bits at least, summing to the row's code
bits).

A **row** (one token of one kv head) takes exactly the bytes of the fallback format's rotated blocks (`FALLBACK`:
q3_0 at 3.5 bits a value, q4_0 at 4.5), and holds one of two codings, whichever errs less in squared error:

- the basis: bytes 0-1 an fp16 scale `s` (positive), then the coefficients `y = (x - mean) @ basis` as a bitstream
  (least significant bit first, direction 0 first, `bits[d]` each): direction `d`'s code `c` in `0 .. 2^b - 1`
  decodes to `(c - 2^(b-1) + 0.5) · s · w[d] / 2^(b-1)` with `w` the spreads over their RMS (at least `WEIGHT_FLOOR`),
  so that `s` is about the largest of a token's coefficients relative to their spreads (`scale="max"` in the map);
  directions with 0 bits decode to 0;
- the fallback: the values Hadamard-rotated (`hadamard.rotate`) and coded in the fallback format with searched scales,
  its blocks' bytes in order (each block its fp16 scale, then its codes), decoded and rotated back.

The lowest bit of the row's first fp16 (the basis scale, or the first block's scale) says which: 1 the basis, 0 the
blocks; the encoder sets it before it codes (the basis) or clears it after (the blocks: the scale then moves by at most
one unit of its last place, the codes kept). So the flag costs no byte: a row is 3.5 bits a value at q3_0.

Rows that are not finite take the blocks (whose scale is NaN there, as the format codes them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..quant import FP16_MAX, QuantizedTensor, dequantize, get_format, quantize
from .hadamard import rotate

MAX_BITS = 8  # the most bits a direction gets
SCALE_BITS = 16  # the basis coding's fp16 scale (a row's first two bytes)
FALLBACK = {3.5: "q3_0", 4.5: "q4_0"}  # a rate's fallback format: a row's bytes are its blocks'
MAX_SEARCH = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)  # multiples of a token's largest relative coefficient tried
RMS_IN_MAX = (2.0, 2.5, 3.0, 4.0)  # ... and of its coefficients' RMS (one direction's excursion then clipped)
WEIGHT_FLOOR = 1e-3  # the smallest spread a direction is coded with, relative to the directions' RMS spread
BASIS_FLAG = 1  # the lowest bit of a row's first fp16: the basis coding (0: the fallback blocks)


@functools.cache
def gaussian_quantizers() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Step and mean squared error of the uniform quantizer (2^b levels, midrise) of least error for a unit Gaussian,
    for b = 0..MAX_BITS (b = 0: nothing stored, error 1), found by golden-section search on the error in closed form
    (per cell `[lo, hi)` around its level `c`: `[(1 + c²)·Φ(x) + (2c - x)·φ(x)]` from `lo` to `hi`, the outer cells
    open): the errors `allocate` spends bits by."""

    def error(bits: int, step: float) -> float:
        half = 2 ** (bits - 1)
        k = torch.arange(-half, half, dtype=torch.float64)
        level = (k + 0.5) * step
        edges = torch.cat([torch.tensor([-math.inf]), (k[1:] * step), torch.tensor([math.inf])]).double()

        def primitive(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            density = torch.where(torch.isinf(x), 0.0, torch.exp(-x * x / 2) / math.sqrt(2 * math.pi))
            return (1 + c * c) * torch.special.ndtr(x) + torch.where(torch.isinf(x), 0.0, (2 * c - x)) * density

        return float((primitive(edges[1:], level) - primitive(edges[:-1], level)).sum())

    steps, errors = [0.0], [1.0]
    for bits in range(1, MAX_BITS + 1):
        low, high = 1e-3, 4.0
        for _ in range(60):
            a, b = low + (high - low) * 0.382, low + (high - low) * 0.618
            if error(bits, a) < error(bits, b):
                high = b
            else:
                low = a
        step = (low + high) / 2
        steps.append(step)
        errors.append(error(bits, step))
    return tuple(steps), tuple(errors)


def allocate(spread: torch.Tensor, total: int, floor: int = 0) -> torch.Tensor:
    """Integer bits (`floor`..MAX_BITS) per direction of variances `spread` `[D]` summing to `total` (or every direction
    at MAX_BITS): reverse water-filling with the quantizers' own errors (each bit to the direction whose error it lowers
    most; optimal, the errors being convex in the bits), every direction given `floor` bits first."""
    bits = torch.full((spread.shape[0],), min(floor, total // spread.shape[0]), dtype=torch.long)
    errors = torch.tensor(gaussian_quantizers()[1], dtype=torch.float64)
    variance = spread.double().clamp_min(0)
    for _ in range(min(total - int(bits.sum()), MAX_BITS * spread.shape[0] - int(bits.sum()))):
        gain = variance * (errors[bits] - errors[(bits + 1).clamp_max(MAX_BITS)])
        gain[bits >= MAX_BITS] = -1
        bits[int(gain.argmax())] += 1
    return bits


def row_bytes(fmt: str, dim: int) -> int:
    """Bytes of one row (a token of a kv head of `dim` values) in fallback format `fmt`: its blocks'."""
    block = get_format(fmt)
    return -(-dim // block.block_size) * block.bytes_per_block


def code_bits(fmt: str, dim: int) -> int:
    """The basis coding's code bits in a row (its bytes less the scale)."""
    return 8 * row_bytes(fmt, dim) - SCALE_BITS


@dataclass(frozen=True)
class BasisTables:
    """What a row is coded against, per kv head (the leading dimensions `[*lead]`: `[heads]` for a model's tables,
    `[batch, heads]` for a sequence's).

    Args:
        mean: fp16 `[*lead, D]`.
        basis: fp16 `[*lead, D, D]`, orthonormal columns (direction `e` is `basis[..., e]`).
        spread: fp16 `[*lead, D]`: the standard deviation of the values along each direction.
        bits: uint8 `[*lead, D]`, summing to `code_bits(fmt, D)` per head.
        fmt: the fallback format (`FALLBACK`).
    """

    mean: torch.Tensor
    basis: torch.Tensor
    spread: torch.Tensor
    bits: torch.Tensor
    fmt: str

    def tensors(self) -> list[torch.Tensor]:
        return [self.mean, self.basis, self.spread, self.bits]


def fit_tables(values: torch.Tensor, fmt: str, floor: int = 2, basis: torch.Tensor | None = None) -> BasisTables:
    """The tables of values `[*lead, T, D]` (each head's own tokens): their mean, the eigenvectors of their covariance
    (or `basis` `[*lead, D, D]` given: another fit's directions), the spreads along them and the bits spread over
    them (`allocate`, at least `floor` each). Tokens that are not finite are left out of the fit."""
    x = values.double()
    finite = torch.isfinite(x).all(-1, keepdim=True)
    count = finite.sum(-2, keepdim=True).clamp_min(1)
    x = torch.where(finite, x, 0.0)
    mean = x.sum(-2) / count[..., 0, :]
    centred = torch.where(finite, x - mean[..., None, :], 0.0)
    covariance = centred.transpose(-1, -2) @ centred / count
    if basis is None:
        basis = torch.linalg.eigh(covariance)[1]
    basis = basis.to(torch.float16)
    directions = basis.double()
    variance = torch.einsum("...de,...df,...fe->...e", directions, covariance, directions).clamp_min(0)
    total = code_bits(fmt, values.shape[-1])
    bits = torch.stack([allocate(v, total, floor) for v in variance.reshape(-1, variance.shape[-1])])
    spread = variance.sqrt().clamp_max(FP16_MAX)
    return BasisTables(mean.clamp(-FP16_MAX, FP16_MAX).half(), basis, spread.half(),
                       bits.view(variance.shape).to(torch.uint8), fmt)  # fmt: skip


def _weights(tables: BasisTables) -> torch.Tensor:
    """Each direction's spread over the RMS of the head's spreads, at least `WEIGHT_FLOOR` (fp32 `[*lead, D]`)."""
    spread = tables.spread.float()
    return (spread / spread.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)).clamp_min(WEIGHT_FLOOR)


def _flagged(scale: torch.Tensor) -> torch.Tensor:
    """fp16 `scale` (finite, non-negative) with its lowest bit set: the basis coding's flag."""
    return (scale.view(torch.int16) | BASIS_FLAG).view(torch.float16)


def _positions(bits: torch.Tensor) -> torch.Tensor:
    """The bitstream positions of every direction's 8 possible code bits `[*lead, D, 8]` (past the last one
    `code_bits`-wide stream where a direction has fewer bits: a slot written with nothing)."""
    bits = bits.long()
    first = torch.cumsum(bits, -1) - bits
    j = torch.arange(MAX_BITS, device=bits.device)
    position = first[..., None] + j
    return torch.where(j < bits[..., None], position, -1)


def encode(values: torch.Tensor, tables: BasisTables) -> torch.Tensor:
    """Rows uint8 `[*lead, T, row_bytes]` of values `[*lead, T, D]` (fp32), each the coding that errs less."""
    x = values.float()
    basis_rows, basis_decoded = _encode_basis(x, tables)
    blocks = quantize(rotate(x), tables.fmt, search_scale=True)
    scales = blocks.scales.clone()
    scales[..., 0] = (scales[..., 0].view(torch.int16) & ~BASIS_FLAG).view(torch.float16)
    blocks = QuantizedTensor(blocks.fmt, blocks.dim, blocks.codes, scales)
    block_rows = torch.cat([scales.view(torch.uint8).unflatten(-1, (-1, 2)), blocks.codes], -1).flatten(-2)
    block_decoded = rotate(dequantize(blocks))
    basis_error = (basis_decoded - x).pow(2).sum(-1, keepdim=True)
    block_error = (block_decoded - x).pow(2).sum(-1, keepdim=True)
    take_basis = basis_error <= block_error  # (NaN: the blocks)
    return torch.where(take_basis, basis_rows, block_rows)


def _encode_basis(x: torch.Tensor, tables: BasisTables) -> tuple[torch.Tensor, torch.Tensor]:
    """The basis coding's rows `[*lead, T, row_bytes]` and what they decode to (fp32 `[*lead, T, D]`)."""
    dim = x.shape[-1]
    basis = tables.basis.float()
    y = (x - tables.mean.float()[..., None, :]) @ basis
    weight = _weights(tables)[..., None, :]
    bits = tables.bits.long()[..., None, :]
    half = (2.0 ** (bits - 1).clamp_min(0)).float()
    kept = bits > 0
    step = torch.where(kept, 1 / half, 0.0)
    relative = torch.where(kept, y.abs() / weight, 0)
    largest = relative.amax(-1, keepdim=True)
    typical = [relative.pow(2).mean(-1, keepdim=True).sqrt(), y.pow(2).mean(-1, keepdim=True).sqrt()]
    sizes = [largest * m for m in MAX_SEARCH] + [torch.minimum(t * m, largest) for t in typical for m in RMS_IN_MAX]
    best_code = best_scale = best_error = None
    for size in sizes:
        scale = _flagged(size.nan_to_num(0.0).clamp(0, FP16_MAX).half())
        unit = scale.float() * weight * step
        code = torch.floor(y / unit.clamp_min(1e-30)).nan_to_num(0.0).clamp(-half, half - 1)
        decoded = torch.where(kept, (code + 0.5) * unit, 0.0)
        error = (decoded - y).pow(2).sum(-1, keepdim=True)
        if best_code is None:
            best_code, best_scale, best_error = code, scale, error
        else:
            better = error < best_error
            best_code = torch.where(better, code, best_code)
            best_scale = torch.where(better, scale, best_scale)
            best_error = torch.minimum(error, best_error)
    unsigned = (best_code + half).long()  # [*lead, T, D] in 0 .. 2^b - 1
    total = code_bits(tables.fmt, dim)
    position = _positions(tables.bits)[..., None, :, :].expand(*unsigned.shape, MAX_BITS)
    bit = (unsigned[..., None] >> torch.arange(MAX_BITS, device=x.device)) & 1
    stream = torch.zeros(*unsigned.shape[:-1], total + 1, dtype=torch.long, device=x.device)
    stream.scatter_(-1, torch.where(position < 0, total, position).flatten(-2), bit.flatten(-2))
    packed = (stream[..., :total].unflatten(-1, (-1, 8)) << torch.arange(8, device=x.device)).sum(-1)
    rows = torch.cat([best_scale.view(torch.uint8), packed.to(torch.uint8)], -1)
    return rows, decode_basis(rows, tables)


def decode_basis(rows: torch.Tensor, tables: BasisTables) -> torch.Tensor:
    """Rows `[*lead, T, row_bytes]` read as the basis coding (whatever their flag), fp32 `[*lead, T, D]`."""
    dim = tables.mean.shape[-1]
    total = code_bits(tables.fmt, dim)
    scale = rows[..., :2].contiguous().view(torch.float16).float()  # [*lead, T, 1]
    stream = (rows[..., 2:, None].long() >> torch.arange(8, device=rows.device)) & 1
    stream = torch.cat([stream.flatten(-2)[..., :total], stream.new_zeros(*stream.shape[:-2], 1)], -1)
    position = _positions(tables.bits)[..., None, :, :]  # [*lead, 1, D, 8]
    position = torch.where(position < 0, total, position).expand(*rows.shape[:-1], dim, MAX_BITS)
    picked = torch.gather(stream, -1, position.flatten(-2)).unflatten(-1, (dim, MAX_BITS))
    unsigned = (picked << torch.arange(MAX_BITS, device=rows.device)).sum(-1)
    bits = tables.bits.long()[..., None, :]
    half = (2.0 ** (bits - 1).clamp_min(0)).float()
    step = torch.where(bits > 0, 1 / half, 0.0)
    coefficients = torch.where(bits > 0, (unsigned - half + 0.5) * scale * _weights(tables)[..., None, :] * step, 0.0)
    return coefficients @ tables.basis.float().transpose(-1, -2) + tables.mean.float()[..., None, :]


def is_basis(rows: torch.Tensor) -> torch.Tensor:
    """bool `[*lead, T]`: which rows hold the basis coding (their flag)."""
    return (rows[..., 0] & BASIS_FLAG).bool()


def decode(rows: torch.Tensor, tables: BasisTables) -> torch.Tensor:
    """Rows `[*lead, T, row_bytes]` decoded, fp32 `[*lead, T, D]`: each by its flag."""
    dim = tables.mean.shape[-1]
    fmt = get_format(tables.fmt)
    per_block = rows.unflatten(-1, (-1, fmt.bytes_per_block))
    scales = per_block[..., :2].contiguous().view(torch.float16).squeeze(-1)
    blocks = QuantizedTensor(fmt, dim, per_block[..., 2:].contiguous(), scales)
    return torch.where(is_basis(rows)[..., None], decode_basis(rows, tables), rotate(dequantize(blocks)))
