"""What the Triton interpreter cannot see (issue 62), held by tests on the CPU:

- grids past a GPU's limits and int32 offsets that wrap: a recorder drives the launchers on `meta` tensors at batch
  64 x 1M tokens (8 kv heads x 128) and audits every launch; every kernel takes its program ids widened to int64;
- several GPUs: layers on two devices launch under their own device's guard and read tensors on it only (the position
  log kept per device); `total_nbytes`' all-reduce on the backend's device;
- host syncs: weight skip's and the residual cache's (with references) decoding steps read nothing back;
- JIT compiles: a 300-step generation of chunks 1-64 compiles each kernel a bounded number of times;
- misaligned words: bit planes off word boundaries are not sent to the kernels that read them as words;
- FMA: the kernels held to the reference's bytes launch without multiply-add contraction;
- the tests' interpreter itself (conftest): programs run reversed or shuffled, `/` one ulp off.

NaN and infinities against the references are in the kernels' own test files."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_deltakv import DeltaKVCache
from hf_deltakv.eval.gpu_path import LaunchRecorder, audit
from hf_deltakv.registry import CACHES, build_cache

TRITON = Path(__file__).parents[1] / "hf_deltakv" / "kernels" / "triton"
KV_HEADS, HEAD_DIM = 8, 128  # Llama-3-8B's kv heads
# every cache of ours (the residual one, with a compressor of the wide model's shape, where its layer is on `meta`)
SPECS = [name for name in CACHES if name not in ("dynamic", "residual") and not name.startswith("hf-")]
SPECS.append("delta-token")
ON_META = [*SPECS, "residual"]
_MODEL = []


def wide_model():
    """A one-layer Llama with 8 kv heads of 128 (32 query heads) and a 2M-token RoPE range, tiny elsewhere."""
    if not _MODEL:
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=32, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_position_embeddings=1 << 21)  # fmt: skip
        torch.manual_seed(0)
        _MODEL.append(AutoModelForCausalLM.from_config(config).eval())
    return _MODEL[0]


def make(spec: str, monkeypatch=None):
    model = wide_model()
    if spec == "delta-token":
        return DeltaKVCache(kf=32, keys="token", model=model)
    if spec == "residual":  # identity weights at 4 bits a latent group, on `meta` (its cost is its shape's)
        from hf_deltakv import ResidualKVCache
        from hf_deltakv.residual import ResidualCompressor, ResidualConfig, attention

        narrowed = attention._narrowed  # (compares weights' values: none on `meta`)
        monkeypatch.setattr(attention, "_narrowed", lambda w: w if w.is_meta else narrowed(w))
        stream = KV_HEADS * HEAD_DIM
        config = ResidualConfig(num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM, latent_dim=stream,
                                bits=[[4] * (2 * stream // 32)])  # fmt: skip
        return ResidualKVCache(model=model, compressor=ResidualCompressor(config).to("meta"))
    return build_cache(spec, model)


def record(spec: str, batch: int, sizes: list[int], monkeypatch) -> list:
    """Every launch of forwards of `sizes` tokens each (the cache's update, then its attention: a query per token, one
    for a prefill past `MAX_QUERIES`) on `meta` tensors, recorded on the GPU path."""
    from hf_deltakv.kernels.triton.common import MAX_QUERIES

    cache = make(spec, monkeypatch)
    with LaunchRecorder() as recorder, torch.no_grad():
        for n in sizes:
            states = torch.empty(batch, KV_HEADS, n, HEAD_DIM, dtype=torch.float16, device="meta")
            cache.update(states, states, 0)
            queries = n if n <= MAX_QUERIES else 1
            query = torch.empty(batch, 4 * KV_HEADS, queries, HEAD_DIM, dtype=torch.float16, device="meta")
            cache.layers[0].attend(query, None, HEAD_DIM**-0.5)
    return recorder.launches


@pytest.mark.parametrize("spec", ON_META)
@pytest.mark.parametrize(("batch", "tokens"), [(64, 1 << 20), (8, 1 << 18), (1, 1 << 17)])
def test_no_launch_passes_a_gpu_limit(spec, batch, tokens, monkeypatch):
    """The recorder's audit at batch 64 x 1M tokens (8 kv heads x 128): no grid axis above its limit, no int32 offset
    that can wrap, for every cache's prefill, decoding step and chunk on the GPU path."""
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "triton")
    launches = record(spec, batch, [tokens, 1, 8], monkeypatch)  # a prefill, a decoding step, a chunk
    assert launches, spec
    problems = [problem for launch in launches for problem in audit(launch)]
    assert not problems, problems


def test_every_kernel_widens_its_program_ids():
    """Program ids reach the kernels as int64 through `common.program` / `common.programs` only: an int32 id times a
    stride wraps once a buffer passes 2**31 elements, which the interpreter (numpy int64 ids) never shows."""
    for path in sorted(TRITON.glob("*.py")):
        text = path.read_text()
        if path.name == "common.py":
            text = re.sub(r"def programs?\(axis: tl.constexpr\):.*?return [^\n]*\n", "", text, flags=re.S)
        assert not re.search(r"tl\.(program_id|num_programs)\(", text), path.name


def test_the_audit_finds_what_a_gpu_refuses():
    """The audit is not blind: a grid past axis 1's limit and an unwidened kernel over a buffer of 2**31 elements are
    reported."""
    from hf_deltakv.eval.gpu_path import Launch

    big = torch.empty(64, 8, 1 << 20, 128, dtype=torch.float16, device="meta")
    source = "def k(x, n):\n    pid = tl.program_id(0)\n"
    meta = big.device
    found = audit(Launch("k", source, (512, 65536, 1), (big, 128), {}, meta))
    assert any("grid axis 1" in p for p in found) and any("spans" in p for p in found), found
    assert any("wraps" in p for p in audit(Launch("k", source, (1 << 20, 1, 1), (big[:1, :1], 4096), {}, meta)))
    widened = source.replace("tl.program_id", "program")
    assert not audit(Launch("k", widened, (512, 64, 1), (big, 128), {}, meta))
    assert any("outside a device guard" in p for p in audit(Launch("k", widened, (512, 64, 1), (big, 128), {})))
    elsewhere = audit(Launch("k", widened, (1, 1, 1), (big, torch.zeros(2)), {}, meta))
    assert elsewhere == ["k: argument 1 is on cpu, the launch on meta"], elsewhere


def _decoding_syncs(model, cache, steps: int, monkeypatch, scoped=()) -> Counter:
    """Host-device syncs (`LaunchCounter`'s detector: values read back, data-dependent sizes, host copies) of `steps`
    greedy decoding steps of `model` on the GPU path after a prefill and one uncounted step (constants are made on a
    device once, on first use): in the cache's updates and attention calls and in the `scoped` methods (`(class,
    name)` pairs), not in the model's own code."""
    from hf_deltakv.eval.gpu_path import LaunchCounter

    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    counter, total = LaunchCounter(cache), Counter()
    for cls, name in scoped:
        method = getattr(cls, name)

        def counted(*args, _method=method, **kwargs):
            with counter.scope(-1, "scoped"):
                return _method(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    with torch.no_grad():
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with counter:
            for _ in range(steps):
                with counter.step():
                    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for step in counter.steps:
        for parts in step.values():
            for tally in parts.values():
                total.update(tally.syncs)
    return total


@pytest.mark.parametrize("options", [{}, dict(threshold=0.3), dict(sparsity=0.3)],
                         ids=["exact", "bounded", "calibrated"])  # fmt: skip
def test_weight_skip_decodes_without_a_host_sync(options, monkeypatch):
    """Weight skip's decoding step on the Triton path reads nothing back: the kept channels are listed by a sort
    (not `nonzero`) and counted on the device, where the skip statistics are summed; exact mode's watch (the step
    counted here decides it) reads its count through a copy it does not wait for."""
    from transformers import DynamicCache

    from hf_deltakv import enable_weight_skip
    from hf_deltakv.weight_skip import _SkippingGroup

    from .conftest import tiny_model

    monkeypatch.setenv("HF_DELTAKV_KERNELS", "triton")
    model = tiny_model()
    if "sparsity" in options:
        options = {**options, "calibration": torch.randint(0, model.config.vocab_size, (2, 32))}
    with enable_weight_skip(model, **options) as handle:
        scoped = [(_SkippingGroup, "_compute"), (_SkippingGroup, "_watch")]
        syncs = _decoding_syncs(model, DynamicCache(), 1, monkeypatch, scoped=scoped)
        stats = handle.stats()["total"]
    assert stats["calls"] > 0 and (not options or 0 < stats["skipped_fraction"] < 1), stats
    assert not syncs, syncs


def test_the_residual_cache_with_references_decodes_without_a_host_sync(monkeypatch):
    """The residual cache's layout with references (every `stride`-th token) splits the tokens leaving its window by
    positions made from host-known counts: no `any()`, no boolean-mask indexing in a decoding step."""
    from hf_deltakv import ResidualKVCache
    from hf_deltakv.residual import layer

    from .conftest import tiny_compressor, tiny_model

    monkeypatch.setenv("HF_DELTAKV_KERNELS", "triton")
    monkeypatch.setattr(layer, "CODE_BATCH", 1)  # every decoding step codes the token leaving the window
    model = tiny_model()
    cache = ResidualKVCache(model=model, compressor=tiny_compressor(model), stride=4, sink_tokens=4, window=8)
    syncs = _decoding_syncs(model, cache, 2, monkeypatch)
    assert cache.layers[0].compressed == 40 + 3 - 4 - 8 and cache.layers[0].references is not None
    assert not syncs, syncs


@pytest.mark.parametrize("spec", SPECS)
def test_layers_on_two_devices_launch_on_their_own(spec, monkeypatch):
    """A model split by `device_map` (layer 0 on one device, layer 1 on another: here `cpu` and `meta`, the launches
    recorded, none run): every launch runs under the device guard of its layer's device and reads tensors on it only,
    the shared position log included (`PositionLog.at`)."""
    from .conftest import tiny_model

    monkeypatch.setenv("HF_DELTAKV_KERNELS", "triton")
    model = tiny_model()
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    cache = DeltaKVCache(kf=8, keys="token", model=model) if spec == "delta-token" else build_cache(spec, model)
    devices = (torch.device("cpu"), torch.device("meta"))
    with LaunchRecorder() as recorder, torch.no_grad():
        for start, n in ((0, 40), (40, 1), (41, 8)):
            ids = torch.arange(start, start + n)[None].expand(2, n)
            for layer, device in enumerate(devices):
                states = torch.zeros(2, heads, n, dim, device=device)
                cache.update(states, states, layer, position_ids=ids.to(device))
                query = torch.zeros(2, config.num_attention_heads, n, dim, device=device)
                cache.layers[layer].attend(query, None, dim**-0.5)
    on = {device: [launch for launch in recorder.launches if launch.device == device] for device in devices}
    assert on[devices[0]] and on[devices[1]], spec
    problems = [problem for launch in recorder.launches for problem in audit(launch)]
    assert not problems, problems


def test_total_nbytes_all_reduces_on_the_backends_device(monkeypatch):
    """Under NCCL (tensor parallelism on GPUs) the all-reduce of `total_nbytes` takes a tensor on the rank's GPU, not a
    CPU tensor NCCL cannot read; under gloo a CPU one."""
    import torch.distributed as dist

    from hf_deltakv import cache as cache_module

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("cpu:gloo,cuda:nccl", torch.device("cuda", 1)),
                            ("gloo", torch.device("cpu"))):  # fmt: skip
        monkeypatch.setattr(dist, "get_backend", lambda group=None, backend=backend: backend)
        assert cache_module.collective_device() == device, backend
    reduced = []
    monkeypatch.setattr(cache_module, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: reduced.append(tensor.device))

    class Held:
        def nbytes(self):
            return 7

    with pytest.raises(RuntimeError, match="meta"):  # a meta tensor's value cannot be read: the reduction was on `meta`
        cache_module.total_nbytes(Held())
    assert reduced == [torch.device("meta")]


def test_the_tests_run_programs_out_of_order():
    """The interpreter's programs run reversed or shuffled in every test (`conftest.interpreter_like_a_gpu`): a kernel
    whose programs race for one element (the last to write wins) shows it."""
    import triton
    import triton.language as tl

    from hf_deltakv.eval.gpu_path import ProgramOrder

    @triton.jit
    def last_writer(out_ptr):
        tl.store(out_ptr, tl.program_id(0))

    out = torch.zeros(1, dtype=torch.int32)
    for order, last in (("reverse", 0), ("shuffle", int(np.random.default_rng(2).permutation(64)[-1]))):
        with ProgramOrder(order, seed=2) as programs:
            last_writer[(64,)](out)
        assert programs.launches == 1 and int(out) == last != 63, (order, int(out))
    last_writer[(64,)](out)  # this test's own order (the first launch of a test: reversed), not the grid's
    assert int(out) == 0


def test_the_tests_divide_as_a_gpu_may():
    """Every test's interpreted `/` is one ulp off (`conftest.interpreter_like_a_gpu`), `tl.math.div_rn` exact: a
    kernel promising the reference's bytes must divide with `div_rn`."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide(x_ptr, y_ptr, plain_ptr, exact_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x, y = tl.load(x_ptr + i), tl.load(y_ptr + i)
        tl.store(plain_ptr + i, x / y)
        tl.store(exact_ptr + i, tl.math.div_rn(x, y))

    x, y = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    plain, exact = torch.empty(16), torch.empty(16)
    divide[(1,)](x, y, plain, exact, N=16)
    assert torch.equal(exact, x / y)
    assert torch.equal(plain, torch.nextafter(x / y, torch.tensor(float("inf"))))


# JIT compiles per kernel a 300-step generation may cause (`compile_keys` for an H100): lengths, positions, chunk
# sizes and query rows are runtime values (`do_not_specialize`), so what still varies is bounded: G_PAD and the tiles'
# row counts (powers of two), one query or several, formats, and whether a growing buffer's outer strides and the
# position log's offset are multiples of 16 (alignment the loads are vectorized on). Measured: at most 21 (the
# token-delta attention's split), 3-5 for most; before, chunk sizes were constexprs (up to 130).
COMPILES = 24


@pytest.mark.parametrize("spec", ON_META)
def test_a_generation_compiles_each_kernel_a_bounded_number_of_times(spec, monkeypatch):
    """A simulated generation of 300 steps (decoding steps and chunks of 2-64 tokens, as chunked prefill and assisted
    decoding feed them) compiles each kernel at most `COMPILES` times for an H100."""
    from hf_deltakv.eval.gpu_path import compile_keys

    monkeypatch.setenv("HF_DELTAKV_KERNELS", "triton")
    launches = record(spec, 1, [20] + [1 if i % 3 else i % 64 + 1 for i in range(300)], monkeypatch)
    compiles = {kernel: len(keys) for kernel, keys in compile_keys(launches).items()}
    assert compiles and max(compiles.values()) <= COMPILES, compiles


def test_planes_off_word_boundaries_are_left_to_the_reference():
    """The adaptive kernels read a group's bit planes as words of group / 8 bytes; planes in an offset view (a
    misaligned address on a GPU, which the interpreter reads anyway) are not sent to them."""
    import dataclasses

    from hf_deltakv.kernels.triton import adaptive_attention, reconstruct

    from .test_kernels_adaptive_triton import _streams

    keys, values = _streams(1, 2, 70, 32, 32, 4, "q4_0", True, torch.Generator().manual_seed(0))
    planes = keys.planes
    shifted = torch.empty(planes.numel() + 1, dtype=torch.uint8)[1:].view(planes.shape)
    shifted.copy_(planes)
    moved = dataclasses.replace(keys, planes=shifted)
    out = torch.empty(1, 2, 70, 32)
    assert adaptive_attention.supports(keys, values, None) and reconstruct.serves(keys, out)
    assert not adaptive_attention.supports(moved, values, None) and not reconstruct.serves(moved, out)


# Kernels held to the reference's bytes (their tests compare bytes): launched without FMA contraction (`EXACT`), a
# GPU's default, which the interpreter never applies (it rounds every multiply and add).
BYTE_EXACT = ("_code_groups_kernel", "_undo_rope_kernel", "_quantize_rows_kernel", "_query_energies_kernel",
              "_delta_encode_kernel", "_delta_tokens_kernel", "_plain_values_kernel", "_adaptive_keys_kernel",
              "_encode_kernel", "_dequantize_latent_kernel", "_snapkv_evict_kernel")  # fmt: skip


def test_kernels_held_to_bytes_launch_without_fma_contraction():
    launches = {}
    for path in sorted(TRITON.glob("*.py")):
        for call in path.read_text().split("on_device(")[1:]:
            name = call.split(")", 1)[0].rsplit(".", 1)[-1]  # (a kernel of another module: `module._kernel`)
            launches.setdefault(name, []).append(call.split("\n\n", 1)[0])
    assert set(BYTE_EXACT) <= set(launches), set(BYTE_EXACT) - set(launches)
    missing = [name for name in BYTE_EXACT for call in launches[name] if "**EXACT" not in call]
    assert not missing, missing
