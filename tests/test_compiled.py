"""Compiled decoding (issue 63): a cache with `max_cache_len` compiles under `generate`, as transformers' own CI
compiles `StaticCache` (`CompileConfig(fullgraph=True, dynamic=False)`, `_compile_all_devices`): no graph break
(fullgraph raises on one), one graph for every decoding step (no recompile), the tokens of eager decoding, the bytes
of the cache that grows as needed."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CompileConfig
from transformers.cache_utils import StaticCache

from hf_deltakv import QuantizedKVCache, StaticQuantizedKVCache

from .conftest import tiny_model

NEW = 64  # decoding steps: every one after the first replays the first one's graph


def prompt(length: int = 9) -> torch.Tensor:
    return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(0))


def generate(model, cache, compile_config=None) -> torch.Tensor:
    return model.generate(
        prompt(), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache=cache, compile_config=compile_config
    )


def counting_config(compiles: list) -> CompileConfig:
    """transformers' CI compile config, with a backend that counts the graphs it is handed (then inductor)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(graph, example_inputs):
        compiles.append(graph)
        return compile_fx(graph, example_inputs)

    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    config._compile_all_devices = True  # (on the CPU generate compiles only when asked so)
    return config


@pytest.mark.parametrize(("formats", "rotate", "dtype"), [(("q8_0", "q4_0"), True, torch.float32),
                                                          (("q4_1", "q4_0"), False, torch.bfloat16)])  # fmt: skip
def test_generate_compiles_once_and_decodes_as_eager(formats, rotate, dtype):
    model = tiny_model(dtype=dtype)
    make = lambda: StaticQuantizedKVCache(*formats, rotate=rotate, max_cache_len=80, model=model)  # noqa: E731
    assert make().is_compileable
    expected = generate(model, make())
    if dtype == torch.float32:  # the tokens of the cache that grows (in bf16 its fp32 attention kernel and SDPA over
        # the decoded bf16 history round differently: a near tie may go the other way)
        assert torch.equal(generate(model, QuantizedKVCache(*formats, rotate=rotate)), expected)
    torch._dynamo.reset()
    compiles = []
    compiled = make()
    # (inductor keeps fused bf16 intermediates in fp32 unless told to round as eager does: without this, transformers'
    # own StaticCache decodes other tokens compiled than eager on this tiny bf16 model, measured)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        assert torch.equal(generate(model, compiled, counting_config(compiles)), expected)
    assert len(compiles) == 1  # one graph, compiled at the first decoding step, replayed by the 63 others
    calls = [node.target for node in compiles[0].graph.nodes if node.op == "call_function"]
    assert [str(target) for target in calls].count("hf_deltakv.plain_attention") == len(model.model.layers)  # codes
    assert not any("scaled_dot_product" in str(target) for target in calls)  # (never on a decoded history)
    held = 9 + NEW - 1  # (the last token is not fed back)
    for layer in compiled.layers:
        assert int(layer.cumulative_length) == held
        assert not any(t[:, :, held:].any() for t in layer.tensors())  # the rest of the capacity untouched


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (as on a GPU: the prompt quantized by the Triton append kernel, every
    decoding step's attention by the Triton kernels inside `hf_deltakv::plain_attention`), compiled by inductor
    around the op: one graph, the tokens of eager decoding on the same path."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    make = lambda: StaticQuantizedKVCache("q8_0", "q4_0", rotate=True, max_cache_len=80, model=model)  # noqa: E731
    expected = generate(model, make())
    torch._dynamo.reset()
    compiles = []
    assert torch.equal(generate(model, make(), counting_config(compiles)), expected)
    assert len(compiles) == 1


@pytest.mark.parametrize(("formats", "rotate"), [(("q8_0", "q4_0"), True), (("q4_1", "q3_0"), False)])
def test_compiled_step_stores_the_bytes_of_the_growing_cache(formats, rotate):
    """Given the same keys and values (a model's numerics differ between eager and compiled decoding, and so do the
    keys of later layers), the compiled update writes the bytes `QuantizedKVCache` stores."""
    from hf_deltakv.layers.static import PackedStaticLayer

    g = torch.Generator().manual_seed(1)
    keys = (torch.randn(2, 3, 24, 64, generator=g) * 3).to(torch.bfloat16)
    values = torch.randn(2, 3, 24, 64, generator=g).to(torch.bfloat16)
    grown = QuantizedKVCache(*formats, rotate=rotate)
    layer = PackedStaticLayer(32, *formats, rotate=rotate, packed_attention=False)  # (update returns it decoded)
    grown.update(keys[:, :, :8], values[:, :, :8], 0)
    layer.update(keys[:, :, :8], values[:, :, :8])  # (a prefill: eager, as generate runs it)
    step = torch.compile(layer.update, fullgraph=True, dynamic=False)
    for t in range(8, 24):
        grown.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], 0)
        decoded = step(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    reference = grown.layers[0]
    for stored, codec in zip(layer.stored, (reference.key_codec, reference.value_codec), strict=True):
        for a, b in zip(stored.tensors(), codec.layout().blocks.tensors(), strict=True):
            assert torch.equal(a[:, :, :24], b)
    eager = grown.layers[0].reconstruct()
    for got, want in zip(decoded, eager, strict=True):
        assert torch.equal(got[:, :, :24], want) and not got[:, :, 24:].any()  # decoded as the growing cache decodes


def test_storage_is_preallocated_and_counted():
    model = tiny_model(dtype=torch.float16)
    cache = StaticQuantizedKVCache("q4_0", "q4_0", max_cache_len=64, model=model)
    generate_ids = model.generate(prompt(), max_new_tokens=4, do_sample=False, cache=cache)
    assert generate_ids.shape[1] == 13
    static = StaticCache(config=model.config, max_cache_len=64)
    model(prompt(), cache=static, use_cache=True)
    static_bytes = sum(t.numel() * t.element_size() for layer in static.layers for t in (layer.keys, layer.values))
    assert cache.nbytes() == static_bytes * 18 // 64  # q4_0: 18 bytes per 32 elements, fp16 64
    assert cache.used_nbytes() == cache.nbytes() * 12 // 64
    addresses = [t.data_ptr() for layer in cache.layers for t in layer.tensors()]
    model.generate(generate_ids, max_new_tokens=2, do_sample=False, cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in layer.tensors()] == addresses  # written in place


def test_bad_use_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        StaticQuantizedKVCache(max_cache_len=0, model=model)
    with pytest.raises(ValueError, match="needs the model"):
        StaticQuantizedKVCache(max_cache_len=16, model=None)
    with pytest.raises(ValueError, match="sliding_attention"):
        StaticQuantizedKVCache(max_cache_len=16, model=tiny_model("gemma3"))
    cache = StaticQuantizedKVCache("q8_0", "q8_0", max_cache_len=12, model=model)
    model(prompt(), cache=cache, use_cache=True)
    before = [t.clone() for layer in cache.layers for t in layer.tensors()]
    with pytest.raises(ValueError, match="at most max_cache_len=12"):
        model(prompt(4), cache=cache, use_cache=True)
    assert int(cache.layers[0].cumulative_length) == 9
    after = [t for layer in cache.layers for t in layer.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == sum(t.nbytes for t in before)


@pytest.mark.parametrize(("formats", "rotate"), [(("q8_0", "q4_0"), True), (("q4_1", "f16"), False)])
def test_plain_attention_op_passes_opcheck_and_matches_sdpa_on_the_decoded_history(formats, rotate):
    """`hf_deltakv::plain_attention`: schema, fake implementation and dispatch as `torch.library.opcheck` checks them;
    the result SDPA gives over the decoded slots under the same mask (fp32 sums, 1e-5)."""
    from hf_deltakv.kernels.hadamard import rotate as hadamard
    from hf_deltakv.quant import dequantize, quantize

    g = torch.Generator().manual_seed(2)
    batch, heads, group, n, slots, dim = 2, 2, 3, 1, 40, 64
    query = torch.randn(batch, heads, group, n, dim, generator=g)
    history = [torch.randn(batch, heads, slots, dim, generator=g) for _ in range(2)]
    packed = [quantize(hadamard(x) if rotate else x, fmt) for x, fmt in zip(history, formats, strict=True)]
    mask = torch.rand(batch, n, slots, generator=g) < 0.7
    kwargs = dict(k_format=formats[0], v_format=formats[1], value_dim=dim, rotate=rotate, scale=dim**-0.5)
    args = (query, *[t for q in packed for t in (q.codes, q.scales, q.mins)], mask)
    torch.library.opcheck(torch.ops.hf_deltakv.plain_attention.default, args, kwargs)
    out = torch.ops.hf_deltakv.plain_attention(*args, **kwargs)
    decoded = [hadamard(dequantize(q)) if rotate else dequantize(q) for q in packed]
    rows = query.flatten(2, 3)  # (n = 1: every row of a kv head is query 0 of one of its query heads)
    expected = torch.nn.functional.scaled_dot_product_attention(
        rows, *decoded, attn_mask=mask[:, None], scale=dim**-0.5
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_other_attentions_get_the_decoded_history():
    model = tiny_model()
    model.config._attn_implementation = "eager"
    cache = StaticQuantizedKVCache("q8_0", "q8_0", max_cache_len=24, model=model)
    ids = model.generate(prompt(), max_new_tokens=4, do_sample=False, cache=cache)
    assert ids.shape[1] == 13 and all(layer.packed is None for layer in cache.layers)


@settings(max_examples=12, deadline=None)
@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6), cut=st.integers(0, 4), more=st.integers(1, 4))
def test_updates_and_crops_store_what_the_growing_cache_stores(chunks, cut, more):
    """Any sequence of eager updates, a crop and more updates: the bytes `QuantizedKVCache` holds for the same
    sequence, the crop's slots rewritten by the next tokens."""
    model = tiny_model()
    g = torch.Generator().manual_seed(sum(chunks) + cut)
    static = StaticQuantizedKVCache("q4_0", "q8_0", rotate=True, max_cache_len=40, model=model)
    grown = QuantizedKVCache("q4_0", "q8_0", rotate=True)

    def feed(n):
        keys, values = torch.randn(2, 1, n, 32, generator=g), torch.randn(2, 1, n, 32, generator=g)
        for cache in (static, grown):
            cache.update(keys, values, 0)

    for n in chunks:
        feed(n)
    cut = min(cut, sum(chunks) - 1)
    if cut:
        static.crop(-cut)
        grown.crop(-cut)
    feed(more)
    held = sum(chunks) - cut + more
    assert int(static.layers[0].cumulative_length) == held == grown.get_seq_length()
    reference = grown.layers[0]
    for stored, codec in zip(static.layers[0].stored, (reference.key_codec, reference.value_codec), strict=True):
        for a, b in zip(stored.tensors(), codec.layout().blocks.tensors(), strict=True):
            assert torch.equal(a[:, :, :held], b[:, :, :held])


BEAM_PAIRS = {
    "delta": ("DeltaKVCache", "StaticDeltaKVCache", {"kf": 8, "model": True}),
    "token": ("DeltaKVCache", "StaticDeltaKVCache", {"kf": 8, "keys": "token", "model": True}),
    "kivi": ("KIVIKVCache", "StaticKIVIKVCache", {"model": True}),
    "snapkv": ("SnapKVCache", "StaticSnapKVCache", {"keep": 0.5, "window": 4, "kernel": 3, "model": True}),
    "q4_0": ("QuantizedKVCache", "StaticQuantizedKVCache", {"k_format": "q4_0", "v_format": "q4_0"}),
}


@pytest.mark.parametrize("name", sorted(BEAM_PAIRS))
def test_beam_search_decodes_as_the_eager_cache(name):
    """Beam search over a preallocated cache: `generate` expands the inputs before the prompt (the batch is fixed from
    the first forward on) and reorders the beams in place (`reorder_cache`), the tokens of the eager cache."""
    import hf_deltakv

    model = tiny_model()
    eager_name, static_name, options = BEAM_PAIRS[name]
    options = {k: (model if k == "model" else v) for k, v in options.items()}
    eager = getattr(hf_deltakv, eager_name)(**options)
    static = getattr(hf_deltakv, static_name)(**{**options, "model": model}, max_cache_len=64)
    ids = [model.generate(prompt(), max_new_tokens=40, num_beams=3, do_sample=False, cache=c) for c in (eager, static)]
    assert torch.equal(*ids)


def test_ops_with_host_counters_run_outside_cuda_graphs():
    """Every op of ours that reads host counters (`counts`) is tagged `cudagraph_unsafe` (inductor's partitioning then
    runs it outside the CUDA graphs); `plain_attention`, which keeps no state on the host, and the `_dev` ops, whose
    counters are on the device (`state`), are not."""
    import hf_deltakv.residual.ops  # noqa: F401  (registers the residual cache's ops)
    from hf_deltakv.kernels.ops import DEFINED

    ops = {name: getattr(torch.ops.hf_deltakv, name).default for name in DEFINED}
    assert len(ops) == 14
    for name, op in ops.items():
        host = any(argument.name == "counts" for argument in op._schema.arguments)
        assert (torch.Tag.cudagraph_unsafe in op.tags) == host, name
    assert not ops["plain_attention"].tags and not ops["stream_append_dev"].tags
    assert not ops["adaptive_attention_dev"].tags
