"""Compiled decoding of DeltaKVCache's coding (issue 63): `StaticDeltaKVCache` compiles under `generate` as
transformers' CI compiles `StaticCache` (`CompileConfig(fullgraph=True, dynamic=False)`, `_compile_all_devices`): one
graph for every decoding step (0 graph breaks, 0 recompiles) crossing several key-group codings, the tokens and bytes
of `DeltaKVCache`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F
from transformers.cache_utils import StaticCache

from hf_deltakv import DeltaKVCache, StaticDeltaKVCache
from hf_deltakv.kernels import ops

from .conftest import tiny_model
from .test_compiled import NEW, counting_config, generate, prompt


def graph_ops(graph) -> list[str]:
    return [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]


def compiles_as_eager(model, make, expected: torch.Tensor, ops: tuple[str, ...]):
    """`make()`'s cache decodes `expected` (the eager cache's tokens) through `generate`, not compiled and then compiled
    (`counting_config`; bf16 rounded as eager: see test_compiled): one graph, compiled at the first decoding step and
    replayed by the 63 others, calling each of `ops` (ours) once per layer and no SDPA (attention read from the codes).
    Returns the cache not compiled and the compiled one."""
    eager = make()
    assert eager.is_compileable
    assert torch.equal(generate(model, eager), expected)  # not compiled: the tokens of the eager cache
    torch._dynamo.reset()
    compiles = []
    compiled = make()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        assert torch.equal(generate(model, compiled, counting_config(compiles)), expected)
    assert len(compiles) == 1
    calls = graph_ops(compiles[0])
    layers = len(model.model.layers)
    assert [calls.count(f"hf_deltakv.{op}") for op in ops] == [layers] * len(ops)
    assert not any("scaled_dot_product" in call for call in calls)
    return eager, compiled


def compiles_once(model, cache, expected: torch.Tensor) -> list[str]:
    """`cache` decodes `expected` through a compiled `generate` in one graph (the GPU-path tests); returns its calls."""
    torch._dynamo.reset()
    compiles = []
    assert torch.equal(generate(model, cache, counting_config(compiles)), expected)
    assert len(compiles) == 1
    return graph_ops(compiles[0])


@pytest.mark.parametrize(("kf", "dtype"), [(8, torch.float32), (16, torch.bfloat16)])
def test_generate_compiles_once_and_decodes_as_delta_kv_cache(kf, dtype):
    model = tiny_model(dtype=dtype)
    make = lambda: StaticDeltaKVCache(kf=kf, max_cache_len=80, model=model)  # noqa: E731
    expected = generate(model, DeltaKVCache(kf=kf, model=model))
    eager, compiled = compiles_as_eager(model, make, expected, ("adaptive_attention_cpu", "stream_append_cpu"))
    held = 9 + NEW - 1
    for layer in compiled.layers:
        tokens, coded, observed, _ = layer.counts.tolist()
        assert tokens == observed == held and coded == (held - layer.sinks + layer.pad) // kf >= 2 + 9 // kf
        assert not layer.values.codes[:, :, held - layer.sinks :].any()  # the rest of the capacity untouched
    assert compiled.used_nbytes() == eager.used_nbytes() < compiled.nbytes()


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (the ops dispatch to the Triton kernels as on a GPU), compiled by
    inductor around the ops: one graph calling the ops with device counters once per layer, the tokens of eager
    decoding on the same path."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    expected = generate(model, DeltaKVCache(kf=16, model=model))
    calls = compiles_once(model, StaticDeltaKVCache(kf=16, max_cache_len=80, model=model), expected)
    ours = [calls.count(f"hf_deltakv.{op}_dev") for op in ("stream_append", "adaptive_attention")]
    assert ours == [len(model.model.layers)] * 2, calls


def steps_by_hand(grown, layer, q, k, v, prompt: int):
    """Feed the eager layer `grown` and the preallocated `layer` (its step compiled) the same prompt (the first
    `prompt` of `q`, `k`, `v` `[batch, heads, tokens, dim]`) and then one decoding step per token left, as attention
    reads them (update, then SDPA on what it returns); asserts their outputs equal bit for bit, yields each step's
    position after it."""
    capacity = layer.max_cache_len

    def attend(target, query, key, value, ids, mask):
        keys, values = target.update(key, value, position_ids=ids)
        return F.scaled_dot_product_attention(query, keys, values, mask[..., : keys.shape[2]], enable_gqa=True)

    def inputs(t, n, slots):
        mask = torch.ones(q.shape[0], 1, n, slots, dtype=torch.bool).tril(t)
        return q[:, :, t : t + n], k[:, :, t : t + n], v[:, :, t : t + n], torch.arange(t, t + n)[None], mask

    step = torch.compile(lambda *args: attend(layer, *args), fullgraph=True, dynamic=False)
    assert torch.equal(attend(grown, *inputs(0, prompt, prompt)), attend(layer, *inputs(0, prompt, capacity)))
    for t in range(prompt, q.shape[2]):
        assert torch.equal(step(*inputs(t, 1, capacity)), attend(grown, *inputs(t, 1, t + 1)))
        yield t


def state_of(layer) -> dict:
    """What a `DeltaKVCache` layer holds by name: the sinks, the key codec's groups, tail and query sums, the values."""
    keys, values = layer.key_codec, layer.value_codec.inner
    return {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values, "planes": keys.planes,
            "depths": keys.depths, "low": keys.low, "step": keys.step, "tail": keys.tail, "energy": keys.energy,
            "values": values.stored.codes, "scales": values.stored.scales}  # fmt: skip


def held_by(layer) -> dict:
    """The same of a `PackedDeltaLayer`: its storage cut to what it holds."""
    tokens, coded, _, _ = layer.counts.tolist()
    stream, first = tokens - layer.sinks, coded * layer.group - layer.pad
    return {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values, "planes": layer.planes[:, :, :coded],
            "depths": layer.depths[:, :, :coded], "low": layer.low[:, :, :coded], "step": layer.step[:, :, :coded],
            "tail": layer.tail[:, :, : stream - first], "energy": layer.energy,
            "values": layer.values.codes[:, :, :stream], "scales": layer.values.scales[:, :, :stream]}  # fmt: skip


def test_compiled_step_stores_the_bytes_and_attends_as_delta_kv_cache():
    """Given the same queries, keys and values (a model's numerics differ between eager and compiled decoding), the
    compiled step (update, then SDPA on what it returns) stores what `DeltaKVCache` stores and attends as it does,
    bit for bit, over three key-group codings."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, steps = 4, 1, 32, 40
    q = torch.randn(2, heads, 9 + steps, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, 9 + steps, dim, generator=g) * 2 for _ in range(2))
    grown = DeltaKVCache(kf=16, model=model)._new_layer(0)  # (one layer fed by hand)
    layer = StaticDeltaKVCache(kf=16, max_cache_len=64, model=model).layers[0]

    for _ in steps_by_hand(grown, layer, q, k, v, 9):
        pass
    for name, want in state_of(grown).items():
        assert torch.equal(held_by(layer)[name], want), name
    assert layer.counts.tolist()[1] == 3


def test_cpu_step_ops_are_the_python_ops_in_one_call(monkeypatch):
    """On the CPU a decoding step calls `stream_append_cpu` and `adaptive_attention_cpu` (their C++ kernels,
    `cpu/step_ops.cpp`): a copy of the layer fed the same steps through the Python ops stores the same bytes and
    counters and attends bit for bit (crossing several key-group codings), and the Python bodies run only in the
    steps the kernels hand over (tokens into the sinks; a mask whose rows are strided)."""
    import hf_deltakv.kernels

    model = tiny_model(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, dim, steps = 2, 4, 2, 32, 30
    q = torch.randn(batch, heads, 2 + steps, dim, generator=g).bfloat16()
    k, v = (torch.randn(batch, kv_heads, 2 + steps, dim, generator=g).bfloat16() * 2 for _ in range(2))
    fast, python = (StaticDeltaKVCache(kf=8, max_cache_len=40, model=model).layers[0] for _ in range(2))
    for layer in (fast, python):
        layer.update(k[:, :, :2], v[:, :, :2], position_ids=torch.arange(2)[None])  # (fewer tokens than the sinks)
    assert fast.append_kernel is not None and fast.attention_kernel is not None
    python.append_kernel = python.attention_kernel = None
    calls = []
    for name in ("append_token", "adaptive_step", "to_sinks"):
        module = ops if name == "to_sinks" else hf_deltakv.kernels
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    handed = []
    for t in range(2, 2 + steps):
        visible = torch.arange(80) <= 2 * t if t == 20 else torch.arange(40) <= t
        mask = visible.expand(batch, 1, 1, -1)[..., :: 2 if t == 20 else 1]  # (step 20: every other entry of 80)
        outputs = []
        for layer in (fast, python):
            before = len(calls)
            keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1], position_ids=torch.tensor([[t]]))
            outputs.append(F.scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, mask, enable_gqa=True))
            if layer is fast and len(calls) > before:
                handed.append(t)
        assert torch.equal(*outputs), t
        for a, b in zip([*fast.tensors(), fast.counts, fast.positions, fast.energy, fast.before],
                        [*python.tensors(), python.counts, python.positions, python.energy, python.before],
                        strict=True):  # fmt: skip
            assert torch.equal(a, b), t
    completes = [t for t in range(fast.sinks, 2 + steps) if (t + 1 - fast.sinks + fast.pad) % 8 == 0]  # held: t + 1
    assert handed == [2, 3, 20] and len(completes) >= 3 and fast.counts[ops.CODED] == len(completes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_counter_ops_are_the_host_counter_ops(monkeypatch, dtype):
    """On the GPU path (Triton, under the interpreter) a layer keeps its counters on the device and decodes through
    `stream_append_dev` and `adaptive_attention_dev` (`triton/step.py`): the same launches at every step, none of them
    a host read of the counters. A copy of the layer fed the same steps through the host-counter ops stores the same
    bytes, counters, positions and query sums and attends bit for bit, from a prompt inside the sinks across several
    key-group codings (while every token is a sink, the outputs agree within rounding: the host op's generic softmax);
    the mask's rows strided at one step."""
    import hf_deltakv.kernels
    from hf_deltakv.eval.gpu_path import _replace_run

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model(dtype=dtype)
    g = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, dim, steps = 2, 4, 2, 32, 20
    q = torch.randn(batch, heads, 2 + steps, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, 2 + steps, dim, generator=g).to(dtype) * 2 for _ in range(2))
    device, host = (StaticDeltaKVCache(kf=8, max_cache_len=40, model=model).layers[0] for _ in range(2))
    for layer in (device, host):
        layer.update(k[:, :, :2], v[:, :, :2], position_ids=torch.arange(2)[None])  # (fewer tokens than the sinks)
    assert device.device_step and device.append_kernel is None and device.attention_kernel is None
    host.device_step = False
    launches, per_step = [], []
    stack = contextlib.ExitStack()
    _replace_run(stack, lambda run: lambda fn, *a, **kw: launches.append(fn.__name__) or run(fn, *a, **kw))
    for t in range(2, 2 + steps):
        visible = torch.arange(80) <= 2 * t if t == 20 else torch.arange(40) <= t
        mask = visible.expand(batch, 1, 1, -1)[..., :: 2 if t == 20 else 1]  # (step 20: every other entry of 80)
        outputs = []
        for layer in (device, host):
            launches.clear()
            keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1], position_ids=torch.tensor([[t]]))
            outputs.append(F.scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, mask, enable_gqa=True))
            if layer is device:
                per_step.append(tuple(launches))
        if t < device.sinks:  # (sinks only: the host op's generic softmax, the device op's merge kernel)
            torch.testing.assert_close(*outputs)
        else:
            assert torch.equal(*outputs), t
        for a, b in zip([*device.tensors(), device.counts, device.positions, device.energy, device.before],
                        [*host.tensors(), host.counts, host.positions, host.energy, host.before],
                        strict=True):  # fmt: skip
            assert torch.equal(a, b), t
    stack.close()
    assert len(set(per_step)) == 1 and len(per_step[0]) == 8, set(per_step)  # (3 launches to append, 5 to attend)
    completes = [t for t in range(device.sinks, 2 + steps) if (t + 1 - device.sinks + device.pad) % 8 == 0]
    assert len(completes) >= 2 and device.counts[ops.CODED] == len(completes)


def test_a_second_prompt_and_a_crop_continue_as_delta_kv_cache():
    """A conversation's next turn after decoding steps (the eager layer given the stored tokens), and a crop."""
    model = tiny_model()
    static, grown = StaticDeltaKVCache(kf=8, max_cache_len=96, model=model), DeltaKVCache(kf=8, model=model)
    ids = [model.generate(prompt(), max_new_tokens=20, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    turn = torch.cat([ids[0], prompt(7)], dim=1)
    ids = [model.generate(turn, max_new_tokens=12, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    for cache in (static, grown):
        cache.crop(-13)  # (into a coded group: its kept tokens back to the raw tail)
    for a, b in zip(static.layers, grown.layers, strict=True):
        for name, want in state_of(b).items():
            assert torch.equal(held_by(a)[name], want), name
    cut = ids[0][:, :-13]
    ids = [model.generate(cut, max_new_tokens=8, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)


def test_ops_pass_opcheck():
    """`hf_deltakv::stream_append` and `adaptive_attention` (and their `_cpu` forms, the C++ kernels): schema (the
    mutated arguments), fake implementation and dispatch as `torch.library.opcheck` checks them, on a layer's storage
    after a prompt (not the AOT-autograd check, which differentiates: decoding is inference; the compiled tests trace
    the ops through AOT dispatch)."""
    model = tiny_model()
    cache = StaticDeltaKVCache(kf=8, max_cache_len=32, model=model)
    model(prompt(15), cache=cache, use_cache=True)
    layer = cache.layers[0]
    values = layer.values
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 2, 1, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
    layer_args = (layer.sink_keys, layer.sink_values, layer.tail, values.codes, values.scales, values.mins,
                  layer.positions, layer.freqs, layer.order, layer.counts)  # fmt: skip
    key, value = key[:, : layer.num_heads], value[:, : layer.num_heads]
    options = dict(group=8, pad=layer.pad, v_format=layer.v_format, search_scale=True, rotation=32)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for name, kernel in (("stream_append", {}), ("stream_append_cpu", layer.append_kernel)):
        torch.library.opcheck(getattr(torch.ops.hf_deltakv, name).default, (key, value, torch.full((2, 1), 15),
                              *layer_args), {**options, **kernel}, test_utils=checks)  # fmt: skip
    query = torch.randn(2, 4, 1, 32, generator=g)
    mask = torch.ones(2, 1, 32, dtype=torch.bool)
    args = (query, mask, layer.sink_keys, layer.sink_values, layer.planes, layer.depths, layer.low, layer.step,
            layer.tail, values.codes, values.scales, values.mins, layer.positions, layer.freqs, layer.order,
            layer.energy, layer.before, layer.counts)  # fmt: skip
    options = dict(pad=layer.pad, total_bits=layer.total_bits, clip_range=True, query_weights=True,
                   v_format=layer.v_format, rotation=32, scale=32**-0.5)  # fmt: skip
    for name, kernel in (("adaptive_attention", {}), ("adaptive_attention_cpu", layer.attention_kernel)):
        torch.library.opcheck(getattr(torch.ops.hf_deltakv, name).default, args, {**options, **kernel},
                              test_utils=checks)  # fmt: skip


def test_storage_is_preallocated_and_counted():
    """Every byte counted; at the same max_cache_len and fp16, at most 0.33x transformers' StaticCache (keys ~4 bits
    plus their groups' ranges, values q4_0: 18 bytes per 32; the sinks and one group raw, the positions)."""
    model = tiny_model(dtype=torch.float16)
    capacity = 4096
    cache = StaticDeltaKVCache(kf=32, max_cache_len=capacity, model=model)
    ids = model.generate(prompt(), max_new_tokens=4, do_sample=False, cache=cache)
    static = StaticCache(config=model.config, max_cache_len=capacity)
    model(prompt(), cache=static, use_cache=True)
    static_bytes = sum(t.numel() * t.element_size() for layer in static.layers for t in (layer.keys, layer.values))
    assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors()) + 2 * capacity * 4
    assert cache.nbytes() <= 0.33 * static_bytes
    assert 0 < cache.used_nbytes() < cache.nbytes()
    addresses = [t.data_ptr() for layer in cache.layers for t in layer.tensors()]
    model.generate(ids, max_new_tokens=2, do_sample=False, cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in layer.tensors()] == addresses  # written in place


def test_bad_use_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        StaticDeltaKVCache(max_cache_len=-1, model=model)
    with pytest.raises(ValueError, match="sliding_attention"):
        StaticDeltaKVCache(max_cache_len=16, model=tiny_model("gemma3"))
    eager = tiny_model()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="sdpa"):
        StaticDeltaKVCache(max_cache_len=16, model=eager)
    cache = StaticDeltaKVCache(kf=8, max_cache_len=12, model=model)
    model(prompt(), cache=cache, use_cache=True)
    before = [t.clone() for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    with pytest.raises(ValueError, match="at most max_cache_len=12"):
        model(prompt(4), cache=cache, use_cache=True)
    after = [t for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(cache.get_seq_length()) == 9 and cache.layers[0].counts[ops.TOKENS] == 9
    cache.reset()
    assert int(cache.get_seq_length()) == 0


def test_device_counter_ops_pass_opcheck(monkeypatch):
    """`stream_append_dev` and `adaptive_attention_dev` (on the Triton path, under the interpreter): schema (the
    mutated arguments, the counters among them), fake implementation and dispatch, as `test_ops_pass_opcheck`."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    cache = StaticDeltaKVCache(kf=8, max_cache_len=32, model=model)
    model(prompt(15), cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.device_step
    values = layer.values
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(2, layer.num_heads, 1, 32, generator=g) for _ in range(2))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.hf_deltakv.stream_append_dev.default, (key, value, torch.full((2, 1), 15),
                          layer.sink_keys, layer.sink_values, layer.tail, values.codes, values.scales, values.mins,
                          layer.positions, layer.freqs, layer.order, layer.counts),
                          dict(group=8, pad=layer.pad, v_format=layer.v_format, search_scale=True, rotation=32),
                          test_utils=checks)  # fmt: skip
    args = (torch.randn(2, 4, 1, 32, generator=g), torch.ones(2, 1, 32, dtype=torch.bool), layer.sink_keys,
            layer.sink_values, layer.planes, layer.depths, layer.low, layer.step, layer.tail, values.codes,
            values.scales, values.mins, layer.positions, layer.freqs, layer.order, layer.energy, layer.before,
            layer.counts)  # fmt: skip
    options = dict(pad=layer.pad, total_bits=layer.total_bits, clip_range=True, query_weights=True,
                   v_format=layer.v_format, rotation=32, scale=32**-0.5)  # fmt: skip
    torch.library.opcheck(torch.ops.hf_deltakv.adaptive_attention_dev.default, args, options, test_utils=checks)
