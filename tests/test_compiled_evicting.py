"""Compiled decoding of the eviction caches (issue 63): `StaticStreamingLLMCache` and `StaticSnapKVCache` compile under
`generate` as transformers' CI compiles `StaticCache` (`CompileConfig(fullgraph=True, dynamic=False)`,
`_compile_all_devices`): one graph for every decoding step (0 graph breaks, 0 recompiles), each step evicting and,
now and then, compacting the slots kept; the tokens, slots and bytes of the eager caches."""

from __future__ import annotations

import math

import pytest
import torch
import torch._inductor.config
from transformers.cache_utils import StaticCache

from hf_deltakv import SnapKVCache, StaticSnapKVCache, StaticStreamingLLMCache, StreamingLLMCache

from .conftest import tiny_model
from .test_compiled import NEW, generate, prompt
from .test_compiled_delta import compiles_as_eager, compiles_once, steps_by_hand

CASES = [
    (StreamingLLMCache, StaticStreamingLLMCache, {"keep": 0.5, "sink_tokens": 4}, torch.float32),
    (SnapKVCache, StaticSnapKVCache, {"keep": 0.5, "window": 4, "kernel": 3}, torch.bfloat16),
]


@pytest.mark.parametrize(("eager_cls", "static_cls", "options", "dtype"), CASES)
def test_generate_compiles_once_and_decodes_as_the_eager_cache(eager_cls, static_cls, options, dtype):
    model = tiny_model(dtype=dtype)
    make = lambda: static_cls(**options, max_cache_len=80, model=model)  # noqa: E731
    expected = generate(model, eager_cls(**options, model=model))
    eager, compiled = compiles_as_eager(model, make, expected, ("kept_append", "kept_attention_step"))
    held = 9 + NEW - 1
    for layer, other in zip(compiled.layers, eager.layers, strict=True):
        seen, slots, _, live, _ = layer.counts.tolist()
        assert seen == held and live == max(math.ceil(0.5 * held) - layer.sinks, layer.recent)
        assert live < slots < layer.slots and layer.counts.tolist() == other.counts.tolist()
    assert compiled.used_nbytes() == eager.used_nbytes() < compiled.nbytes()


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (attention with SnapKV's observation, the evicted slots chosen and the
    slots compacted by the Triton kernels, as on a GPU): one graph, the tokens of eager decoding on the same path."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    options = {"keep": 0.4, "window": 4, "kernel": 3}
    expected = generate(model, SnapKVCache(**options, model=model))
    compiles_once(model, StaticSnapKVCache(**options, max_cache_len=80, model=model), expected)


def kept_by(layer) -> torch.Tensor:
    """The positions a `PackedKeptLayer` keeps, in order `[batch, kv_heads, kept]`."""
    _, slots, first, live, _ = layer.counts.tolist()
    index = layer.index[:, :, first:slots]
    return index.sort(dim=-1).values[..., index.shape[2] - live :]


@pytest.mark.parametrize("snapkv", [False, True])
def test_compiled_step_keeps_and_attends_as_the_eager_layer(snapkv):
    """Given the same queries, keys and values, the compiled step (update, then SDPA on what it returns) keeps the
    tokens the eager layer keeps and attends as it does, bit for bit, over 60 steps (evictions each step, several
    compactions)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, steps = 4, 2, 32, 60
    q = torch.randn(2, heads, 9 + steps, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, 9 + steps, dim, generator=g) * 2 for _ in range(2))
    options = {"keep": 0.3, "window": 3, "kernel": 3} if snapkv else {"keep": 0.3, "sink_tokens": 2}
    eager_cls, static_cls = (SnapKVCache, StaticSnapKVCache) if snapkv else (StreamingLLMCache, StaticStreamingLLMCache)
    grown = eager_cls(**options, model=model)._new_layer(0)  # (one layer fed by hand)
    layer = static_cls(**options, max_cache_len=80, model=model).layers[0]

    compactions, slots = 0, None
    for _ in steps_by_hand(grown, layer, q, k, v, 9):
        compactions += slots is not None and layer.counts.tolist()[1] < slots
        slots = layer.counts.tolist()[1]
        assert torch.equal(kept_by(layer), grown.kept_positions())
    assert compactions >= 2


def test_a_second_prompt_and_a_crop_continue_as_the_eager_cache():
    """A conversation's next turn after decoding steps (the eager layer given the slots kept), and a crop."""
    model = tiny_model()
    options = {"keep": 0.5, "window": 4, "kernel": 3}
    static, grown = StaticSnapKVCache(**options, max_cache_len=96, model=model), SnapKVCache(**options, model=model)
    ids = [model.generate(prompt(), max_new_tokens=20, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    turn = torch.cat([ids[0], prompt(7)], dim=1)
    ids = [model.generate(turn, max_new_tokens=12, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    for cache in (static, grown):
        cache.crop(-3)
    for a, b in zip(static.layers, grown.layers, strict=True):
        assert torch.equal(kept_by(a), b.kept_positions())
    cut = ids[0][:, :-3]
    ids = [model.generate(cut, max_new_tokens=8, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)


def test_ops_pass_opcheck():
    """`hf_deltakv::kept_append` and `kept_attention_step`: schema (the mutated arguments), fake implementation and
    dispatch as `torch.library.opcheck` checks them (as `test_compiled_delta.test_ops_pass_opcheck`)."""
    model = tiny_model()
    cache = StaticSnapKVCache(keep=0.5, window=2, kernel=3, max_cache_len=32, model=model)
    model(prompt(15), cache=cache, use_cache=True)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(5)
    key, value = (torch.randn(2, layer.num_heads, 1, 32, generator=g) for _ in range(2))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    storage = (layer.sink_keys, layer.sink_values, layer.keys, layer.values, layer.index, layer.counts)
    torch.library.opcheck(torch.ops.hf_deltakv.kept_append.default, (key, value, *storage), test_utils=checks)
    torch.ops.hf_deltakv.kept_append(key, value, *storage)  # (opcheck runs on copies: the step itself)
    args = (torch.randn(2, 4, 1, 32, generator=g), torch.ones(2, 1, 32, dtype=torch.bool), *storage)
    options = dict(keep=0.5, recent=2, pool=3, snapkv=True, scale=32**-0.5)
    torch.library.opcheck(torch.ops.hf_deltakv.kept_attention_step.default, args, options, test_utils=checks)


def test_storage_is_preallocated_and_counted():
    """Every byte counted: the slots hold the budget (`keep` of `max_cache_len`) and its room, so at keep=0.3 and fp16
    about a third of transformers' StaticCache; written in place."""
    model = tiny_model(dtype=torch.float16)
    capacity = 4096
    cache = StaticStreamingLLMCache(keep=0.3, max_cache_len=capacity, model=model)
    ids = model.generate(prompt(), max_new_tokens=4, do_sample=False, cache=cache)
    static = StaticCache(config=model.config, max_cache_len=capacity)
    model(prompt(), cache=static, use_cache=True)
    static_bytes = sum(t.numel() * t.element_size() for layer in static.layers for t in (layer.keys, layer.values))
    assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors())
    assert cache.nbytes() <= 0.33 * static_bytes
    assert 0 < cache.used_nbytes() < cache.nbytes()
    addresses = [t.data_ptr() for layer in cache.layers for t in layer.tensors()]
    model.generate(ids, max_new_tokens=2, do_sample=False, cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in layer.tensors()] == addresses  # written in place


def test_bad_use_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        StaticSnapKVCache(max_cache_len=1.5, model=model)
    with pytest.raises(ValueError, match="keep must be a fraction"):
        StaticStreamingLLMCache(keep=0, max_cache_len=16, model=model)
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="sdpa"):
        StaticStreamingLLMCache(max_cache_len=16, model=eager)
    cache = StaticSnapKVCache(keep=0.5, window=2, max_cache_len=12, model=model)
    model(prompt(), cache=cache, use_cache=True)
    before = [t.clone() for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    with pytest.raises(ValueError, match="at most max_cache_len=12"):
        model(prompt(4), cache=cache, use_cache=True)
    after = [t for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(cache.get_seq_length()) == 9
