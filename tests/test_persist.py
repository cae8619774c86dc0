"""A compressed prefix survives the process: `cache.save(path)`, `Cls.load(path, model=...)` in another process gives
the tokens of the cache it came from; the file is the cache's bytes plus a small header; a file for another model or
cache class, or changed since it was written, is refused before anything is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, SnapKVCache, StreamingLLMCache, persist

from .conftest import tiny_model

CACHES = {
    "DeltaKVCache": lambda m: DeltaKVCache(kf=8, model=m),
    "QuantizedKVCache": lambda m: QuantizedKVCache("q4_0", "q8_0", rotate=True, model=m),
    "KIVIKVCache": lambda m: KIVIKVCache(model=m, pre_rope=True),
    "StreamingLLMCache": lambda m: StreamingLLMCache(keep=0.5, model=m),
    "SnapKVCache": lambda m: SnapKVCache(keep=0.5, window=4, model=m),
}
PREFIX, QUESTION = 45, 7
ROOT = Path(__file__).resolve().parents[1]


def tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def saved(name: str, path: Path):
    model = tiny_model("gemma3")  # sliding layers, pre-RoPE keys
    cache = CACHES[name](model)
    with torch.no_grad():
        model(tokens(PREFIX, 0), cache=cache, use_cache=True)
    cache.save(path)
    return model, cache


@pytest.mark.parametrize("name", CACHES)
def test_a_saved_prefix_reloads_in_another_process_and_generates_the_same_tokens(name, tmp_path):
    path = tmp_path / "prefix.safetensors"
    model, cache = saved(name, path)
    assert os.path.getsize(path) <= cache.nbytes() + 64 * 1024  # the held bytes, plus a header
    question = torch.cat([tokens(PREFIX, 0), tokens(QUESTION, 1)], dim=1)
    expected = model.generate(question, max_new_tokens=6, do_sample=False, cache=cache)
    code = (
        "import sys, torch\nsys.path.insert(0, sys.argv[1])\nfrom tests.conftest import tiny_model\n"
        "from tests.test_persist import tokens, PREFIX, QUESTION\nimport hf_deltakv\n"
        f"model = tiny_model('gemma3')\ncache = hf_deltakv.{name}.load(sys.argv[2], model=model)\n"
        "question = torch.cat([tokens(PREFIX, 0), tokens(QUESTION, 1)], dim=1)\n"
        "out = model.generate(question, max_new_tokens=6, do_sample=False, cache=cache)\n"
        "print(' '.join(map(str, out[0].tolist())))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(t) for t in expected[0].tolist()]


def test_foreign_changed_and_odd_files_are_refused_before_anything_is_built(tmp_path, monkeypatch):
    path = tmp_path / "prefix.safetensors"
    model, _ = saved("DeltaKVCache", path)

    def no_reading(*args):
        raise AssertionError("tensors read before the header was checked")

    with monkeypatch.context() as patch:
        patch.setattr(persist, "read_tensors", no_reading)
        torch.manual_seed(1)
        other = tiny_model("gemma3")
        with torch.no_grad():
            other.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # the same shape, other weights
        with pytest.raises(ValueError, match="another model"):
            DeltaKVCache.load(path, model=other)
        with pytest.raises(ValueError, match="another model"):
            DeltaKVCache.load(path, model=tiny_model("llama"))
        with pytest.raises(ValueError, match="holds a 'DeltaKVCache'"):
            KIVIKVCache.load(path, model=model)
    data = bytearray(path.read_bytes())
    changed = tmp_path / "changed.safetensors"
    data[-5] ^= 0xFF  # one byte of the tensors
    changed.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="changed after it was written"):
        DeltaKVCache.load(changed, model=model)
    header = path.read_bytes()
    edited = tmp_path / "edited.safetensors"
    edited.write_bytes(header.replace(b'\\"sink_tokens\\": 4', b'\\"sink_tokens\\": 5'))
    with pytest.raises(ValueError):
        DeltaKVCache.load(edited, model=model)
    for odd in (b"", b"\xff" * 8 + b"{}", b"not a cache at all"):
        bad = tmp_path / "odd.safetensors"
        bad.write_bytes(odd)
        with pytest.raises(ValueError):
            DeltaKVCache.load(bad, model=model)


def test_saving_needs_the_model_and_a_named_cache(tmp_path):
    model = tiny_model("llama")
    cache = QuantizedKVCache()
    with torch.no_grad():
        model(tokens(10, 0), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="model="):
        cache.save(tmp_path / "x.safetensors")


def test_a_prefix_ending_on_a_group_boundary_and_per_layer_settings_save_and_reload(tmp_path):
    """A prefill that ends where a key group starts keeps the queries' sums before it as a view of the running
    total (never copied): the file writes them apart (safetensors refused the shared storage). Per-layer `key_bits`
    and `values` are options like the others: the reloaded cache codes and answers as the saved one."""
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    cache = DeltaKVCache(kf=8, key_bits=[3.0] * layers, values=["q3_0"] + ["q4_0"] * (layers - 1), model=model)
    with torch.no_grad():
        model(tokens(40, 0), cache=cache, use_cache=True)  # (40 = 5 groups of 8)
        cache.save(tmp_path / "prefix.safetensors")
        loaded = DeltaKVCache.load(tmp_path / "prefix.safetensors", model=model)
        assert loaded.options == cache.options
        question = tokens(3, 1)
        expected = model(question, cache=cache, use_cache=True).logits
        assert torch.equal(model(question, cache=loaded, use_cache=True).logits, expected)
