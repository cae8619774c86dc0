"""Speed JSON names the machine it was measured on: the CPU's model, the features that decide how fast the kernels and
the model's matmuls run (AMX, AVX-512 bf16, ...), the cores and threads (`benchmarks/paths.machine`)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import paths  # noqa: E402

# The scripts that write speed: each records `machine()` in its JSON's config.
SPEED_SCRIPTS = ("decode_speed.py", "weight_skip.py", "encode_cost.py", "matvec_layouts.py", "newcomer.py",
                 "gpu_decode.py", "ab_caches.py")  # fmt: skip


def test_the_machine_is_described():
    where = paths.machine()
    assert set(where) == {"cpu", "flags", "cores", "threads", "arch"}
    assert where["cpu"] and where["cores"] >= 1 and where["threads"] >= 1
    assert set(where["flags"]) <= set(paths.SPEED_FLAGS)


def test_every_speed_script_records_it():
    for name in SPEED_SCRIPTS:
        tree = ast.parse((BENCHMARKS / name).read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "machine"]
        assert calls, f"{name} does not record machine() in its JSON"
