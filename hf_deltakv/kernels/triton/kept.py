"""Triton kernels of the evicting caches' decoding step (StreamingLLM, SnapKV), over the slots of `KeptStream`:

- `keep_rows` (one launch): the new token's key and value saturated to fp16 into their slot, its position into the
  index, and the slots SnapKV chose at the last step marked evicted. Specification: `reference.keep_rows`.
- `compact_kept` (one launch, a program per kv head): the kept tokens (less the slots SnapKV just chose) copied in
  order into new storage, when the room runs out. Specification: `reference.compact_kept`.
- `kept_attention` (two launches): `decode_attention`'s split kernel over the slots (a slot's mask column is its
  position, evicted slots skipped; with SnapKV, each query row's scores kept), then the adaptive keys' merge, which
  folds in the raw sinks (and, with SnapKV, writes the softmax's final max and sum); one query per head or a chunk of
  up to 64. Specification: `reference.kept_attention`.
- `snapkv_evicted` (one launch, a program per kv head): the observed weights from the scores and the softmax's
  statistics (the observed queries' rows summed), ranked in position order (a prefix sum over the slots alive),
  max-pooled over `kernel` neighbours, and the lowest outside the recent window chosen (the oldest among equals), as
  many times as slots go. Specification: `reference.snapkv_evicted`.

Nothing is gathered or copied at a decoding step but the new token: the slots stay where they are until the storage
grows, and no value is read back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import get_format
from ..layout import KeptStream, Observation
from .adaptive_attention import merge_splits
from .common import EXACT, mask_strides, on_device, program, query_rows, query_strides, rows_of, saturate_fp16
from .decode_attention import _plain_split_kernel, split_tokens, tile_tokens

RANK_TILE = 256  # slots a program of `_snapkv_evict_kernel` ranks at a time


@triton.jit(do_not_specialize=("at", "position", "n"))
def _keep_rows_kernel(
    k_ptr, v_ptr, kd_ptr, vd_ptr, idx_ptr, pend_ptr,
    heads, at, position, n, pending,
    skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, seb, seh, set_, sib, sih, spb, sph,
    D: tl.constexpr, DV: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    tile, bh = program(0), program(1)
    b, h = bh // heads, bh % heads
    if tile == 0:
        for j in range(pending):
            tl.store(idx_ptr + b * sib + h * sih + tl.load(pend_ptr + b * spb + h * sph + j), -1)
    t = tile * ROWS + tl.arange(0, ROWS)[:, None]
    live = t < n
    e = tl.arange(0, D)[None, :]
    key = tl.load(k_ptr + b * skb + h * skh + t * skt + e, mask=live, other=0.0).to(tl.float32)
    tl.store(kd_ptr + b * sdb + h * sdh + (at + t) * sdt + e, saturate_fp16(key).to(tl.float16), mask=live)
    ev = tl.arange(0, DV)[None, :]
    value = tl.load(v_ptr + b * svb + h * svh + t * svt + ev, mask=live, other=0.0).to(tl.float32)
    tl.store(vd_ptr + b * seb + h * seh + (at + t) * set_ + ev, saturate_fp16(value).to(tl.float16), mask=live)
    rows = tile * ROWS + tl.arange(0, ROWS)
    tl.store(idx_ptr + b * sib + h * sih + at + rows, (position + rows).to(tl.int32), mask=rows < n)


def serves(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Rows of a power-of-two width of 16-256 (keys and values each), each row contiguous."""
    dims = (keys.shape[-1], values.shape[-1])
    return all(16 <= d <= 256 and not d & (d - 1) for d in dims) and keys.stride(-1) == values.stride(-1) == 1


def keep_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    target: KeptStream,
    at: int,
    position: int,
    pending: torch.Tensor | None = None,
) -> None:
    """`reference.keep_rows` (see there) in one launch; the buffers' rows contiguous (see `serves`)."""
    batch, heads, n, dim = keys.shape
    rows = min(triton.next_power_of_2(max(n, 1)), 16)
    marks = pending if pending is not None else target.index
    on_device(_keep_rows_kernel)[(max(triton.cdiv(n, rows), 1), batch * heads)](
        keys, values, target.keys, target.values, target.index, marks,
        heads, at, position, n, 0 if pending is None else pending.shape[2],
        *keys.stride()[:3], *values.stride()[:3], *target.keys.stride()[:3], *target.values.stride()[:3],
        *target.index.stride()[:2], *marks.stride()[:2],
        D=dim, DV=values.shape[-1], ROWS=rows,
    )  # fmt: skip


@triton.jit(do_not_specialize=("first", "slots"))
def _compact_kernel(
    k_ptr, v_ptr, idx_ptr, pend_ptr, kd_ptr, vd_ptr, id_ptr,
    heads, first, slots, pending,
    skb, skh, skt, svb, svh, svt, sib, sih, spb, sph, sdb, sdh, sdt, seb, seh, set_, sjb, sjh,
    D: tl.constexpr, DV: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // heads, bh % heads
    e = tl.arange(0, D)[None, :]
    ev = tl.arange(0, DV)[None, :]
    count = 0
    for t0 in range(first, slots, TILE):  # the slots alive, ranked in order by a prefix sum, each to its rank
        slot = t0 + tl.arange(0, TILE)
        inside = slot < slots
        position = tl.load(idx_ptr + b * sib + h * sih + slot, mask=inside, other=-1)
        alive = inside & (position >= 0)
        for j in range(pending):
            alive = alive & (slot != tl.load(pend_ptr + b * spb + h * sph + j))
        rank = count + tl.cumsum(alive.to(tl.int32), axis=0) - 1
        row, to = slot[:, None], rank[:, None]
        key = tl.load(k_ptr + b * skb + h * skh + row * skt + e, mask=alive[:, None], other=0.0)
        tl.store(kd_ptr + b * sdb + h * sdh + to * sdt + e, key, mask=alive[:, None])
        value = tl.load(v_ptr + b * svb + h * svh + row * svt + ev, mask=alive[:, None], other=0.0)
        tl.store(vd_ptr + b * seb + h * seh + to * set_ + ev, value, mask=alive[:, None])
        tl.store(id_ptr + b * sjb + h * sjh + rank, position, mask=alive)
        count += tl.sum(alive.to(tl.int32), axis=0)


def compact_kept(kept: KeptStream, pending: torch.Tensor | None, target: KeptStream) -> None:
    """`reference.compact_kept` (see there) in one launch, a program per kv head; rows contiguous (`serves`)."""
    batch, heads, slots, dim = kept.keys.shape
    marks = pending if pending is not None else kept.index
    on_device(_compact_kernel)[(batch * heads,)](
        kept.keys, kept.values, kept.index, marks, target.keys, target.values, target.index,
        heads, kept.first, slots, 0 if pending is None else pending.shape[2],
        *kept.keys.stride()[:3], *kept.values.stride()[:3], *kept.index.stride()[:2], *marks.stride()[:2],
        *target.keys.stride()[:3], *target.values.stride()[:3], *target.index.stride()[:2],
        D=dim, DV=kept.values.shape[-1], TILE=max(8, 2048 // max(dim, kept.values.shape[-1])),
    )  # fmt: skip


def supports(kept: KeptStream, mask: torch.Tensor | None, n_queries: int = 1) -> bool:
    """Keys and values of one power-of-two width of 16-256, rows contiguous, the index's slots contiguous; up to
    `common.MAX_QUERIES` queries, a mask of a row each."""
    dim = kept.keys.shape[-1]
    if dim != kept.values.shape[-1] or dim < 16 or dim > 256 or dim & (dim - 1) or not rows_of(mask, n_queries):
        return False
    return kept.keys.stride(-1) == kept.values.stride(-1) == kept.index.stride(-1) == 1


def kept_attention(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    sink_values: torch.Tensor,
    kept: KeptStream,
    mask: torch.Tensor | None,
    scale: float,
    observe_from: int | None,
    n_queries: int = 1,
    query_position: int = 0,
) -> tuple[torch.Tensor, Observation | None]:
    """`reference.kept_attention`: fp32 `[batch, kv_heads, rows, dim]` and, with `observe_from`, SnapKV's
    `Observation` of it.

    Args:
        query: `[batch, kv_heads, rows, dim]` (rows contiguous): row `g * n_queries + i` is query `i` (at position
            `query_position + i`) of the kv head's `g`-th query head.
        mask: bool `[batch, n_queries, positions]` (a token's column is its position), or None: causal.
    """
    strides, group = query_strides(query, n_queries)
    batch, kv_heads, dim = query.shape[0], query.shape[1], query.shape[-1]
    device = query.device
    tile = tile_tokens(dim)
    rows = query_rows(group, n_queries, query_position)
    slots, first = kept.slots, kept.first
    splits, per_split = split_tokens(slots - first, tile)
    padded = rows.block * rows.blocks
    o = torch.empty(batch * kv_heads, splits, padded, dim, dtype=torch.float32, device=device)
    m = torch.empty(batch * kv_heads, splits, padded, dtype=torch.float32, device=device)
    l_sum = torch.empty_like(m)
    observe = observe_from is not None
    scores = torch.empty(batch * kv_heads, padded, slots, dtype=torch.float32, device=device) if observe else None
    stats = torch.empty(2, batch * kv_heads, padded, dtype=torch.float32, device=device) if observe else None
    f16 = get_format("f16")
    k, v = kept.keys, kept.values
    mask_rows = mask if mask is not None else query
    on_device(_plain_split_kernel)[(batch * kv_heads, splits, rows.blocks)](
        query, k, k, k, k, v, v, v, query, query, mask_rows, o, m, l_sum,
        kept.index, scores if observe else query,
        kv_heads, slots, slots, 0, per_split, float(scale), first, query_position,
        *strides, *k.stride(), 0, 0, 0, 0, 0, 0, 0, *v.stride()[:3], 0, 0, 0, 0, 0, *mask_strides(mask),
        *kept.index.stride()[:2],
        GROUP=group, G_PAD=rows.block, D=dim, T=tile, K_KIND=int(f16.kind), K_BS=1, K_CHANNEL=False,
        V_KIND=int(f16.kind), V_BS=1, K_STAGES=0, K_SCALE=1.0, ROPE=False, MASK=mask is not None, INDEXED=True,
        SCORES=observe, NQ=n_queries, ONE=n_queries == 1, num_warps=4 if dim < 128 else 8,
    )  # fmt: skip
    out = merge_splits(query, sink_keys, sink_values, (o, m, l_sum), mask, scale, 0, rows, stats=stats)
    if not observe:
        return out, None
    return out, Observation(scores, stats[0], stats[1], group, n_queries, observe_from)


@triton.jit(do_not_specialize=("first", "slots", "live", "candidates", "drop", "observe_from"))
def _snapkv_evict_kernel(
    sc_ptr, m_ptr, l_ptr, idx_ptr, weight_ptr, slot_ptr, pool_ptr, out_ptr,
    heads, first, slots, live, candidates, drop, observe_from, sib, sih,
    ROWS: tl.constexpr, R_PAD: tl.constexpr, RB: tl.constexpr, NQ: tl.constexpr, RADIUS: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    bh = program(0)
    b, h = bh // heads, bh % heads
    weight_row, slot_row, pool_row = weight_ptr + bh * live, slot_ptr + bh * live, pool_ptr + bh * live
    count = 0
    for t0 in range(first, slots, TILE):  # the alive slots ranked in order, with their observed weights
        slot = t0 + tl.arange(0, TILE)
        inside = slot < slots
        alive = inside & (tl.load(idx_ptr + b * sib + h * sih + slot, mask=inside, other=-1) >= 0)
        weight = tl.zeros((TILE,), tl.float32)
        for r0 in range(0, R_PAD, RB):  # the rows of the observed queries (from `observe_from`), by blocks
            r = r0 + tl.arange(0, RB)
            maximum = tl.load(m_ptr + bh * R_PAD + r)
            total = tl.load(l_ptr + bh * R_PAD + r)
            safe = tl.where(maximum == float("-inf"), 0.0, maximum)
            seen = (r < ROWS) & (r % NQ >= observe_from) & (total > 0)
            total = tl.where(seen, total, 1.0)
            score = tl.load(sc_ptr + (bh * R_PAD + r[:, None]) * slots + slot[None, :],
                            mask=seen[:, None] & alive[None, :], other=float("-inf"))  # fmt: skip
            share = tl.math.div_rn(tl.exp(score - safe[:, None]), tl.broadcast_to(total[:, None], score.shape))
            weight += tl.sum(tl.where(seen[:, None], share, 0.0), axis=0)
        rank = count + tl.cumsum(alive.to(tl.int32), axis=0) - 1
        tl.store(weight_row + rank, weight, mask=alive)
        tl.store(slot_row + rank, slot.to(tl.int64), mask=alive)
        count += tl.sum(alive.to(tl.int32), axis=0)
    tl.debug_barrier()
    for r0 in range(0, candidates, TILE):  # max-pooled over RADIUS neighbours each side, in rank order
        rank = r0 + tl.arange(0, TILE)
        ok = rank < candidates
        pooled = tl.full((TILE,), float("-inf"), tl.float32)
        for j in tl.static_range(2 * RADIUS + 1):
            near = rank + j - RADIUS
            near_w = tl.load(weight_row + near, mask=ok & (near >= 0) & (near < live), other=float("-inf"))
            # (NaN pooled as max_pool1d pools it: `tl.maximum` alone would return the number)
            pooled = tl.where((near_w != near_w) | (pooled != pooled), float("nan"), tl.maximum(pooled, near_w))
        tl.store(pool_row + rank, tl.where(pooled != pooled, float("inf"), pooled), mask=ok)  # NaN: after every number
    tl.debug_barrier()
    for k in range(drop):  # the lowest, the lowest rank (oldest) among equals; then out of the running (NaN)
        best = float("inf")
        best_rank = candidates
        for r0 in range(0, candidates, TILE):
            rank = r0 + tl.arange(0, TILE)
            ok = rank < candidates
            pooled = tl.load(pool_row + rank, mask=ok, other=float("nan"))
            running = pooled == pooled
            low = tl.min(tl.where(running, pooled, float("inf")), axis=0)
            at = tl.min(tl.where(running & (pooled == low), rank, candidates), axis=0)
            take = (low < best) | ((low == best) & (at < best_rank))
            best_rank = tl.where(take, at, best_rank)
            best = tl.where(take, low, best)
        tl.store(out_ptr + bh * drop + k, tl.load(slot_row + best_rank))
        tl.store(pool_row + best_rank, float("nan"))
        tl.debug_barrier()


def snapkv_evicted(kept: KeptStream, observed: Observation, drop: int, recent: int, kernel: int) -> torch.Tensor:
    """`reference.snapkv_evicted` (see there) from the attention kernel's `Observation`, in one launch."""
    batch, heads, slots = kept.index.shape
    device = kept.index.device
    live = kept.live
    weight = torch.empty(batch * heads, live, dtype=torch.float32, device=device)
    slot = torch.empty(batch * heads, live, dtype=torch.int64, device=device)
    pooled = torch.empty(batch * heads, live, dtype=torch.float32, device=device)
    out = torch.empty(batch, heads, drop, dtype=torch.int64, device=device)
    padded = observed.scores.shape[1]
    on_device(_snapkv_evict_kernel)[(batch * heads,)](
        observed.scores, observed.maximum, observed.total, kept.index, weight, slot, pooled, out,
        heads, kept.first, slots, live, live - recent, drop, observed.observe_from, *kept.index.stride()[:2],
        ROWS=observed.rows, R_PAD=padded, RB=min(padded, 16), NQ=observed.n_queries, RADIUS=kernel // 2,
        TILE=RANK_TILE, **EXACT,
    )  # fmt: skip
    return out
