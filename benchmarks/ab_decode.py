"""Did a change make decoding faster? Decode tokens/s of one configuration of `compiled_decode.py` at two git
revisions of this repository, run alternately on the same machine (base, head, base, head, ...) so that the
machine's drift between runs (10-20 % here) falls on both sides alike.

The base revision is checked out into a temporary git worktree and run with that tree first on the import path
(its own C++ kernels are built there, as a user's install would build them); head is this working tree. Each run is
`compiled_decode.py --one` in its own process (a warm-up generation that compiles where asked, then `--rounds` timed
generations); the medians of all the base and all the head rounds give the ratio.

    python benchmarks/ab_decode.py --base HEAD~1 --caches delta-static-compiled --ctx 4096 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import RESULTS, machine

ROOT = Path(__file__).resolve().parent.parent


def _revision(name: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", name], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def run_once(tree: Path, cache: str, ctx: int, dtype: str, new: int, rounds: int) -> list[float]:
    """Decode tokens/s of each timed round of `cache` with the code of `tree`."""
    cmd = [sys.executable, str(tree / "benchmarks" / "compiled_decode.py"), "--one", cache, "--ctx", str(ctx)]
    cmd += ["--new", str(new), "--dtypes", dtype, "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{cache} at {tree} failed:\n{done.stderr[-1500:]}")
    return [r["decode_tokens_per_s"] for r in json.loads(done.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with (this tree is head)")
    parser.add_argument("--caches", default="delta-static-compiled", help="compiled_decode.py's cache names")
    parser.add_argument("--ctx", default="4096")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per run")
    parser.add_argument("--pairs", type=int, default=2, help="base/head runs alternated per configuration")
    parser.add_argument("--out", default=str(RESULTS / "ab_decode.json"))
    args = parser.parse_args(argv)
    base = _revision(args.base)
    head = _revision("HEAD")
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "hf_deltakv"],
                                capture_output=True, text=True).stdout.strip())  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base], check=True,
                       capture_output=True)  # fmt: skip
        try:
            for ctx in map(int, args.ctx.split(",")):
                for dtype in args.dtypes.split(","):
                    for cache in args.caches.split(","):
                        runs: dict[str, list[list[float]]] = {"base": [], "head": []}
                        for _ in range(args.pairs):
                            for side, where in (("base", tree), ("head", ROOT)):
                                runs[side].append(run_once(where, cache, ctx, dtype, args.new, args.rounds))
                        medians = {side: statistics.median(x for run in r for x in run) for side, r in runs.items()}
                        row = {"cache": cache, "ctx": ctx, "dtype": dtype, "base_runs": runs["base"],
                               "head_runs": runs["head"], "base_tokens_per_s": medians["base"],
                               "head_tokens_per_s": medians["head"],
                               "head_vs_base": medians["head"] / medians["base"]}  # fmt: skip
                        rows.append(row)
                        print(f"  {cache} @ {ctx} {dtype}: base {medians['base']:.2f}, head {medians['head']:.2f} "
                              f"tok/s ({row['head_vs_base']:.2f}x)", file=sys.stderr)  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    print(markdown(rows))
    config = {**vars(args), "base": base, "head": head, "head_has_uncommitted_changes": dirty,
              "date": time.strftime("%F"), "machine": machine()}  # fmt: skip
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| cache | ctx | dtype | base tok/s | head tok/s | head / base |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['ctx']} | {r['dtype']} | {r['base_tokens_per_s']:.2f} | "
                     f"{r['head_tokens_per_s']:.2f} | {r['head_vs_base']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
