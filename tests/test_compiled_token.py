"""Compiled decoding of DeltaKVCache with `keys="token"` (issue 63): keyframes every `kf` tokens and closed-loop
deltas, in storage preallocated to `max_cache_len` (`layers.static.PackedTokenLayer`), one graph for every decoding
step (0 graph breaks, 0 recompiles), the tokens and bytes of `DeltaKVCache(keys="token")`."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from hf_deltakv import DeltaKVCache, StaticDeltaKVCache

from .conftest import tiny_model
from .test_compiled import generate, prompt
from .test_compiled_delta import compiles_as_eager, compiles_once, steps_by_hand

OPTIONS = [
    ({"kf": 8}, torch.float32),  # rotated keys, intra blocks against the mean snapshots (the defaults of "token")
    ({"kf": 16, "rotate": False, "intra": False, "reference": "keyframe"}, torch.bfloat16),
]


@pytest.mark.parametrize(("options", "dtype"), OPTIONS)
def test_generate_compiles_once_and_decodes_as_delta_kv_cache(options, dtype):
    model = tiny_model(dtype=dtype)
    make = lambda: StaticDeltaKVCache(**options, keys="token", max_cache_len=80, model=model)  # noqa: E731
    expected = generate(model, DeltaKVCache(**options, keys="token", model=model))
    eager, compiled = compiles_as_eager(model, make, expected, ("token_append", "token_attention"))
    assert compiled.used_nbytes() == eager.used_nbytes() < compiled.nbytes()


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (`delta_tokens` and the delta attention kernel, as on a GPU)."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    expected = generate(model, DeltaKVCache(kf=16, keys="token", model=model))
    compiles_once(model, StaticDeltaKVCache(kf=16, keys="token", max_cache_len=80, model=model), expected)


def state_of(layer) -> dict:
    """What a `DeltaKVCache(keys="token")` layer holds by name."""
    keys, values = layer.key_codec.inner, layer.value_codec.inner
    return {"sink_keys": layer.sink_keys, "keyframes": keys.keyframes.codes, "keyframe_scales": keys.keyframes.scales,
            "deltas": keys.deltas.codes, "delta_scales": keys.deltas.scales, "means": keys.means,
            "reference": keys.reference_state, "running": keys.running_sum, "values": values.stored.codes,
            "value_scales": values.stored.scales}  # fmt: skip


def held_by(layer) -> dict:
    """The same of a `PackedTokenLayer`: its storage cut to what it holds."""
    stream = int(layer.counts[0]) - layer.sinks
    keyframes, deltas, snapshots = layer._rows(stream)
    return {"sink_keys": layer.sink_keys, "keyframes": layer.keyframes.codes[:, :, :keyframes],
            "keyframe_scales": layer.keyframes.scales[:, :, :keyframes], "deltas": layer.deltas.codes[:, :, :deltas],
            "delta_scales": layer.deltas.scales[:, :, :deltas], "means": layer.means[:, :, :snapshots],
            "reference": layer.state, "running": layer.running, "values": layer.values.codes[:, :, :stream],
            "value_scales": layer.values.scales[:, :, :stream]}  # fmt: skip


def test_compiled_step_stores_the_bytes_and_attends_as_delta_kv_cache():
    """Given the same q/k/v, the compiled step stores what `DeltaKVCache(keys="token")` stores (keyframes, deltas, the
    mean snapshots of 16 and 64 stream tokens, the closed loop's state) and attends as it does, bit for bit."""
    model = tiny_model()
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, steps = 4, 1, 32, 64
    q = torch.randn(2, heads, 9 + steps, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, 9 + steps, dim, generator=g) * 2 for _ in range(2))
    grown = DeltaKVCache(kf=8, keys="token", model=model)._new_layer(0)
    layer = StaticDeltaKVCache(kf=8, keys="token", max_cache_len=80, model=model).layers[0]

    for _ in steps_by_hand(grown, layer, q, k, v, 9):
        pass
    held = held_by(layer)
    for name, want in state_of(grown).items():
        assert torch.equal(held[name], want), name
    assert held["means"].shape[2] == 2


def test_a_second_prompt_and_a_crop_continue_as_delta_kv_cache():
    model = tiny_model()
    static = StaticDeltaKVCache(kf=8, keys="token", max_cache_len=96, model=model)
    grown = DeltaKVCache(kf=8, keys="token", model=model)
    ids = [model.generate(prompt(), max_new_tokens=20, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    turn = torch.cat([ids[0], prompt(7)], dim=1)
    ids = [model.generate(turn, max_new_tokens=12, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    for cache in (static, grown):
        cache.crop(-13)
    for a, b in zip(static.layers, grown.layers, strict=True):
        held = held_by(a)
        for name, want in state_of(b).items():
            assert torch.equal(held[name], want), name
    cut = ids[0][:, :-13]
    ids = [model.generate(cut, max_new_tokens=8, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)


def test_ops_pass_opcheck():
    """`hf_deltakv::token_append` and `token_attention` (as `test_compiled_delta.test_ops_pass_opcheck`)."""
    model = tiny_model()
    cache = StaticDeltaKVCache(kf=8, keys="token", max_cache_len=32, model=model)
    model(prompt(15), cache=cache, use_cache=True)
    layer = cache.layers[0]
    values = layer.values
    g = torch.Generator().manual_seed(7)
    key, value = (torch.randn(2, layer.num_heads, 1, 32, generator=g) for _ in range(2))
    options = {**layer._key_options(), **layer._options()}
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (key, value, torch.full((2, 1), 15), layer.sink_keys, layer.sink_values, *layer._key_args(), layer.state,
            layer.running, values.codes, values.scales, values.mins, layer.positions, layer.freqs, layer.order,
            layer.counts)  # fmt: skip
    torch.library.opcheck(torch.ops.hf_deltakv.token_append.default, args, {**options, "search_scale": True},
                          test_utils=checks)  # fmt: skip
    args = (torch.randn(2, 4, 1, 32, generator=g), torch.ones(2, 1, 32, dtype=torch.bool), layer.sink_keys,
            layer.sink_values, *layer._key_args(), values.codes, values.scales, values.mins, layer.positions,
            layer.freqs, layer.order, layer.counts)  # fmt: skip
    torch.library.opcheck(torch.ops.hf_deltakv.token_attention.default, args, {**options, "scale": 32**-0.5},
                          test_utils=checks)  # fmt: skip


def test_delta_coded_values_are_refused():
    with pytest.raises(ValueError, match="values in a block format"):
        StaticDeltaKVCache(kf=8, keys="token", values="delta", max_cache_len=16, model=tiny_model())
