"""The real SmolLM2-135M-Instruct (embedded default): quality, measured bits, generation.

Marked `real_model`: slower than the unit tests, run in CI all the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv import DeltaKVCache, QuantizedKVCache
from hf_deltakv.eval.perplexity import perplexity, token_windows
from hf_deltakv.eval.texts import load_text

pytestmark = pytest.mark.real_model

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.fixture(scope="module")
def windows(real_model):
    _, tokenizer = real_model
    text = WIKITEXT.read_text() if WIKITEXT.exists() else load_text("python-docs")
    ids = tokenizer(text[:60000], return_tensors="pt").input_ids[0]
    return token_windows(ids, 1024, 2)


def test_default_model_shape(real_model):
    model, _ = real_model
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        30,
        9,
        3,
    )


def test_delta_beats_q4_0_by_four_within_five_bits(real_model, windows):
    model, _ = real_model
    base = perplexity(model, windows, lambda: QuantizedKVCache("f16", "f16"))
    q4 = perplexity(model, windows, lambda: QuantizedKVCache("q4_0", "q4_0"))
    delta = perplexity(model, windows, lambda: DeltaKVCache(kf=32, model=model))
    q4_loss = q4.perplexity / base.perplexity - 1
    delta_loss = delta.perplexity / base.perplexity - 1
    assert q4_loss > 0.03  # the baseline really is lossy: the measurement can fail
    assert delta_loss < q4_loss / 4
    assert delta.bits_per_element <= 5.0


def test_greedy_generation_follows_the_uncompressed_model(real_model):
    model, tokenizer = real_model
    messages = [{"role": "user", "content": "Name three primary colors."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, cache=DynamicCache())
    cache = DeltaKVCache(kf=32, model=model)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    assert torch.equal(out[0, : ids.shape[1] + 4], ref[0, : ids.shape[1] + 4])
    # ~45 tokens: the raw sinks and the group still filling (up to kf - 1 tokens) weigh most here.
    assert cache.nbytes() < 0.6 * cache.fp16_nbytes()
    long_ids = tokenizer(load_text("python-docs")[:6000], return_tensors="pt").input_ids[:, :512]
    long_cache = DeltaKVCache(kf=32, model=model)
    model(long_ids, cache=long_cache)
    assert long_cache.nbytes() < 0.36 * long_cache.fp16_nbytes()  # 4.9 bits/element + sinks


def test_residual_cache_is_under_29_percent_of_fp16_with_less_loss_than_rotated_q4_0(real_model, windows):
    from hf_deltakv import ResidualKVCache

    model, _ = real_model
    reference = perplexity(model, windows, keep_logprobs=True)
    rotated = perplexity(
        model, windows, lambda: QuantizedKVCache("q4_0", "q4_0", rotate=True), reference=reference.logprobs
    )
    residual = perplexity(model, windows, lambda: ResidualKVCache(model=model), reference=reference.logprobs)
    assert rotated.kl_divergence > 0.02  # the baseline really is lossy: the measurement can fail
    assert residual.kl_divergence < rotated.kl_divergence / 2
    assert residual.perplexity / reference.perplexity - 1 < 0.015
    assert residual.bits_per_element <= 0.29 * 16


def test_residual_cache_generates_like_the_uncompressed_model(real_model):
    from hf_deltakv import ResidualKVCache

    model, tokenizer = real_model
    ids = tokenizer(load_text("python-docs")[:3000], return_tensors="pt").input_ids[:, :300]
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, cache=DynamicCache())
    out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=ResidualKVCache(model=model))
    assert torch.equal(out[0, : ids.shape[1] + 3], ref[0, : ids.shape[1] + 3])


def _teacher_forced_logprobs(model, window: torch.Tensor, cache) -> torch.Tensor:
    """Next-token log-probabilities decoding one token at a time (48 tokens after a 512-token prompt)."""
    prompt, follow = window[None, :512], window[None, 512:560]
    out = []
    with torch.no_grad():
        model(prompt, cache=cache)
        for t in range(follow.shape[1]):
            out.append(model(follow[:, t : t + 1], cache=cache).logits[:, -1].float().log_softmax(-1))
    return torch.cat(out)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.fixture(scope="module")
def residual_references(real_model, windows):
    """The uncompressed model's and the residual cache's decoded-history log-probabilities (shared by both decoders)."""
    from hf_deltakv import ResidualKVCache
    from hf_deltakv.layers import StreamLayer

    model, _ = real_model
    uncompressed = _teacher_forced_logprobs(model, windows[0], DynamicCache())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StreamLayer, "sdpa", lambda self, *args: None)  # attention over the decoded history
        decoded = _teacher_forced_logprobs(model, windows[0], ResidualKVCache(model=model))
    return uncompressed, decoded


@pytest.mark.parametrize("decoder", [torch.float32, torch.bfloat16])
def test_residual_decode_attention_adds_little_to_the_caches_own_error(
    real_model, windows, residual_references, decoder, monkeypatch
):
    """Decoding one token at a time through the served attention moves the next-token distribution from the one over
    the decoded history by under a tenth of what the cache itself moves it from the uncompressed model's (KL
    divergences), with the key decoder in fp32 and in bf16."""
    from hf_deltakv import ResidualKVCache
    from hf_deltakv.residual import attention

    model, _ = real_model
    uncompressed, decoded = residual_references
    monkeypatch.setattr(attention, "key_decoder_dtype", lambda device: decoder)
    served = _teacher_forced_logprobs(model, windows[0], ResidualKVCache(model=model))
    assert _kl(uncompressed, decoded) > 1e-3  # the cache is lossy: the comparison can fail
    assert _kl(decoded, served) < _kl(uncompressed, decoded) / 10
