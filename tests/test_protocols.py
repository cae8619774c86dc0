"""Perplexity protocols: chunked teacher forcing scores the same predictions as one forward when nothing is lost,
and exposes caches that hide their loss from a single forward (transformers' QuantizedCache)."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv.eval.perplexity import _window_logprobs, cache_bits, kv_elements, perplexity
from hf_deltakv.quant import nbytes_of
from hf_deltakv.registry import CACHES, build_cache

from .conftest import tiny_model

needs_hqq = pytest.mark.skipif(not CACHES["hf-hqq"].available(), reason="hqq not installed")


def _windows(n=2, ctx=48):
    torch.manual_seed(1)
    return [torch.randint(3, 128, (ctx,)) for _ in range(n)]


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_uncompressed_equals_one_forward(chunk):
    model = tiny_model("llama")
    ids = _windows(1)[0][None]
    with torch.no_grad():
        full = _window_logprobs(model, ids, DynamicCache(), "one-forward", 0, 0)
        chunked = _window_logprobs(model, ids, DynamicCache(), "chunked", 20, chunk)
    assert chunked.shape == (48 - 20, 128)
    torch.testing.assert_close(chunked, full[19:], atol=1e-4, rtol=1e-4)


def test_protocol_arguments_are_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="protocol"):
        perplexity(model, _windows(1), protocol="sliding")
    with pytest.raises(ValueError, match="prefix"):
        perplexity(model, _windows(1), protocol="chunked", prefix=48)


@needs_hqq
def test_hf_quantized_cache_hides_its_loss_from_one_forward_only():
    model = tiny_model("llama")
    wins = _windows()
    ref = {p: perplexity(model, wins, keep_logprobs=True, protocol=p) for p in ("one-forward", "chunked")}
    hf = {
        p: perplexity(
            model,
            wins,
            lambda: build_cache("hf-hqq:residual_length=8,nbits=2", model),
            reference=ref[p].logprobs,
            protocol=p,
            chunk=4,
        )
        for p in ref
    }
    assert abs(hf["one-forward"].kl_divergence) < 1e-6  # the prefill is returned unquantized
    assert hf["chunked"].kl_divergence > 1e-4  # scored tokens attend to quantized history
    assert hf["chunked"].bits_per_element > 3  # 2-bit codes, fp32 scales and zeros, raw window all counted


@needs_hqq
def test_bytes_of_transformers_quantized_cache_are_counted_from_its_tensors():
    model = tiny_model("llama")
    cache = build_cache("hf-hqq:residual_length=4", model)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 64)), cache=cache)
    elements = kv_elements(model.config, 64)
    assert elements == 2 * 2 * 1 * 32 * 64
    bits, nbytes = cache_bits(cache, elements)
    # 4-bit codes plus a scale and a zero point per group of 64, both fp32 in this fp32 model: 5 bits.
    assert bits == pytest.approx(5.0)
    assert nbytes == sum(nbytes_of(vars(layer)) for layer in cache.layers)
