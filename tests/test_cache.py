"""Cache API: update semantics, measured bytes, batch operations, errors."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache

from .conftest import tiny_model

CACHES = {
    "q4_0": lambda **kw: QuantizedKVCache("q4_0", "q4_0", **kw),
    "q8_0-rot": lambda **kw: QuantizedKVCache("q8_0", "q8_0", rotate=True, **kw),
    "kivi": lambda **kw: KIVIKVCache(**kw),
    "delta": lambda **kw: DeltaKVCache(kf=8, **kw),
    "delta-values": lambda **kw: DeltaKVCache(kf=8, keys="token", values="delta", **kw),
}


def kv(tokens: int, batch: int = 2, heads: int = 3, dim: int = 64, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, heads, tokens, dim, generator=g).to(dtype),
        torch.randn(batch, heads, tokens, dim, generator=g).to(dtype),
    )


@pytest.mark.parametrize("name", CACHES)
def test_update_returns_every_token_reconstructed(name):
    cache = CACHES[name]()
    k1, v1 = kv(10)
    keys, values = cache.update(k1, v1, 0)
    assert keys.shape == values.shape == (2, 3, 10, 64)
    k2, v2 = kv(1, seed=1)
    keys, values = cache.update(k2, v2, 0)
    assert keys.shape == (2, 3, 11, 64) and cache.get_seq_length() == 11
    # The token just added is returned as stored (encode first, then decode), not as given.
    assert (keys[:, :, -1] - k2[:, :, 0]).abs().max() < 0.5 * k2.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_returns_input_dtype(dtype):
    cache = DeltaKVCache(kf=8)
    keys, values = cache.update(*kv(9, dtype=dtype), 0)
    assert keys.dtype == values.dtype == dtype


def test_bits_per_element_is_measured():
    cache = DeltaKVCache(kf=32, sink_tokens=0)
    for layer in range(2):
        cache.update(*kv(1024, batch=1), layer)
    assert cache.bits_per_element() == pytest.approx((16 + 4.5) / 2)  # keys wait raw until read (no query yet)
    for layer in cache.layers:
        layer.reconstruct()  # a read codes the complete groups
    # keys: 4-bit codes, fp16 low and step and a 4-bit depth per channel and 32 tokens; values q4_0
    assert cache.bits_per_element() == pytest.approx((4 + 36 / 32 + 4.5) / 2, rel=1e-6)
    assert cache.nbytes() == sum(layer.nbytes() for layer in cache.layers)
    assert cache.layers[0].bits_per_element() == pytest.approx(cache.bits_per_element())
    # The ~3.5-bit point: 2.75-bit keys over groups of 64 tokens, q3_0 values (3 bits + an fp16 scale per 32)
    low = DeltaKVCache(kf=64, key_bits=2.75, values="q3_0", sink_tokens=0)
    low.update(*kv(1024, batch=1), 0)
    low.layers[0].reconstruct()
    assert low.bits_per_element() == pytest.approx((2.75 + 36 / 64 + 3.5) / 2, rel=1e-6)


def test_sink_tokens_are_stored_raw_and_counted():
    cache = QuantizedKVCache("q4_0", "q4_0", sink_tokens=4)
    k, v = kv(20, dtype=torch.bfloat16)
    keys, values = cache.update(k, v, 0)
    assert torch.equal(keys[:, :, :4], k[:, :, :4]) and torch.equal(values[:, :, :4], v[:, :, :4])
    assert cache.nbytes() == 2 * (2 * 3 * 4 * 64 * 2) + 2 * (2 * 3 * 16 * 2 * 18)
    # An fp32 model's sinks are held in fp16.
    cache = QuantizedKVCache("q4_0", "q4_0", sink_tokens=4)
    k, v = kv(20)
    keys, _ = cache.update(k, v, 0)
    torch.testing.assert_close(keys[:, :, :4], k[:, :, :4].half().float())
    assert cache.layers[0].sink_keys.dtype == torch.float16


def test_fp16_format_is_lossless_for_half_inputs():
    cache = QuantizedKVCache("f16", "f16")
    k, v = kv(7, dtype=torch.float16)
    keys, values = cache.update(k, v, 0)
    assert torch.equal(keys, k) and torch.equal(values, v)


@pytest.mark.parametrize("name", CACHES)
def test_reorder_matches_reordered_inputs(name):
    k, v = kv(9, batch=3)
    order = torch.tensor([2, 0, 0])
    a, b = CACHES[name](), CACHES[name]()
    a.update(k, v, 0)
    a.reorder_cache(order)
    b.update(k[order], v[order], 0)
    k2, v2 = kv(2, batch=3, seed=5)
    ka, va = a.update(k2, v2, 0)
    kb, vb = b.update(k2, v2, 0)
    torch.testing.assert_close(ka, kb)
    torch.testing.assert_close(va, vb)


def test_reset_empties_the_cache():
    cache = DeltaKVCache(kf=8)
    cache.update(*kv(9), 0)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0

    token = DeltaKVCache(kf=32, sink_tokens=0, keys="token")
    token.update(*kv(1024, batch=1), 0)
    # keys: 31 q4_0_16 deltas (5 bits) + 1 q8_0 keyframe (8.5) per 32; values q4_0; plus two fp32 state vectors
    # (closed-loop reference, running sum) and four fp16 mean snapshots (at 16, 64, 256, 1024 tokens)
    expected_keys = (31 * 5.0 + 8.5) / 32 + (2 * 32 + 4 * 16) / 1024
    assert token.bits_per_element() == pytest.approx((expected_keys + 4.5) / 2, rel=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kf=0), "kf"),
        (dict(kf=-1), "kf"),
        (dict(kf="32"), "kf"),
        (dict(kf=24), "kf"),
        (dict(key_bits=0.5), "key_bits"),
        (dict(delta_format="q4_0"), "keys='token'"),
        (dict(keys="token", delta_format="q5_k"), "allowed"),
        (dict(keys="token", keyframe_format="fp8"), "allowed"),
        (dict(keys="token", reference="future"), "previous"),
        (dict(keys="token", kf=5000), "kf"),
        (dict(keys="pixel"), "keys"),
        (dict(values="int4"), "values"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(pre_rope=True), "model"),
        (dict(model="llama"), "nn.Module"),
        (dict(rotate="yes"), "rotate"),
        (dict(clip_range=1), "clip_range"),
        (dict(keys="token", clip_range=False), "keys='channel' only"),
        (dict(values="q3_1"), "values"),
        (dict(values=[]), "one entry per layer"),
        (dict(values=["q3_0", "int4"]), "values"),
        (dict(key_bits=[3, 9]), "key_bits"),
        (dict(keys="token", key_bits=[3, 4]), "keys='channel' only"),
        (dict(values=["q3_0", "delta"]), "keys='token'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeltaKVCache(**kwargs)


def test_per_layer_settings_code_each_layer_as_its_entry_says():
    """`key_bits` and `values` as lists: layer i's codecs take entry i (the bytes say so); a list must cover the
    model's layers, and a layer it does not name is refused before anything is stored."""
    cache = DeltaKVCache(kf=8, key_bits=[2, 4], values=["q3_0", "q4_0"])
    alone = [DeltaKVCache(kf=8, key_bits=b, values=v) for b, v in ((2, "q3_0"), (4, "q4_0"))]
    for layer in range(2):
        pair = kv(40, seed=layer)
        cache.update(*pair, layer)
        alone[layer].update(*pair, 0)
        assert cache.layers[layer].nbytes() == alone[layer].layers[0].nbytes()
    assert cache.layers[0].nbytes() < cache.layers[1].nbytes()
    with pytest.raises(ValueError, match="layer 2 has none"):
        cache.update(*kv(40), 2)
    assert len(cache.layers) == 2
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"the model has {layers} layers"):
        DeltaKVCache(values=["q3_0"] * (layers + 1), model=model)
    assert DeltaKVCache(values=("q3_0",) * layers, model=model).options["values"] == ["q3_0"] * layers


def test_bad_tensors():
    cache = DeltaKVCache()
    with pytest.raises(ValueError, match="float"):
        cache.update(torch.ones(1, 1, 2, 32, dtype=torch.int64), torch.ones(1, 1, 2, 32), 0)
    with pytest.raises(ValueError, match="head_dim"):
        cache.update(torch.ones(1, 2, 32), torch.ones(1, 2, 32), 0)
    cache.update(*kv(3), 0)
    with pytest.raises(ValueError, match="do not continue"):
        cache.update(*kv(1, heads=4), 0)
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(*kv(1), -1)
    with pytest.raises(ValueError, match="allowed"):
        QuantizedKVCache("q4_0", "q3")


def test_pre_rope_round_trip_is_exact_with_lossless_storage():
    model = tiny_model("llama")
    cache = QuantizedKVCache("f16", "f16", model=model, pre_rope=True)
    ref = DynamicCache()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True).logits
        expected = model(ids, cache=ref, use_cache=True).logits
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=1e-3)
    assert cache.pre_rope and cache.positions.ids.shape == (1, 12)


def test_unsupported_layer_type_is_named():
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        DeltaKVCache(model=model)
