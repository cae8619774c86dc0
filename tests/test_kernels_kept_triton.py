"""The evicting caches' Triton kernels (`kernels/triton/kept.py`) against their PyTorch references, under the
interpreter: storing new tokens into their slots and compacting the slots (the same bytes), attention over the slots
(within fp32 rounding) and SnapKV's choice of the slot to evict (the same slots)."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.kernels import KeptStream, reference

pytest.importorskip("triton", reason="needs the triton extra")


def _kept(batch: int, heads: int, slots: int, dim: int, first: int, evicted: int, seed: int) -> KeptStream:
    """Slots of tokens at increasing positions (gaps: tokens evicted and compacted away), `evicted` of those from
    `first` on marked evicted in each head (other slots in each)."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(batch, heads, slots, dim, generator=g) * 2).half()
    values = torch.randn(batch, heads, slots, dim, generator=g).half()
    gaps = torch.randint(1, 4, (batch, heads, slots), generator=g)
    index = (gaps.cumsum(-1) + 3).to(torch.int32)
    for row in index.view(-1, slots):
        row[first + torch.randperm(slots - first, generator=g)[:evicted]] = -1
    return KeptStream(keys, values, index, first, slots - first - evicted)


@pytest.mark.parametrize(("n", "pending"), [(1, 0), (1, 2), (5, 1), (19, 0)])
def test_keep_rows_writes_the_bytes_of_the_reference(n, pending):
    from hf_deltakv.kernels.triton.kept import keep_rows

    kept = _kept(2, 3, 40, 32, 0, 0, n)
    keys = torch.randn(2, 3, n, 32, dtype=torch.bfloat16) * 3
    keys[0, 0, 0, :4] = torch.tensor([1e6, -1e6, float("nan"), 0.0])  # saturated, NaN kept
    values = torch.randn(2, 3, n, 32)
    marks = torch.randint(0, 20, (2, 3, pending)) if pending else None
    want = KeptStream(kept.keys.clone(), kept.values.clone(), kept.index.clone(), 0, kept.live)
    reference.keep_rows(keys, values, want, 20, 57, marks)
    keep_rows(keys, values, kept, 20, 57, marks)
    for got, expected in ((kept.keys, want.keys), (kept.values, want.values), (kept.index, want.index)):
        assert torch.equal(got.view(torch.int16) if got.is_floating_point() else got,
                           expected.view(torch.int16) if expected.is_floating_point() else expected)  # fmt: skip


@pytest.mark.parametrize(("first", "evicted", "pending"), [(0, 0, 0), (5, 0, 0), (3, 7, 0), (0, 6, 2)])
def test_compaction_keeps_the_bytes_of_the_reference(first, evicted, pending):
    from hf_deltakv.kernels.triton.kept import compact_kept

    kept = _kept(2, 2, 300, 64, first, evicted, first + evicted)
    marks = None
    if pending:  # slots still alive in every head, chosen by SnapKV at the last step
        alive = [torch.nonzero(row >= 0).flatten()[first:] for row in kept.index.view(-1, 300)]
        marks = torch.stack([a[[3, 40]] for a in alive]).view(2, 2, 2)
        kept = KeptStream(kept.keys, kept.values, kept.index, first, kept.live - pending)

    def empty():
        return KeptStream(torch.zeros(2, 2, 310, 64, dtype=torch.float16), torch.zeros(2, 2, 310, 64,
                          dtype=torch.float16), torch.zeros(2, 2, 310, dtype=torch.int32), 0, kept.live)  # fmt: skip

    want, got = empty(), empty()
    reference.compact_kept(kept, marks, want)
    compact_kept(kept, marks, got)
    for a, b in ((got.keys, want.keys), (got.values, want.values), (got.index, want.index)):
        assert torch.equal(a, b)
    assert (got.index[:, :, : kept.live].diff(dim=-1) > 0).all()  # in order


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "slots", "first", "evicted", "sinks", "masked"),
    [(3, 1, 64, 70, 0, 9, 0, False), (4, 2, 32, 600, 11, 40, 4, True), (2, 2, 128, 33, 2, 0, 1, False)],
)
def test_attention_over_the_slots_and_what_snapkv_chooses_match_the_references(
    q_heads, kv_heads, dim, slots, first, evicted, sinks, masked
):
    from hf_deltakv.kernels.triton.kept import kept_attention, snapkv_evicted

    batch = 2
    kept = _kept(batch, kv_heads, slots, dim, first, evicted, slots)
    g = torch.Generator().manual_seed(dim)
    query = torch.randn(batch, q_heads, 1, dim, generator=g, dtype=torch.float32).to(torch.bfloat16)
    sink_keys = torch.randn(batch, kv_heads, sinks, dim, generator=g).to(torch.bfloat16)
    sink_values = torch.randn(batch, kv_heads, sinks, dim, generator=g).to(torch.bfloat16)
    seen = int(kept.index.max()) + 1
    mask = None
    if masked:  # left padding of row 0 (positions 0-5) and a few holes
        mask = torch.ones(batch, 1, 1, seen, dtype=torch.bool)
        mask[0, :, :, :6] = False
        mask[1, :, :, 100:140] = False
    want, importance = reference.kept_attention(query, sink_keys, sink_values, kept, mask, dim**-0.5, seen - 1, 0)
    grouped = query.view(batch, kv_heads, q_heads // kv_heads, dim)
    rows = None if mask is None else mask[:, :, 0]
    got, observation = kept_attention(grouped, sink_keys, sink_values, kept, rows, dim**-0.5, 0)
    torch.testing.assert_close(got.view(want.shape), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(reference.observed_importance(observation, kept), importance, atol=1e-6, rtol=1e-5)
    for drop, recent in ((1, 8), (3, 1)):
        expected = reference.snapkv_evicted(kept, observation, drop, recent, 7)
        assert torch.equal(snapkv_evicted(kept, observation, drop, recent, 7), expected)
        assert torch.equal(reference.snapkv_evicted(kept, importance, drop, recent, 7), expected)


def test_snapkv_evicts_the_oldest_among_equals():
    """Pooled weights tie wherever one token dominates its neighbours; the oldest of the lowest goes first."""
    from hf_deltakv.kernels import Observation
    from hf_deltakv.kernels.triton.kept import snapkv_evicted

    kept = _kept(1, 2, 40, 16, 0, 0, 0)
    scores = torch.zeros(2, 1, 40)  # every slot the same weight: only the order decides
    scores[1, 0, 20] = 5.0
    observation = Observation(scores, torch.zeros(2, 1), torch.full((2, 1), 40.0), 1)
    expected = reference.snapkv_evicted(kept, observation, 2, 4, 3)
    assert expected[0, 0].tolist() == [0, 1]
    assert torch.equal(snapkv_evicted(kept, observation, 2, 4, 3), expected)


def test_snapkv_pools_and_ranks_nan_weights_as_the_reference():
    """A NaN weight (a NaN key's attention) pools to NaN over its neighbours, as max_pool1d pools it, and ranks after
    every number: the kernel's max and min (which return the number) are not left to decide; the tokens chosen are
    each chosen once, even when the NaN ones must go."""
    from hf_deltakv.kernels import Observation
    from hf_deltakv.kernels.triton.kept import snapkv_evicted

    kept = _kept(1, 2, 40, 16, 0, 0, 0)
    scores = torch.randn(2, 1, 40, generator=torch.Generator().manual_seed(0))
    scores[0, 0, 10], scores[1, 0, 3] = float("nan"), float("nan")
    observation = Observation(scores, torch.zeros(2, 1), torch.full((2, 1), 40.0), 1)
    for drop, recent in ((3, 4), (20, 4), (37, 2)):
        expected = reference.snapkv_evicted(kept, observation, drop, recent, 3)
        got = snapkv_evicted(kept, observation, drop, recent, 3)
        assert torch.equal(got, expected), (drop, recent)
        assert all(len(set(row)) == drop for row in got.flatten(0, 1).tolist())


@pytest.mark.parametrize(("n", "masked"), [(5, False), (20, True)])
def test_a_chunk_of_queries_over_the_slots_matches_the_reference(n, masked):
    """Several queries per head (a chunk: query `i` at position `query_position + i` sees the slots up to it, or its
    row of the mask), SnapKV's observation of the last queries and the slots it evicts."""
    from hf_deltakv.kernels.triton.kept import kept_attention, snapkv_evicted

    batch, q_heads, kv_heads, dim = 2, 4, 2, 32
    kept = _kept(batch, kv_heads, 90, dim, 4, 10, n)
    positions = kept.index.max() + 1
    g = torch.Generator().manual_seed(n)
    query = torch.randn(batch, q_heads, n, dim, generator=g)
    sinks = torch.randn(batch, kv_heads, 2, dim, generator=g).half()
    query_position = int(positions) - n + 3  # the chunk's last queries are past the slots
    mask = None
    if masked:
        mask = torch.ones(n, query_position + n, dtype=torch.bool).tril(query_position)
        mask = mask.expand(batch, 1, n, -1).clone()
        mask[0, :, :, :12] = False
    observe_from = n - 3
    want, importance = reference.kept_attention(query, sinks, sinks, kept, mask, dim**-0.5, query_position,
                                                observe_from)  # fmt: skip
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads * n, dim)
    rows = None if mask is None else mask[:, 0]
    got, observation = kept_attention(grouped, sinks, sinks, kept, rows, dim**-0.5, observe_from, n, query_position)
    torch.testing.assert_close(got.view(want.shape), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(reference.observed_importance(observation, kept), importance, atol=1e-6, rtol=1e-5)
    expected = reference.snapkv_evicted(kept, observation, 5, 8, 7)
    assert torch.equal(snapkv_evicted(kept, observation, 5, 8, 7), expected)
