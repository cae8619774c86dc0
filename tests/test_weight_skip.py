"""Weight skip: exact mode changes nothing, skipped rows are never read, the kernels compute the specification,
calibration groups shared inputs and reaches its budget, changes to the weights are followed, the hook comes off
cleanly, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_deltakv import kernels
from hf_deltakv.eval.texts import load_text
from hf_deltakv.kernels.reference import sparse_matvec
from hf_deltakv.weight_skip import (
    CURVE_LEVELS,
    MAX_SPARSITY,
    WATCH_CALLS,
    SkipCalibration,
    SkipSimulator,
    block_max,
    calibrate,
    enable_weight_skip,
    keep_mask,
)

from .conftest import tiny_model


def _linear(n_in=70, n_out=24, bias=True, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(n_in, n_out, bias=bias).to(dtype)


def _tokens(windows=2, length=24) -> torch.Tensor:
    return torch.randint(3, 128, (windows, length), generator=torch.Generator().manual_seed(1))


def _decode_logits(model, prompt: torch.Tensor, steps: int = 4) -> torch.Tensor:
    """Logits of a prefill on `prompt[:, :-steps]`, then of `steps` decode calls fed the prompt's next tokens (teacher
    forced: one different token would otherwise make every later comparison one of different contexts)."""
    with torch.no_grad():
        out = model(prompt[:, :-steps], use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1]]
        for t in range(prompt.shape[1] - steps, prompt.shape[1]):
            out = model(prompt[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


# --- the kernel against its specification ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3),
    n_in=st.integers(1, 300),
    n_out=st.integers(1, 70),
    threshold=st.sampled_from([0.0, 0.3, 1.0, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    with_scale=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_cpu_kernel_computes_the_specification(rows, n_in, n_out, threshold, dtype, with_scale, with_bias, seed):
    torch.manual_seed(seed)
    x = (torch.randn(rows, 1, n_in) * torch.rand(n_in) ** 3).to(dtype)  # heavy-tailed, as real activations
    x[..., ::7] = 0
    wt = torch.randn(n_in, n_out).to(dtype)
    bias = torch.randn(n_out).to(dtype) if with_bias else None
    scale = torch.rand(n_in) + 0.2 if with_scale else None
    expected, kept = sparse_matvec(x, wt, bias, scale, threshold)
    got, got_kept = kernels.sparse_matvec(x, wt, bias, scale, threshold)
    assert got.dtype == dtype and got.shape == (rows, 1, n_out)
    assert got_kept == kept
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * max(1, n_in**0.5), rtol=tol)


def test_cpu_kernel_never_reads_skipped_rows():
    x, wt, bias = torch.randn(2, 1, 200), torch.randn(200, 33), torch.randn(33)
    x[..., 64:150] = 0
    expected = x[..., :64] @ wt[:64] + x[..., 150:] @ wt[150:] + bias
    wt[64:150] = float("nan")  # would poison any product that read them
    got, kept = kernels.sparse_matvec(x, wt, bias, None, 0.0)
    assert kept == 114
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    threshold=st.floats(0.0, 0.5),
    n_in=st.integers(1, 100),
    block_size=st.sampled_from([1, 4, 16, 32]),
    seed=st.integers(0, 10_000),
)
def test_bound_rule_bounds_every_output_error(threshold, n_in, block_size, seed):
    torch.manual_seed(seed)
    weight = torch.randn(8, n_in)
    x = torch.randn(2, n_in) * torch.rand(n_in) ** 4  # heavy-tailed magnitudes, as in real activations
    bounds = block_size * block_max(weight, block_size).amax(0) * block_max(x, block_size)
    keep = keep_mask(bounds, threshold)
    for row in range(2):
        columns = keep[row].repeat_interleave(block_size)[:n_in]
        got, _ = sparse_matvec(x[row : row + 1] * columns, weight.T, None, None, 0.0)
        error = (got - x[row : row + 1] @ weight.T).abs().max().item()
        assert error <= threshold * bounds[row].sum().item() * (1 + 1e-5) + 1e-5
        assert bool(keep[row][bounds[row] > threshold * bounds[row].sum()].all())


# --- exact mode ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_exact_mode_equals_plain_linear_and_never_reads_zero_channels(dtype, bias):
    layer = _linear(bias=bias, dtype=dtype)
    x = torch.randn(3, 1, 70).to(dtype)
    x[0, 0, :32] = 0  # zero in one sequence only: still computed for the batch
    x[:, :, 32:64] = 0  # zero everywhere: skipped
    with torch.no_grad():
        expected = layer(x)
        with enable_weight_skip(layer, threshold=0.0, modules=[""]) as handle:
            for _ in range(WATCH_CALLS):  # 32 of 70 channels zero: worth skipping, from the end of the watch on
                layer(x)
            layer.weight[:, 32:64] = float("nan")
            got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    stats = handle.stats()[""]
    assert stats["calls"] == WATCH_CALLS + 1 and stats["channels_skipped"] == (WATCH_CALLS + 1) * 32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_mode_with_half_precision_weights_takes_the_kernel_from_the_first_call(dtype):
    layer = _linear(n_in=64, dtype=dtype)
    x = torch.randn(1, 1, 64).to(dtype)  # nothing to skip: on the CPU the kernel still beats the dense matvec
    with torch.no_grad(), enable_weight_skip(layer, modules=[""]) as handle:
        assert not layer.weight.is_contiguous()  # stored input-major when enabled, not mid-generation
        got = layer(x)
    torch.testing.assert_close(got, layer(x), atol=2e-2, rtol=2e-2)
    assert handle.stats()[""]["calls"] == 1 and handle.stats()[""]["channels_skipped"] == 0


@pytest.mark.parametrize("zeros", [0, 8])  # fp32: 8 of 64 zero channels would not pay for the kernel
def test_exact_mode_steps_aside_where_too_little_is_zero(zeros):
    layer = _linear(n_in=64)
    with torch.no_grad(), enable_weight_skip(layer, modules=[""]) as handle:
        for _ in range(WATCH_CALLS):
            x = torch.randn(1, 1, 64)
            x[..., :zeros] = 0
            layer(x)
        assert "forward" not in layer.__dict__  # the class's own forward again: no cost at all
        assert handle.stats()[""]["channels_skipped"] == WATCH_CALLS * zeros


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_exact_mode_generates_the_same_tokens(arch):
    model = tiny_model(arch)
    prompt = torch.randint(3, 128, (2, 7))
    plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    with enable_weight_skip(model, threshold=0.0):
        skipped = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, skipped)


def test_only_decode_shaped_inputs_take_the_skipping_path():
    layer = _linear(n_in=64)
    x = torch.randn(1, 5, 64)
    with torch.no_grad(), enable_weight_skip(layer, threshold=0.3, modules=[""]) as handle:
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert handle.stats()[""]["calls"] == 0
        layer(x[:, :1])
        assert handle.stats()[""]["calls"] == 1
    with enable_weight_skip(layer, threshold=0.3, modules=[""]) as handle:
        layer(x[:, :1]).sum().backward()  # training keeps the layer's own path (and its gradients)
        assert handle.stats()[""]["calls"] == 0 and layer.weight.grad is not None


# --- calibrated mode -------------------------------------------------------------------------------------------------


def test_calibration_groups_projections_that_share_their_input():
    model = tiny_model("llama")
    with enable_weight_skip(model, sparsity=0.3, calibration=_tokens()) as handle:
        groups = handle.groups
    attention = "model.layers.0.self_attn"
    assert [f"{attention}.q_proj", f"{attention}.k_proj", f"{attention}.v_proj"] in groups
    assert ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"] in groups
    assert [f"{attention}.o_proj"] in groups and ["model.layers.0.mlp.down_proj"] in groups


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5])
def test_calibrated_sparsity_is_close_to_the_budget_and_the_error_grows_with_it(sparsity):
    model = tiny_model("llama")
    prompt = _tokens(1, 16)
    plain = _decode_logits(model, prompt)
    calibration = calibrate(model, _all_linears(model), _tokens(4, 32))
    with enable_weight_skip(model, sparsity=sparsity, calibration=calibration) as handle:
        skipped = _decode_logits(model, prompt)
    fraction = handle.stats()["total"]["skipped_fraction"]
    assert abs(fraction - sparsity) < 0.12, fraction  # calibrated on other text than it runs on
    error = ((skipped - plain).norm() / plain.norm()).item()
    if sparsity == 0:
        assert error < 1e-5
    else:
        assert 1e-4 < error < 2 * sparsity


def _all_linears(model) -> list[str]:
    """What `enable_weight_skip` selects by default: every linear, the output head included."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_calibration_saves_loads_and_refuses_tampered_or_mismatched_files(tmp_path):
    model = tiny_model("llama")
    names = _all_linears(model)
    calibration = calibrate(model, names, _tokens())
    path = calibration.save(tmp_path / "skip.json")
    loaded = SkipCalibration.load(path)
    assert loaded == calibration
    assert loaded.allocate(0.3) == calibration.allocate(0.3)
    text = path.read_text()
    for tampered in (
        text.replace('"thresholds": [', '"thresholds": [-1, ', 1),
        text.replace('"version": 5', '"version": 4'),
        text.replace('"kl": [', '"kl": [NaN, ', 1),  # a KL curve one level too long, with a NaN
        text.replace('"share": ', '"share": -', 1),
        text.replace('"kinds": {', '"kinds": {"x": {"share": 0.5, "kl": [0, 0, 0, 0, 0, 0, 0, 0, 0]}, ', 1),  # sum > 1
        text[: len(text) // 2],
        "[]",
    ):
        path.write_text(tampered)
        with pytest.raises(ValueError, match="not a weight-skip calibration"):
            SkipCalibration.load(path)
    with pytest.raises(ValueError, match="does not match the selected modules"):
        enable_weight_skip(model, sparsity=0.2, calibration=calibration, modules=names[:3])
    with pytest.raises(ValueError, match="sparsity must be"):
        calibration.allocate(0.97)


def test_the_allocation_spends_sparsity_where_the_measured_kl_is_lowest_and_meets_the_budget():
    calibration = calibrate(tiny_model("llama"), _all_linears(tiny_model("llama")), _tokens())
    assert set(calibration.kinds) == {
        "model.layers.*.self_attn.q_proj,model.layers.*.self_attn.k_proj,model.layers.*.self_attn.v_proj",
        "model.layers.*.self_attn.o_proj",
        "model.layers.*.mlp.gate_proj,model.layers.*.mlp.up_proj",
        "model.layers.*.mlp.down_proj",
        "lm_head",
    }
    assert all(entry["kl"][-1] > entry["kl"][0] >= 0 for entry in calibration.kinds.values())  # measured, rising
    cheap, dear = "model.layers.*.mlp.down_proj", "model.layers.*.self_attn.o_proj"
    for kind, entry in calibration.kinds.items():  # make one kind nearly free and one dear, the others in between
        entry["kl"] = [level * (0.001 if kind == cheap else 10 if kind == dear else 1) for level in CURVE_LEVELS]
    for sparsity in (0.0, 0.1, 0.3, 0.6, MAX_SPARSITY):
        levels = calibration.kind_levels(sparsity)
        budget = sum(calibration.kinds[kind]["share"] * level for kind, level in levels.items())
        assert budget == pytest.approx(sparsity, abs=1e-6)
        assert levels[cheap] >= levels[dear] and max(levels.values()) <= MAX_SPARSITY + 1e-9
    assert calibration.kind_levels(0.05)[dear] == 0 and calibration.kind_levels(0.05)[cheap] > 0


def test_the_calibration_is_cached_per_model_and_module_selection(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DELTAKV_CACHE", str(tmp_path))
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="tokenizer"):  # a tiny random model has no tokenizer to calibrate with
        enable_weight_skip(model, sparsity=0.2)
    made = enable_weight_skip(model, sparsity=0.2, calibration=_tokens())
    made.remove()
    made.calibration.save(next(iter([tmp_path / "weight_skip" / "x.json"])))  # a saved one can be passed by path
    with enable_weight_skip(model, sparsity=0.2, calibration=tmp_path / "weight_skip" / "x.json") as handle:
        assert handle.calibration == made.calibration


# --- weights changing under the hook ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [dict(sparsity=0.3), dict(threshold=0.0)])
def test_weight_changes_while_enabled_are_followed(mode):
    model = tiny_model("llama")
    prompt = _tokens(1, 12)
    extra = dict(calibration=_tokens()) if "sparsity" in mode else {}
    with enable_weight_skip(model, **mode, **extra) as handle:
        before = _decode_logits(model, prompt)
        # load_state_dict with other weights
        other = tiny_model("llama")
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(1.1)
        model.load_state_dict(other.state_dict())
        loaded = _decode_logits(model, prompt)
        # .data replaced
        down = model.model.layers[1].mlp.down_proj
        down.weight.data = down.weight.data * 0.5
        replaced = _decode_logits(model, prompt)
    assert not torch.allclose(before, loaded)
    if handle.calibration is not None:  # the thresholds stay those calibrated (on the weights of then)
        extra = dict(calibration=handle.calibration)
    with enable_weight_skip(other, **mode, **extra):
        torch.testing.assert_close(loaded, _decode_logits(other, prompt), atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # written in place (seen through the weight's version counter)
            other.model.layers[1].mlp.down_proj.weight.mul_(0.5)
        torch.testing.assert_close(replaced, _decode_logits(other, prompt), atol=1e-5, rtol=1e-5)


def test_a_cast_while_enabled_is_followed():
    model = tiny_model("llama")
    reference = tiny_model("llama").to(torch.bfloat16)
    prompt = _tokens(1, 12)
    with enable_weight_skip(model, threshold=0.0):
        model.to(torch.bfloat16)
        got = _decode_logits(model, prompt)
    torch.testing.assert_close(got, _decode_logits(reference, prompt), atol=2e-2, rtol=2e-2)


def test_state_dict_while_enabled_is_contiguous_and_saves(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    with enable_weight_skip(model, sparsity=0.2, calibration=_tokens()):
        assert not model.model.layers[0].mlp.down_proj.weight.is_contiguous()  # input-major storage while enabled
        state = model.state_dict()
        assert all(t.is_contiguous() for t in state.values())
        save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "m.safetensors")
    loaded = load_file(tmp_path / "m.safetensors")
    assert torch.equal(loaded["model.layers.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight)


def test_remove_restores_forward_and_layout():
    model = tiny_model("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    handle = enable_weight_skip(model, sparsity=0.1, calibration=_tokens())
    assert not model.model.layers[0].mlp.down_proj.weight.is_contiguous()
    handle.remove()
    handle.remove()  # idempotent
    for name, p in model.named_parameters():
        assert p.is_contiguous() and torch.equal(p, before[name]), name
    assert "forward" not in model.model.layers[0].mlp.down_proj.__dict__


def test_works_with_the_compressed_cache_in_the_same_generate():
    from hf_deltakv import DeltaKVCache

    model = tiny_model("llama")
    prompt = _tokens(2, 40)
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=DeltaKVCache())
    with enable_weight_skip(model, threshold=0.0) as handle:
        skipped = model.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=DeltaKVCache())
    assert torch.equal(plain, skipped) and handle.stats()["total"]["calls"] > 0


def test_the_output_head_is_included_unless_left_out_and_stats_cover_every_module():
    model = tiny_model("llama")
    with enable_weight_skip(model, include_lm_head=False) as handle:
        assert "lm_head" not in handle.stats()
    with enable_weight_skip(model) as handle:
        model.generate(torch.randint(3, 128, (2, 4)), max_new_tokens=3, do_sample=False)
        stats = handle.stats()
    assert "lm_head" in stats and "model.layers.1.self_attn.q_proj" in stats
    assert stats["total"]["calls"] == sum(s["calls"] for n, s in stats.items() if n != "total") > 0


def test_the_simulator_computes_what_decoding_token_by_token_computes():
    """`SkipSimulator` applies the rule to every token of one forward; decoding a sequence from its first token applies
    it to every token one at a time (through the kernel): the same logits, to float rounding."""
    model = tiny_model("llama")
    calibration = calibrate(model, _all_linears(model), _tokens())
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), SkipSimulator(model, calibration=calibration).skipping(0.3):
        simulated = model(ids).logits
    with enable_weight_skip(model, sparsity=0.3, calibration=calibration) as handle:
        decoded = _decode_logits(model, ids, steps=ids.shape[1] - 1)
        assert handle.stats()["total"]["skipped_fraction"] > 0.1
    plain = _decode_logits(model, ids, steps=ids.shape[1] - 1)
    assert (decoded - plain).abs().max() > 1e-2  # it skipped something that shows
    torch.testing.assert_close(decoded, simulated, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain, atol=1e-4, rtol=1e-4)  # the hooks came off


def test_accelerate_hooked_modules_keep_their_hook():
    """device_map-placed models wrap forward in an accelerate hook that calls `_old_forward`: patch that one."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class CountingHook(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            CountingHook.calls += 1
            return args, kwargs

    layer = _linear(n_in=64)
    add_hook_to_module(layer, CountingHook())
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        with enable_weight_skip(layer, threshold=0.2, modules=[""]) as handle:
            got = layer(x)
        after = layer(x)
    assert CountingHook.calls == 2 and handle.stats()[""]["calls"] == 1
    torch.testing.assert_close(got, expected, atol=0.5, rtol=0.5)
    torch.testing.assert_close(after, expected)
    remove_hook_from_module(layer)
    torch.testing.assert_close(layer(x), expected)


def test_bad_input_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="threshold"):
        enable_weight_skip(model, threshold=-0.1)
    with pytest.raises(ValueError, match="block_size"):
        enable_weight_skip(model, block_size=0)
    with pytest.raises(ValueError, match="sparsity must be"):
        enable_weight_skip(model, sparsity="0.5")
    with pytest.raises(ValueError, match="not both"):
        enable_weight_skip(model, sparsity=0.2, threshold=0.1)
    with pytest.raises(ValueError, match="calibration is used with sparsity"):
        enable_weight_skip(model, calibration=_tokens())
    with pytest.raises(TypeError, match="calibration must be"):
        enable_weight_skip(model, sparsity=0.2, calibration=3)
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        enable_weight_skip(model, modules=["model.norm"])
    with pytest.raises(ValueError, match="no module"):
        enable_weight_skip(model, modules=["model.nothing"])
    with enable_weight_skip(model), pytest.raises(ValueError, match="already enabled"):
        enable_weight_skip(model)


# --- the real model --------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_model_exact_is_identical_and_calibrated_sparsity_stays_close(real_model):
    model, tokenizer = real_model
    ids = tokenizer("The history of the printing press", return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    with enable_weight_skip(model, threshold=0.0):
        assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False), plain)
    text = tokenizer(load_text("python-docs")[50_000:53_000], return_tensors="pt").input_ids[:, :96]
    reference = _decode_logits(model, text, steps=32)
    with enable_weight_skip(model, sparsity=0.25) as handle:
        skipped = _decode_logits(model, text, steps=32)
    assert abs(handle.stats()["total"]["skipped_fraction"] - 0.25) < 0.1
    agree = (skipped.argmax(-1) == reference.argmax(-1)).float().mean().item()
    log_p, log_q = reference.log_softmax(-1), skipped.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    assert agree >= 0.75 and kl < 0.1, (agree, kl)  # measured: about 0.85 and 0.03
