"""Compiled decoding of KIVI-style caches (issue 63): `StaticKIVIKVCache` compiles under `generate` as transformers'
CI compiles `StaticCache` (`CompileConfig(fullgraph=True, dynamic=False)`, `_compile_all_devices`): one graph for every
decoding step (0 graph breaks, 0 recompiles) crossing two key-group codings, the tokens and bytes of `KIVIKVCache`."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from hf_deltakv import KIVIKVCache, StaticKIVIKVCache

from .conftest import tiny_model
from .test_compiled import NEW, generate, prompt
from .test_compiled_delta import compiles_as_eager, compiles_once, steps_by_hand

KIVI_OPTIONS = [
    ({}, torch.float32),  # KIVI: keys after RoPE, no sinks
    ({"pre_rope": True, "sink_tokens": 4}, torch.bfloat16),
    ({"k_format": "q8_0", "v_format": "q4_0", "pre_rope": True}, torch.float32),
]


@pytest.mark.parametrize(("options", "dtype"), KIVI_OPTIONS)
def test_generate_compiles_once_and_decodes_as_kivi(options, dtype):
    model = tiny_model(dtype=dtype)
    make = lambda: StaticKIVIKVCache(**options, max_cache_len=80, model=model)  # noqa: E731
    expected = generate(model, KIVIKVCache(**options, model=model))
    eager, compiled = compiles_as_eager(model, make, expected, ("channel_attention", "stream_append_cpu"))
    held = 9 + NEW - 1
    for layer in compiled.layers:
        tokens, coded = layer.counts.tolist()[:2]
        assert tokens == held and coded == (held - layer.sinks) // 32 == 2  # (the prompt coded none)
    assert compiled.used_nbytes() == eager.used_nbytes() < compiled.nbytes()


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (the ops dispatch to the Triton kernels as on a GPU): one graph, the
    tokens of eager decoding on the same path."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    expected = generate(model, KIVIKVCache(pre_rope=True, model=model))
    compiles_once(model, StaticKIVIKVCache(pre_rope=True, max_cache_len=80, model=model), expected)


def state_of(layer) -> dict:
    """What a `KIVIKVCache` layer holds by name: the sinks, the key groups and raw tail, the values."""
    keys, values = layer.key_codec, layer.value_codec
    sinks = {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values} if layer.sink_tokens else {}
    groups = {} if keys.groups is None else {"codes": keys.groups.codes, "scales": keys.groups.scales,
                                             "mins": keys.groups.mins}  # fmt: skip
    return {**sinks, **groups, "tail": keys.tail, "values": values.stored.codes, "v_scales": values.stored.scales}


def held_by(layer) -> dict:
    """The same of a `PackedChannelLayer`: its storage cut to what it holds."""
    tokens, coded = layer.counts.tolist()[:2]
    stream = tokens - layer.sinks
    groups = layer.groups.map(lambda t: t[:, :, :coded])
    return {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values, "codes": groups.codes,
            "scales": groups.scales, "mins": groups.mins, "tail": layer.tail[:, :, : stream - coded * 32],
            "values": layer.values.codes[:, :, :stream], "v_scales": layer.values.scales[:, :, :stream]}  # fmt: skip


def assert_holds(static, eager) -> None:
    """The `PackedChannelLayer` `static` holds what the `KIVIKVCache` layer `eager` holds (no coded group when it has
    none)."""
    want, held = state_of(eager), held_by(static)
    assert "codes" in want or not static.counts[1]
    for name, tensor in want.items():
        assert torch.equal(held[name], tensor), name


def test_compiled_step_stores_the_bytes_and_attends_as_kivi():
    """Given the same queries, keys and values, the compiled step (update, then SDPA on what it returns) stores what
    `KIVIKVCache` stores and attends as it does, bit for bit, over two key-group codings (keys before RoPE, sinks)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, steps = 4, 1, 32, 64
    q = torch.randn(2, heads, 9 + steps, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, 9 + steps, dim, generator=g) * 2 for _ in range(2))
    options = {"sink_tokens": 4, "pre_rope": True, "model": model}
    grown = KIVIKVCache(**options)._new_layer(0)  # (one layer fed by hand)
    layer = StaticKIVIKVCache(**options, max_cache_len=80).layers[0]

    for _ in steps_by_hand(grown, layer, q, k, v, 9):
        pass
    assert_holds(layer, grown)
    assert layer.counts.tolist()[1] == 2


def test_a_second_prompt_and_a_crop_continue_as_kivi():
    """A conversation's next turn after decoding steps (the eager layer given the stored tokens), and a crop into a
    coded group (its kept tokens back to the raw tail)."""
    model = tiny_model()
    static, grown = StaticKIVIKVCache(max_cache_len=96, model=model), KIVIKVCache(model=model)
    ids = [model.generate(prompt(), max_new_tokens=30, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    turn = torch.cat([ids[0], prompt(7)], dim=1)
    ids = [model.generate(turn, max_new_tokens=12, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    for cache in (static, grown):
        cache.crop(-30)  # (57 tokens held, one group coded: the cut goes into it)
    for a, b in zip(static.layers, grown.layers, strict=True):
        assert_holds(a, b)
    cut = ids[0][:, :-30]
    ids = [model.generate(cut, max_new_tokens=8, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)


def test_channel_attention_passes_opcheck():
    """`hf_deltakv::channel_attention`: schema (the mutated arguments), fake implementation and dispatch as
    `torch.library.opcheck` checks them (as `test_compiled_delta.test_ops_pass_opcheck`), on the step that codes a
    group and on one that does not."""
    model = tiny_model()
    cache = StaticKIVIKVCache(sink_tokens=2, pre_rope=True, max_cache_len=48, model=model)
    model(prompt(33), cache=cache, use_cache=True)  # 31 stream tokens: the next one completes the first group
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(2, layer.num_heads, 1, 32, generator=g) for _ in range(2))
    keys, values = layer.groups, layer.values
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for _ in range(2):
        layer.update(key, value, position_ids=layer.counts[:1].expand(2, 1).clone())
        args = (torch.randn(2, 4, 1, 32, generator=g), torch.ones(2, 1, 48, dtype=torch.bool), layer.sink_keys,
                layer.sink_values, keys.codes, keys.scales, keys.mins, layer.tail, values.codes, values.scales,
                values.mins, layer.positions, layer.freqs, layer.order, layer.counts)  # fmt: skip
        options = dict(k_format="q4_1", v_format="q4_1", rotation=0, scale=32**-0.5)
        torch.library.opcheck(torch.ops.hf_deltakv.channel_attention.default, args, options, test_utils=checks)
        torch.ops.hf_deltakv.channel_attention(*args, **options)  # (opcheck runs on copies: the step itself)
    assert layer.counts.tolist()[:2] == [35, 1]


def test_bad_use_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        StaticKIVIKVCache(max_cache_len=0, model=model)
    with pytest.raises(ValueError, match="sliding_attention"):
        StaticKIVIKVCache(max_cache_len=16, model=tiny_model("gemma3"))
    with pytest.raises(ValueError, match="f16"):
        StaticKIVIKVCache("f16", max_cache_len=16, model=model)
    cache = StaticKIVIKVCache(max_cache_len=12, model=model)
    model(prompt(), cache=cache, use_cache=True)
    before = [t.clone() for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    with pytest.raises(ValueError, match="at most max_cache_len=12"):
        model(prompt(4), cache=cache, use_cache=True)
    after = [t for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(cache.get_seq_length()) == 9
