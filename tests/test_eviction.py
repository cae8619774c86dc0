"""The eviction baselines: StreamingLLM keeps sinks and the most recent tokens, SnapKV per head the most attended
ones and a recent window; `keep=1` is DynamicCache; what they cannot serve is refused when built."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv import SnapKVCache, StreamingLLMCache

from .conftest import tiny_model
from .families import family_model


def run(model, cache, prompt: int = 100, new: int = 6):
    ids = torch.randint(3, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache=cache)


@pytest.mark.parametrize(
    "make", [lambda m: StreamingLLMCache(keep=1.0, model=m), lambda m: SnapKVCache(keep=1.0, model=m)]
)
def test_keeping_everything_is_dynamic_cache(make):
    model = tiny_model("llama")
    assert torch.equal(run(model, make(model)), run(model, DynamicCache()))


def test_streaming_llm_keeps_the_sinks_and_the_most_recent():
    model = tiny_model("llama")
    cache = StreamingLLMCache(keep=0.3, model=model)
    run(model, cache)
    seen = cache.get_seq_length()  # 105: the last generated token is never fed back
    for layer in cache.layers:
        kept = layer.kept_positions()[0, 0].tolist()
        assert layer.sink_keys.shape[2] == 4
        assert kept == list(range(seen - len(kept), seen)) and 4 + len(kept) == -(-3 * seen // 10)


def test_snapkv_keeps_the_recent_window_and_the_most_attended_per_head():
    model = tiny_model("llama-mha")  # 2 kv heads: each chooses its own tokens
    cache = SnapKVCache(keep=0.3, window=8, model=model)
    run(model, cache)
    seen = cache.get_seq_length()
    for layer in cache.layers:
        budget = -(-3 * seen // 10)
        assert layer.kept_positions().shape[2] == budget
        for head in layer.kept_positions()[0]:
            kept = head.tolist()
            assert kept == sorted(set(kept)) and kept[-8:] == list(range(seen - 8, seen))
    assert any(not torch.equal(*layer.kept_positions()[0, :2]) for layer in cache.layers)
    # fp16 keys and values of 30 % of the tokens, their positions (4 bytes a head), the room decoding appends into
    # (ROOM_FRACTION, at least a slot) and slots evicted since the last compaction: 5.35 bits here
    assert 16 * 0.3 < cache.bits_per_element() < 16 * 0.3 * 1.15


def test_what_eviction_cannot_serve_is_refused_when_built():
    with pytest.raises(ValueError, match="eager"):
        StreamingLLMCache(model=family_model("gemma2"))  # eager attention (soft-capping)
    with pytest.raises(ValueError, match="latents"):
        SnapKVCache(model=family_model("deepseek-v3"))
    for bad in ({"keep": 0}, {"keep": 1.5}, {"window": 0}, {"kernel": 4}):
        with pytest.raises(ValueError):
            SnapKVCache(**bad)
