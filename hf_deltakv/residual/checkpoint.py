"""Compressor checkpoints: safetensors weights plus a JSON config, tied to the model they were trained for.

Never pickles: a checkpoint from the internet must not be able to run code. The config records the model's shape
and a probe of its key-projection weights; loading for another model fails with a clear error instead of
silently corrupting the cache.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..persist import model_signature, replace_folder
from .compressor import ResidualCompressor, ResidualConfig

WEIGHTS_NAME = "compressor.safetensors"
CONFIG_NAME = "config.json"
FORMAT_VERSION = 1
BUILTIN_CHECKPOINTS = {"smollm2-135m": Path(__file__).parent / "checkpoints" / "smollm2-135m"}
DEFAULT_COMPRESSOR = "smollm2-135m"  # the built-in compressor of the embedded default model


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


# Bounds on a checkpoint's sizes, checked before anything is allocated (a config from the internet must not be able
# to exhaust memory): far above any model this library serves.
LIMITS = {"num_layers": 1024, "kv_heads": 1024, "head_dim": 4096}
MAX_LATENT_PER_CHANNEL = 4  # latent_dim <= 4 x kv_heads x head_dim (the fit uses 1x)
MAX_CONFIG_BYTES = 16 * 2**20


def save_compressor(compressor: ResidualCompressor, directory: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write `compressor.safetensors` (weights in `dtype`) and `config.json` into `directory`, atomically: the files
    are written into a new folder that then replaces `directory`, so a save killed half-way leaves the previous one."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f".{directory.name}.saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in compressor.state_dict().items()}
    save_file(tensors, str(staging / WEIGHTS_NAME), metadata={"format_version": str(FORMAT_VERSION)})
    payload = {"format_version": FORMAT_VERSION, **compressor.config.to_dict()}
    (staging / CONFIG_NAME).write_text(json.dumps(payload, indent=1) + "\n")
    replace_folder(staging, directory)
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


def read_config(path_or_name: str | Path) -> ResidualConfig:
    """A checkpoint's config, checked before anything is allocated: its format, field types, sizes within `LIMITS`,
    a model signature to check models against, and weights whose names and shapes match it (read from the
    safetensors header only)."""
    directory = resolve_checkpoint(path_or_name)
    config_path = directory / CONFIG_NAME
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{config_path} is larger than {MAX_CONFIG_BYTES} bytes: not a compressor config")
    try:
        payload = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(payload, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    version = payload.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{directory} has checkpoint format {version!r}; this hf_deltakv reads {FORMAT_VERSION}")
    for key, limit in LIMITS.items():
        value = payload.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ValueError(f"{config_path}: {key} must be an integer in [1, {limit}], got {value!r}")
    stream = payload["kv_heads"] * payload["head_dim"]
    latent = payload.get("latent_dim")
    if not isinstance(latent, int) or isinstance(latent, bool) or not 1 <= latent <= MAX_LATENT_PER_CHANNEL * stream:
        raise ValueError(f"{config_path}: latent_dim must be an integer in [1, {MAX_LATENT_PER_CHANNEL * stream}]")
    model = payload.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("probe"), list) or not model["probe"]:
        raise ValueError(f"{config_path} has no model signature (model.probe): it cannot be checked against a model")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in model["probe"]):
        raise ValueError(f"{config_path}: the model probe must be finite numbers")
    try:
        config = ResidualConfig.from_dict(payload)
    except TypeError as err:
        raise ValueError(f"{config_path}: {err}") from err
    _check_weights(directory / WEIGHTS_NAME, config)
    return config


def _check_weights(path: Path, config: ResidualConfig) -> None:
    """The weights file holds exactly the compressor's tensors, at their shapes (the header only is read)."""
    from safetensors import safe_open

    expected = {name: tuple(shape) for name, shape in ResidualCompressor.parameter_shapes(config).items()}
    try:
        with safe_open(str(path), framework="pt") as handle:
            found = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    if found != expected:
        missing = sorted(set(expected) - set(found))[:3]
        odd = sorted(n for n in found if n in expected and found[n] != expected[n])[:3]
        extra = sorted(set(found) - set(expected))[:3]
        raise ValueError(f"{path} does not match its config: missing {missing}, other shapes {odd}, unknown {extra}")


def load_compressor(path_or_name: str | Path, model: nn.Module | None = None) -> ResidualCompressor:
    """Load a compressor (weights in fp32) saved by `save_compressor`: the config is checked (`read_config`, and
    against `model` when given) before anything is allocated, and non-finite weights are refused."""
    from safetensors.torch import load_file

    config = read_config(path_or_name)
    if model is not None:
        check_compatible(config, model)
    compressor = ResidualCompressor(config)
    state = {k: v.float() for k, v in load_file(str(resolve_checkpoint(path_or_name) / WEIGHTS_NAME)).items()}
    bad = [name for name, value in state.items() if not torch.isfinite(value).all()]
    if bad:
        raise ValueError(f"{path_or_name}: non-finite weights in {bad[:3]}")
    compressor.load_state_dict(state, strict=True)
    return compressor.eval().requires_grad_(False)
