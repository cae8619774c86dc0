"""Every generate() mode through every cache, on tiny random models of several architectures.

Correctness of the plumbing is checked exactly: with lossless f16 storage and a half-precision model, a cache must
reproduce DynamicCache's generations token for token. Lossy caches must run every mode and stay close.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, ResidualKVCache

from .conftest import ARCHS, tiny_compressor, tiny_model

LOSSY = {
    "q4_0": lambda model: QuantizedKVCache("q4_0", "q4_0"),
    "kivi": lambda model: KIVIKVCache(model=model, pre_rope=True),
    "delta": lambda model: DeltaKVCache(kf=8),
    "delta-pre-rope": lambda model: DeltaKVCache(kf=8, model=model),
    "delta-both": lambda model: DeltaKVCache(kf=8, keys="token", values="delta", model=model),
    "residual": lambda model: ResidualKVCache(model=model, compressor=tiny_compressor(model)),
}


def prompt(batch: int = 1, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, **kwargs):
    return model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache, **kwargs)


def stepwise_logits(model, ids: torch.Tensor, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits `[steps, vocab]` (fp32) of a prefill of `ids` followed by `tokens` fed one at a time through `cache`."""
    with torch.no_grad():
        logits = [model(ids, cache=cache, use_cache=True).logits[:, -1]]
        for t in range(tokens.shape[1]):
            logits.append(model(tokens[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits).float()


# Logit tolerance of f16 storage against DynamicCache: an fp32 model's keys and values are rounded to fp16; a
# half-precision model's are stored exactly, but our attention runs in fp32 where the model's SDPA runs in its dtype.
LOSSLESS_ATOL = {torch.float32: 1e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # q4_0 storage: >= 0.02


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossless_storage_reproduces_dynamic_cache(arch, dtype):
    """f16 storage gives DynamicCache's logits at every decoding step, on the same tokens (greedy token equality
    would test how near-tied logits of a random model round, which differs between CPUs)."""
    model = tiny_model(arch, dtype)
    ids = prompt(length=12)  # longer than Gemma 3's sliding window of 8
    tokens = greedy(model, ids, DynamicCache(config=model.config))[:, ids.shape[1] :]
    expected = stepwise_logits(model, ids, tokens, DynamicCache(config=model.config))
    got = stepwise_logits(model, ids, tokens, QuantizedKVCache("f16", "f16", model=model))
    torch.testing.assert_close(got, expected, atol=LOSSLESS_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", LOSSY)
def test_greedy_every_architecture(arch, name):
    model = tiny_model(arch)
    ids = prompt(length=12)
    cache = LOSSY[name](model)
    out = greedy(model, ids, cache)
    assert out.shape == (1, 20) and torch.equal(out[:, :12], ids)
    assert cache.get_seq_length() == 19  # the last generated token is never fed back
    assert 0 < cache.bits_per_element() < 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    model = tiny_model("llama", dtype)
    cache = DeltaKVCache(kf=8, model=model)
    out = greedy(model, prompt(), cache)
    assert out.shape == (1, 15)
    keys, _ = cache.layers[0].reconstruct()
    assert keys.dtype == dtype


def test_high_precision_delta_tracks_dynamic_cache_logits():
    model = tiny_model("llama")
    ids = prompt(length=40)
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(), use_cache=True).logits
        cache = DeltaKVCache(kf=8, key_bits=8, values="q8_0", model=model)
        got = model(ids, cache=cache, use_cache=True).logits
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.parametrize("name", LOSSY)
def test_sampling(name):
    model = tiny_model("llama")
    torch.manual_seed(0)
    out = model.generate(prompt(), max_new_tokens=6, do_sample=True, top_k=20, cache=LOSSY[name](model))
    assert out.shape == (1, 13)


@pytest.mark.parametrize("name", LOSSY)
def test_beam_search(name):
    model = tiny_model("llama")
    cache = LOSSY[name](model)
    out = model.generate(prompt(), max_new_tokens=6, num_beams=3, do_sample=False, cache=cache)
    assert out.shape == (1, 13)


def test_beam_search_lossless_matches_dynamic_cache():
    model = tiny_model("qwen2", torch.bfloat16)
    ids = prompt(length=9)
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    expected = model.generate(ids, cache=DynamicCache(), **kwargs)
    got = model.generate(ids, cache=QuantizedKVCache("f16", "f16", model=model), **kwargs)
    assert torch.equal(got, expected)


def left_padded_batch():
    a, b = prompt(length=9, seed=1)[0], prompt(length=5, seed=2)[0]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 4:], mask[1, 4:] = b, 1
    return ids, mask


@pytest.mark.parametrize("name", ["f16", *LOSSY])
def test_left_padded_batch_matches_single_prompts(name):
    dtype = torch.bfloat16 if name == "f16" else torch.float32
    model = tiny_model("llama", dtype)
    make = (lambda m: QuantizedKVCache("f16", "f16", model=m, pre_rope=True)) if name == "f16" else LOSSY[name]
    ids, mask = left_padded_batch()
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=make(model))
    assert batched.shape == (2, 14)
    if name == "f16":
        # Lossless storage: fed the same tokens, the padded row predicts what the short prompt predicts alone, to the
        # rounding of the attention's summation order (decoding reads the storage in tiles that start at the padding
        # for one row and at the first real token for the other).
        single = model.generate(ids[1:, 4:], max_new_tokens=5, do_sample=False, cache=make(model))
        assert torch.equal(batched[1, 9:10], single[0, 5:6])
        follow = single[:, 5:]
        padded, alone = make(model), make(model)
        with torch.no_grad():
            got = [model(ids, attention_mask=mask, cache=padded).logits[1:, -1]]
            want = [model(ids[1:, 4:], cache=alone).logits[:, -1]]
            for t in range(follow.shape[1] - 1):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                step = follow[:, t : t + 1]
                got.append(model(step.expand(2, 1), attention_mask=mask, cache=padded).logits[1:, -1])
                want.append(model(step, cache=alone).logits[:, -1])
        torch.testing.assert_close(torch.cat(got).float(), torch.cat(want).float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", LOSSY)
def test_multi_turn_continues_on_the_same_cache(name):
    model = tiny_model("llama")
    cache = LOSSY[name](model)
    first = greedy(model, prompt(), cache)
    follow = torch.cat([first, prompt(length=4, seed=3)], dim=1)
    second = greedy(model, follow, cache)
    assert second.shape == (1, follow.shape[1] + 8) and torch.equal(second[:, : follow.shape[1]], follow)
    assert cache.get_seq_length() == second.shape[1] - 1


def test_chunked_prefill_equals_one_shot_for_closed_loop_codec():
    model = tiny_model("llama")
    ids = prompt(length=30)
    whole, chunked = DeltaKVCache(kf=8, model=model), DeltaKVCache(kf=8, model=model)
    with torch.no_grad():
        ref = model(ids, cache=whole, use_cache=True).logits[:, -1]
        for start in range(0, 30, 7):
            out = model(ids[:, start : start + 7], cache=chunked, use_cache=True).logits[:, -1]
    # Only the attention inputs differ (the chunk attends to the reconstruction, as does the one-shot forward).
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # The first layer's keys are the same inputs coded with the same (causal) query statistics: the same storage
    # (raw tail tokens to the float noise of RoPE tables computed for other position ranges).
    first = whole.layers[0].key_codec, chunked.layers[0].key_codec
    assert all(torch.equal(getattr(first[0], n), getattr(first[1], n)) for n in ("planes", "depths", "low", "step"))
    torch.testing.assert_close(whole.layers[0].reconstruct()[0], chunked.layers[0].reconstruct()[0], atol=1e-4, rtol=0)
    # Later layers' inputs differ by float noise, which may move a bit between channels: within the coding error.
    a, b = whole.layers[1].reconstruct()[0], chunked.layers[1].reconstruct()[0]
    assert (a - b).norm() < 0.05 * a.norm()


def test_cache_keyword_and_past_key_values_agree():
    model = tiny_model("llama")
    ids = prompt()
    a = model.generate(ids, max_new_tokens=5, do_sample=False, cache=DeltaKVCache(kf=8, model=model))
    b = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DeltaKVCache(kf=8, model=model))
    assert torch.equal(a, b)
