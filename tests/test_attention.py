"""Attention read straight from the compressed cache: `StoredKV` (what `update` returns) serving SDPA from the
packed storage by default, the chunked reference and the compiled CPU kernel (`kernels.stream_attention`), on tiny
random models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, ResidualKVCache, kernels
from hf_deltakv.attention import StoredKV
from hf_deltakv.codecs import ChannelGroupCodec, PlainCodec, RotatedCodec
from hf_deltakv.codecs.adaptive import AdaptiveChannelCodec
from hf_deltakv.kernels.cpu import extension
from hf_deltakv.kernels.cpu.stream_attention import supports
from hf_deltakv.kernels.online_softmax import OnlineSoftmax
from hf_deltakv.layers import StreamLayer

from .conftest import ARCHS, attend_by_name, delta_codec, rope_angles, tiny_compressor, tiny_model

CACHES = {
    "q4_0": lambda model: QuantizedKVCache("q4_0", "q4_0"),
    "q8_0-rot": lambda model: QuantizedKVCache("q8_0", "q4_1", rotate=True),
    "kivi": lambda model: KIVIKVCache(model=model, pre_rope=True),
    "delta": lambda model: DeltaKVCache(kf=8),
    "delta-pre-rope": lambda model: DeltaKVCache(kf=8, model=model),
    "delta-both": lambda model: DeltaKVCache(kf=8, keys="token", values="delta", model=model, sink_tokens=0),
    "residual": lambda model: ResidualKVCache(model=model, compressor=tiny_compressor(model)),
}


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def _decoded_only(monkeypatch) -> None:
    """Make every layer decline SDPA, so attention runs on the decoded history (the reference path)."""
    monkeypatch.setattr(StreamLayer, "sdpa", lambda self, *args: None)


@pytest.mark.parametrize("arch", ARCHS)
def test_served_attention_equals_the_decoded_history_end_to_end(arch, monkeypatch):
    """Model-level wiring (StoredKV answering SDPA, GQA, sliding windows, a left-padded batch, a multi-token step,
    decode steps): with lossless f16 storage the logits equal those of SDPA over the decoded history. (Lossy caches
    are compared per layer above: through a model, rounding flips in later layers' quantization amplify float noise.)"""
    model = tiny_model(arch)
    ids = _ids(2, 45)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    outs = []
    for decoded in (False, True):
        if decoded:
            _decoded_only(monkeypatch)
        cache = QuantizedKVCache("f16", "f16", model=model)
        with torch.no_grad():
            first = model(ids[:, :30], attention_mask=mask[:, :30], cache=cache).logits
            second = model(ids[:, 30:35], attention_mask=mask[:, :35], cache=cache).logits
            steps = [
                model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits for t in range(35, 45)
            ]
        outs.append(torch.cat([first, second, *steps], dim=1))
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][0, 6:], outs[1][0, 6:], rtol=1e-4, atol=1e-4)


def test_decoding_reads_the_storage_by_default(monkeypatch):
    """The plain one-liner (no context manager, no model=): after the prefill, decode steps never decode the
    history; attention is served from the packed storage."""
    model = tiny_model("qwen2")
    ids = _ids(1, 20)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False, cache=QuantizedKVCache("f16", "f16"))
    original = StreamLayer.sdpa

    def no_decoding(self):
        raise AssertionError("a decode step decoded the history")

    for make in (lambda: QuantizedKVCache("f16", "f16"), lambda: DeltaKVCache(kf=8)):
        cache = make()
        with torch.no_grad():
            logits = model(ids, cache=cache).logits
        served = []
        monkeypatch.setattr(StreamLayer, "reconstruct", no_decoding)

        def counted(self, *args, served=served):
            served.append(original(self, *args))
            return served[-1]

        monkeypatch.setattr(StreamLayer, "sdpa", counted)
        tokens = [logits[:, -1].argmax(-1, keepdim=True)]
        with torch.no_grad():
            for _ in range(7):
                tokens.append(model(tokens[-1], cache=cache).logits[:, -1].argmax(-1, keepdim=True))
        monkeypatch.undo()
        assert len(served) == 7 * model.config.num_hidden_layers and all(out is not None for out in served)
        if isinstance(cache, QuantizedKVCache):
            assert torch.equal(torch.cat([ids, *tokens], dim=1), expected)


def test_other_models_in_the_process_are_untouched():
    """Two models, interleaved: each with our cache and with DynamicCache gives what it gives alone (the behaviour
    lives in the tensors a cache returns, not in a process-wide switch)."""
    from transformers import DynamicCache

    first, second = tiny_model("llama"), tiny_model("gemma3")
    ids = _ids(1, 16)
    alone = {
        name: (model(ids, cache=DynamicCache()).logits, model(ids, cache=QuantizedKVCache("f16", "f16")).logits)
        for name, model in (("first", first), ("second", second))
    }
    with torch.no_grad():
        ours = QuantizedKVCache("f16", "f16")
        a = first(ids[:, :10], cache=ours).logits
        b = second(ids, cache=DynamicCache()).logits
        c = first(ids[:, 10:], cache=ours).logits
        d = second(ids, cache=QuantizedKVCache("f16", "f16")).logits
    torch.testing.assert_close(torch.cat([a, c], dim=1), alone["first"][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b, alone["second"][0])
    torch.testing.assert_close(d, alone["second"][1])


def test_eager_attention_and_other_ops_decode_the_history():
    """Attention other than SDPA (eager: repeat_kv, matmul) and any other op on the returned tensors run on the
    decoded history: the same as what SDPA is served."""
    from transformers import AutoModelForCausalLM

    from .conftest import tiny_config

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager").eval()
    sdpa = tiny_model("llama")
    ids = _ids(1, 14)
    with torch.no_grad():
        for step in (ids, ids[:, :13]):
            got = eager(step, cache=QuantizedKVCache("f16", "f16")).logits
            want = sdpa(step, cache=QuantizedKVCache("f16", "f16")).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cache = QuantizedKVCache("f16", "f16")
    keys, _ = cache.update(torch.randn(1, 1, 5, 32), torch.randn(1, 1, 5, 32), 0)
    assert isinstance(keys, StoredKV) and keys.shape == (1, 1, 5, 32) and keys.dtype == torch.float32
    decoded_keys, _ = cache.layers[0].reconstruct()
    assert torch.equal(keys + 0, decoded_keys) and torch.equal(keys.sum(), decoded_keys.sum())


@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal"])
def test_a_prefill_chunk_attends_to_the_decoded_history_at_its_own_kv_heads(mask_kind, monkeypatch):
    """A prefill chunk (more queries than the storage path serves) attends to the decoded history with SDPA's GQA, in
    blocks of query rows: the numbers of SDPA over repeat_kv's copy, without making that copy (the history of each kv
    head is never expanded per query head) or the float mask of every query row at once."""
    import torch.nn.functional as F

    from hf_deltakv.attention import stored

    torch.manual_seed(0)
    length, rows = 700, 700 if mask_kind == "causal" else 600
    cache = QuantizedKVCache("q4_0", "q4_0")
    keys, values = cache.update(torch.randn(1, 2, length, 32), torch.randn(1, 2, length, 32), 0)
    query = torch.randn(1, 8, rows, 32)
    history = [t.repeat_interleave(4, dim=1) for t in cache.layers[0].reconstruct()]
    mask = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)[None, None]
    if mask_kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    mask = None if mask_kind == "causal" else mask
    want = F.scaled_dot_product_attention(query, *history, attn_mask=mask, is_causal=mask is None)

    def repeated(tensor):  # transformers' repeat_kv, followed lazily by StoredKV
        return tensor[:, :, None, :, :].expand(1, 2, 4, length, 32).reshape(1, 8, length, 32)

    monkeypatch.setattr(StoredKV, "decoded", lambda self: pytest.fail("the history was expanded per query head"))
    calls = []
    plain = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape) or plain(*a, **k))
    call = stored._own_call((query, repeated(keys), repeated(values), mask, 0.0, mask is None), {})
    got = stored._sdpa_on_decoded(call)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    block = stored.SDPA_QUERY_BLOCK if mask is not None else rows  # causal over the whole history: no mask made
    assert [shape[-2] for shape in calls] == [min(block, rows - start) for start in range(0, rows, block)]
    assert all(shape[1] == 8 for shape in calls)


CODECS = {
    "q4_0": lambda: PlainCodec("q4_0"),
    "q4_0_16-rot": lambda: RotatedCodec(PlainCodec("q4_0_16")),
    "q4_1": lambda: PlainCodec("q4_1"),
    "q8_0-rot": lambda: RotatedCodec(PlainCodec("q8_0")),
    "f16": lambda: PlainCodec("f16"),
    "q3_0-rot": lambda: RotatedCodec(PlainCodec("q3_0", search_scale=True)),
    "delta": lambda: delta_codec(kf=8, delta_format="q4_0_16"),
    "delta-rot": lambda: RotatedCodec(delta_codec(kf=5, delta_format="q4_0", keyframe_format="q8_0")),
    "delta-no-intra": lambda: delta_codec(kf=6, intra=False, delta_format="q8_0", keyframe_format="f16"),
    "delta-no-mean": lambda: RotatedCodec(delta_codec(kf=32, mean_reference=False, delta_format="q4_1")),
    "kivi": lambda: ChannelGroupCodec("q4_1"),
    "delta-keyframe-ref": lambda: delta_codec(kf=4, reference="keyframe"),
    "adaptive-32": lambda: AdaptiveChannelCodec(group=32, bits=4, offset=3),
    "adaptive-16": lambda: AdaptiveChannelCodec(group=16, bits=3.5, offset=0),
    "adaptive-64": lambda: AdaptiveChannelCodec(group=64, bits=5, offset=7),
    "adaptive-grid": lambda: AdaptiveChannelCodec(group=16, bits=3, offset=5, ranges="grid8"),
}


def _stream(make, length: int, batch: int, heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(dim, generator=g) * 4
    x = (torch.randn(batch, heads, length, dim, generator=g).cumsum(2) * 0.2 + offset).float()
    codec = make()
    codec.append(x[:, :, : length // 3])  # a prefill, then single tokens: both append paths
    for t in range(length // 3, length):
        codec.append(x[:, :, t : t + 1])
    return codec


@pytest.mark.parametrize("key", list(CODECS))
@pytest.mark.parametrize("value", ["q4_0", "delta-rot", "q8_0-rot", "kivi", "q3_0-rot"])
@pytest.mark.parametrize("case", ["decode", "causal-3", "masked", "rope", "rope-gaps"])
def test_stream_attention_kernel_matches_reference(key, value, case):
    """The dispatched op (the compiled CPU kernel where it reads the storage) against `reference.stream_attention`
    on odd shapes: 77 tokens (not a multiple of the tile or of kf), GQA group 3, batch 2, with and without sinks."""
    batch, heads, dim, length, n = 2, 2, 64, 77, 3 if case == "causal-3" else 1
    keys = _stream(CODECS[key], length, batch, heads, dim, seed=1)
    values = _stream(CODECS[value], length, batch, heads, dim, seed=2)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(batch, heads, 3 * n, dim, generator=g)
    sinks = 3 if case in ("rope", "rope-gaps", "masked") else 0
    sink_keys, sink_values = (torch.randn(batch, heads, sinks, dim, generator=g).half() for _ in range(2))
    rope = rope_angles(batch, length, dim, g, case) if case.startswith("rope") else None
    mask = None
    if case == "masked":
        mask = torch.rand(batch, n, sinks + length, generator=g) > 0.3
        mask[1, :, :] = False  # a fully masked row: no key at all
    args = (query, sink_keys, sink_values, keys.layout(), values.layout(), rope, mask, n, sinks + length - n, 0.125)
    torch.testing.assert_close(
        attend_by_name(kernels.stream_attention, *args),
        attend_by_name(kernels.reference.stream_attention, *args),
        rtol=2e-4,
        atol=2e-4,
    )


@pytest.mark.parametrize("key", ["adaptive-32", "delta"])
def test_stream_attention_kernel_turns_long_runs_of_positions_exactly(key):
    """The kernel turns consecutive positions a span at a time from an angle it computes exactly only every few
    hundred tokens (rope.h); over 1,500 tokens at large positions, with a jump and a run of repeats (left padding)
    midway, its attention stays within the parity tolerance of the reference's exact angles."""
    batch, heads, dim, length = 1, 2, 64, 1500
    keys = _stream(CODECS[key], length, batch, heads, dim, seed=4)
    values = _stream(CODECS["q4_0"], length, batch, heads, dim, seed=5)
    g = torch.Generator().manual_seed(6)
    query = torch.randn(batch, heads, 3, dim, generator=g) * 3  # peaked scores: angle errors would show
    rope = rope_angles(batch, length, dim, g)
    rope.positions[:, 700:] += 5  # a jump inside a tile
    rope.positions[:, 1000:1010] = rope.positions[:, 999:1000]  # repeats
    no_sinks = torch.zeros(batch, heads, 0, dim)
    args = (query, no_sinks, no_sinks, keys.layout(), values.layout(), rope, None, 1, length - 1, 0.125)
    torch.testing.assert_close(
        attend_by_name(kernels.stream_attention, *args),
        attend_by_name(kernels.reference.stream_attention, *args),
        rtol=2e-4,
        atol=2e-4,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CODECS))
def test_reconstruction_kernel_writes_the_reference_history(name, dtype):
    """`kernels.decode_into` (what a prefill's SDPA reads: the C++ kernel on the CPU) against
    `reference.decode_into` on every stream the attention kernel reads, 77 tokens, into a strided view of a larger
    buffer in the model's dtype: keys with RoPE re-applied at gapped positions and a channel order, values without.
    Tolerance: RoPE's angles (rope.h, within ~3e-5 of the reference's float64 ones) and one fp32 rounding where the
    kernel fuses a multiply and an add (q4_1, deltas); the conversion to bf16/fp16 is torch's own."""
    batch, heads, dim, length = 2, 3, 64, 77
    layout = _stream(CODECS[name], length, batch, heads, dim, seed=11).layout()
    g = torch.Generator().manual_seed(12)
    order = torch.randperm(dim, generator=g)
    for rope, channels in ((rope_angles(batch, length, dim, g, "rope-gaps"), order), (None, None)):
        want = torch.zeros(batch, heads, length + 4, dim, dtype=dtype)
        got = torch.zeros(batch, heads, length + 4, dim, dtype=dtype)
        kernels.reference.decode_into(layout, want[:, :, 4:], rope, channels)
        kernels.decode_into(layout, got[:, :, 4:], rope, channels)
        assert not got[:, :, :4].any()  # nothing written outside the view
        tolerance = {torch.float32: 3e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance * 4)
        if rope is None and name in ("q4_0", "q8_0-rot", "f16", "adaptive-32", "kivi"):  # no fused rounding: exact
            assert torch.equal(got, want)


def test_reconstruction_kernel_serves_the_cache_history(monkeypatch):
    """A prefill's SDPA reads the history through `reconstruct`: with the C++ kernel it is the reference's."""
    assert extension() is not None
    model = tiny_model("llama")
    cache = DeltaKVCache(kf=8, model=model)
    with torch.no_grad():
        model(_ids(1, 40), cache=cache)
    served = cache.layers[0].reconstruct()
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")
    want = cache.layers[0].reconstruct()
    for a, b in zip(served, want, strict=True):
        torch.testing.assert_close(a, b, rtol=3e-5, atol=1e-4)


def _with_room(t: torch.Tensor) -> torch.Tensor:
    """`t` `[B, H, rows, ...]` as the leading rows of a larger buffer (what `codecs.base.GrowingRows` keeps)."""
    return torch.cat([t, torch.zeros_like(t[:, :, :3])], dim=2)[:, :, : t.shape[2]]


@pytest.mark.parametrize("key", ["adaptive-16", "adaptive-32", "kivi"])
def test_stream_attention_kernel_reads_buffers_with_room_in_place(key):
    """Coded groups appended into buffers with room are views whose heads lie further apart than their rows: the
    kernel reads them where they lie (no copy per call) and attends exactly as over contiguous copies."""
    batch, heads, dim, length = 2, 3, 64, 150
    keys = _stream(CODECS[key], length, batch, heads, dim, seed=7).layout()
    values = _stream(CODECS["q4_0"], length, batch, heads, dim, seed=8).layout()
    if isinstance(keys, kernels.AdaptiveStream):
        roomy = dataclasses.replace(
            keys, **{n: _with_room(getattr(keys, n)) for n in ("planes", "bits", "low", "step")}
        )
        assert not roomy.planes.is_contiguous()
    else:
        roomy = dataclasses.replace(keys, groups=keys.groups.map(_with_room))
        assert not roomy.groups.codes.is_contiguous()
    g = torch.Generator().manual_seed(9)
    query = torch.randn(batch, heads, 3, dim, generator=g)
    no_sinks = torch.zeros(batch, heads, 0, dim)
    rope = rope_angles(batch, length, dim, g)

    def attend(stream):
        return attend_by_name(
            kernels.stream_attention, query, no_sinks, no_sinks, stream, values, rope, None, 1, length - 1, 0.125
        )

    served = attend(roomy)
    assert torch.equal(served, attend(keys))
    args = (query, no_sinks, no_sinks, roomy, values, rope, None, 1, length - 1, 0.125)
    torch.testing.assert_close(served, attend_by_name(kernels.reference.stream_attention, *args), rtol=2e-4, atol=2e-4)


def test_cpu_kernel_builds_and_reads_the_default_delta_cache():
    """CI must build the C++ kernel: a silent fallback would leave the parity tests comparing the reference with
    itself."""
    assert extension() is not None
    model = tiny_model("llama")
    cache = DeltaKVCache(kf=8, model=model)
    with torch.no_grad():
        model(_ids(1, 20), cache=cache)
    layer = cache.layers[0]
    assert supports(layer.key_codec.layout(), layer.value_codec.layout())
    kivi = ChannelGroupCodec("q4_1")
    kivi.append(torch.randn(1, 1, 40, 64))
    assert supports(kivi.layout(), layer.value_codec.layout())  # KIVI-style keys
    assert not supports(layer.value_codec.layout(), kivi.layout())  # per-channel groups are read as keys only


def test_forced_reference_never_calls_the_kernel(monkeypatch):
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")

    def fail():
        raise AssertionError("kernel used")

    monkeypatch.setattr("hf_deltakv.kernels.cpu.extension", fail)
    keys, values = _stream(CODECS["q4_0"], 20, 1, 1, 64, 0), _stream(CODECS["q4_0"], 20, 1, 1, 64, 1)
    sinks = torch.zeros(1, 1, 0, 64)
    query = torch.randn(1, 1, 2, 64)
    attend_by_name(
        kernels.stream_attention, query, sinks, sinks, keys.layout(), values.layout(), None, None, 1, 19, 0.125
    )


@pytest.mark.parametrize("name", ["delta", "delta-rot", "kivi", "q4_1"])
def test_decode_range_equals_slices_of_decode(name):
    codec = _stream(CODECS[name], 70, 1, 2, 64, seed=4)
    full = codec.decode()
    for start, end in [(0, 70), (0, 1), (5, 6), (7, 33), (32, 64), (69, 70), (10, 10)]:
        torch.testing.assert_close(codec.decode_range(start, end), full[:, :, start:end], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        codec.decode_range(60, 71)


def test_online_softmax_over_chunks_equals_sdpa():
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 6, 5, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
    )
    state = OnlineSoftmax(q, 0.25, None, 40)
    for i in range(0, 40, 7):
        state.add(k[:, :, i : i + 7], v[:, :, i : i + 7])
    got = state.result()
    kk, vv = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    mask = torch.ones(5, 40, dtype=torch.bool).tril(diagonal=35)
    expected = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_read_the_cache(dtype):
    """Sinks and queries in the model's dtype reach the kernels as fp32; the output goes back in the model's dtype."""
    model = tiny_model("llama", dtype)
    ids = _ids(1, 20)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=DeltaKVCache(kf=8, model=model))
    assert out.shape == (1, 26)
    cache = DeltaKVCache(kf=8, model=model)
    with torch.no_grad():
        model(ids, cache=cache)
    layer = cache.layers[0]
    keys, values = layer.reconstruct()
    query = torch.randn(1, model.config.num_attention_heads, 1, keys.shape[-1]).to(dtype)
    group = query.shape[1] // keys.shape[1]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1), scale=0.2
    )
    torch.testing.assert_close(layer.attend(query, None, 0.2), expected, rtol=2e-2, atol=2e-2)


def _whole_buffer(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A buffer of `rows` (`[batch, heads, rows, ...]`) whose first rows are `t` (the rest garbage, never read)."""
    room = torch.full((*t.shape[:2], rows, *t.shape[3:]), 3, dtype=t.dtype)
    room[:, :, : t.shape[2]] = t
    return room


@pytest.mark.parametrize("key", ["adaptive-32", "adaptive-16", "adaptive-64"])
@pytest.mark.parametrize("case", ["decode", "causal-3", "masked", "expanded-3", "rope", "reordered"])
def test_adaptive_step_kernel_is_stream_attention_over_the_layouts(key, case):
    """`kernels.adaptive_step` (a compiled step's attention over a preallocated DeltaKVCache layer, one C++ call
    reading the buffers whole) returns the floats of `kernels.stream_attention` over the layouts of the same tokens,
    bit for bit: GQA rows, batch 2, sinks, coded groups then a raw tail, a mask over the whole capacity (expanded, as
    transformers' is), RoPE and a channel order."""
    batch, heads, dim, length, n, sinks, capacity = 2, 2, 64, 77, 3 if case.endswith("-3") else 1, 3, 200
    codec = _stream(CODECS[key], length, batch, heads, dim, seed=1)
    keys, values = codec.layout(), _stream(CODECS["q4_0_16-rot"], length, batch, heads, dim, seed=2).layout()
    g = torch.Generator().manual_seed(3)
    query = torch.randn(batch, heads, 3 * n, dim, generator=g)
    sink_keys, sink_values = (torch.randn(batch, heads, sinks, dim, generator=g).half() for _ in range(2))
    held = sinks + length
    rope = rope_angles(batch, length, dim, g) if case in ("rope", "reordered") else None
    positions = torch.full((batch, capacity), -5, dtype=torch.int32)
    if rope is not None:
        positions[:, sinks:held] = rope.positions
    order = torch.randperm(dim, generator=g) if case == "reordered" else None
    mask = None
    if case == "masked":
        mask = torch.rand(batch, n, capacity, generator=g) > 0.3
        mask[1] = False  # a row that may attend nothing
    elif case == "expanded-3":  # transformers' mask of one position for its packed rows: read through its strides
        mask = (torch.rand(batch, 1, capacity, generator=g) > 0.3).expand(batch, n, capacity)
    groups = tuple(_whole_buffer(t, keys.planes.shape[2] + 2) for t in (keys.planes, keys.bits, keys.low, keys.step))
    group = keys.group
    tail = _whole_buffer(keys.tail, group)
    stored = values.blocks.map(lambda t: _whole_buffer(t, capacity))
    coded = keys.planes.shape[2]
    got = kernels.adaptive_step(query, mask, sink_keys, sink_values, groups, tail, stored, positions,
                                None if rope is None else rope.freqs, order, held=held, coded=coded, pad=keys.offset,
                                rotation=values.rotation, n_queries=n, scale=0.125)  # fmt: skip
    assert got is not None
    ordered = (query, sink_keys) if order is None else (query[..., order], sink_keys[..., order])
    args = (*ordered, sink_values, keys, values, rope, None if mask is None else mask[:, :, :held], n, held - n, 0.125)
    assert torch.equal(got, attend_by_name(kernels.stream_attention, *args))


def test_adaptive_step_kernel_declines_what_it_does_not_serve(monkeypatch):
    """None (the caller reads the layouts through `stream_attention`) where the C++ step does not run: the reference
    forced, a head dimension the kernel is not compiled for; a clear error for more tokens than the storage holds."""
    keys = _stream(CODECS["adaptive-32"], 40, 1, 2, 64, seed=1).layout()
    values = _stream(CODECS["q4_0"], 40, 1, 2, 64, seed=2).layout()
    groups = (keys.planes, keys.bits, keys.low, keys.step)
    args = (torch.randn(1, 2, 3, 64), None, torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64), groups, keys.tail,
            values.blocks, torch.zeros(1, 64, dtype=torch.int32), None, None)  # fmt: skip
    options = dict(held=43, coded=keys.planes.shape[2], pad=keys.offset, rotation=0, n_queries=1, scale=0.125)
    assert kernels.adaptive_step(*args, **options) is not None
    with pytest.raises(RuntimeError, match="tokens after the sinks"):  # more tokens than the storage holds
        kernels.adaptive_step(*args, **{**options, "held": 44})
    assert kernels.adaptive_step(torch.randn(1, 2, 3, 48), *args[1:], **options) is None
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")
    assert kernels.adaptive_step(*args, **options) is None
