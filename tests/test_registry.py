"""The one registry of caches: every entry serves generate(), specs parse, the CLI runs end to end."""

from __future__ import annotations

import json

import pytest
import torch

from hf_deltakv.cli import main, split_specs
from hf_deltakv.registry import CACHES, build_cache, parse_spec
from hf_deltakv.residual import save_compressor

from .conftest import tiny_compressor, tiny_model


@pytest.mark.parametrize("name", sorted(CACHES))
def test_every_registered_cache_generates(name, tmp_path):
    model = tiny_model("llama")
    if not CACHES[name].available():
        pytest.skip(f"{CACHES[name].requires} not installed")
    spec = name
    if name == "residual":  # the built-in compressor is SmolLM2's: the tiny model needs its own
        with pytest.raises(ValueError, match="trained for"):
            build_cache(name, model)
        spec = f"residual:compressor={save_compressor(tiny_compressor(model), tmp_path / 'c')}"
    cache = build_cache(spec, model)
    # 8 prompt tokens: HQQ needs each quantized tensor's size to be a multiple of its group (64 values)
    out = model.generate(torch.randint(3, 128, (1, 8)), max_new_tokens=4, do_sample=False, cache=cache)
    assert out.shape == (1, 12)


def test_spec_parsing():
    assert parse_spec("delta:kf=64,values=q4_1,keys=token,intra=false") == (
        "delta",
        {"kf": 64, "values": "q4_1", "keys": "token", "intra": False},
    )
    with pytest.raises(ValueError, match="allowed"):
        parse_spec("zip")
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("delta:kf")
    with pytest.raises(ValueError, match="bad parameters"):
        build_cache("q4_0:colour=red")
    with pytest.raises(ValueError, match="kf"):
        build_cache("delta:kf=0")
    assert parse_spec("delta:key_bits=3/2.5,values=q3_0/q4_0") == (
        "delta",
        {"key_bits": [3.0, 2.5], "values": ["q3_0", "q4_0"]},
    )
    with pytest.raises(ValueError, match="expected float"):
        parse_spec("delta:key_bits=3/many")


def test_split_specs_keeps_parameters_with_their_cache():
    assert split_specs("fp16,delta:kf=64,values=q4_1,q4_0") == ("fp16", "delta:kf=64,values=q4_1", "q4_0")
    assert split_specs("fp16;delta:kf=8") == ("fp16", "delta:kf=8")


@pytest.mark.real_model
def test_cli_ppl_end_to_end(real_model, tmp_path, capsys):
    args = ["ppl", "--full", "--ctx", "64,128", "--windows", "1", "--caches", "fp16,q4_0,delta", "--out", str(tmp_path)]
    assert main([*args, "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "| delta | one-forward | 128 |" in table and "| delta | chunked | 128 |" in table
    result = json.loads((tmp_path / "ppl.json").read_text())
    assert [row["cache"] for row in result["rows"]] == ["fp16", "q4_0", "delta"] * 4
    for plot in ("delta_vs_bits.png", "delta_vs_ctx.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["config"]["text"] == "python-docs"
    rows = {row["cache"]: row for row in result["rows"] if row["protocol"] == "one-forward" and row["ctx"] == 128}
    assert rows["q4_0"]["bits_per_element"] == pytest.approx(4.5)
    assert rows["fp16"]["bits_per_element"] == pytest.approx(16.0)


def test_ppl_runs_a_quick_comparison_unless_told_full():
    """`hf-deltakv ppl` alone: one forward per window on 2 windows, our caches beside q8_0, q4_0 and KIVI's layout;
    `--full`: both protocols, 4 windows, every default cache and transformers' anchors; any option overrides."""
    from hf_deltakv.cli import build_parser, ppl_plan
    from hf_deltakv.compare import DEFAULT_CACHES

    parse = build_parser().parse_args
    caches, protocols, ctx, windows = ppl_plan(parse(["ppl"]))
    assert caches == ("fp16", "q8_0", "q4_0", "kivi-pre-rope", "delta", "residual")
    assert (protocols, ctx, windows) == (("one-forward",), (1024,), 2)
    caches, protocols, ctx, windows = ppl_plan(parse(["ppl", "--full"]))
    assert caches[: len(DEFAULT_CACHES) + 1] == (*DEFAULT_CACHES, "residual")
    assert (protocols, ctx, windows) == (("one-forward", "chunked"), (1024,), 4)
    caches, protocols, ctx, windows = ppl_plan(parse(["ppl", "--model", "gemma3-270m", "--windows", "3"]))
    assert "residual" not in caches and windows == 3
    assert ppl_plan(parse(["ppl", "--full", "--protocols", "chunked"]))[1] == ("chunked",)


def test_prebuilt_only_is_scoped(monkeypatch):
    from hf_deltakv import kernels

    monkeypatch.delenv("HF_DELTAKV_KERNELS", raising=False)
    with kernels.prebuilt_only():
        assert kernels.kernel_choice() == "prebuilt"
    assert kernels.kernel_choice() == "auto"
    monkeypatch.setenv("HF_DELTAKV_KERNELS", "reference")
    with kernels.prebuilt_only():
        assert kernels.kernel_choice() == "reference"
