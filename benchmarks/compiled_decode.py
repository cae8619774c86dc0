"""Compiled decoding on the CPU: `generate` decode tokens/s of SmolLM2 per cache, eager and compiled, against the
fastest uncompressed transformers cache.

Caches: `dynamic` (DynamicCache, eager), `static` (StaticCache, eager), `static-compiled` (StaticCache under
`CompileConfig(fullgraph=True, dynamic=False)`, `_compile_all_devices` as transformers' CI runs it on the CPU,
mode None: CUDA graphs do not exist here), `q4_0-rot-static` / `-compiled` (`StaticQuantizedKVCache("q4_0",
"q4_0", rotate=True)`, the llama.cpp format with rotation), `delta` (`DeltaKVCache(kf=32, model=model)`, eager),
`delta-static` / `-compiled` (`StaticDeltaKVCache(kf=32, max_cache_len=...)`: the same coding preallocated); the other
caches (`OTHERS`, `--caches`): `kivi` (`KIVIKVCache()`), `delta-token` (`DeltaKVCache(kf=32, keys="token")`),
`streaming-llm` and `snapkv` (keep 0.3), `residual` (`ResidualKVCache(model=model)`), each eager, `-static`
(`StaticKIVIKVCache`, `StaticDeltaKVCache(..., keys="token")`, `StaticStreamingLLMCache`, `StaticSnapKVCache`,
`StaticResidualKVCache`) and `-static-compiled` (`--others` times KIVI and `keys="token"`; the eviction caches are in
its memory table only: see `main`; `--residual` times the residual cache). Each
configuration runs in its own process: one warm-up generation (compiling, where asked), then its rounds, each a
generation of `--new` tokens on a fresh cache: decode tokens/s = (new - 1) / the time between the first new token's
logits and the last's (`--timing stamps`, a logits processor's clock; `--timing subtract`, how `compiled_decode.json`
and `compiled_decode_others.json` were measured: a full generation less a prefill-only one, which a long prefill's
variation swamps). Figures are medians over rounds, and each row's ratio is against the fastest uncompressed cache
(`dynamic`, `static`, `static-compiled`) at its context and dtype in the same invocation.

    python benchmarks/compiled_decode.py                              # 1K, 4K; fp32 and bf16; 2 rounds
    python benchmarks/compiled_decode.py --ctx 4096 --dtypes bfloat16 --caches static,q4_0-rot-static-compiled
    python benchmarks/compiled_decode.py --others   # KIVI, keys="token" at 4K -> compiled_decode_others.json
    python benchmarks/compiled_decode.py --residual # ResidualKVCache at 4K -> compiled_decode_residual.json

Memory (`--memory`, default 8192,32768): what each preallocated cache holds at that `max_cache_len` for SmolLM2 in
fp16 after a 64-token prompt (`nbytes()`: the capacity, allocated up front; transformers' `StaticCache` counted the
same way, its key and value tensors), against `StaticCache`. (The allocator's peak needs a GPU: not measured here.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from paths import RESULTS, machine

CACHES = (
    "dynamic",
    "static",
    "static-compiled",
    "q4_0-rot-static",
    "q4_0-rot-static-compiled",
    "delta",
    "delta-static",
    "delta-static-compiled",
)
UNCOMPRESSED = ("dynamic", "static", "static-compiled")
OTHERS = tuple(f"{name}{suffix}" for name in ("kivi", "delta-token", "streaming-llm", "snapkv", "residual")
               for suffix in ("", "-static", "-static-compiled"))  # fmt: skip


def make_cache(name: str, model, capacity: int):
    from transformers.cache_utils import DynamicCache, StaticCache

    from hf_deltakv import (
        DeltaKVCache,
        KIVIKVCache,
        ResidualKVCache,
        SnapKVCache,
        StaticDeltaKVCache,
        StaticKIVIKVCache,
        StaticQuantizedKVCache,
        StaticResidualKVCache,
        StaticSnapKVCache,
        StaticStreamingLLMCache,
        StreamingLLMCache,
    )

    base = name.removesuffix("-compiled")
    others = {
        "kivi": (KIVIKVCache, StaticKIVIKVCache, {}),
        "delta-token": (DeltaKVCache, StaticDeltaKVCache, {"kf": 32, "keys": "token"}),
        "streaming-llm": (StreamingLLMCache, StaticStreamingLLMCache, {"keep": 0.3}),
        "snapkv": (SnapKVCache, StaticSnapKVCache, {"keep": 0.3}),
        "residual": (ResidualKVCache, StaticResidualKVCache, {}),  # (the built-in compressor of SmolLM2)
    }
    family = others.get(base.removesuffix("-static"))
    if family is not None:
        eager, static, options = family
        if base.endswith("-static"):
            return static(**options, max_cache_len=capacity, model=model)
        return eager(**options, model=model)
    if base == "dynamic":
        return DynamicCache(config=model.config)
    if base == "static":
        return StaticCache(config=model.config, max_cache_len=capacity)
    if base == "q4_0-rot-static":
        return StaticQuantizedKVCache("q4_0", "q4_0", rotate=True, max_cache_len=capacity, model=model)
    if base == "delta":
        return DeltaKVCache(kf=32, model=model)
    if base == "delta-static":
        return StaticDeltaKVCache(kf=32, max_cache_len=capacity, model=model)
    raise ValueError(f"unknown cache {name!r}; one of {CACHES}")


class _Stamp:
    """A logits processor recording when `generate` reaches each new token's logits (after that step's forward)."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = stamps

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


@torch.no_grad()
def measure_one(name: str, ctx: int, new: int, dtype: str, rounds: int, timing: str = "stamps") -> list[dict]:
    from transformers import CompileConfig, LogitsProcessorList

    from hf_deltakv.eval.texts import load_text
    from hf_deltakv.kernels.cpu import extension
    from hf_deltakv.models import load_model

    model, tokenizer = load_model(dtype=getattr(torch, dtype))
    ids = tokenizer(load_text("stdlib-code"), return_tensors="pt").input_ids[:, :ctx]
    extension()  # the CPU kernels built outside the timings
    compiled = name.endswith("-compiled")
    config = None
    if compiled:
        config = CompileConfig(fullgraph=True, dynamic=False, mode=None)
        config._compile_all_devices = True

    def run(tokens: int, stamps: list[float] | None = None) -> float:
        cache = make_cache(name, model, ctx + new)
        processors = LogitsProcessorList([_Stamp(stamps)]) if stamps is not None else None
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, cache=cache,
                       compile_config=config, disable_compile=not compiled, logits_processor=processors)  # fmt: skip
        return time.perf_counter() - start

    start = time.perf_counter()
    run(new)  # warm-up: compiles, where asked
    warmup = time.perf_counter() - start
    results = []
    for _ in range(rounds):
        if timing == "stamps":  # one generation: the time between the first token's logits and the last's
            stamps: list[float] = []
            full = run(new, stamps)
            decode = stamps[-1] - stamps[0]
            results.append({"prefill_s": full - decode, "decode_tokens_per_s": (len(stamps) - 1) / decode})
        else:  # a full generation less a prefill-only one
            prefill, full = run(1), run(new)
            results.append({"prefill_s": prefill, "decode_tokens_per_s": (new - 1) / (full - prefill)})
    return [{"cache": name, "ctx": ctx, "dtype": dtype, "new": new, "warmup_s": warmup, **r} for r in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", default="1024,4096")
    parser.add_argument("--new", type=int, default=33, help="tokens generated (the first comes from the prefill)")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per process (after one warm-up)")
    parser.add_argument("--out", default=str(RESULTS / "compiled_decode.json"))
    parser.add_argument("--memory", default="8192,32768", help="max_cache_len values for the memory table")
    parser.add_argument("--others", action="store_true", help="the other caches (OTHERS) at 4K, their own JSON")
    parser.add_argument("--residual", action="store_true", help="ResidualKVCache at 4K, its own JSON")
    parser.add_argument("--timing", default="stamps", choices=("stamps", "subtract"),
                        help="decode time: between the first and last token's logits in one generation (stamps), or a "
                        "full generation less a prefill-only one (subtract: compiled_decode.json's and "
                        "compiled_decode_others.json's runs)")  # fmt: skip
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    memory_of = args.caches.split(",")
    if args.others:  # (the eviction caches in the memory table only: their eager prefill of a 4K prompt takes ~40 s
        # here, the reference attention over it, which makes the prefill-subtracted decode time mostly noise)
        memory_of = OTHERS
        args.ctx, args.caches = "4096", ",".join((*UNCOMPRESSED, *(c for c in OTHERS if "kivi" in c or "token" in c)))
        args.out = str(RESULTS / "compiled_decode_others.json")
    if args.residual:
        memory_of = [c for c in OTHERS if c.startswith("residual")]
        args.ctx, args.caches = "4096", ",".join((*UNCOMPRESSED, *memory_of))
        args.out = str(RESULTS / "compiled_decode_residual.json")
    if args.one:
        print(json.dumps(measure_one(args.one, int(args.ctx), args.new, args.dtypes, args.rounds, args.timing)))
        return 0
    statics = [name for name in memory_of if name.endswith("-static") and name != "static"]
    memory = measure_memory([int(n) for n in args.memory.split(",") if n], statics)
    print(memory_markdown(memory))
    rows = []
    for ctx in map(int, args.ctx.split(",")):
        for dtype in args.dtypes.split(","):
            for name in args.caches.split(","):
                cmd = [sys.executable, __file__, "--one", name, "--ctx", str(ctx), "--new", str(args.new)]
                cmd += ["--dtypes", dtype, "--rounds", str(args.rounds), "--timing", args.timing]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    print(f"  {name} @ {ctx} {dtype} failed:\n{done.stderr[-1500:]}", file=sys.stderr)
                    continue
                results = json.loads(done.stdout.strip().splitlines()[-1])
                row = dict(results[0])
                for key in ("prefill_s", "decode_tokens_per_s"):
                    row[key] = statistics.median(r[key] for r in results)
                row["rounds"] = len(results)
                rows.append(row)
                print(f"  {name} @ {ctx} {dtype}: {row['decode_tokens_per_s']:.2f} tok/s", file=sys.stderr)
    print(markdown(rows))
    config = {**vars(args), "date": time.strftime("%F"), "machine": machine()}
    config.pop("one")
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows, "memory": memory}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


@torch.no_grad()
def measure_memory(capacities: list[int], statics: list[str]) -> list[dict]:
    """Bytes each preallocated cache holds at each capacity (fp16 SmolLM2, after a 64-token prompt)."""
    from hf_deltakv.eval.texts import load_text
    from hf_deltakv.models import load_model

    model, tokenizer = load_model(dtype=torch.float16)
    ids = tokenizer(load_text("stdlib-code"), return_tensors="pt").input_ids[:, :64]
    rows = []
    for capacity in capacities:
        held = {}
        for name in ("static", *statics):
            cache = make_cache(name, model, capacity)
            model(ids, cache=cache, use_cache=True)
            if name == "static":
                held[name] = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
            else:
                held[name] = cache.nbytes()
        rows += [{"cache": name, "max_cache_len": capacity, "nbytes": n, "vs_static": n / held["static"]}
                 for name, n in held.items()]  # fmt: skip
    return rows


def memory_markdown(rows: list[dict]) -> str:
    lines = ["| cache (fp16) | max_cache_len | MiB held | vs StaticCache |", "|---|---:|---:|---:|"]
    lines += [f"| {r['cache']} | {r['max_cache_len']} | {r['nbytes'] / 2**20:.1f} | {r['vs_static']:.3f}x |"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """One table: decode tokens/s and the ratio to the fastest uncompressed cache at the same context and dtype."""
    best = {}
    for r in rows:
        if r["cache"] in UNCOMPRESSED:
            key = (r["ctx"], r["dtype"])
            if key not in best or r["decode_tokens_per_s"] > best[key]["decode_tokens_per_s"]:
                best[key] = r
    lines = [
        "| cache | ctx | dtype | decode tokens/s | vs fastest uncompressed | (which) | warm-up s |",
        "|---|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        ref = best.get((r["ctx"], r["dtype"]))
        ratio = f"{r['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}x" if ref else "—"
        lines.append(
            f"| {r['cache']} | {r['ctx']} | {r['dtype']} | {r['decode_tokens_per_s']:.2f} | {ratio} | "
            f"{ref['cache'] if ref else '—'} | {r['warmup_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
