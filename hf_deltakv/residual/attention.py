"""Attention over the residual cache's coded tokens with the values attended in latent space.

The decoder is linear: a coded token's value is `z_t D + m` (`z_t` its dequantized value latent, `D` the decoder rows
of the latent groups kept, `m` the mean), so for a query of kv head `h`, `sum_t p_t v_t = (sum_t p_t z_t) D_h +
m_h sum_t p_t`: the softmax weights meet the packed latents, and the decoder is applied once per query instead of
once per cached token. Keys cannot take the same route when they are coded before RoPE (the rotation depends on the
position and does not commute with the decoder), so they are decoded a chunk at a time (only the kept groups: one
matrix product), RoPE re-applied, and scored; each chunk's softmax statistics are merged into the attention over the
raw sinks and window (`OnlineSoftmax.merge`). Transient memory is one chunk, whatever the context.

The keys' decoder product is most of a step's arithmetic (every kept latent component times every channel, for every
cached token). On CPUs with bf16 matrix units (AMX) or bf16 dot products (AVX512-BF16) it runs in bf16
(`key_decoder_dtype`): latents and decoder rounded to bf16, the product rounded to bf16, the mean added and RoPE applied
in fp32 in the kernel. bf16 keeps 8 significant bits, finer than the 3-6-bit latent codes it multiplies, but it is a
rounding the specification does not make (`HF_DELTAKV_KEY_DECODER=float32` keeps the product in fp32).

Specification: the layer's `reconstruct()` followed by SDPA (fp32 decoder: tested within fp32 rounding; bf16 decoder:
within the tolerance `tests/test_residual.py` states).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels.layout import LatentCoder, RopeAngles
from ..kernels.online_softmax import OnlineSoftmax
from ..quant.bitpack import GROUP
from .compressor import LayerCompressor

KEY_DECODER_ENV = "HF_DELTAKV_KEY_DECODER"  # forces the keys' decoder product's dtype (float32: the specification's)
CHUNK_TOKENS = 4096  # coded tokens decoded at a time: one chunk up to 4K tokens (fewer small ops; ~6 MB transient)
# The keys' decoder product runs on a multiple of this many rows (zeros after the latents): its shape then changes
# every 256 steps, not every step, and oneDNN reuses its prepared product (a new shape costs more than the product).
PRODUCT_ROWS = 256


@functools.cache
def key_decoder_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the keys' decoder product on `device`: on CPUs, `HF_DELTAKV_KEY_DECODER` (float32 or bfloat16)
    when set (read once per device), else bf16 where there are AMX tiles or AVX512-BF16 dot products (oneDNN's bf16
    products run several times, or about twice, as fast as fp32 ones there) and fp32 elsewhere (with AVX2 alone bf16
    products are no faster); fp32 on GPUs, which take the reference path."""
    if device.type != "cpu":
        return torch.float32
    forced = os.environ.get(KEY_DECODER_ENV, "")
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"{KEY_DECODER_ENV} must be float32 or bfloat16, got {forced!r}")
        return getattr(torch, forced)
    try:
        fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch without the probes
        return torch.float32
    return torch.bfloat16 if fast else torch.float32


def _served(
    compressor: LayerCompressor, name: str, key: tuple, build: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`build(compressor.<name>)`, kept on the compressor (not a parameter or buffer) and computed again only when that
    parameter changes: a layer asks at every decode step."""
    parameter = getattr(compressor, name)
    entries = compressor.__dict__.setdefault("_served", {})
    state = (parameter._version, parameter.data_ptr(), parameter.device)
    hit = entries.get((name, *key))
    if hit is None or hit[0] != state:
        hit = entries[(name, *key)] = (state, build(parameter.detach()))
    return hit[1]


@functools.cache
def _kept(bits: tuple[int, ...]) -> tuple[list[int], torch.Tensor, int]:
    """Depths of the groups stored, the latent rows they fill, and their packed bytes (once per allocation: a layer
    asks at every decode step)."""
    rows = [g * GROUP + j for g, b in enumerate(bits) if b for j in range(GROUP)]
    return [b for b in bits if b], torch.tensor(rows, dtype=torch.long), sum(GROUP * b // 8 for b in bits)


def latent_coder(compressor: LayerCompressor, bits: tuple[int, ...]) -> LatentCoder:
    """The layer's coder as the kernels read it (`kernels.LatentCoder`: the stored latent components' columns of the
    encoders and rows of the decoders, fp32, the decoders fp16 where that is exact), made once per device and kept on
    the compressor until a weight changes: a decoding step asks in every layer."""
    parameters = [getattr(compressor, f"{s}_{p}") for s in ("key", "value") for p in ("mean", "encoder", "decoder")]
    state = tuple((w._version, w.data_ptr()) for w in parameters)
    kept = compressor.__dict__.setdefault("_coders", {})
    key = (bits, parameters[0].device)
    hit = kept.get(key)
    if hit is None or hit[0] != state:
        half = len(bits) // 2
        rows = [_kept(bits[:half])[1], _kept(bits[half:])[1]]
        (key_mean, key_encoder, key_decoder), (value_mean, value_encoder, value_decoder) = (
            [w.detach().float() for w in parameters[i : i + 3]] for i in (0, 3)
        )
        columns = [r.to(key_encoder.device) for r in rows]
        hit = kept[key] = (state, LatentCoder(
            key_mean.contiguous(), value_mean.contiguous(), key_encoder[:, columns[0]].contiguous(),
            value_encoder[:, columns[1]].contiguous(), _narrowed(key_decoder[columns[0]].contiguous()),
            _narrowed(value_decoder[columns[1]].contiguous()),
        ))  # fmt: skip
    return hit[1]


def _narrowed(weights: torch.Tensor) -> torch.Tensor:
    """fp32 `weights` in fp16 where fp16 holds every one exactly (a checkpoint stored in fp16), else as they are."""
    half = weights.half()
    return half if torch.equal(half.float(), weights) else weights


class CodedWeights(NamedTuple):
    """What `attend_latents` reads of a layer's decoder: `key_decoder` `[kv_heads * dim, kept key components]` in
    `key_decoder_dtype` (F.linear's weight layout), `key_mean` `[kv_heads * dim]`, `value_decoder` `[kv_heads, kept
    value components, dim]`, `value_mean` `[kv_heads, dim]`."""

    key_decoder: torch.Tensor
    key_mean: torch.Tensor
    value_decoder: torch.Tensor
    value_mean: torch.Tensor


def coded_weights(compressor: LayerCompressor, bits: list[int], kv_heads: int) -> CodedWeights:
    """The layer's decoder as `attend_latents` reads it, kept on the compressor until a weight changes (a layer asks
    at every decode step)."""
    half = len(bits) // 2
    key_depths, value_depths = tuple(bits[:half]), tuple(bits[half:])
    key_rows, value_rows = _kept(key_depths)[1], _kept(value_depths)[1]
    dtype = key_decoder_dtype(compressor.key_decoder.device)
    key_decoder = _served(
        compressor, "key_decoder", (key_depths, dtype), lambda w: w[key_rows.to(w.device)].t().contiguous().to(dtype)
    )
    value_dim = compressor.stream_dim // kv_heads
    value_decoder = _served(
        compressor,
        "value_decoder",
        (value_depths,),
        lambda w: w[value_rows.to(w.device)].view(-1, kv_heads, value_dim).transpose(0, 1).contiguous(),
    )
    value_mean = compressor.value_mean.detach().view(kv_heads, value_dim)
    return CodedWeights(key_decoder, compressor.key_mean.detach(), value_decoder, value_mean)


def attend_coded(
    state: OnlineSoftmax,
    compressor: LayerCompressor,
    bits: list[int],
    codes: torch.Tensor,
    scales: torch.Tensor,
    first: int,
    kv_heads: int,
    rope: Callable[[int, int], RopeAngles | None],
    canonical: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Fold coded tokens into `state` (`attend_latents` with the decoder of `compressor`)."""
    weights = coded_weights(compressor, bits, kv_heads)
    attend_latents(state, weights, bits, codes, scales, first, kv_heads, rope, canonical)


def attend_latents(
    state: OnlineSoftmax,
    weights: CodedWeights,
    bits: list[int],
    codes: torch.Tensor,
    scales: torch.Tensor,
    first: int,
    kv_heads: int,
    rope: Callable[[int, int], RopeAngles | None],
    canonical: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Fold coded tokens into `state`.

    Args:
        state: the attention being computed (queries, scale, mask over every position held).
        weights: the layer's decoder (`coded_weights`).
        bits: its latent groups' depths (keys' groups, then values').
        codes, scales: `uint8 [batch, tokens, bytes]`, `fp16 [batch, tokens, kept groups]` of tokens coded against
            zero (no references).
        first: the position of the first coded token in `state`'s key order.
        kv_heads: heads per token.
        rope: `rope(begin, end)`: the RoPE of coded tokens `begin:end` (see `kernels.latent_attention`), or None
            without RoPE.
        canonical: the RoPE's channel order applied to queries (the coded keys are in it), or None: the model's.
    """
    half = len(bits) // 2
    key_bits, _, key_bytes = _kept(tuple(bits[:half]))
    value_bits = _kept(tuple(bits[half:]))[0]
    key_scales = len(key_bits)
    key_decoder, key_mean, value_decoder, value_mean = weights
    dtype = key_decoder.dtype
    value_dim = value_decoder.shape[-1]
    query = state.grouped(kv_heads)
    batch, _, group, n, dim = query.shape
    rows = query.reshape(batch, kv_heads, group * n, dim)
    if canonical is not None:
        rows = canonical(rows)
    total = codes.shape[1]
    for start in range(0, total, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, total)
        count = batch * (end - start)
        rows_padded = -(-count // PRODUCT_ROWS) * PRODUCT_ROWS
        latent = torch.empty(rows_padded, key_decoder.shape[1], dtype=dtype, device=codes.device)
        latent[count:].zero_()
        kernels.dequantize_latent(
            codes[:, start:end, :key_bytes], scales[:, start:end, :key_scales], key_bits, latent[:count]
        )
        keys = F.linear(latent, key_decoder)[:count].view(batch, end - start, -1)  # less the mean
        allowed = state.allowed(first + start, first + end, kv_heads, codes.device)
        if allowed is not None:
            allowed = allowed.expand(batch, kv_heads, group, n, end - start).reshape(batch, kv_heads, group * n, -1)
        value_codes, value_scales = codes[:, start:end, key_bytes:], scales[:, start:end, key_scales:]
        maximum, weight, latent_acc = kernels.latent_attention(
            rows, keys, rope(start, end), allowed, value_codes, value_scales, value_bits, state.scale, key_mean
        )
        acc = torch.matmul(latent_acc, value_decoder) + weight[..., None] * value_mean[:, None]
        shape = (batch, kv_heads, group, n)
        state.merge(acc.view(*shape, value_dim), maximum.view(shape), weight.view(shape))
