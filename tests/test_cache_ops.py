"""Random sequences of cache operations (updates of any size, beam reorder, batch selection and repetition, crop,
reset): lossless storage equals DynamicCache bit for bit; lossy codecs equal their own one-shot coding of the same
tokens, and a crop never changes the tokens it keeps. Then the generate() modes that crop: prompt lookup and
assisted decoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache

from .conftest import tiny_model

HEADS, DIM, BATCH = 2, 32, 3

OPERATION = st.one_of(
    st.tuples(st.just("update"), st.integers(0, 11)),
    st.tuples(st.just("reorder"), st.permutations(range(BATCH))),
    st.tuples(st.just("repeat_select"), st.integers(1, 2)),  # repeat the batch, then select it back
    st.tuples(st.just("crop"), st.integers(1, 6)),
    st.tuples(st.just("reset"), st.just(0)),
)


def _tokens(count: int, seed: int, dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(BATCH, HEADS, count, DIM, generator=g).cumsum(2) * 0.3 + torch.randn(DIM, generator=g) * 2
    return keys.to(dtype), torch.randn(BATCH, HEADS, count, DIM, generator=g).to(dtype)


def _apply(cache, op, arg, seed):
    if op == "update":
        cache.update(*_tokens(arg, seed), 0)
    elif op == "reorder":
        cache.reorder_cache(torch.tensor(arg))
    elif op == "repeat_select":
        cache.batch_repeat_interleave(arg)
        cache.batch_select_indices(torch.arange(0, BATCH * arg, arg))
    elif op == "crop":
        cache.crop(-arg)
    else:
        cache.reset()


def _held(cache) -> int:
    return cache.get_seq_length() if cache.layers else 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPERATION, min_size=1, max_size=10))
def test_lossless_storage_follows_dynamic_cache_bit_for_bit(operations):
    ours, reference = QuantizedKVCache("f16", "f16", sink_tokens=2), DynamicCache()
    for seed, (op, arg) in enumerate(operations):
        if op != "update" and not _held(reference):
            continue  # nothing cached yet: DynamicCache has no layer to reorder or crop
        if op == "crop" and arg > _held(reference):
            arg = _held(reference)
        for cache in (ours, reference):
            _apply(cache, op, arg, seed)
        assert _held(ours) == _held(reference)
        if _held(reference):
            keys, values = ours.layers[0].reconstruct()
            assert torch.equal(keys, reference.layers[0].keys) and torch.equal(values, reference.layers[0].values)


LOSSY = {
    "delta": lambda: DeltaKVCache(kf=8, sink_tokens=2),
    "delta-token": lambda: DeltaKVCache(kf=4, keys="token", sink_tokens=2),
    "kivi": lambda: KIVIKVCache(),
    "q4_0-rot": lambda: QuantizedKVCache(rotate=True),
}


@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(OPERATION, min_size=1, max_size=8))
@example(operations=[("update", 1), ("crop", 1)])  # a crop while every token is still a sink: nothing to truncate
# Once moved kept keys by an fp16 step (the rotation was a matrix product, whose rounding depends on how many rows it
# multiplies: a crop changed how many tokens decode together); rotations are row by row now (butterflies).
@example(operations=[("reset", 0), ("update", 0), ("update", 0), ("update", 0), ("repeat_select", 1), ("update", 11),
                     ("crop", 1)])  # fmt: skip
def test_lossy_codecs_equal_their_one_shot_coding(name, operations):
    """Without crops, any sequence of operations stores what one update of the same tokens stores; a crop leaves
    the reconstruction of the kept tokens as it was, bit for bit (a token decodes from its stored bytes alone)."""
    cache = LOSSY[name]()
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # the tokens the cache holds, in its batch order
    cropped = False
    for seed, (op, arg) in enumerate(operations):
        if op != "update" and inputs is None:
            continue
        before = cache.layers[0].reconstruct() if op == "crop" else None
        if op == "crop":
            arg = min(arg, inputs[0].shape[2])
        _apply(cache, op, arg, seed)
        if op == "update":
            new = _tokens(arg, seed)
            inputs = (
                new if inputs is None else tuple(torch.cat([a, b], dim=2) for a, b in zip(inputs, new, strict=True))
            )
        elif op == "reorder":
            inputs = tuple(t[torch.tensor(arg)] for t in inputs)
        elif op == "crop":
            inputs = tuple(t[:, :, :-arg] for t in inputs)
            cropped = True
            kept = inputs[0].shape[2]
            for a, b in zip(cache.layers[0].reconstruct(), before, strict=True):
                assert torch.equal(a, b[:, :, :kept])
        elif op == "reset":
            inputs, cropped = None, False
        if inputs is not None and inputs[0].shape[2] and not cropped:
            fresh = LOSSY[name]()
            fresh.update(*inputs, 0)
            for a, b in zip(cache.layers[0].reconstruct(), fresh.layers[0].reconstruct(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


GENERATE = {
    "f16": lambda model: QuantizedKVCache("f16", "f16", model=model),
    "delta": lambda model: DeltaKVCache(kf=8, model=model),
    "delta-token": lambda model: DeltaKVCache(kf=4, keys="token", model=model),
    "kivi": lambda model: KIVIKVCache(model=model, pre_rope=True),
}


@pytest.mark.parametrize("name", GENERATE)
@pytest.mark.parametrize("mode", ["prompt_lookup", "assisted"])
def test_generate_modes_that_crop(name, mode):
    """Prompt lookup and assisted decoding verify candidate tokens and crop the rejected ones."""
    model = tiny_model("llama", torch.float16 if name == "f16" else torch.float32)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8]])  # repeats: prompt lookup finds candidates
    kwargs = dict(max_new_tokens=10, do_sample=False)
    if mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = 3
    else:
        kwargs["assistant_model"] = tiny_model("llama", model.dtype)
    cache = GENERATE[name](model)
    out = model.generate(ids, cache=cache, **kwargs)
    assert out.shape[1] == ids.shape[1] + 10 and cache.get_seq_length() == out.shape[1] - 1
    if name == "f16":  # lossless storage: what plain greedy decoding with DynamicCache gives
        expected = model.generate(ids, cache=DynamicCache(), max_new_tokens=10, do_sample=False)
        assert torch.equal(out, expected)
