"""Finite in, finite out: keys and values of any magnitude fp32 holds, in every cache, decode to finite values whose
error stays within the range of what was given (scales and ranges past fp16's ±65504 saturate there)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_deltakv import (
    DeltaKVCache,
    KIVIKVCache,
    QuantizedKVCache,
    ResidualKVCache,
    SnapKVCache,
    StreamingLLMCache,
)

from .conftest import tiny_compressor, tiny_model

CACHES = {
    "fp16": lambda m: QuantizedKVCache("f16", "f16"),
    "q8_0": lambda m: QuantizedKVCache("q8_0", "q8_0"),
    "q4_0-rot": lambda m: QuantizedKVCache("q4_0", "q4_0", rotate=True),
    "q4_1": lambda m: QuantizedKVCache("q4_1", "q4_1"),
    "kivi": lambda m: KIVIKVCache(),
    "kivi-pre-rope": lambda m: KIVIKVCache(model=m, pre_rope=True),
    "delta": lambda m: DeltaKVCache(kf=8, model=m),
    "delta-no-model": lambda m: DeltaKVCache(kf=32, sink_tokens=4),
    "delta-3.5": lambda m: DeltaKVCache(kf=16, key_bits=2.75, values="q3_0"),
    "delta-token": lambda m: DeltaKVCache(kf=8, keys="token", values="delta"),
    "residual": lambda m: ResidualKVCache(model=m, compressor=tiny_compressor(m)),
}
_MODEL = []


def model():
    if not _MODEL:
        _MODEL.append(tiny_model("llama"))
    return _MODEL[0]


@st.composite
def states(draw):
    """Keys or values `[1, 1, tokens, 32]`: normal noise times 10**e per channel (e in -30..30: every channel its own
    magnitude, or all one), some channels offset."""
    tokens = draw(st.integers(9, 40))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    mixed = draw(st.booleans())
    exponents = torch.randint(-30, 31, (32,), generator=g) if mixed else torch.full((32,), draw(st.integers(-30, 30)))
    x = torch.randn(1, 1, tokens, 32, generator=g) * (10.0 ** exponents.double()).float()
    return x + (torch.rand(32, generator=g) < 0.2) * 3 * (10.0 ** exponents.double()).float()


@pytest.mark.parametrize("name", CACHES)
@settings(max_examples=25, deadline=None)
@given(keys=states(), values=states())
def test_finite_in_finite_out(name, keys, values):
    tokens = min(keys.shape[2], values.shape[2])
    keys, values = keys[:, :, :tokens], values[:, :, :tokens]
    cache = CACHES[name](model())
    layers = model().config.num_hidden_layers  # a cache built for a model is fed as its forwards feed it: every layer
    split = tokens // 2
    for part in [slice(0, split)] + [slice(t, t + 1) for t in range(split, tokens)]:  # prefill, then decoding steps
        outputs = [cache.update(keys[:, :, part], values[:, :, part], layer) for layer in range(layers)]
    out_k, out_v = outputs[0]
    for out, given_ in ((out_k, keys), (out_v, values)):
        out = out.float()
        assert torch.isfinite(out).all(), name
        if name == "residual":  # a learned decoder adds the means it was trained with: not scale-free, finite
            continue
        span = (given_.amax() - given_.amin()).double()
        assert (out.double() - given_.double()).abs().max() <= 2 * span, name  # never beyond the given range
        if given_.abs().max() <= 1e4 and given_.abs().max() >= 1e-4:  # within fp16's range: a real quantizer's error
            assert (out - given_).abs().max() <= 0.5 * span, name


EVICTING = {
    "streaming-llm": lambda m: StreamingLLMCache(keep=0.5, model=m),
    "snapkv": lambda m: SnapKVCache(keep=0.5, window=4, model=m),
}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", [*CACHES, *EVICTING])
def test_non_finite_query_gives_nan_rows(name, bad):
    """A query row holding NaN or ±inf attends to NaN, as softmax attention over the uncompressed keys gives (a model
    that overflowed is seen, not served zeros); the other rows are untouched and finite."""
    m = model()
    cache = {**CACHES, **EVICTING}[name](m)
    g = torch.Generator().manual_seed(0)
    heads, dim = m.config.num_key_value_heads, m.config.head_dim
    for part in (40, 1, 1):  # a prefill, then decoding steps: sinks, stored stream and window all hold tokens
        keys, values = (torch.randn(1, heads, part, dim, generator=g) for _ in range(2))
        for layer in range(m.config.num_hidden_layers):
            cache.update(keys, values, layer)
    q_heads = m.config.num_attention_heads
    for n in (1, 3):  # one decoding query (causal), a few at once
        query = torch.randn(1, q_heads, n, dim, generator=g)
        query[0, 1, n - 1, 3] = bad
        out = cache.layers[0].attend(query, None, dim**-0.5)
        broken = torch.zeros(q_heads, n, dtype=torch.bool)
        broken[1, n - 1] = True
        assert torch.isnan(out[0][broken]).all(), (name, n)
        assert torch.isfinite(out[0][~broken]).all(), (name, n)


@pytest.mark.parametrize("path", ["reference", "auto", "triton"])
@pytest.mark.parametrize("name", [*CACHES, *EVICTING])
def test_extreme_magnitudes_decode_finite_on_every_path(name, path, monkeypatch):
    """Keys and values `randn × s` for s in 1e5, 1e-30 and 3.75e37 (near fp32's limit: a rotation's sums of such
    values overflow unless its input saturates first), one prefill of 80 tokens and two decoding steps on a tiny Llama:
    finite out on the reference, the CPU kernels and the GPU path (Triton, interpreted)."""
    monkeypatch.setenv("HF_DELTAKV_KERNELS", path)
    m = model()
    heads, dim = m.config.num_key_value_heads, m.config.head_dim
    for s in (1e5, 1e-30, 3.75e37):
        g = torch.Generator().manual_seed(0)
        cache = {**CACHES, **EVICTING}[name](m)
        for n in (80, 1, 1):
            keys, values = (torch.randn(1, heads, n, dim, generator=g) * s for _ in range(2))
            for layer in range(m.config.num_hidden_layers):
                outputs = cache.update(keys, values, layer)
            query = torch.randn(1, m.config.num_attention_heads, 1, dim, generator=g)
            outputs = [cache.layers[0].attend(query, None, dim**-0.5)[0]]  # (an evicting cache's update is no tensor)
            if name in CACHES:
                outputs += [o.float() for o in cache.update(keys[:, :, :0], values[:, :, :0], 0)]
            bad = [int((~torch.isfinite(o)).sum()) for o in outputs]
            assert not any(bad), (name, path, s, n, bad)
