"""Files of caches and checkpoints: safetensors tensors with a JSON header, checked before anything is built.

Never pickles: a file from the internet must not be able to run code. A saved cache is one `.safetensors` file: its
tensors are the cache's state as held (packed codes, scales, raw tokens, positions: `nbytes()` of it), and its
metadata one JSON document: the format version, the cache's class and options, the model's signature (shape and a
probe of its key projection's weights) and each layer's non-tensor state; plus a SHA-256 of both, so that a file
changed after it was written is refused. Reading checks the JSON (sizes within bounds, the names of the state the
cache's own objects have) and the tensors' names, types and leading shapes from the file's header before any tensor
is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from .quant import FORMATS, QuantizedTensor, get_format

CACHE_FORMAT = 1
PROBE_SIZE = 32
MAX_HEADER_BYTES = 64 * 2**20
ALLOWED_DTYPES = {"torch.uint8", "torch.int8", "torch.int16", "torch.int32", "torch.int64", "torch.float16",
                  "torch.bfloat16", "torch.float32"}  # fmt: skip


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
        if name.endswith(("k_proj", "kv_a_proj_with_mqa", "c_attn", "query_key_value")) and isinstance(
            module, nn.Linear
        ):
            weight = module.weight.detach()
            weight = weight.to_local() if hasattr(weight, "to_local") else weight  # a rank's shard under TP
            flat = weight.float().flatten()
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


def same_model(want: dict, model: nn.Module) -> str | None:
    """None when `model` has the signature `want`, else what differs, in words."""
    have = model_signature(model)
    for key in ("model_type", "num_layers", "kv_heads", "head_dim"):
        if want.get(key) != have[key]:
            return f"{key}={want.get(key)!r} where this model has {have[key]!r}"
    probe, ours = want.get("probe") or [], have["probe"]
    if len(probe) != len(ours) or (
        probe and not torch.allclose(torch.tensor(probe), torch.tensor(ours), rtol=2e-2, atol=2e-3)
    ):
        return "other weights (a probe of the key projection differs)"
    return None


def replace_folder(new: Path, target: Path) -> None:
    """Put folder `new` in place of `target` (two renames: at every moment one complete version exists)."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


# --- object state <-> (JSON, tensors) -------------------------------------------------------------------------------


def state_of(obj, prefix: str, tensors: dict, skip: tuple[type, ...]) -> dict:
    """The state of `obj` (its attributes) as JSON, its tensors added to `tensors` under `prefix.name`.

    Tensors and `QuantizedTensor`s are stored; numbers, strings, flags, dtypes and block formats are written; dicts
    of number -> (tensor, number) (query statistics) both; other objects of the cache are recursed into when they
    are not of a `skip` type (shared or rebuilt ones: modules, RoPE, position logs, factories, buffers)."""
    out = {}
    for name, value in vars(obj).items():
        key = f"{prefix}.{name}"
        if name.startswith("_growing") or isinstance(value, (torch.device, set, *skip)) or callable(value):
            continue
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().contiguous()
            out[name] = {"tensor": key}
        elif isinstance(value, QuantizedTensor):
            for part in ("codes", "scales", "mins"):
                if getattr(value, part) is not None:
                    tensors[f"{key}.{part}"] = getattr(value, part).detach().contiguous()
            out[name] = {"quantized": key, "format": value.fmt.name, "dim": value.dim, "mins": value.mins is not None}
        elif isinstance(value, torch.dtype):
            out[name] = {"dtype": str(value)}
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif hasattr(value, "block_size") and getattr(value, "name", None) in FORMATS:
            out[name] = {"format": value.name}
        elif isinstance(value, dict):
            entries = {}
            for k, (t, n) in value.items():
                tensors[f"{key}.{k}"] = t.detach().contiguous()
                entries[str(int(k))] = int(n)
            out[name] = {"counts": entries, "tensors": key}
        else:
            out[name] = {"object": type(value).__name__, "state": state_of(value, key, tensors, skip)}
    return out


def restore_state(obj, state: dict, tensors: dict, device, lazy: frozenset[str]) -> None:
    """Set `obj`'s attributes from `state_of`'s JSON; only names `obj` has (or `lazy` ones a first update sets),
    with values of the kinds `state_of` writes; nested objects must be of the class written."""
    if not isinstance(state, dict):
        raise ValueError("a saved object's state must be a JSON object")
    have = vars(obj)
    for name, value in state.items():
        if name not in have and name not in lazy:
            raise ValueError(f"saved state names {name!r}, which {type(obj).__name__} does not have")
        current = have.get(name)
        if isinstance(value, dict) and "object" in value:
            if current is None or type(current).__name__ != value["object"]:
                raise ValueError(f"saved {name!r} is a {value['object']}, not the {type(current).__name__} built")
            restore_state(current, value["state"], tensors, device, lazy)
            continue
        setattr(obj, name, _value(value, tensors, device))


def _value(value, tensors: dict, device):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"unexpected saved value {value!r}")
    if "tensor" in value:
        return tensors[value["tensor"]].to(device)
    if "quantized" in value:
        key = value["quantized"]
        parts = {p: tensors[f"{key}.{p}"].to(device) for p in ("codes", "scales", "mins") if f"{key}.{p}" in tensors}
        return QuantizedTensor(get_format(value["format"]), int(value["dim"]), **parts)
    if "dtype" in value:
        if value["dtype"] not in ALLOWED_DTYPES:
            raise ValueError(f"unexpected saved dtype {value['dtype']!r}")
        return getattr(torch, value["dtype"].removeprefix("torch."))
    if "format" in value:
        return get_format(value["format"])
    if "counts" in value:
        return {int(k): (tensors[f"{value['tensors']}.{k}"].to(device), int(n)) for k, n in value["counts"].items()}
    raise ValueError(f"unexpected saved value {value!r}")


# --- the file --------------------------------------------------------------------------------------------------------


def _digest(header: dict, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def write_file(path: str | Path, header: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `tensors` and `header` (JSON) to one safetensors file, atomically (a temporary file renamed)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    storages = Counter(t.untyped_storage().data_ptr() for t in cpu.values() if t.numel())
    # views of one storage (a layer's state kept as rows of one tensor, never copied) are written apart
    cpu = {name: t.clone() if t.numel() and storages[t.untyped_storage().data_ptr()] > 1 else t
           for name, t in cpu.items()}  # fmt: skip
    metadata = {"hf_deltakv": json.dumps(header), "sha256": _digest(header, cpu)}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(cpu, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def read_header(path: str | Path) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """The JSON header and each tensor's (dtype, shape), read from the file's header only."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
    if not 0 < size <= MAX_HEADER_BYTES:
        raise ValueError(f"{path} is not a safetensors file of hf_deltakv (header of {size} bytes)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            shapes = {name: (str(handle.get_slice(name).get_dtype()), tuple(handle.get_slice(name).get_shape()))
                      for name in handle.keys()}  # fmt: skip
    except Exception as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    try:
        header = json.loads(metadata["hf_deltakv"])
    except (KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} holds no hf_deltakv header: not a saved cache") from err
    if not isinstance(header, dict) or "sha256" not in metadata:
        raise ValueError(f"{path}: its header is not a saved cache's")
    header["_sha256"] = metadata["sha256"]
    return header, shapes


def read_tensors(path: str | Path, header: dict) -> dict[str, torch.Tensor]:
    """The file's tensors (on the CPU), refused unless they and the header are what was written."""
    from safetensors.torch import load_file

    expected = header.pop("_sha256")
    tensors = load_file(str(path))
    if _digest(header, tensors) != expected:
        raise ValueError(f"{path} was changed after it was written (checksum mismatch): refused")
    return tensors
