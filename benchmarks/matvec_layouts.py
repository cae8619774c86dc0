"""Why weight skip's CPU path chooses between one dense product and a gather of kept rows (`GATHER_BELOW`).

Times one batch-1 matrix-vector product on SmolLM2-135M's linear shapes four ways: the plain row-major weight,
the input-major layout weight skip uses while enabled (a transposed view), a gather of all input-major rows
(`embedding_bag`), and a gather of half of them. One thread, median of `--repeats` runs of `--calls` calls.
Writes benchmarks/results/matvec_layouts.json.

    python benchmarks/matvec_layouts.py          # ~10 s
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from paths import RESULTS, machine

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))  # (out, in): attention q/o, k/v, MLP up/gate, down


def _microseconds(fn, calls: int, repeats: int) -> float:
    for _ in range(20):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append(1e6 * (time.perf_counter() - start) / calls)
    return sorted(runs)[len(runs) // 2]


def time_shape(n_out: int, n_in: int, calls: int, repeats: int) -> dict[str, float]:
    """Microseconds of the four ways to compute one [1, n_in] x [n_in, n_out] product."""
    weight = torch.randn(n_out, n_in)
    input_major = weight.t().contiguous()
    x = torch.randn(1, n_in)
    offsets = torch.zeros(1, dtype=torch.long)

    def gather(kept: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(kept, input_major, offsets, mode="sum", per_sample_weights=x[0, kept])

    everything, half = torch.arange(n_in), torch.arange(n_in // 2)
    return {
        "row_major_us": _microseconds(lambda: F.linear(x, weight), calls, repeats),
        "input_major_us": _microseconds(lambda: F.linear(x, input_major.t()), calls, repeats),
        "gather_all_us": _microseconds(lambda: gather(everything), calls, repeats),
        "gather_half_us": _microseconds(lambda: gather(half), calls, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "matvec_layouts.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [{"out": n_out, "in": n_in, **time_shape(n_out, n_in, args.calls, args.repeats)} for n_out, n_in in SHAPES]
    print("| out × in | row-major (µs) | input-major (µs) | gather all (µs) | gather half (µs) | all / input-major |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['out']} × {r['in']} | {r['row_major_us']:.1f} | {r['input_major_us']:.1f} "
            f"| {r['gather_all_us']:.1f} | {r['gather_half_us']:.1f} | {r['gather_all_us'] / r['input_major_us']:.2f} |"
        )
    config = {"calls": args.calls, "repeats": args.repeats, "threads": 1, "date": time.strftime("%F"),
              "machine": machine()}  # fmt: skip
    with open(args.out, "w") as f:
        f.write(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
