"""Defaults must hold where per-token 4-bit collapses: keys with huge outlier channels (as in Qwen2).

Synthetic keys: N(0, 1) channels plus two channels with an offset of 80 (a Qwen2-like outlier), rotated by a real
RoPE. Per-token q4_0 puts its step near 10 and erases the small channels; the default DeltaKVCache must keep them.
"""

from __future__ import annotations

import pytest
import torch

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache
from hf_deltakv.rope import probe_rope

from .conftest import tiny_model

TOKENS = 256


@pytest.fixture(scope="module")
def outlier_keys():
    model = tiny_model("qwen2")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(1, 1, TOKENS, head_dim, generator=g)
    pre[..., 3] += 80.0
    pre[..., 3 + head_dim // 2] -= 60.0
    positions = torch.arange(TOKENS).unsqueeze(0)
    rope = probe_rope(model).forms[0]
    return model, rope.redo(pre, positions), positions


def small_channel_error(cache, keys, positions) -> float:
    values = torch.randn_like(keys)
    out, _ = cache.update(keys, values, 0, position_ids=positions)
    return (out - keys).pow(2).mean().sqrt().item()


def test_per_token_q4_0_collapses_and_delta_holds(outlier_keys):
    model, keys, positions = outlier_keys
    q4 = small_channel_error(QuantizedKVCache("q4_0", "q4_0"), keys, positions)
    q4_rot = small_channel_error(QuantizedKVCache("q4_0", "q4_0", rotate=True), keys, positions)
    delta = small_channel_error(DeltaKVCache(kf=32, model=model), keys, positions)
    delta_no_model = small_channel_error(DeltaKVCache(kf=32), keys, positions)
    kivi = small_channel_error(KIVIKVCache(model=model, pre_rope=True), keys, positions)
    # Per-token 4-bit erases the unit-variance channels (error ~ their own size), rotated or not.
    assert q4 > 0.8 and q4_rot > 0.8
    # The default keeps them: the outliers are a per-channel offset, which the mean reference removes.
    assert delta < 0.1 * q4
    assert delta <= 1.5 * kivi
    # Without the model (keys coded after RoPE) the outliers spin, but deltas still track them.
    assert delta_no_model < 0.25 * q4
