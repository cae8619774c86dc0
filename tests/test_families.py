"""The family matrix: every cache of the registry on tiny random models of transformers' decoder families.

fp16 storage (pre-RoPE where the model's RoPE is understood) gives DynamicCache's logits; every registry cache runs
greedy generate on a left-padded batch or refuses when it is built; sliding and chunked layers hold less; models whose
cache is not keys and values of every layer are refused when a cache is built.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv import DeltaKVCache, QuantizedKVCache
from hf_deltakv.registry import CACHES, build_cache

from .families import FAMILIES, REFUSED, family_model
from .test_generate import stepwise_logits

# Where pre-RoPE coding does not apply: GPT-2 has no RoPE (absolute positions); DeepSeek-V3's MLA caches the
# compressed latent as "keys" (no position in it) and the RoPE'd part as "values", coded as given.
NO_PRE_ROPE = {"gpt2", "deepseek-v3"}
WINDOWED = {"mistral", "gemma2", "gemma3", "gpt-oss", "llama4", "exaone4"}  # sliding or chunked layers of 8 tokens
_MODELS: dict[str, torch.nn.Module] = {}


def model_of(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # configs' own notes on tiny sizes
            _MODELS[name] = family_model(name)
    return _MODELS[name]


def prompts(batch: int = 2, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: the first sequence starts with 4 pads."""
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_storage_gives_dynamic_cache_logits(family):
    model = model_of(family)
    ids = prompts(1)[0]
    tokens = model.generate(ids, max_new_tokens=6, do_sample=False, cache=DynamicCache(config=model.config))
    tokens = tokens[:, ids.shape[1] :]
    expected = stepwise_logits(model, ids, tokens, DynamicCache(config=model.config))
    cache = QuantizedKVCache("f16", "f16", model=model, pre_rope=None)  # pre-RoPE where understood
    got = stepwise_logits(model, ids, tokens, cache)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert cache.pre_rope == (family not in NO_PRE_ROPE)
    assert DeltaKVCache(kf=32, model=model).pre_rope == (family not in NO_PRE_ROPE)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_registry_cache_generates_or_refuses_when_built(family):
    model = model_of(family)
    ids, mask = prompts()
    for name, entry in CACHES.items():
        if not entry.available():
            continue
        try:
            cache = build_cache(name, model) if name != "dynamic" else DynamicCache(config=model.config)
        except (ValueError, ImportError) as refusal:  # a clear refusal up front (e.g. the residual compressor)
            assert len(str(refusal)) > 20, name
            continue
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=cache)
        assert out.shape == (2, ids.shape[1] + 5), name
        if hasattr(cache, "bits_per_element"):
            assert 0 < cache.bits_per_element() <= 20, name  # fp16 storage + room for appends + positions


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_and_chunked_layers_hold_only_their_window(family):
    """With `model=` a sliding or chunked layer (windows of 8 tokens here) holds a fraction of what the same layer
    holds in a cache not told of the model (which must keep every token); full layers hold the same."""
    model = model_of(family)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    caches = DeltaKVCache(kf=8, model=model, pre_rope=False), DeltaKVCache(kf=8)
    with torch.no_grad():
        for cache in caches:
            model(ids, cache=cache, use_cache=True)
    windowed = [i for i, layer in enumerate(caches[0].layers) if layer.window is not None]
    assert windowed
    for i, (told, blind) in enumerate(zip(caches[0].layers, caches[1].layers, strict=True)):
        if i in windowed:
            assert told.nbytes() < 0.6 * blind.nbytes()
        else:
            assert told.nbytes() == blind.nbytes()


@pytest.mark.parametrize("family", REFUSED)
def test_models_without_a_kv_cache_per_layer_are_refused_when_built(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family_model(family)
    for make in (lambda: DeltaKVCache(model=model), lambda: QuantizedKVCache(model=model)):
        with pytest.raises(ValueError, match=r"Mamba|reuse the keys|cannot hold"):
            make()


def test_a_rope_not_understood_falls_back_with_one_warning(monkeypatch):
    """A model whose keys change with the position in another way is coded after RoPE, with a warning saying why;
    asking for pre-RoPE coding explicitly is refused."""
    from hf_deltakv import rope

    model = family_model("llama")
    monkeypatch.setattr(rope, "_PROBES", {model: rope.RopeProbe(None, "layer 0: not a rotation")})
    with pytest.warns(RuntimeWarning, match=r"coded after RoPE.*not a rotation"):
        cache = DeltaKVCache(model=model)
    assert not cache.pre_rope
    with pytest.raises(ValueError, match="pre_rope=True"):
        DeltaKVCache(model=model, pre_rope=True)
