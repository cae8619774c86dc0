"""A forward interrupted midway loses nothing, and a copied prefix serves several continuations: for every cache.

An exception raised inside the model after some layers have updated (Ctrl-C in a notebook during `generate`) leaves
every layer as it was before that forward, so `generate` can go on with the same cache and gives the tokens of an
uninterrupted run. A cache copied (`copy.deepcopy`) after a shared prefix answers each question as a cache that saw
the same prefix, and the original is left as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, ResidualKVCache, SnapKVCache, StreamingLLMCache

from .conftest import tiny_compressor, tiny_model
from .test_bytes import held_bytes

# Caches told of the model know its layer count: an interrupted first forward (the prefill) is undone too.
WITH_MODEL = {
    "fp16": lambda m: QuantizedKVCache("f16", "f16", model=m),
    "q4_0-rot": lambda m: QuantizedKVCache("q4_0", "q4_0", rotate=True, model=m),
    "kivi-pre-rope": lambda m: KIVIKVCache(model=m, pre_rope=True),
    "delta": lambda m: DeltaKVCache(kf=8, model=m),
    "delta-3.5": lambda m: DeltaKVCache(kf=16, key_bits=2.75, values="q3_0", model=m),
    "delta-token": lambda m: DeltaKVCache(kf=8, keys="token", values="delta", model=m),
    "residual": lambda m: ResidualKVCache(model=m, compressor=tiny_compressor(m)),
    "streaming-llm": lambda m: StreamingLLMCache(keep=0.5, model=m),
    "snapkv": lambda m: SnapKVCache(keep=0.5, window=4, model=m),
}
WITHOUT_MODEL = {
    "q4_0": lambda m: QuantizedKVCache("q4_0", "q4_0"),
    "kivi": lambda m: KIVIKVCache(),
    "delta-no-model": lambda m: DeltaKVCache(kf=8),
}
CACHES = {**WITH_MODEL, **WITHOUT_MODEL}


class Interrupted(KeyboardInterrupt):
    pass


def interrupt_in_layer(model, layer: int):
    """A hook that raises when the model reaches `layer` (the layers before it have updated the cache)."""

    def stop(module, args, kwargs):
        raise Interrupted

    return model.model.layers[layer].register_forward_pre_hook(stop, with_kwargs=True)


def greedy(model, ids, cache, new: int = 5):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache=cache)


def prompt(length: int = 21, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", CACHES)
def test_an_interrupted_decoding_step_is_undone(name, arch):
    if name == "residual" and arch == "gemma3":
        pytest.skip("the tiny residual compressor is fitted for llama")
    model = tiny_model(arch)
    cache = CACHES[name](model)
    reference = CACHES[name](model)
    first = greedy(model, prompt(), cache)
    assert torch.equal(first, greedy(model, prompt(), reference))
    before = [(layer.nbytes(), layer.cumulative_length) for layer in cache.layers]
    handle = interrupt_in_layer(model, 1)
    with pytest.raises(Interrupted), torch.no_grad():
        model(first[:, -1:], cache=cache, use_cache=True)
    handle.remove()
    with pytest.warns(RuntimeWarning, match="did not reach every layer"):
        assert cache.get_seq_length() == first.shape[1] - 1
    assert [(layer.nbytes(), layer.cumulative_length) for layer in cache.layers] == before
    assert cache.nbytes() == held_bytes(cache)  # nothing the interrupted forward grew is left behind
    assert torch.equal(greedy(model, first, cache), greedy(model, first, reference))


@pytest.mark.parametrize("name", WITH_MODEL)
def test_an_interrupted_prefill_is_undone_when_the_cache_knows_the_model(name):
    model = tiny_model("llama")
    cache = CACHES[name](model)
    handle = interrupt_in_layer(model, 1)
    with pytest.raises(Interrupted):
        greedy(model, prompt(), cache)
    handle.remove()
    with pytest.warns(RuntimeWarning, match="back to its state before that forward"):
        assert cache.get_seq_length() == 0
    assert torch.equal(greedy(model, prompt(), cache), greedy(model, prompt(), CACHES[name](model)))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", CACHES)
def test_a_copied_prefix_answers_each_question_as_a_fresh_cache(name, arch):
    """A shared prefix encoded once, `copy.deepcopy` per question: the tokens of a cache that saw the same forwards,
    and the prefix's cache unchanged by its copies."""
    if name == "residual" and arch == "gemma3":
        pytest.skip("the tiny residual compressor is fitted for llama")
    model = tiny_model(arch)
    prefix = prompt(30)
    shared = CACHES[name](model)
    with torch.no_grad():
        model(prefix, cache=shared, use_cache=True)
    held = shared.nbytes()
    for seed in (1, 2):
        question = torch.cat([prefix, prompt(6, seed)], dim=1)
        fresh = CACHES[name](model)
        with torch.no_grad():
            model(prefix, cache=fresh, use_cache=True)
        assert torch.equal(greedy(model, question, copy.deepcopy(shared)), greedy(model, question, fresh))
    assert shared.nbytes() == held and shared.get_seq_length() == prefix.shape[1]
