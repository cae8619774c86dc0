"""The long-context benchmark's short version on SmolLM2 (`benchmarks/long_context.py --quick`): each part runs
(error against length, retrieval, multi-turn, memory, eviction beside us) and its figures are the ones it claims."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


@pytest.mark.real_model
def test_every_part_of_the_long_context_benchmark_runs_on_smollm2(tmp_path):
    out = tmp_path / "long_context.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                          cwd=SCRIPT.parent, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["models"]
    assert run["model"] == "smollm2-135m" and run["tokens"] == 1024
    kl = {row["cache"]: [bucket["kl"] for bucket in row["buckets"]] for row in run["kl"]}
    assert set(kl) == {"delta", "snapkv"} and all(len(v) == 2 for v in kl.values())  # 0-512, 512-1K
    assert all(math.isfinite(x) and x >= 0 for v in kl.values() for x in v)
    assert max(kl["delta"]) < 0.05  # near-lossless at every length read
    assert kl["snapkv"][0] < 1e-6 < kl["snapkv"][-1]  # eviction is exact until it drops, then loses
    cells = {(row["cache"], row["cell"]) for row in run["retrieval"]}
    assert cells == {(c, 1024) for c in ("dynamic", "delta", "snapkv")} and len(run["retrieval"]) == 6
    turns = run["multi_turn"]
    assert set(turns) == {"dynamic", "delta", "snapkv"}
    assert turns["dynamic"]["same_as_dynamic"] == turns["dynamic"]["of"] == 2
    memory = {row["cache"]: row for row in result["memory"]}
    assert set(memory) == {"dynamic", "delta"}
    assert memory["delta"]["held_after_prefill"] < 0.2 * memory["dynamic"]["held_after_prefill"]  # vs fp32
    assert memory["delta"]["held_after_decode"] > memory["delta"]["held_after_prefill"]
    assert 0 < memory["delta"]["peak_above_model"] < memory["delta"]["peak_rss"]
    assert run["bytes_held"]["delta"] < 0.35 * run["fp16_bytes"]
    for name in ("delta", "snapkv"):  # nbytes() is every storage the cache holds, on a real model too
        assert run["bytes_held"][name] == pytest.approx(run["reachable_bytes"][name], rel=0.02)
