"""Weight skip: exact mode changes nothing, the relative rule bounds the error, the weights of skipped blocks are
never needed, the hook comes off cleanly, and bad input is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hf_deltakv.ops.reference import skip_matvec
from hf_deltakv.weight_skip import block_max, enable_weight_skip, keep_mask

from .conftest import tiny_model


def _linear(n_in=70, n_out=24, bias=True, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(n_in, n_out, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_exact_mode_equals_plain_linear(dtype, bias):
    layer = _linear(bias=bias, dtype=dtype)
    x = torch.randn(3, 1, 70).to(dtype)
    x[0, 0, :32] = 0  # an all-zero block in one sequence only: still computed for the batch
    x[:, :, 32:64] = 0  # an all-zero block everywhere: skipped
    with torch.no_grad():
        expected = layer(x)
        with enable_weight_skip(layer, threshold=0.0, block_size=32, modules=[""]) as handle:
            got = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    stats = handle.stats()[""]
    assert stats["blocks_seen"] == 3 and stats["blocks_skipped"] == 1  # 70 inputs: blocks of 32, 32, 6 (padded)


def test_skipped_weights_are_never_read():
    layer = _linear(n_in=96)
    x = torch.randn(1, 1, 96)
    x[..., 32:64] = 0
    with torch.no_grad():
        expected = layer(x)
        with enable_weight_skip(layer, modules=[""]):
            layer.weight[:, 32:64] = float("nan")  # would poison any product that read them
            got = layer(x)
    torch.testing.assert_close(got, expected)


@settings(max_examples=40, deadline=None)
@given(
    threshold=st.floats(0.0, 0.5),
    n_in=st.integers(1, 100),
    block_size=st.sampled_from([1, 4, 16, 32]),
    seed=st.integers(0, 10_000),
)
def test_relative_rule_bounds_every_output_error(threshold, n_in, block_size, seed):
    torch.manual_seed(seed)
    weight = torch.randn(8, n_in)
    x = torch.randn(2, n_in) * torch.rand(n_in) ** 4  # heavy-tailed magnitudes, as in real activations
    bounds = block_size * block_max(weight, block_size).amax(0) * block_max(x, block_size)
    keep = keep_mask(bounds, threshold)
    for row in range(2):
        got = skip_matvec(x[row : row + 1], weight, None, keep[row], block_size)
        error = (got - x[row : row + 1] @ weight.T).abs().max().item()
        assert error <= threshold * bounds[row].sum().item() * (1 + 1e-5) + 1e-5
        assert bool(keep[row][bounds[row] > threshold * bounds[row].sum()].all())


def test_only_decode_shaped_inputs_take_the_skipping_path():
    layer = _linear(n_in=64)
    x = torch.randn(1, 5, 64)
    with torch.no_grad(), enable_weight_skip(layer, threshold=0.3, modules=[""]) as handle:
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert handle.stats()[""]["calls"] == 0
        layer(x[:, :1])
        assert handle.stats()[""]["calls"] == 1


def test_remove_restores_forward_and_layout():
    model = tiny_model("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    handle = enable_weight_skip(model, threshold=0.1)
    assert not model.model.layers[0].mlp.down_proj.weight.is_contiguous()  # input-major storage while enabled
    handle.remove()
    handle.remove()  # idempotent
    for name, p in model.named_parameters():
        assert p.is_contiguous() and torch.equal(p, before[name]), name
    assert "forward" not in model.model.layers[0].mlp.down_proj.__dict__


def test_lm_head_is_opt_in_and_stats_cover_every_module():
    model = tiny_model("llama")
    with enable_weight_skip(model) as handle:
        assert "lm_head" not in handle.stats()
    with enable_weight_skip(model, include_lm_head=True) as handle:
        model.generate(torch.randint(3, 128, (2, 4)), max_new_tokens=3, do_sample=False)
        stats = handle.stats()
    assert "lm_head" in stats and "model.layers.1.self_attn.q_proj" in stats
    assert stats["total"]["calls"] == sum(s["calls"] for n, s in stats.items() if n != "total") > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_exact_mode_generates_the_same_tokens(arch):
    model = tiny_model(arch)
    prompt = torch.randint(3, 128, (2, 7))
    plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    with enable_weight_skip(model, threshold=0.0):
        skipped = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, skipped)


def test_bad_input_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="threshold"):
        enable_weight_skip(model, threshold=-0.1)
    with pytest.raises(ValueError, match="block_size"):
        enable_weight_skip(model, block_size=0)
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        enable_weight_skip(model, modules=["model.norm"])
    with pytest.raises(ValueError, match="no module"):
        enable_weight_skip(model, modules=["model.nothing"])
    with enable_weight_skip(model), pytest.raises(ValueError, match="already enabled"):
        enable_weight_skip(model)


@pytest.mark.real_model
def test_exact_mode_greedy_generation_identical_on_the_real_model(real_model):
    model, tokenizer = real_model
    ids = tokenizer("The history of the printing press", return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    with enable_weight_skip(model, threshold=0.0) as handle:
        skipped = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(plain, skipped)
    assert handle.stats()["total"]["calls"] > 0


@pytest.mark.parametrize("zero_blocks", [1, 3])  # 3 of 4 kept: one dense product; 1 of 4 kept: rows gathered
def test_both_cpu_paths_compute_the_skipping_specification(zero_blocks):
    layer = _linear(n_in=128, n_out=40)
    x = torch.randn(1, 1, 128)
    x[..., : 32 * zero_blocks] *= 1e-6  # tiny blocks: skipped by a small relative budget
    with torch.no_grad(), enable_weight_skip(layer, threshold=1e-4, modules=[""]) as handle:
        got = layer(x)
    stats = handle.stats()[""]
    assert stats["blocks_skipped"] == zero_blocks
    assert stats["blocks_read"] == (4 if zero_blocks == 1 else 1)
    keep = torch.tensor([False] * zero_blocks + [True] * (4 - zero_blocks))
    expected = skip_matvec(x[0], layer.weight.detach(), layer.bias.detach(), keep, 32)
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-5)


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
        with enable_weight_skip(layer, modules=[""]) as handle:
            got = layer(x)
        after = layer(x)
    assert CountingHook.calls == 2 and handle.stats()[""]["calls"] == 1
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(after, expected)
    remove_hook_from_module(layer)
    torch.testing.assert_close(layer(x), expected)
