"""Compressor checkpoints: safetensors weights plus a JSON config, tied to the model they were trained for.

Never pickles: a checkpoint from the internet must not be able to run code. The config records the model's shape
and a probe of its key-projection weights; loading for another model fails with a clear error instead of
silently corrupting the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .compressor import ResidualCompressor, ResidualConfig

WEIGHTS_NAME = "compressor.safetensors"
CONFIG_NAME = "config.json"
FORMAT_VERSION = 1
BUILTIN_CHECKPOINTS = {"smollm2-135m": Path(__file__).parent / "checkpoints" / "smollm2-135m"}
DEFAULT_COMPRESSOR = "smollm2-135m"  # the built-in compressor of the embedded default model
PROBE_SIZE = 32


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_signature(model: nn.Module) -> dict:
    """Shape of the model's KV cache plus a probe of its first key projection's weights."""
    text = _text_config(model)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    probe = []
    for name, module in model.named_modules():
        if name.endswith("k_proj") and isinstance(module, nn.Linear):
            flat = module.weight.detach().float().flatten()
            probe = flat[:: max(flat.numel() // PROBE_SIZE, 1)][:PROBE_SIZE].tolist()
            break
    return {
        "model_type": getattr(text, "model_type", type(model).__name__),
        "name": getattr(model.config, "_name_or_path", ""),
        "num_layers": text.num_hidden_layers,
        "kv_heads": heads,
        "head_dim": head_dim,
        "probe": probe,
    }


def check_compatible(config: ResidualConfig, model: nn.Module) -> None:
    """Raise ValueError unless `model` is the model (shape and weights) the compressor was trained for."""
    have = model_signature(model)
    want = config.model
    trained_for = f"{want.get('name') or want.get('model_type')!r}"
    for key in ("num_layers", "kv_heads", "head_dim"):
        if key in want and want[key] != have[key]:
            raise ValueError(
                f"this residual compressor was trained for {trained_for} ({key}={want[key]}), but the model has "
                f"{key}={have[key]}; train one for this model with `hf-deltakv train-residual --model ...`"
            )
    probe, ours = want.get("probe") or [], have["probe"]
    if probe and (
        len(probe) != len(ours) or not torch.allclose(torch.tensor(probe), torch.tensor(ours), rtol=2e-2, atol=2e-3)
    ):
        raise ValueError(
            f"this residual compressor was trained for {trained_for}, whose weights differ from this model's "
            f"({have['name'] or have['model_type']!r}); train one for this model with `hf-deltakv train-residual`"
        )


def save_compressor(compressor: ResidualCompressor, directory: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write `compressor.safetensors` (weights in `dtype`) and `config.json` into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in compressor.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format_version": str(FORMAT_VERSION)})
    payload = {"format_version": FORMAT_VERSION, **compressor.config.to_dict()}
    (directory / CONFIG_NAME).write_text(json.dumps(payload, indent=1) + "\n")
    return directory


def resolve_checkpoint(path_or_name: str | Path) -> Path:
    """A built-in name (`smollm2-135m`) or a directory holding `config.json` and `compressor.safetensors`."""
    if isinstance(path_or_name, str) and path_or_name in BUILTIN_CHECKPOINTS:
        return BUILTIN_CHECKPOINTS[path_or_name]
    path = Path(path_or_name)
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise ValueError(
            f"{str(path_or_name)!r} is neither a built-in compressor {sorted(BUILTIN_CHECKPOINTS)} nor a directory "
            f"with {CONFIG_NAME} and {WEIGHTS_NAME}"
        )
    return path


def load_compressor(path_or_name: str | Path) -> ResidualCompressor:
    """Load a compressor (weights in fp32) saved by `save_compressor`."""
    from safetensors.torch import load_file

    directory = resolve_checkpoint(path_or_name)
    payload = json.loads((directory / CONFIG_NAME).read_text())
    version = payload.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{directory} has checkpoint format {version!r}; this hf_deltakv reads {FORMAT_VERSION}")
    compressor = ResidualCompressor(ResidualConfig.from_dict(payload))
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS_NAME)).items()}
    compressor.load_state_dict(state, strict=True)
    return compressor.eval().requires_grad_(False)
