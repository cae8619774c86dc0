"""Regression tests for faults a hostile new user found: checkpoints, training runs, the command line, cache input
checks, atomic updates, pickling. (The kernel build: test_build.py; crop and cache operations: test_cache_ops.py.)"""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from hf_deltakv import DeltaKVCache, KIVIKVCache, QuantizedKVCache, ResidualKVCache
from hf_deltakv.cli import main
from hf_deltakv.residual import ResidualLayout, load_compressor, save_compressor
from hf_deltakv.residual.train import TrainConfig, train_residual

from .conftest import tiny_compressor, tiny_model


def _saved(tmp_path, model):
    return save_compressor(tiny_compressor(model), tmp_path / "c", dtype=torch.float32)


def _edit_config(folder, **changes):
    path = folder / "config.json"
    payload = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            payload.pop(key, None)
        else:
            payload[key] = value
    path.write_text(json.dumps(payload))


# --- checkpoints ----------------------------------------------------------------------------------------------------


def test_a_huge_latent_is_refused_before_anything_is_allocated(tmp_path):
    model = tiny_model("llama")
    folder = _saved(tmp_path, model)
    _edit_config(folder, latent_dim=32768)  # ~22 GB of modules if built
    with pytest.raises(ValueError, match="latent_dim"):
        ResidualKVCache.from_pretrained(folder, model=model)


def test_a_checkpoint_without_a_model_signature_is_refused(tmp_path):
    model = tiny_model("llama")
    folder = _saved(tmp_path, model)
    _edit_config(folder, model=None)
    with pytest.raises(ValueError, match="model signature"):
        load_compressor(folder)


def test_tampered_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    folder = _saved(tmp_path, model)
    weights = load_file(str(folder / "compressor.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(folder / "compressor.safetensors"))
    with pytest.raises(ValueError, match="non-finite"):
        load_compressor(folder)
    weights[name] = torch.zeros(3)  # another shape
    save_file(weights, str(folder / "compressor.safetensors"))
    with pytest.raises(ValueError, match="does not match its config"):
        load_compressor(folder)
    (folder / "compressor.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        load_compressor(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_compressor(folder)


def test_saves_are_atomic(tmp_path, monkeypatch):
    """A save killed half-way leaves the previous checkpoint readable."""
    import safetensors.torch

    model = tiny_model("llama")
    folder = _saved(tmp_path, model)
    before = load_compressor(folder)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_compressor(tiny_compressor(model), folder)
    monkeypatch.undo()
    after = load_compressor(folder)
    assert torch.equal(before.layers[0].key_encoder, after.layers[0].key_encoder)


# --- training runs ---------------------------------------------------------------------------------------------------


def test_a_run_resumes_only_with_its_model_and_layout(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (600,), generator=torch.Generator().manual_seed(0))
    layout = ResidualLayout(stride=3, top_k=2, sink_tokens=2, window=3)
    config = TrainConfig(steps=1, ctx=32, warmup=1, calibration_windows=2, save_every=1, rate=3.0)
    train_residual(model, ids, tmp_path, config, layout, progress=False)
    more = TrainConfig(steps=2, ctx=32, warmup=1, calibration_windows=2, save_every=1, rate=3.0)
    with pytest.raises(ValueError, match="layout"):
        train_residual(model, ids, tmp_path, more, ResidualLayout(stride=3, top_k=2, sink_tokens=2, window=4))
    other = tiny_model("llama-mha")  # another model (2 kv heads)
    with pytest.raises(ValueError, match="trained for"):
        train_residual(other, ids, tmp_path, more, layout, progress=False)
    with pytest.raises(ValueError, match="rate"):
        train_residual(model, ids, tmp_path, TrainConfig(**{**vars(more), "rate": 4.0}), layout, progress=False)
    train_residual(model, ids, tmp_path, more, layout, progress=False)  # the same: resumes


@pytest.mark.parametrize(
    "bad",
    [{"save_every": 0}, {"rate": 0}, {"steps": 0}, {"ctx": 1}, {"loss": "mse"}, {"sensitivity_windows": -1},
     {"calibration_windows": 1, "sensitivity_windows": 2}],
)  # fmt: skip
def test_training_settings_are_checked_before_any_work(bad):
    with pytest.raises(ValueError):
        TrainConfig(**bad)


# --- the command line -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "--windows", "0"], "at least 1"),
        (["ppl", "--caches", ""], "--caches is empty"),
        (["ppl", "--ctx", "1"], "at least 2"),
        (["ppl", "--caches", "delta:kf=oops"], "expected int"),
        (["ppl", "--caches", "zip"], "unknown cache"),
        (["ppl", "--protocols", "sideways"], "--protocols"),
        (["train-residual", "--save-every", "0"], "save_every"),
        (["train-residual", "--rate", "0"], "rate"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path):
    try:
        code = main([*argv, "--out", str(tmp_path / "out")])
    except SystemExit as exit:  # argparse's own checks exit 2 with a usage line and one error line
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_binary_text_and_unusable_out_are_refused_before_work(capsys, tmp_path):
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 10)
    assert main(["ppl", "--text", str(binary), "--out", str(tmp_path / "o")]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["ppl", "--out", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
    out = tmp_path / "results"
    out.mkdir()
    (out / "ppl.json").write_text("{}")
    assert main(["ppl", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "ppl.json").read_text() == "{}"


def _fake_comparison(model, tokenizer, text, caches, ctx, *args, **kwargs) -> dict:
    """What compare_caches returns, without a model: the ppl command's output files are what is tested."""
    rows = []
    for n in ctx:
        for i, cache in enumerate(caches):
            kl, top1 = (None, None) if i == 0 else (0.01 * i, 0.9)
            rows.append({"cache": cache, "ctx": n, "protocol": "one-forward", "perplexity": 10.0 + i,
                         "delta_pct": 10.0 * i, "kl_divergence": kl, "top1_agreement": top1,
                         "bits_per_element": 16.0 / (i + 1), "seconds": 0.1})  # fmt: skip
    return {"config": {"model": "fake", "text": text, "ctx": list(ctx), "reference": caches[0]}, "rows": rows}


def test_ppl_run_again_replaces_its_own_output_and_nothing_else(monkeypatch, capsys, tmp_path):
    """The README's first command, run twice into the same folder, works both times: a run replaces what an earlier
    run wrote (unchanged since), removes an earlier plot it does not draw again, keeps other files, and refuses a
    file of the same name that it did not write (or that was changed) unless --overwrite."""
    pytest.importorskip("matplotlib")
    import hf_deltakv.compare
    import hf_deltakv.models

    monkeypatch.setattr(hf_deltakv.models, "load_model", lambda name=None: (None, None))
    monkeypatch.setattr(hf_deltakv.compare, "compare_caches", _fake_comparison)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["ppl", "--caches", "fp16,q4_0,delta", "--out", str(out), "--no-progress"]
    assert main([*args, "--ctx", "64,128"]) == 0
    assert {"ppl.json", "delta_vs_bits.png", "delta_vs_ctx.png"} <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert main([*args, "--ctx", "128"]) == 0  # one length: no plot against length, the earlier one removed
    err = capsys.readouterr().err
    assert "replacing the previous run's ppl.json, delta_vs_bits.png" in err and "no delta_vs_ctx.png" in err
    assert "removed the previous run's delta_vs_ctx.png" in err
    assert not (out / "delta_vs_ctx.png").exists() and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "ppl.json").read_text())["config"]["ctx"] == [128]
    assert main([*args, "--ctx", "128"]) == 0  # the same command again
    (out / "delta_vs_bits.png").write_bytes(b"edited")  # no longer what the run wrote: not replaced silently
    assert main([*args, "--ctx", "128"]) == 2
    assert "delta_vs_bits.png, not written by an earlier" in capsys.readouterr().err
    assert (out / "delta_vs_bits.png").read_bytes() == b"edited"
    assert main([*args, "--ctx", "128", "--overwrite"]) == 0
    assert (out / "delta_vs_bits.png").read_bytes()[:4] == b"\x89PNG"


# --- cache inputs, atomic updates, pickling ---------------------------------------------------------------------------


def test_zero_tokens_dtype_switch_and_deeper_models():
    cache = DeltaKVCache()
    keys, _ = cache.update(torch.randn(1, 2, 0, 64), torch.randn(1, 2, 0, 64), 0)
    assert keys.shape == (1, 2, 0, 64) and cache.get_seq_length() == 0
    cache.update(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), 0)
    with pytest.raises(ValueError, match="dtype"):
        cache.update(torch.randn(1, 2, 1, 64).half(), torch.randn(1, 2, 1, 64).half(), 0)
    model = tiny_model("llama")
    bound = DeltaKVCache(model=model)
    with pytest.raises(ValueError, match="2 layers"):
        bound.update(torch.randn(1, 1, 3, 32), torch.randn(1, 1, 3, 32), 2)


@pytest.mark.parametrize("make", [lambda: DeltaKVCache(kf=8), lambda: KIVIKVCache(), lambda: QuantizedKVCache()])
def test_a_failed_update_leaves_the_cache_as_it_was(make, monkeypatch):
    cache = make()
    cache.update(torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64), 0)
    layer = cache.layers[0]
    decoded = [t.clone() for t in layer.reconstruct()]  # a read codes complete groups: measure after it
    before = (cache.nbytes(), cache.get_seq_length(), decoded)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(layer.value_codec, "append_model", broken)  # after the keys were stored
    with pytest.raises(RuntimeError, match="disk on fire"):
        cache.update(torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64), 0)
    monkeypatch.undo()
    assert (cache.nbytes(), cache.get_seq_length()) == before[:2]
    for a, b in zip(layer.reconstruct(), before[2], strict=True):
        assert torch.equal(a, b)
    cache.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), 0)  # and it carries on
    assert cache.get_seq_length() == 21


def test_a_failed_update_of_a_later_layer_leaves_it_as_the_forward_found_it(monkeypatch):
    """A layer's update restores, on failure, the snapshot the cache took when the forward started (not copied again
    per layer), with the shared position log as the earlier layers of this forward left it."""
    model = tiny_model("llama")
    cache = DeltaKVCache(kf=8, model=model)

    def feed(layer: int, tokens: int = 1):
        cache.update(torch.randn(1, 1, tokens, 32), torch.randn(1, 1, tokens, 32), layer)

    for tokens in (20, 1):
        feed(0, tokens), feed(1, tokens)
    layer = cache.layers[1]
    decoded = [t.clone() for t in layer.reconstruct()]
    before = (layer.nbytes(), layer.cumulative_length)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(layer.value_codec, "append_model", broken)
    feed(0)  # the next forward starts
    with pytest.raises(RuntimeError, match="disk on fire"):
        feed(1)
    monkeypatch.undo()
    assert (layer.nbytes(), layer.cumulative_length) == before
    for a, b in zip(layer.reconstruct(), decoded, strict=True):
        assert torch.equal(a, b)
    assert cache.positions.ids.shape[1] == cache.layers[0].cumulative_length == 22  # layer 0's token kept
    feed(1)  # the same forward carries on
    assert [lay.cumulative_length for lay in cache.layers] == [22, 22]


@pytest.mark.parametrize("make", [lambda: DeltaKVCache(kf=8), lambda: QuantizedKVCache(rotate=True), KIVIKVCache])
def test_caches_pickle(make):
    cache = make()
    cache.update(torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64), 0)
    copy = pickle.loads(pickle.dumps(cache))
    for a, b in zip(copy.layers[0].reconstruct(), cache.layers[0].reconstruct(), strict=True):
        assert torch.equal(a, b)


def test_a_non_finite_input_spoils_only_its_own_group_and_block():
    """One NaN key element spoils its channel in its group of kf tokens; one NaN value, its own token's block."""
    cache = DeltaKVCache(kf=32)
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
    keys[0, 0, 50, 3] = float("nan")
    values[0, 1, 70, 5] = float("inf")
    for start in range(0, 200, 40):
        stored_keys, stored_values = cache.update(keys[:, :, start : start + 40], values[:, :, start : start + 40], 0)
    bad_keys, bad_values = ~torch.isfinite(stored_keys.decoded()), ~torch.isfinite(stored_values.decoded())
    assert int(bad_keys.sum()) == 32 and bool(bad_keys[0, 0, 32:64, 3].all())  # positions 32-63: 50's group
    assert bad_values.any(-1).sum().item() == 1 and bool(bad_values[0, 1, 70].any())


def test_sink_tokens_saturate_to_the_fp16_range():
    cache = DeltaKVCache()
    keys = torch.full((1, 1, 2, 64), 1e6)
    keys[..., 1, :] = -1e6
    stored_keys, _ = cache.update(keys, keys.clone(), 0)
    assert torch.isfinite(stored_keys.decoded()).all()
    assert stored_keys.decoded().abs().max().item() == 65504.0
