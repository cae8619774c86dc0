"""Quantize and dequantize llama.cpp block formats in PyTorch (the reference implementation).

Arithmetic follows ggml-quants.c (and `gguf.quants`) so that codes and scales match byte for byte. Defined edge
cases, beyond llama.cpp:
- a last dimension that is not a multiple of 32 is zero-padded to one; the padding is stored (and counted) and
  dropped on dequantization;
- a block holding NaN or ±inf gets a NaN scale, so the whole block decodes as NaN instead of finite garbage;
- a scale beyond the fp16 range saturates at ±65504 (llama.cpp would store inf), so huge finite values clip;
- a block so tiny that its reciprocal scale overflows gets codes 0 (what llama.cpp produces on x86).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import pack_3bit, pack_4bit, unpack_3bit, unpack_4bit
from .table import BlockFormat, Kind, check_search_scale, get_format

FP16_MAX = torch.finfo(torch.float16).max  # 65504: fp16's largest finite value, where scales saturate


def saturate_fp16(x: torch.Tensor) -> torch.Tensor:
    """`x` in fp16, saturating at ±65504 instead of overflowing to ±inf (NaN stays NaN): finite in, finite out."""
    return x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


@dataclass
class QuantizedTensor:
    """Packed storage of a tensor `[*lead, dim]` in one block format.

    Args:
        fmt: the block format.
        dim: the original last dimension (before padding to whole blocks).
        codes: `uint8 [*lead, n_blocks, code_bytes]` (`float16 [*lead, dim]` for `f16`).
        scales: `float16 [*lead, n_blocks]` (None for `f16`).
        mins: `float16 [*lead, n_blocks]` for asymmetric formats, else None.
    """

    fmt: BlockFormat
    dim: int
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.mins) if t is not None]

    def nbytes(self) -> int:
        """Bytes really held by the packed storage."""
        return nbytes_of(self.tensors())

    def map(self, fn) -> QuantizedTensor:
        """Apply `fn` to every stored tensor (they share their leading dimensions)."""
        scales = None if self.scales is None else fn(self.scales)
        mins = None if self.mins is None else fn(self.mins)
        return QuantizedTensor(self.fmt, self.dim, fn(self.codes), scales, mins)

    @staticmethod
    def empty(fmt: BlockFormat, lead: tuple[int, ...], dim: int, device: torch.device | str) -> QuantizedTensor:
        """Uninitialised storage of `[*lead, dim]` in `fmt` (written in place by a quantizer)."""
        if fmt.kind == Kind.F16:
            return QuantizedTensor(fmt, dim, torch.empty(*lead, dim, dtype=torch.float16, device=device))
        blocks = -(-dim // fmt.block_size)
        codes = torch.empty(*lead, blocks, fmt.code_bytes, dtype=torch.uint8, device=device)
        scales = torch.empty(*lead, blocks, dtype=torch.float16, device=device)
        mins = torch.empty_like(scales) if fmt.kind == Kind.Q4_ASYM else None
        return QuantizedTensor(fmt, dim, codes, scales, mins)

    @staticmethod
    def cat(parts: list[QuantizedTensor], dim: int) -> QuantizedTensor:
        """Concatenate along a leading dimension `dim` (non-negative)."""
        first = parts[0]
        joined = [torch.cat(ts, dim=dim) for ts in zip(*(p.tensors() for p in parts), strict=True)]
        names = [n for n in ("codes", "scales", "mins") if getattr(first, n) is not None]
        return QuantizedTensor(first.fmt, first.dim, **dict(zip(names, joined, strict=True)))


def nbytes_of(obj) -> int:
    """Bytes of memory held by the tensors in `obj`: a tensor, a `QuantizedTensor`, or nested tuples, lists and
    dicts of them.

    What is counted is each tensor's storage, once per storage: a view into a larger buffer (room kept for appends)
    counts the whole buffer, a slice that keeps a dropped part alive counts that part, and tensors sharing a storage
    count it once. The one byte counter of the package (codecs, cache layers, the residual cache, and other
    libraries' caches in evaluation). Tensor subclasses such as optimum-quanto's packed tensors are opened to their
    inner tensors, so packed codes count at their real size.
    """
    storages: dict[int, int] = {}
    _storages(obj, storages)
    return sum(storages.values())


def _storages(obj, storages: dict[int, int]) -> None:
    """Record the storage (address -> bytes) of every tensor in `obj`."""
    if isinstance(obj, QuantizedTensor):
        _storages(obj.tensors(), storages)
    elif isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            _storages([getattr(obj, name) for name in names], storages)
            return
        storage = obj.untyped_storage()
        key = storage.data_ptr() or id(storage)
        storages[key] = max(storages.get(key, 0), storage.nbytes())
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _storages(item, storages)
    elif isinstance(obj, dict):
        _storages(list(obj.values()), storages)


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` holding only its own elements: a compact copy when it is a view into a larger storage (what a slice that
    drops tokens leaves), so that dropped data is freed and no byte is held that is not counted as the tensor's."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _check_float(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"expected a floating-point tensor (float32, float16 or bfloat16), got {got}")


def _to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 view `[*lead, n_blocks, block_size]`, zero-padded."""
    pad = (-x.shape[-1]) % block_size
    x = x.float()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block_size)


def _safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _finite_or_zero(scaled: torch.Tensor) -> torch.Tensor:
    """Codes of non-finite scaled values are 0: NaN (0 * inf) and ±inf (a block so tiny that the reciprocal of its
    scale overflows; its fp16 scale is 0, so it decodes as 0 anyway), as llama.cpp's float-to-int conversion gives on
    x86."""
    return scaled.nan_to_num(0.0, posinf=0.0, neginf=0.0)


def _finalize_scale(d: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """fp16 scale: saturate at the fp16 range, NaN where the block is not finite."""
    d = d.clamp(-FP16_MAX, FP16_MAX)
    d = torch.where(torch.isfinite(blocks).all(dim=-1), d, torch.full_like(d, float("nan")))
    return d.to(torch.float16)


# Divisors of the signed absmax tried for a symmetric block's scale when searching, by code offset (8: q4_0, 4: q3_0):
# llama.cpp's offset first, then smaller ones, which clip the largest value for a finer step over the rest (the same
# bytes' layout; another encoder). q3_0's reach down to 0.75 of its offset, as q4_0's reach 0.81 of theirs.
SCALE_SEARCH = {8: (8.0, 7.75, 7.5, 7.25, 7.0, 6.5), 4: (4.0, 3.75, 3.5, 3.25, 3.0)}


def _symmetric_codes(blocks: torch.Tensor, d: torch.Tensor, offset: int) -> torch.Tensor:
    inv = _safe_reciprocal(d)
    return _finite_or_zero(torch.trunc(blocks * inv + (offset + 0.5))).clamp(0, 2 * offset - 1)


def _quantize_symmetric(x: torch.Tensor, fmt_name: str, search_scale: bool, offset: int):
    """Codes (unpacked, float) and fp16 scales of a symmetric format with codes offset by `offset`."""
    _check_float(x)
    fmt = get_format(fmt_name)
    blocks = _to_blocks(x, fmt.block_size)
    imax = blocks.abs().argmax(dim=-1, keepdim=True)
    peak = torch.gather(blocks, -1, imax)
    divisors = SCALE_SEARCH[offset] if search_scale else SCALE_SEARCH[offset][:1]
    d = (peak / -divisors[0]).clamp(-FP16_MAX, FP16_MAX)
    q = _symmetric_codes(blocks, d, offset)
    if len(divisors) > 1:
        best = ((q - offset) * d.half().float() - blocks).double().pow(2).sum(-1, keepdim=True)
        for divisor in divisors[1:]:
            d_try = (peak / -divisor).clamp(-FP16_MAX, FP16_MAX)
            q_try = _symmetric_codes(blocks, d_try, offset)
            err = ((q_try - offset) * d_try.half().float() - blocks).double().pow(2).sum(-1, keepdim=True)
            better = err < best
            q, d, best = torch.where(better, q_try, q), torch.where(better, d_try, d), torch.where(better, err, best)
    return fmt, q.to(torch.uint8), _finalize_scale(d.squeeze(-1), blocks)


def quantize_q4_0(x: torch.Tensor, fmt_name: str = "q4_0", search_scale: bool = False) -> QuantizedTensor:
    """Symmetric 4-bit: scale = signed absmax / -8, codes = trunc(x / scale + 8.5) clipped to 0..15.

    With `search_scale`, each block's scale is the one of `SCALE_SEARCH[8]` whose decoded block (with the stored fp16
    scale) has the smallest squared error, summed in fp64 (the first on ties): the format and the decoder are
    llama.cpp's, the encoder is not.
    """
    fmt, q, scales = _quantize_symmetric(x, fmt_name, search_scale, 8)
    return QuantizedTensor(fmt, x.shape[-1], pack_4bit(q), scales)


def quantize_q3_0(x: torch.Tensor, search_scale: bool = False) -> QuantizedTensor:
    """Symmetric 3-bit (ours, not llama.cpp's): scale = signed absmax / -4, codes = trunc(x / scale + 4.5) clipped to
    0..7, packed by `pack_3bit`; `search_scale` as in `quantize_q4_0` (divisors `SCALE_SEARCH[4]`)."""
    fmt, q, scales = _quantize_symmetric(x, "q3_0", search_scale, 4)
    return QuantizedTensor(fmt, x.shape[-1], pack_3bit(q), scales)


def quantize_q4_1(x: torch.Tensor, fmt_name: str = "q4_1") -> QuantizedTensor:
    """Asymmetric 4-bit: scale = (max - min) / 15, min stored, codes = trunc((x - min) / scale + 0.5)."""
    _check_float(x)
    fmt = get_format(fmt_name)
    blocks = _to_blocks(x, fmt.block_size)
    hi = blocks.amax(dim=-1, keepdim=True)
    lo = blocks.amin(dim=-1, keepdim=True).clamp(-FP16_MAX, FP16_MAX)
    d = ((hi - lo) / 15).clamp(-FP16_MAX, FP16_MAX)
    inv = _safe_reciprocal(d)
    q = _finite_or_zero(torch.trunc((blocks - lo) * inv + 0.5)).clamp(0, 15).to(torch.uint8)
    finite = torch.isfinite(blocks).all(dim=-1)
    mins = torch.where(finite, lo.squeeze(-1), torch.full_like(finite, float("nan"), dtype=torch.float32))
    scales = _finalize_scale(d.squeeze(-1), blocks)
    return QuantizedTensor(fmt, x.shape[-1], pack_4bit(q), scales, mins.to(torch.float16))


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(x: torch.Tensor) -> QuantizedTensor:
    """Symmetric 8-bit: scale = absmax / 127, codes = round(x / scale) as int8 (stored as uint8 bytes)."""
    _check_float(x)
    fmt = get_format("q8_0")
    blocks = _to_blocks(x, fmt.block_size)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127).clamp(max=FP16_MAX)
    inv = _safe_reciprocal(d)
    q = _finite_or_zero(_round_half_away(blocks * inv)).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    return QuantizedTensor(fmt, x.shape[-1], q, _finalize_scale(d.squeeze(-1), blocks))


def quantize_f16(x: torch.Tensor) -> QuantizedTensor:
    """Plain fp16 storage (the unquantized baseline), saturating like the block formats."""
    _check_float(x)
    y = x.float()
    y = torch.where(torch.isfinite(y), y.clamp(-FP16_MAX, FP16_MAX), y)  # ±inf stays ±inf: only finite values saturate
    return QuantizedTensor(get_format("f16"), x.shape[-1], y.to(torch.float16))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed storage back to `[*lead, dim]` in `dtype`."""
    name = q.fmt.name
    if name == "f16":
        return q.codes.to(dtype)
    if name == "q8_0":
        values = q.codes.view(torch.int8).float()
    elif q.fmt.kind == Kind.Q3_SYM:
        values = unpack_3bit(q.codes).float() - 4
    else:
        values = unpack_4bit(q.codes).float()
        if q.mins is None:  # symmetric 4-bit formats store codes offset by 8
            values = values - 8
    out = values * q.scales.float().unsqueeze(-1)
    if q.mins is not None:
        out = out + q.mins.float().unsqueeze(-1)
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])[..., : q.dim].to(dtype)


QUANTIZERS = {
    "q4_0": quantize_q4_0,
    "q4_1": quantize_q4_1,
    "q8_0": quantize_q8_0,
    "f16": quantize_f16,
    "q4_0_16": lambda x: quantize_q4_0(x, "q4_0_16"),
    "q4_1_16": lambda x: quantize_q4_1(x, "q4_1_16"),
    "q3_0": quantize_q3_0,
}


def quantize(x: torch.Tensor, fmt: str, search_scale: bool = False) -> QuantizedTensor:
    """Quantize `x` along its last dimension into the named format (`search_scale`: see `quantize_q4_0`; symmetric
    formats only, `SEARCHABLE_KINDS`, where it is a choice of the encoder)."""
    check_search_scale(fmt, search_scale)
    if search_scale:
        return quantize_q3_0(x, True) if fmt == "q3_0" else quantize_q4_0(x, fmt, search_scale=True)
    return QUANTIZERS[fmt](x)
