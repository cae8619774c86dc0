"""A decoding step of a `ResidualKVCache` layer as two PyTorch ops over storage preallocated to a capacity
(`residual.static.PackedResidualLayer`), registered in the `hf_deltakv` library as `kernels.ops`' are (tensors and
scalars in, a fake implementation each; the coder's weights are tensors of the call, never the module).

`hf_deltakv::latent_append` stores the token (raw in the sinks, else raw in the window) and, when the window then
holds `CODE_BATCH` tokens more than it keeps, codes its oldest `CODE_BATCH` into the latent codes
(`kernels.encode_latent_into`), as `ResidualLayer._append_stream` does. `hf_deltakv::latent_attention_step` is
`ResidualLayer.attend` over that storage: `kernels.latent_stream_attention` where it serves (GPUs), else the raw
parts and the coded tokens folded into one online softmax (`attention.attend_latents`). Counters (`counts`, int64 on
the host): the tokens held, the tokens coded.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.layout import LatentCoder, LatentStream, RopeAngles
from ..kernels.online_softmax import OnlineSoftmax
from ..kernels.ops import fake, op, to_sinks
from .attention import CodedWeights, attend_latents
from .layer import CODE_BATCH

TOKENS, CODED = range(2)


@op(mutates_args=("sink_keys", "sink_values", "window_keys", "window_values", "codes", "scales", "positions", "counts"))
def latent_append(
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    window_keys: torch.Tensor,
    window_values: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    key_mean: torch.Tensor,
    value_mean: torch.Tensor,
    key_encoder: torch.Tensor,
    value_encoder: torch.Tensor,
    counts: torch.Tensor,
    *,
    bits: list[int],
    window: int,
) -> None:
    """One new token of a layer (`key` after RoPE and `value` `[batch, kv_heads, 1, dim]`, at `position_ids` int
    `[batch, 1]`; None: the count of tokens held): while fewer than `sink_keys.shape[2]` tokens are held, raw into
    the sinks (fp16 saturates); else raw into the row of `window_keys`/`window_values` `[batch, kv_heads, rows,
    dim]` after the window's tokens, and when the window then holds `window + CODE_BATCH` tokens, its oldest
    `CODE_BATCH` are coded (keys turned back by their RoPE, `freqs` float64 and `order`; None: as given; each token's
    residual less the means times the encoders, quantized at `bits`) into the next rows of `codes` `[batch, capacity,
    bytes]` and `scales`, and the window's other tokens moved to its first rows. `positions` int32 `[batch,
    max_cache_len]` records the position; the counters advance."""
    held, coded = counts.tolist()
    sinks = sink_keys.shape[2]
    positions[:, held] = held if position_ids is None else position_ids[:, 0]
    if held < sinks:
        to_sinks(key, value, sink_keys, sink_values, held)
    else:
        length = held - sinks - coded  # the window's tokens before this one
        kernels.write_raw(key, value, window_keys, window_values, length)
        length += 1
        if length - window >= CODE_BATCH:
            begin = sinks + coded
            ids = positions[:, begin : begin + CODE_BATCH] if freqs is not None else None
            none = key_mean.new_empty(0)  # (the decoders: not read by the encoding)
            coder = LatentCoder(key_mean, value_mean, key_encoder, value_encoder, none, none)
            target = LatentStream(codes, scales, tuple(bits))
            oldest = (window_keys[:, :, :CODE_BATCH], window_values[:, :, :CODE_BATCH])
            kernels.encode_latent_into(*oldest, ids, freqs, order, coder, tuple(bits), target, coded)
            for buffer in (window_keys, window_values):
                buffer[:, :, : length - CODE_BATCH] = buffer[:, :, CODE_BATCH:length].clone()
            coded += CODE_BATCH
    counts.copy_(torch.tensor([held + 1, coded]))


@fake
def _latent_append(key, value, position_ids, sink_keys, sink_values, window_keys, window_values, codes, scales,
                   positions, freqs, order, key_mean, value_mean, key_encoder, value_encoder, counts, *, bits,
                   window):  # fmt: skip
    return None


@op()
def latent_attention_step(
    query: torch.Tensor,
    mask: torch.Tensor | None,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    window_keys: torch.Tensor,
    window_values: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    key_mean: torch.Tensor,
    value_mean: torch.Tensor,
    key_encoder: torch.Tensor,
    value_encoder: torch.Tensor,
    key_decoder: torch.Tensor,
    value_decoder: torch.Tensor,
    key_rows: torch.Tensor,
    value_heads: torch.Tensor,
    counts: torch.Tensor,
    *,
    bits: list[int],
    scale: float,
) -> torch.Tensor:
    """Attention of a decoding step's `query` `[batch, heads, n, dim]` (as SDPA is given it) over a layer's tokens:
    the raw sinks, the coded tokens (`codes`, `scales`: the first `counts[CODED]` rows), the raw window, under `mask`
    bool `[batch, n, max_cache_len]` (None: causal), as `ResidualLayer.attend` computes it. The coder: `key_mean` ...
    `value_decoder` as `kernels.LatentCoder` (the GPU kernel's), `key_rows` and `value_heads` the decoders as
    `attention.CodedWeights` holds them (the chunked path's). Returns fp32 `[batch, heads, n, value_dim]`."""
    held, coded = counts.tolist()
    batch, heads, n, _ = query.shape
    sinks, kv_heads = sink_keys.shape[2], sink_keys.shape[1]
    length = max(held - sinks - coded, 0)  # raw in the window
    mask = None if mask is None else mask[:, :, :held]
    sink_k, sink_v = sink_keys[:, :, : min(held, sinks)], sink_values[:, :, : min(held, sinks)]
    window_k, window_v = window_keys[:, :, :length], window_values[:, :, :length]
    if not coded:  # (`StreamLayer.attend`: the sinks, then the window decoded)
        state = OnlineSoftmax(query, scale, None if mask is None else mask[:, None], held)
        if sink_k.shape[2]:
            state.add(sink_k, sink_v)
        if length:
            state.add(window_k.float(), window_v.float())
        return state.result()
    stream = LatentStream(codes[:, :coded], scales[:, :coded], tuple(bits))
    rope = None if freqs is None else RopeAngles(positions[:, sinks : sinks + coded], freqs)
    coder = LatentCoder(key_mean, value_mean, key_encoder, value_encoder, key_decoder, value_decoder)
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads))
    raw = [(sink_k, sink_v, 0), (window_k, window_v, sinks + coded)]
    served = kernels.latent_stream_attention(grouped, raw, stream, coder, rope, order, sinks, mask, n, held - n, scale)
    if served is not None:
        return served.reshape(batch, heads, n, -1)
    if mask is not None and n == 1 and mask.device.type == "cpu" and bool(mask.all()):
        mask = None  # (as the eager layer: every token visible)
    state = OnlineSoftmax(query, scale, None if mask is None else mask[:, None], held)
    if mask is None and n == 1:  # (the eager layer folds both raw parts in one product)
        raw = [(torch.cat([sink_k, window_k], dim=2), torch.cat([sink_v, window_v], dim=2), 0)]
    for keys, values, start in raw:
        if keys.shape[2]:
            state.add(keys, values, start=start)

    def angles(begin: int, end: int) -> RopeAngles | None:
        return None if rope is None else RopeAngles(rope.positions[:, begin:end], freqs)

    canonical = None if order is None else (lambda x: x[..., order])
    weights = CodedWeights(key_rows, key_mean, value_heads, value_mean.view(kv_heads, -1))
    attend_latents(state, weights, bits, stream.codes, stream.scales, sinks, kv_heads, angles, canonical)
    return state.result()


@fake
def _latent_attention_step(query, mask, sink_keys, sink_values, window_keys, window_values, codes, scales, positions,
                           freqs, order, key_mean, value_mean, key_encoder, value_encoder, key_decoder, value_decoder,
                           key_rows, value_heads, counts, *, bits, scale):  # fmt: skip
    return query.new_empty(*query.shape[:3], window_values.shape[-1], dtype=torch.float32)
