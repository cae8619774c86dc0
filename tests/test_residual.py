"""ResidualKVCache: packed codes, causal references, exact raw tokens, checkpoints, refusals, training, and its CPU
kernels (encode, decode, attention with values in latent space) against their references."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_deltakv import ResidualKVCache, kernels
from hf_deltakv.kernels import reference
from hf_deltakv.quant.bitpack import BIT_DEPTHS, GROUP, dequantize_group, pack_bits, quantize_group, unpack_bits
from hf_deltakv.residual import ResidualLayout, load_compressor, save_compressor
from hf_deltakv.residual import attention as residual_attention
from hf_deltakv.residual.layer import CODE_BATCH
from hf_deltakv.residual.references import nearest_references
from hf_deltakv.residual.train import TrainConfig, train_residual
from hf_deltakv.residual.window import code_window

from .conftest import rope_angles, tiny_compressor, tiny_model


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from(BIT_DEPTHS), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_bit_packing_round_trips_and_error_is_half_a_step(bits, rows, seed):
    x = torch.randn(rows, GROUP, generator=torch.Generator().manual_seed(seed)) * (seed % 7 + 0.1)
    codes, scales = quantize_group(x, bits)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, GROUP * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes.to(torch.int32))
    error = (dequantize_group(unpack_bits(packed, bits), scales, bits) - x).abs()
    assert (error <= scales.float().unsqueeze(-1) * 0.5 + 1e-3 * x.abs().amax()).all()


def test_bad_bit_depth_is_refused():
    with pytest.raises(ValueError, match="bit depth"):
        pack_bits(torch.zeros(GROUP, dtype=torch.uint8), 7)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), stride=st.integers(1, 6), k=st.integers(1, 4), seed=st.integers(0, 1000))
def test_references_are_never_from_the_future(n, stride, k, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.arange(n)
    ref_index = index[index % stride == 0]
    x = torch.randn(1, n, 8, generator=g)
    ids = nearest_references(x, index, x[:, ref_index], ref_index, k)
    chosen = torch.where(ids >= 0, ref_index[ids.clamp_min(0)], -1)
    assert (chosen <= index.view(1, -1, 1)).all()
    assert (ids[..., 0] >= 0).all()  # stream index 0 is a reference, so every token has one


def _feed(model, ids, cache):
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache


def test_coded_tokens_do_not_depend_on_later_tokens():
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    short = _feed(model, ids[:, :25], ResidualKVCache(model=model, compressor=compressor))
    long = _feed(model, ids, ResidualKVCache(model=model, compressor=compressor))
    coded = short.layers[1].compressed + short.sink_tokens
    for a, b in zip(short.layers[1].reconstruct(), long.layers[1].reconstruct(), strict=True):
        torch.testing.assert_close(a[:, :, :coded], b[:, :, :coded])


def test_token_by_token_equals_one_shot():
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    steps = ResidualKVCache(model=model, compressor=compressor)
    # decoding codes CODE_BATCH tokens at a time: at this length both have coded the same tokens
    total = steps.sink_tokens + steps.layout.window + 2 * CODE_BATCH
    ids = torch.randint(3, 128, (1, total), generator=torch.Generator().manual_seed(6))
    whole = _feed(model, ids, ResidualKVCache(model=model, compressor=compressor))
    raw = []
    for t in range(total):
        _feed(model, ids[:, t : t + 1], steps)
        raw.append(steps.layers[0].window_keys.shape[2] if steps.layers[0].window_keys is not None else 0)
    window = steps.layout.window
    assert max(raw) == window + CODE_BATCH - 1 and raw[-1] == window  # tokens leave the window a batch at a time
    assert steps.layers[0].compressed == whole.layers[0].compressed == 2 * CODE_BATCH
    # appends keep room: codes for a coding step's tokens more (CODE_BATCH of them, or 1/32 of those held)
    room = sum(CODE_BATCH * (layer.codes[0, 0].nbytes + layer.scales[0, 0].nbytes) for layer in steps.layers)
    assert whole.nbytes() <= steps.nbytes() <= whole.nbytes() + room
    for a, b in zip(whole.layers[0].reconstruct(), steps.layers[0].reconstruct(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_raw_tokens_are_reconstructed_exactly():
    model = tiny_model("llama", torch.bfloat16)
    compressor = tiny_compressor(model)
    cache = ResidualKVCache(model=model, compressor=compressor, reference_format="f16")
    keys, values = torch.randn(2, 1, 15, 32, dtype=torch.bfloat16), torch.randn(2, 1, 15, 32, dtype=torch.bfloat16)
    out_k, out_v = cache.update(keys, values, 0)
    sinks, window = cache.sink_tokens, cache.layout.window
    raw = list(range(sinks)) + list(range(15 - window, 15))
    assert torch.equal(out_k[:, :, raw], keys[:, :, raw]) and torch.equal(out_v[:, :, raw], values[:, :, raw])
    refs = [sinks + i for i in range(0, 15 - sinks - window, cache.layout.stride)]
    torch.testing.assert_close(out_v[:, :, refs], values[:, :, refs])  # f16 references: raw up to bf16->fp16
    torch.testing.assert_close(out_k[:, :, refs], keys[:, :, refs], atol=3e-2, rtol=2e-2)  # through RoPE and back


def test_storage_is_packed_and_counted():
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    cache = ResidualKVCache(model=model, compressor=compressor)
    cache.update(torch.randn(1, 1, 64, 32), torch.randn(1, 1, 64, 32), 0)
    layer = cache.layers[0]
    assert layer.codes.dtype == torch.uint8 and layer.scales.dtype == torch.float16
    assert layer.reference_ids.dtype == torch.int16
    coded = 64 - cache.sink_tokens - cache.layout.window - layer.references.codes.shape[1]
    assert layer.codes.shape[1] == coded
    expected = coded * (compressor.code_bits(0) // 8 + 2 * cache.layout.top_k)
    expected += layer.references.nbytes() + 2 * 2 * (cache.sink_tokens + cache.layout.window) * 32
    assert layer.nbytes() == expected
    assert cache.bits_per_element() == pytest.approx(8 * cache.nbytes() / (2 * 64 * 32))


def test_code_window_matches_the_layer():
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    cache = ResidualKVCache(model=model, compressor=compressor)
    # fp16-representable inputs: the layer keeps raw tokens in fp16 before coding them as they leave the window
    keys, values = torch.randn(1, 1, 30, 32).half().float(), torch.randn(1, 1, 30, 32).half().float()
    got_k, got_v = cache.update(keys, values, 0)  # no position_ids: positions 0..29, RoPE undone then redone
    layout = cache.layout
    rope = cache.layers[0].rope
    positions = torch.arange(30).unsqueeze(0)
    with torch.no_grad():
        want_k, want_v, error = code_window(
            compressor.layers[0], compressor.config.bits[0], layout, rope.undo(keys, positions), values
        )
    torch.testing.assert_close(got_k.float(), rope.redo(want_k, positions), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got_v.float(), want_v, atol=1e-3, rtol=1e-3)
    assert 0 < error.item() < 1


def test_checkpoint_round_trip_and_refusals(tmp_path):
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    save_compressor(compressor, tmp_path / "c", dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["compressor.safetensors", "config.json"]
    loaded = load_compressor(tmp_path / "c")
    assert loaded.config == compressor.config
    for a, b in zip(loaded.state_dict().values(), compressor.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ids = torch.randint(3, 128, (1, 20))
    a = _feed(model, ids, ResidualKVCache(model=model, compressor=compressor)).layers[0].reconstruct()[0]
    b = _feed(model, ids, ResidualKVCache.from_pretrained(tmp_path / "c", model=model)).layers[0].reconstruct()[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="trained for"):
        ResidualKVCache(model=tiny_model("llama-mha"), compressor=compressor)  # other KV shape
    other = tiny_model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    with pytest.raises(ValueError, match="weights differ"):
        ResidualKVCache(model=other, compressor=compressor)
    with pytest.raises(ValueError, match="built-in compressor"):
        ResidualKVCache(model=model, compressor=tmp_path / "missing")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(ValueError, match="format"):
        load_compressor(tmp_path / "c")


def test_builtin_compressor_refuses_another_model():
    with pytest.raises(ValueError, match="trained for"):
        ResidualKVCache(model=tiny_model("llama"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stride": -1}, "stride"),
        ({"top_k": 0}, "top_k"),
        ({"window": -1}, "window"),
        ({"sink_tokens": -2}, "sink_tokens"),
        ({"reference_format": "q3"}, "format"),
    ],
)
def test_bad_arguments(kwargs, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        ResidualKVCache(model=model, compressor=tiny_compressor(model), **kwargs)


def test_wrong_shapes_and_dtypes_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="needs the model"):
        ResidualKVCache(model=None)
    cache = ResidualKVCache(model=model, compressor=tiny_compressor(model))
    with pytest.raises(ValueError, match="channels per token"):
        cache.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), 0)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        cache.update(torch.ones(1, 1, 4, 32, dtype=torch.int32), torch.ones(1, 1, 4, 32), 0)


def test_training_runs_resumes_and_generates(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (600,), generator=torch.Generator().manual_seed(0))
    layout = ResidualLayout(stride=3, top_k=2, sink_tokens=2, window=3, reference_format="q8_0")
    config = TrainConfig(steps=2, ctx=32, warmup=1, calibration_windows=2, save_every=1, rate=3.0)
    train_residual(model, ids, tmp_path, config, layout, progress=False)
    log = [json.loads(line) for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2] and all(r["loss"] > 0 for r in log if "loss" in r)
    assert [r["step"] for r in log if "validation_kl" in r] == [0, 1, 2]
    before = load_compressor(tmp_path / "checkpoint")
    config.steps = 3
    trained = train_residual(model, ids, tmp_path, config, layout, progress=False)  # resumes at step 2
    steps = [json.loads(line) for line in (tmp_path / "loss_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2, 3]
    assert not torch.equal(before.layers[0].key_encoder, trained.layers[0].key_encoder)
    assert trained.config.training["steps_done"] == 3
    out = model.generate(
        ids[None, :12], max_new_tokens=6, do_sample=False, cache=ResidualKVCache(model=model, compressor=trained)
    )
    assert out.shape == (1, 18)


def test_training_code_is_disjoint_from_the_code_we_measure_on():
    from hf_deltakv.eval.texts import STDLIB_MODULES, TRAIN_CODE_MODULES

    assert not set(TRAIN_CODE_MODULES) & set(STDLIB_MODULES)


@pytest.fixture(params=["vector", "scalar"])
def latent_decoder(request):
    """The C++ latent decoder under test: the vector one (AVX-512 VBMI or AVX2, where the build has one) or the scalar
    one."""
    compiled = kernels._cpu_extension(torch.device("cpu"))
    if compiled is None:
        pytest.skip("no CPU kernels here")
    previous = compiled.vector_latent_decode(request.param == "vector")
    if request.param == "vector" and not compiled.vector_latent_decode(True):
        pytest.skip("this build has only the scalar decoder")
    yield request.param
    compiled.vector_latent_decode(previous)


@pytest.mark.parametrize("bits", [[4, 0, 2, 8], [3, 5, 6, 0, 0, 2], [0, 8], [6, 4, 4, 3, 3, 0, 5, 4, 4, 4, 4, 3]])
@pytest.mark.parametrize("magnitude", [1e-3, 3.0, 1e5])
def test_latent_kernels_match_the_reference(bits, magnitude, latent_decoder):
    """The C++ encoder writes the reference's bytes and scales, the decoder its values (fp32 exactly; bf16 as the
    reference's values rounded), into a slice of a larger buffer too."""
    torch.manual_seed(len(bits))
    latent = torch.randn(3, 37, len(bits) * GROUP) * magnitude
    latent[0, 0, :GROUP] = 0  # an all-zero group: scale 0
    latent[1, 2, :GROUP] = torch.arange(GROUP) - GROUP / 2  # codes landing on exact halves
    packed, scales = kernels.quantize_latent(latent, bits)
    expected_packed, expected_scales = reference.quantize_latent(latent, bits)
    assert torch.equal(packed, expected_packed) and torch.equal(
        scales.view(torch.int16), expected_scales.view(torch.int16)
    )
    expected = reference.dequantize_latent(packed, scales, bits)
    assert torch.equal(kernels.dequantize_latent(packed, scales, bits), expected)
    buffer = torch.full((3 * 37 + 5, len(bits) * GROUP), 7.0, dtype=torch.bfloat16)
    out = kernels.dequantize_latent(packed.flatten(0, 1), scales.flatten(0, 1), bits, buffer[: 3 * 37])
    assert torch.equal(out.view(torch.int16), expected.flatten(0, 1).bfloat16().view(torch.int16))
    assert (buffer[3 * 37 :] == 7).all()  # rows after the slice untouched


def test_latent_decoder_reads_every_depth(latent_decoder):
    """Random bytes at every depth (every code value, groups ending on and off byte boundaries)."""
    g = torch.Generator().manual_seed(3)
    bits = list(BIT_DEPTHS)
    packed = torch.randint(0, 256, (41, sum(GROUP * b // 8 for b in bits)), generator=g, dtype=torch.uint8)
    scales = (torch.rand(41, len(bits), generator=g) * 3).half()
    assert torch.equal(
        kernels.dequantize_latent(packed, scales, bits), reference.dequantize_latent(packed, scales, bits)
    )


@pytest.mark.parametrize("rope", ["none", "rope", "rope-gaps"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_kernel_matches_the_reference(rope, masked, key_dtype):
    """Odd shapes: batch 2, 3 kv heads, 4 rows each, 700 tokens (several token ranges merged) sliced out of a longer
    history, a fully masked row; keys fp32 or bf16, with a mean added in the kernel."""
    g = torch.Generator().manual_seed(5)
    batch, heads, rows, dim, tokens, bits = 2, 3, 4, 64, 700, [5, 0, 3, 4]
    query = torch.randn(batch, heads, rows, dim, generator=g)
    keys = torch.randn(batch, tokens, heads * dim, generator=g) * 2
    codes, scales = reference.quantize_latent(torch.randn(batch, tokens + 90, len(bits) * GROUP, generator=g), bits)
    codes, scales = codes[:, 50 : 50 + tokens], scales[:, 50 : 50 + tokens]  # a chunk of a longer history
    allowed = None
    angles = None if rope == "none" else rope_angles(batch, tokens, dim, g, rope)
    if masked:
        allowed = torch.rand(batch, heads, rows, tokens, generator=g) > 0.3
        allowed[1, 2, 1] = False
    args = (query, keys.to(key_dtype), angles, allowed, codes, scales, bits, 0.125, torch.randn(heads * dim) * 3)
    for got, expected in zip(kernels.latent_attention(*args), reference.latent_attention(*args), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("decoder", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_latents_like_the_decoded_history(arch, decoder, monkeypatch):
    """Without references (the built-in layout), SDPA served by a layer (values attended in latent space) equals SDPA
    over the layer's decoded history, for one decoded query (GQA) and for a masked multi-query step: within fp32
    rounding with the fp32 key decoder, within bf16's (8 significant bits of the keys) with the bf16 one."""
    monkeypatch.setattr(residual_attention, "key_decoder_dtype", lambda device: decoder)
    model = tiny_model(arch)
    cache = ResidualKVCache(model=model, compressor=tiny_compressor(model), stride=0)
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1)), cache=cache)
    layer = cache.layers[1]
    assert layer.codes is not None and layer.references is None
    keys, values = layer.reconstruct()
    heads = model.config.num_attention_heads
    g = torch.Generator().manual_seed(2)
    for n, mask in ((1, None), (3, torch.rand(2, 1, 3, keys.shape[2], generator=g) > 0.4)):
        query = torch.randn(2, heads, n, keys.shape[-1], generator=g)
        served = layer.sdpa(query, mask, 0.0, False, None, True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys.float(), values.float(), attn_mask=mask, enable_gqa=True
        )
        tolerance = 1e-5 if decoder == torch.float32 else 1e-3
        torch.testing.assert_close(served, expected, rtol=tolerance, atol=tolerance)


def test_key_decoder_dtype_follows_the_cpu_and_the_environment(monkeypatch):
    """bf16 where the CPU has AMX tiles or AVX512-BF16, fp32 elsewhere and on GPUs; HF_DELTAKV_KEY_DECODER forces
    either on the CPU, and anything else it says is refused."""
    cpu = torch.device("cpu")

    def choice(amx, bf16, forced=None):
        residual_attention.key_decoder_dtype.cache_clear()
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
        if forced is None:
            monkeypatch.delenv(residual_attention.KEY_DECODER_ENV, raising=False)
        else:
            monkeypatch.setenv(residual_attention.KEY_DECODER_ENV, forced)
        return residual_attention.key_decoder_dtype(cpu)

    try:
        assert choice(True, False) == choice(False, True) == torch.bfloat16
        assert choice(False, False) == torch.float32
        assert choice(True, True, "float32") == torch.float32 and choice(False, False, "bfloat16") == torch.bfloat16
        residual_attention.key_decoder_dtype.cache_clear()
        assert residual_attention.key_decoder_dtype(torch.device("meta")) == torch.float32  # not a CPU
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            choice(True, True, "fp8")
    finally:
        residual_attention.key_decoder_dtype.cache_clear()


def test_decode_attention_follows_a_decoder_changed_in_place():
    """The served decoder is prepared once, then again whenever the compressor's weights change (in place too)."""
    model = tiny_model("llama")
    compressor = tiny_compressor(model)
    cache = ResidualKVCache(model=model, compressor=compressor, stride=0)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1)), cache=cache)
    layer = cache.layers[1]
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.head_dim)
    before = layer.sdpa(query, None, 0.0, False, None, True)
    with torch.no_grad():
        compressor.layers[1].key_decoder.mul_(1.5)
        compressor.layers[1].value_decoder.mul_(0.5)
    keys, values = layer.reconstruct()
    expected = torch.nn.functional.scaled_dot_product_attention(query, keys.float(), values.float(), enable_gqa=True)
    after = layer.sdpa(query, None, 0.0, False, None, True)
    torch.testing.assert_close(after, expected, rtol=1e-3, atol=1e-3)
    assert not torch.allclose(after, before, atol=1e-3)


def test_generate_through_latent_attention_follows_the_decoded_history(monkeypatch):
    """Through `generate` (a left-padded batch of 2, GQA), the served attention picks the same tokens as attention
    over the decoded history, with scores equal to fp32 rounding."""
    from hf_deltakv.layers import StreamLayer

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    runs = []
    for decoded in (False, True):
        if decoded:
            monkeypatch.setattr(StreamLayer, "sdpa", lambda self, *args: None)
        cache = ResidualKVCache(model=model, compressor=tiny_compressor(model), stride=0)
        options = {"max_new_tokens": 12, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
        runs.append(model.generate(ids, attention_mask=mask, cache=cache, **options))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores), rtol=1e-3, atol=1e-3)
