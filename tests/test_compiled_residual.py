"""Compiled decoding of the learned residual cache (issue 63): `StaticResidualKVCache` holds what `ResidualKVCache`
holds (raw sinks and window, latent codes) in storage preallocated to `max_cache_len` (`residual.static`), one graph
for every decoding step (0 graph breaks, 0 recompiles) crossing several codings of `CODE_BATCH` tokens, the tokens
and bytes of `ResidualKVCache`."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config

from hf_deltakv import ResidualKVCache, StaticResidualKVCache
from hf_deltakv.residual.layer import CODE_BATCH

from .conftest import tiny_compressor, tiny_model
from .test_compiled import NEW, generate, prompt
from .test_compiled_delta import compiles_as_eager, compiles_once, steps_by_hand


def caches(model, max_cache_len: int = 80, **options):
    """The eager cache and a preallocated one of the tiny compressor, without references (sinks 2, window 3)."""
    compressor = tiny_compressor(model)
    options = {"stride": 0, **options}
    return (ResidualKVCache(model=model, compressor=compressor, **options),
            StaticResidualKVCache(model, compressor, max_cache_len=max_cache_len, **options))  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "options"), [(torch.float32, {}), (torch.bfloat16, {"window": 8, "uncompressed_layers": (1,)})]
)
def test_generate_compiles_once_and_decodes_as_residual_kv_cache(dtype, options):
    model = tiny_model(dtype=dtype)
    expected = generate(model, caches(model, **options)[0])
    make = lambda: caches(model, **options)[1]  # noqa: E731
    eager, compiled = compiles_as_eager(model, make, expected, ("latent_append", "latent_attention_step"))
    held = 9 + NEW - 1
    for i, layer in enumerate(compiled.layers):
        tokens, coded = layer.counts.tolist()
        raw = i in options.get("uncompressed_layers", ())
        assert tokens == held and (coded == 0 if raw else coded >= 3 * CODE_BATCH)  # coded by batches while decoding
        assert not layer.codes[:, coded:].any()  # the rest of the capacity untouched
    assert eager.used_nbytes() == compiled.used_nbytes() < compiled.nbytes()


def test_gpu_path_compiles_once_and_decodes_as_eager(monkeypatch):
    """The Triton path under the interpreter (`write_raw`, `encode_latent_into`, `latent_stream_attention`, as on a
    GPU), compiled by inductor around the ops: one graph, the tokens of eager decoding on the same path."""
    import hf_deltakv.kernels

    monkeypatch.setattr(hf_deltakv.kernels, "use_triton", lambda device: True)
    monkeypatch.setattr(hf_deltakv.kernels, "_cpu_extension", lambda device: None)
    model = tiny_model()
    compiles_once(model, caches(model)[1], generate(model, caches(model)[0]))


def state_of(layer) -> dict:
    """What a `ResidualLayer` holds by name."""
    return {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values, "window_keys": layer.window_keys,
            "window_values": layer.window_values, "codes": layer.codes, "scales": layer.scales}  # fmt: skip


def held_by(layer) -> dict:
    """The same of a `PackedResidualLayer`: its storage cut to what it holds."""
    coded, length = int(layer.counts[1]), layer._window_length()
    return {"sink_keys": layer.sink_keys, "sink_values": layer.sink_values,
            "window_keys": layer.window_keys[:, :, :length], "window_values": layer.window_values[:, :, :length],
            "codes": layer.codes[:, :coded], "scales": layer.scales[:, :coded]}  # fmt: skip


@pytest.mark.parametrize("prompt_length", [1, 9])
def test_compiled_step_stores_the_bytes_and_attends_as_residual_kv_cache(prompt_length):
    """Given the same q/k/v, the compiled step (update, then SDPA on what it returns) stores what `ResidualKVCache`
    stores (three codings of `CODE_BATCH` tokens) and attends as it does, bit for bit, from a prompt shorter than
    the sinks (attention over raw tokens until the first coding) or longer."""
    model = tiny_model()
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, steps = 4, 1, 32, 3 * CODE_BATCH + 4
    q = torch.randn(2, heads, prompt_length + steps, dim, generator=g)
    k, v = (torch.randn(2, kv_heads, prompt_length + steps, dim, generator=g) * 2 for _ in range(2))
    grown, static = caches(model, max_cache_len=64)
    grown, layer = grown._new_layer(0), static.layers[0]  # (one layer fed by hand)
    for _ in steps_by_hand(grown, layer, q, k, v, prompt_length):
        pass
    for name, want in state_of(grown).items():
        assert torch.equal(held_by(layer)[name], want), name
    assert int(layer.counts[1]) == grown.compressed >= 2 * CODE_BATCH


def test_a_second_prompt_and_a_crop_continue_as_residual_kv_cache():
    """A conversation's next turn after decoding steps (the eager layer given the stored tokens), a crop within the
    raw window, and a deeper crop refused as `ResidualKVCache` refuses it, the cache left as it was."""
    model = tiny_model()
    grown, static = caches(model, max_cache_len=96, window=8)
    ids = [model.generate(prompt(), max_new_tokens=30, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    turn = torch.cat([ids[0], prompt(7)], dim=1)
    ids = [model.generate(turn, max_new_tokens=12, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)
    for cache in (static, grown):
        cache.crop(-5)
    for a, b in zip(static.layers, grown.layers, strict=True):
        for name, want in state_of(b).items():
            assert torch.equal(held_by(a)[name], want), name
    held = lambda: [t for layer in static.layers for t in (*layer.tensors(), layer.counts)]  # noqa: E731
    before = [t.clone() for t in held()]
    for cache in (static, grown):
        with pytest.raises(ValueError, match="crops only within its raw window"):
            cache.crop(-40)
    assert all(torch.equal(a, b) for a, b in zip(before, held(), strict=True))
    cut = ids[0][:, :-5]
    ids = [model.generate(cut, max_new_tokens=8, do_sample=False, cache=c) for c in (static, grown)]
    assert torch.equal(*ids)


def test_ops_pass_opcheck():
    """`hf_deltakv::latent_append` and `latent_attention_step` (as `test_compiled_delta.test_ops_pass_opcheck`), the
    append on the step that codes `CODE_BATCH` tokens."""
    model = tiny_model()
    cache = caches(model, max_cache_len=48)[1]
    model(prompt(2 + 3 + CODE_BATCH - 1), cache=cache, use_cache=True)  # (sinks, window, one token short of coding)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(9)
    key, value = (torch.randn(2, layer.num_heads, 1, 32, generator=g) for _ in range(2))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    storage = (layer.sink_keys, layer.sink_values, layer.window_keys, layer.window_values, layer.codes, layer.scales,
               layer.positions, layer.freqs, layer.order)  # fmt: skip
    args = (key, value, torch.full((2, 1), 20), *storage, *layer.coder[:4], layer.counts)
    torch.library.opcheck(torch.ops.hf_deltakv.latent_append.default, args, {"bits": layer.bits, "window": 3},
                          test_utils=checks)  # fmt: skip
    assert int(layer.counts[1]) > 0  # (opcheck ran the op: its tokens coded)
    query, mask = torch.randn(2, 4, 1, 32, generator=g), torch.ones(2, 1, 48, dtype=torch.bool)
    args = (query, mask, *storage, *layer.coder, *layer.decoders, layer.counts)
    torch.library.opcheck(torch.ops.hf_deltakv.latent_attention_step.default, args,
                          {"bits": layer.bits, "scale": 32**-0.5}, test_utils=checks)  # fmt: skip


def test_storage_is_preallocated_and_counted():
    model = tiny_model(dtype=torch.float16)
    cache = caches(model, max_cache_len=256)[1]
    ids = model.generate(prompt(), max_new_tokens=4, do_sample=False, cache=cache)
    layer = cache.layers[0]
    assert layer.window_keys.shape[2] == 3 + CODE_BATCH and layer.codes.shape[1] == 256 - 2 - 3
    assert cache.nbytes() == sum(t.nbytes for layer in cache.layers for t in layer.tensors()) + 2 * 256 * 4
    assert 0 < cache.used_nbytes() < cache.nbytes()
    addresses = [t.data_ptr() for layer in cache.layers for t in layer.tensors()]
    model.generate(ids, max_new_tokens=2 * CODE_BATCH, do_sample=False, cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in layer.tensors()] == addresses  # written in place


def test_bad_use_is_refused_and_leaves_the_cache_as_it_was():
    model = tiny_model()
    compressor = tiny_compressor(model)
    with pytest.raises(ValueError, match="without references"):
        StaticResidualKVCache(model, compressor, max_cache_len=16)  # (the tiny compressor's stride is 3)
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        StaticResidualKVCache(model, compressor, stride=0, max_cache_len=0)
    cache = caches(model, max_cache_len=12)[1]
    model(prompt(), cache=cache, use_cache=True)
    before = [t.clone() for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    with pytest.raises(ValueError, match="at most max_cache_len=12"):
        model(prompt(4), cache=cache, use_cache=True)
    after = [t for layer in cache.layers for t in (*layer.tensors(), layer.counts)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
