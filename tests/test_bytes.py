"""`nbytes()` is what the cache holds: every storage reachable from the cache object, room for appends and position
logs included, within 2 %; sliding windows hold no more than their window after any update."""

from __future__ import annotations

import dataclasses
import functools
import types

import pytest
import torch
from torch import nn

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, ResidualKVCache, SnapKVCache, StreamingLLMCache
from hf_deltakv.quant import QuantizedTensor, nbytes_of
from hf_deltakv.rope import RopeForm

from .conftest import tiny_compressor, tiny_model

CACHES = {
    "fp16": lambda m: QuantizedKVCache("f16", "f16"),
    "q4_0": lambda m: QuantizedKVCache("q4_0", "q4_0"),
    "q4_0-rot": lambda m: QuantizedKVCache("q4_0", "q4_0", rotate=True),
    "q8_0-pre-rope": lambda m: QuantizedKVCache("q8_0", "q8_0", model=m, pre_rope=True),
    "kivi": lambda m: KIVIKVCache(),
    "kivi-pre-rope": lambda m: KIVIKVCache(model=m, pre_rope=True),
    "delta": lambda m: DeltaKVCache(kf=8, model=m),
    "delta-no-model": lambda m: DeltaKVCache(kf=8),
    "delta-3.5": lambda m: DeltaKVCache(kf=16, key_bits=2.75, values="q3_0", model=m),
    "delta-token": lambda m: DeltaKVCache(kf=8, keys="token", values="delta", model=m),
    "residual": lambda m: ResidualKVCache(model=m, compressor=tiny_compressor(m)),
    "streaming-llm": lambda m: StreamingLLMCache(keep=0.3, model=m),
    "snapkv": lambda m: SnapKVCache(keep=0.3, window=8, model=m),
}


def held_bytes(cache) -> int:
    """Bytes of every storage reachable from `cache` (attributes, containers, dataclasses; each storage once). The
    model's own objects a cache refers to (its modules, e.g. the residual compressor, and its RoPE, measured once
    per model) are not the cache's."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()

    def walk(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, (nn.Module, RopeForm, type, types.ModuleType, types.FunctionType, functools.partial)):
            return
        elif isinstance(obj, dict):
            for item in (*obj.keys(), *obj.values()):
                walk(item)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                walk(item)
        elif isinstance(obj, QuantizedTensor) or dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item)

    walk(cache)
    return nbytes_of(tensors)


def run(model, cache, prompt: int, new: int):
    ids = torch.randint(3, 128, (2, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache=cache)
    return cache


@pytest.mark.parametrize("name", CACHES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("steps", [(300, 1), (64, 40)])
def test_nbytes_counts_every_storage_the_cache_holds(name, arch, steps):
    """After a prefill (one decoded token) and after many decoding steps (room kept for appends)."""
    model = tiny_model(arch)
    if name == "residual" and arch == "gemma3":
        pytest.skip("the tiny residual compressor is fitted for llama")
    cache = run(model, CACHES[name](model), *steps)
    held = held_bytes(cache)
    assert cache.nbytes() == pytest.approx(held, rel=0.02), (cache.nbytes(), held)


@pytest.mark.parametrize("name", CACHES)
def test_nbytes_counts_every_storage_at_32k_tokens(name):
    """At 32K tokens (position logs and grown buffers at the size long prompts reach): a prefill in 8K chunks, then
    decoding steps, fed as a model's forwards feed every layer."""
    model = tiny_model("llama")
    cache, config = CACHES[name](model), model.config
    g = torch.Generator().manual_seed(0)
    for part in (8192,) * 4 + (1,) * 3:
        keys, values = (torch.randn(1, config.num_key_value_heads, part, config.head_dim, generator=g) for _ in "kv")
        for layer in range(config.num_hidden_layers):
            cache.update(keys, values, layer)
    assert cache.get_seq_length() == 4 * 8192 + 3
    held = held_bytes(cache)
    assert cache.nbytes() == pytest.approx(held, rel=0.02), (cache.nbytes(), held)


def test_a_view_that_keeps_dropped_tokens_alive_is_counted():
    """The counter reads storages, not shapes: a slice of a larger buffer counts the buffer."""
    buffer = torch.zeros(4, 100)
    assert nbytes_of(buffer[:, :10]) == buffer.numel() * 4
    assert nbytes_of([buffer[:1], buffer[1:]]) == buffer.numel() * 4  # one storage, once


SLIDING = {
    "delta": lambda m: DeltaKVCache(kf=8, model=m),
    "q4_0": lambda m: QuantizedKVCache("q4_0", "q4_0", model=m),
    "kivi-pre-rope": lambda m: KIVIKVCache(model=m, pre_rope=True),
    "fp16": lambda m: QuantizedKVCache("f16", "f16", model=m),
}


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_layers_hold_only_their_window_after_a_one_shot_prefill(name):
    """Gemma 3's sliding layers (window 8) after a 200-token prefill, before any decoding step (the prefill's own
    attention read everything first): the window and at most one group being coded."""
    model = tiny_model("gemma3")
    cache = SLIDING[name](model)
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    sliding = [layer for layer in cache.layers if layer.window is not None]
    full = [layer for layer in cache.layers if layer.window is None]
    assert sliding and full
    for layer in sliding:
        assert layer.cumulative_length - layer._first_stored() <= layer.window + 8
        assert layer.nbytes() < 0.15 * full[0].nbytes()
