"""Decode speed and memory on the CPU: tokens/s and peak memory after a prompt, per cache and context length.

Each (cache, context) runs in its own process: load the model and run it once (RSS baseline), prefill the prompt,
hand freed memory back to the OS (malloc_trim) and reset the peak-RSS mark (/proc/self/clear_refs), then decode
`--new` tokens greedily one at a time. Reported: decode tokens/s; peak memory while decoding above the loaded
model (the cache plus every transient buffer, such as a dequantized history); and the cache's bytes at the end
(our caches count their own; for transformers' caches every tensor they hold is counted, the full-precision
window included), and prefill tokens/s. Every configuration runs once per round, `--rounds` rounds in a rotating
order, and each figure is the median over rounds, so drift on a noisy machine hits all alike; ratios are against
`dynamic` at the same context and dtype, measured in the same invocation.

Our caches serve attention from their packed storage by default (`StoredKV`); nothing else is needed.

    python benchmarks/decode_speed.py                       # 1K, 4K, 8K; fp32 and bf16; 3 rounds: ~90 min on 2 cores
    python benchmarks/decode_speed.py --ctx 4096 --caches dynamic,delta --dtypes float32 --rounds 2

Tensor parallelism: `--ranks 1,2` also runs every configuration under `torchrun --nproc-per-node 2` (transformers'
`tp_plan="auto"`, gloo on the CPU), the cores split between the ranks; bytes and peak memory are then summed over
ranks, and rank 0 reports the timings (every rank waits for the others at each all-reduce).

    python benchmarks/decode_speed.py --ctx 4096 --dtypes float32 --ranks 1,2 --out benchmarks/results/decode_tp.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, machine

CACHES = ("dynamic", "q4_0", "kivi-pre-rope", "delta", "delta-no-model", "residual", "hf-hqq")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@torch.no_grad()
def measure_one(spec: str, ctx: int, new: int, text: str, dtype: str) -> dict:
    """Prefill `ctx` tokens of `text` through a fresh `spec` cache, then decode `new` tokens; one process each."""
    from hf_deltakv.eval.perplexity import cache_bits, kv_elements
    from hf_deltakv.eval.texts import load_text
    from hf_deltakv.models import load_model
    from hf_deltakv.registry import build_cache

    distributed = "RANK" in os.environ  # launched by torchrun: this process is one rank of a tensor-parallel job
    model, tokenizer = load_model(dtype=getattr(torch, dtype), tp_plan="auto" if distributed else None)
    ids = tokenizer(load_text(text), return_tensors="pt").input_ids[:, :ctx]
    if ids.shape[1] < ctx:
        raise ValueError(f"{text} has only {ids.shape[1]} tokens, {ctx} asked")
    model(ids[:, :8])  # weights are memory-mapped: page them all in before the baseline
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    baseline = _rss_kib("VmRSS")  # model weights and the Python runtime
    cache = build_cache(spec, model)
    from hf_deltakv.kernels.cpu import extension

    extension()  # build the CPU kernels (cached on disk after the first run) outside the timings
    start = time.perf_counter()
    logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    prefill = time.perf_counter() - start
    libc.malloc_trim(0)  # the prefill's transient buffers go back to the OS, so decoding's peak is its own
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    start = time.perf_counter()
    for _ in range(new):
        token = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(token, cache=cache, use_cache=True).logits
    decode = time.perf_counter() - start
    elements = kv_elements(model.config, ctx + new)
    bits, nbytes = cache_bits(cache, elements)
    peak_mib = (_rss_kib("VmHWM") - baseline) / 1024
    ranks = 1
    if distributed:  # each rank holds its own heads: the job's figures are the sums
        import torch.distributed as dist

        ranks = dist.get_world_size()
        sums = torch.tensor([nbytes, peak_mib], dtype=torch.float64)
        dist.all_reduce(sums)
        nbytes, peak_mib = int(sums[0]), float(sums[1])
        bits = 8 * nbytes / elements
    return {
        "cache": spec,
        "ctx": ctx,
        "dtype": dtype,
        "new": new,
        "prefill_s": prefill,
        "prefill_tokens_per_s": ctx / prefill,
        "decode_tokens_per_s": new / decode,
        "decode_peak_mib": peak_mib,
        "cache_mib": nbytes / 2**20,
        "bits_per_element": bits,
        "threads": torch.get_num_threads(),
        "ranks": ranks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", default="1024,4096,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--new", type=int, default=32, help="tokens decoded after the prompt")
    parser.add_argument(
        "--caches",
        default=",".join(CACHES),
        help="cache specs separated by ',', or by ';' when one has parameters (delta:kf=64,bits=3.5)",
    )
    parser.add_argument("--text", default="stdlib-code", help="built-in text or file (needs >= ctx tokens)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", default="1", help="tensor-parallel process counts, comma-separated (1: no TP)")
    parser.add_argument("--out", default=str(RESULTS / "decode_speed.json"))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one cache
    args = parser.parse_args(argv)

    if args.one:
        result = measure_one(args.one, int(args.ctx), args.new, args.text, args.dtypes)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result))
        return 0
    from hf_deltakv.models import resolve_model_path

    resolve_model_path(None)  # convert the embedded model once, before ranks could race to do it
    configs = [
        (spec, int(ctx), dtype, int(ranks))
        for ranks in args.ranks.split(",")
        for ctx in args.ctx.split(",")
        for dtype in args.dtypes.split(",")
        for spec in (args.caches.split(";") if ";" in args.caches else args.caches.split(","))
    ]
    runs: dict[tuple, list[dict]] = {config: [] for config in configs}
    for round_ in range(args.rounds):
        shift = round_ % len(configs)
        for spec, ctx, dtype, ranks in configs[shift:] + configs[:shift]:
            launcher, env = [sys.executable], dict(os.environ)
            if ranks > 1:  # the cores are split between the ranks, so 1 and N processes use the same machine
                launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
            cmd = [*launcher, __file__, "--one", spec, "--ctx", str(ctx), "--new", str(args.new)]
            cmd += ["--text", args.text, "--dtypes", dtype]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:  # reported, and the other configurations still run
                print(f"  {spec} at {ctx} ({dtype}, {ranks} ranks) failed:\n{done.stderr[-1500:]}", file=sys.stderr)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            runs[(spec, ctx, dtype, ranks)].append(result)
            speed = result["decode_tokens_per_s"]
            print(f"  round {round_ + 1}: {spec} @ {ctx} {dtype} x{ranks}: {speed:.1f} tok/s", file=sys.stderr)
    rows = [_median(results) for results in runs.values() if results]
    print(markdown(rows))
    config = {**vars(args), "date": time.strftime("%F"), "machine": machine()}
    config.pop("one")
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


def _median(results: list[dict]) -> dict:
    """One row: the median of every timing over the rounds (bytes do not vary)."""
    row = dict(results[0])
    for key in ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_peak_mib"):
        row[key] = statistics.median(r[key] for r in results)
    row["rounds"] = len(results)
    return row


def markdown(rows: list[dict]) -> str:
    """One table; speed ratios are against `dynamic` at the same context, dtype and rank count (medians over rounds).

    With tensor-parallel rows (`ranks` > 1) the table gets a rank column and each row's decode speed against the
    same cache in one process; bytes and peak memory are then the sums over ranks."""
    with_ranks = any(r.get("ranks", 1) > 1 for r in rows)
    by_key = {(r["cache"], r["ctx"], r.get("dtype", "float32"), r.get("ranks", 1)): r for r in rows}
    lines = [
        "| cache | ctx | dtype |"
        + (" ranks |" if with_ranks else "")
        + " decode tokens/s | vs dynamic |"
        + (" vs 1 process |" if with_ranks else "")
        + " prefill tokens/s | vs dynamic | peak memory decoding (MiB) | cache (MiB) | bits/element |",
        "|---|---:|---|" + ("---:|---:|---:|---:|" if with_ranks else "---:|---:|") + "---:|---:|---:|---:|---:|",
    ]

    def ratio(r: dict, field: str, cache: str = "dynamic", ranks: int | None = None) -> str:
        key = (cache, r["ctx"], r.get("dtype", "float32"), r.get("ranks", 1) if ranks is None else ranks)
        ref = by_key.get(key)
        return f"{r[field] / ref[field]:.2f}x" if ref and field in r and field in ref else "—"

    for r in rows:
        prefill = f"{r['prefill_tokens_per_s']:.0f}" if "prefill_tokens_per_s" in r else "—"
        decode = ratio(r, "decode_tokens_per_s")
        if with_ranks:
            decode += f" | {ratio(r, 'decode_tokens_per_s', r['cache'], 1)}"
        lines.append(
            f"| {r['cache']} | {r['ctx']} | {r.get('dtype', 'float32')} |"
            + (f" {r.get('ranks', 1)} |" if with_ranks else "")
            + f" {r['decode_tokens_per_s']:.1f} | {decode} | {prefill} | {ratio(r, 'prefill_tokens_per_s')} | "
            f"{r['decode_peak_mib']:.1f} | {r['cache_mib']:.2f} | {r['bits_per_element']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
