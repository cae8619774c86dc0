"""Every attention implementation a model can be loaded with, on the caches: `sdpa` is served from the packed storage
silently; `eager` and `flex_attention` read the history decoded, give the same tokens, and are warned about once per
cache (`HistoryDecodedWarning`); `flash_attention_2` (flash-attn is not installed here) is stood in for by an
attention function registered through `AttentionInterface` that reads the tensors as it does (transposed to
`[batch, tokens, heads, dim]`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_deltakv import DeltaKVCache, HistoryDecodedWarning, KIVIKVCache

from .conftest import tiny_config

IDS = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))


def _model(implementation: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation=implementation).eval()
    model.generation_config.pad_token_id = 0
    return model


def _generate(model, cache) -> tuple[torch.Tensor, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(IDS, max_new_tokens=5, do_sample=False, cache=cache)
    return out, [w for w in caught if issubclass(w.category, HistoryDecodedWarning)]


@pytest.fixture(scope="module")
def sdpa_tokens():
    model = _model("sdpa")
    return {name: _generate(model, make(model))[0] for name, make in CACHES.items()}


CACHES = {"delta": lambda model: DeltaKVCache(kf=32, model=model), "kivi": lambda model: KIVIKVCache()}


@pytest.mark.parametrize("name", CACHES)
def test_sdpa_is_served_from_storage_without_a_warning(name, monkeypatch):
    """No decoding step reconstructs the history (attention reads the packed storage), and nothing is warned."""
    model = _model("sdpa")
    cache = CACHES[name](model)
    model(IDS, cache=cache, use_cache=True)  # the prefill
    calls = []
    for layer in cache.layers:
        original = layer.reconstruct
        monkeypatch.setattr(layer, "reconstruct", lambda original=original: calls.append(1) or original())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for token in (5, 6, 7):
            model(torch.tensor([[token]]), cache=cache, use_cache=True)
    assert not calls
    assert not [w for w in caught if issubclass(w.category, HistoryDecodedWarning)]


@pytest.mark.parametrize("name", CACHES)
def test_eager_attention_decodes_and_is_warned_about_once(name, sdpa_tokens):
    model = _model("eager")
    out, warned = _generate(model, CACHES[name](model))
    assert torch.equal(out, sdpa_tokens[name])
    assert len(warned) == 1 and "attn_implementation='sdpa'" in str(warned[0].message)
    _, again = _generate(model, CACHES[name](model))
    assert len(again) == 1  # once per cache: a new cache warns again


def test_flex_attention_is_handed_decoded_tensors_when_the_cache_knows_the_model(sdpa_tokens):
    model = _model("flex_attention")
    out, warned = _generate(model, DeltaKVCache(kf=32, model=model))
    assert torch.equal(out, sdpa_tokens["delta"])
    assert len(warned) == 1 and "flex_attention" in str(warned[0].message)


def test_flex_attention_without_the_model_is_a_clear_error():
    model = _model("flex_attention")
    with pytest.raises(Exception, match="pass the model to the cache"):
        model.generate(IDS, max_new_tokens=2, do_sample=False, cache=DeltaKVCache(kf=32))


def test_a_flash_attention_stand_in_decodes_and_is_warned_about_once(sdpa_tokens):
    """What transformers' flash_attention_2 does with the tensors before flash-attn's kernel: transposed to
    `[batch, tokens, heads, dim]` (then, here, SDPA on the plain tensors instead of flash-attn)."""

    def flash_like(module, query, key, value, attention_mask, **kwargs):
        key, value = key.transpose(1, 2), value.transpose(1, 2)  # as `_flash_attention_forward` receives them
        return sdpa_attention_forward(module, query, key.transpose(1, 2), value.transpose(1, 2), attention_mask,
                                      **kwargs)  # fmt: skip

    AttentionInterface.register("flash_stand_in", flash_like)
    model = _model("sdpa")
    model.config._attn_implementation = "flash_stand_in"  # (set_attn_implementation checks hub kernels)
    out, warned = _generate(model, DeltaKVCache(kf=32, model=model))
    assert torch.equal(out, sdpa_tokens["delta"])
    assert len(warned) == 1 and "transpose" in str(warned[0].message)
