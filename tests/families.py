"""Tiny random models of transformers' decoder-only families (unit tests only): every rotary form, sliding and
chunked layers, NoPE layers, MLA, absolute positions; and hybrids the caches must refuse when built."""

from __future__ import annotations

import torch
import transformers

# Shared by every family: 2 heads sharing 1 kv head (GQA) of 32 channels, a vocabulary of 128 (ids 3..127 are drawn).
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SLIDING = dict(sliding_window=8)

# Family -> (config class, options beyond BASE). Windows of 8 tokens and chunks of 8: a 12-token prompt crosses them.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", SLIDING),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, **SLIDING, layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, num_hidden_layers=3, **SLIDING, sliding_window_pattern=2)),
    "phi": ("PhiConfig", dict(num_key_value_heads=2, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "gpt-neox": ("GPTNeoXConfig", dict(rotary_pct=0.25)),
    "cohere": ("CohereConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "stablelm": ("StableLmConfig", dict(num_key_value_heads=2, partial_rotary_factor=0.25)),
    "granite": ("GraniteConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "glm": ("GlmConfig", dict(head_dim=32, partial_rotary_factor=0.5)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "gpt-oss": (
        "GptOssConfig",
        dict(
            head_dim=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            **SLIDING,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "llama4": (
        "Llama4TextConfig",
        dict(
            head_dim=32,
            num_hidden_layers=4,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            attention_chunk_size=8,
            no_rope_layers=[1, 1, 1, 0],
            interleave_moe_layer_step=2,
        ),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=2,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            kv_lora_rank=32,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=2, n_positions=512, n_inner=128)),
    "falcon": ("FalconConfig", dict(num_kv_heads=1, new_decoder_architecture=True, alibi=False)),
    "exaone4": ("Exaone4Config", dict(num_hidden_layers=4, **SLIDING, sliding_window_pattern=4)),
}

# Families whose cache is not keys and values of every layer: refused when a cache is built, with the reason.
REFUSED: dict[str, tuple[str, dict]] = {
    "jamba": (
        "JambaConfig",
        dict(
            num_experts=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=4,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
    ),
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            num_experts=2,
            head_dim=32,
            linear_num_value_heads=2,
            linear_num_key_heads=1,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
    "gemma3n": (
        "Gemma3nTextConfig",
        dict(
            num_hidden_layers=4,
            num_kv_shared_layers=2,
            head_dim=32,
            laurel_rank=8,
            hidden_size_per_layer_input=8,
            altup_num_inputs=2,
            activation_sparsity_pattern=[0.0] * 4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            **SLIDING,
        ),
    ),
}


def family_config(name: str):
    """The tiny config of a family of `FAMILIES` or `REFUSED`."""
    class_name, options = FAMILIES.get(name) or REFUSED[name]
    return getattr(transformers, class_name)(**{**BASE, **options})


def family_model(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(name), dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()
