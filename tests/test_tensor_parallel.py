"""Tensor parallelism (transformers' `tp_plan="auto"` under torchrun, gloo on the CPU): every cache of ours generates
under 2 ranks as in one process, each rank holding its own heads, and the residual cache is refused clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_deltakv.registry import CACHES

from .conftest import tiny_model

WORKER = Path(__file__).with_name("tp_worker.py")
SPECS = [name for name, entry in CACHES.items() if entry.cls.__module__.startswith("hf_deltakv") and name != "residual"]


def _run(model_dir: Path, out: Path, specs: list[str], ranks: int | None) -> dict:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"] if ranks else [sys.executable]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    done = subprocess.run(
        [*launcher, str(WORKER), str(model_dir), str(out), *specs],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    tiny_model("llama-mha").save_pretrained(folder / "model")  # 2 KV heads: one per rank
    single = _run(folder / "model", folder / "single.json", SPECS, None)
    sharded = _run(folder / "model", folder / "tp.json", SPECS, 2)
    return single, sharded


@pytest.mark.parametrize("spec", ["dynamic", *SPECS])
def test_every_cache_generates_under_tensor_parallelism_as_in_one_process(tiny_runs, spec):
    single, sharded = tiny_runs
    one, tp = single[spec], sharded[spec]
    assert "error" not in one and "error" not in tp, (one.get("error"), tp.get("error"))
    assert tp["tokens"] == one["tokens"]
    worst = _worst(one["logits"], tp["logits"])
    if spec == "dynamic":
        assert worst < 1e-4, worst  # only the all-reduce's summation order differs
        return
    # Layer 0's inputs are the same on every rank and in one process, and each head is coded on its own: the ranks
    # store, head for head, the single process's bytes.
    assert tp["layer0_heads"] == one["layer0_heads"]
    # Later layers' inputs differ in their last bits (the all-reduce sums in another order), and a code at its
    # rounding edge may then flip: one value moves by one quantization step, less than quantization already moves
    # every value, so its effect on the logits stays within what the cache's quantization does to them (its logits'
    # distance from DynamicCache's, in one process); 1e-4 where that is smaller (lossless storage).
    bound = max(1e-4, _worst(single["dynamic"]["logits"], one["logits"]))
    assert worst <= bound, (worst, bound)
    if spec != "dynamic":
        assert tp["rank_nbytes"] < 0.6 * one["rank_nbytes"]  # a rank holds its heads only
        # summed over ranks: the single process's bytes, plus the position ids each rank keeps for itself
        assert one["rank_nbytes"] <= tp["total_nbytes"] <= 1.05 * one["rank_nbytes"]


def _worst(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.real_model
def test_residual_cache_is_refused_under_tensor_parallelism_on_three_ranks(real_model, tmp_path):
    from hf_deltakv.models import converted_default_dir

    runs = _run(converted_default_dir(), tmp_path / "tp.json", ["residual", "delta"], 3)  # SmolLM2: 3 KV heads
    assert "cannot run under tensor parallelism" in runs["residual"]["error"]
    assert "error" not in runs["delta"] and runs["delta"]["total_nbytes"] > runs["delta"]["rank_nbytes"]
