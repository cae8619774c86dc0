"""Every Triton kernel compiles for real GPU targets without a GPU, in each configuration the dispatch sends it (a
covering pass: every kernel, block format, head dim, GQA group size and option at least once), within each target's
shared memory: `benchmarks/triton_compile.py --quick` for an NVIDIA and an AMD target (sm_90, gfx942: ~2 minutes on 2
cores; the benchmark's pass over all four, sm_80 and gfx90a too, takes twice that and writes triton_compile.json)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_compile.py"
TARGETS = ("sm_90", "gfx942")  # one of each vendor's compilers (CI's time); the benchmark compiles for four


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_every_triton_kernel_compiles_for_every_gpu_target(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels cannot compile
    out = tmp_path / "triton_compile.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--targets", ",".join(TARGETS), "--out", str(out)],
                          env=env, capture_output=True, text=True, cwd=SCRIPT.parent, timeout=1500)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"plain_split_kernel",
                       "delta_split_kernel", "delta_tokens_kernel", "delta_encode_kernel", "dequantize_latent_kernel",
                       "sparse_matvec_kernel", "adaptive_split_kernel", "adaptive_merge_kernel", "undo_rope_kernel",
                       "quantize_rows_kernel", "code_groups_kernel", "copy_rows_kernel",
                       "adaptive_keys_kernel", "plain_values_kernel", "keep_rows_kernel", "compact_kernel",
                       "snapkv_evict_kernel", "raw_rows_kernel", "encode_kernel", "latent_split_kernel",
                       "latent_merge_kernel", "query_energies_kernel", "advance_kernel"}  # fmt: skip
    no_spills = [row for row in rows if row["target"] == "sm_90" and "head_dim 128" in row["config"]
                 and row["kernel"].startswith("adaptive")]  # fmt: skip
    assert no_spills and all(row["spills"] == 0 for row in no_spills), no_spills
    assert {row["target"] for row in rows} == set(TARGETS)
    assert all(row["error"] is None and row["shared"] <= row["shared_limit"] for row in rows)
