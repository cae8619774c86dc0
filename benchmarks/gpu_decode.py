"""Decode attention on a GPU: fp16 SDPA over a full-precision cache vs our fused kernels reading packed codes.

For each context length: one decode step's attention (SmolLM2-like shapes scaled up: 32 query heads, 8 kv heads,
head_dim 128, batch 1 by default), latency by CUDA events (median of `--iters`), bytes of the cache read, and each
kernel's maximum error against its PyTorch reference. Two kernels: q4_0 keys and values (QuantizedKVCache), and
the token-delta layout of `DeltaKVCache(keys="token")` (rotated pre-RoPE delta keys with RoPE re-applied in the
kernel, rotated q4_0 values), through the same dispatch the model uses (`kernels.stream_attention`). The default
per-channel key layout has no Triton kernel yet (it takes the chunked reference on GPUs). Then, with `--e2e`,
end-to-end decode tokens/s of the embedded model (16 greedy steps after the prompt) with DynamicCache against
DeltaKVCache (default) and DeltaKVCache(keys="token"). Written to benchmarks/results/gpu_decode.json.

    python benchmarks/gpu_decode.py --e2e                          # < 5 min on one H200
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --device cpu --contexts 64 --iters 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from paths import RESULTS

# Predicted decoding speed on GPUs from bytes alone: a decode step of batch 1 is bound by memory bandwidth, so it
# takes (weights read + cache read) / bandwidth. Published peak bandwidths (an upper bound on tokens/s):
GPU_BANDWIDTH = {"H100 SXM": 3.35e12, "H200": 4.8e12, "MI300X": 5.3e12}
# Model shapes (weights read per step: every parameter but the embedding table, in bf16; the tied head is read).
MODEL_SHAPES = {
    "1B (Llama-3.2-1B)": {"layers": 16, "kv_heads": 8, "head_dim": 64, "weight_bytes": 2 * 1.236e9},
    "8B (Llama-3.1-8B)": {"layers": 32, "kv_heads": 8, "head_dim": 128, "weight_bytes": 2 * (8.03e9 - 0.525e9)},
}
PREDICT_CONTEXTS = (8192, 32768, 131072)
# Bits per cached element of each cache: fp16 for DynamicCache, the others as measured on SmolLM2
# (benchmarks/results/quality.json and bit_tradeoff.json; `_measured_bits`).
PREDICT_CACHES = {"dynamic (fp16)": None, "q8_0": "q8_0", "delta": "delta", "kivi-pre-rope": "kivi-pre-rope",
                  "q4_0": "q4_0", "delta 3.5-bit": "delta:kf=64,key_bits=2.75,values=q3_0"}  # fmt: skip


def _measured_bits() -> dict[str, float]:
    """Bits per element by cache spec, from the committed quality tables (SmolLM2 rows)."""
    bits = {}
    for name in ("quality.json", "bit_tradeoff.json"):
        path = RESULTS / name
        if path.exists():
            table = json.loads(path.read_text())
            first = next(iter(table.values()))
            bits.update({row["cache"]: row["bits_per_element"] for row in first["rows"]})
    return bits


def predicted_rows() -> list[dict]:
    """tokens/s = bandwidth / (weight bytes + cache bytes) per GPU, model shape, context and cache."""
    measured = _measured_bits()
    rows = []
    for gpu, bandwidth in GPU_BANDWIDTH.items():
        for shape_name, shape in MODEL_SHAPES.items():
            elements = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"]  # cached scalars per token
            for context in PREDICT_CONTEXTS:
                row = {"gpu": gpu, "model": shape_name, "context": context}
                for label, spec in PREDICT_CACHES.items():
                    bits = 16.0 if spec is None else measured.get(spec)
                    if bits is None:
                        continue
                    cache_bytes = elements * context * bits / 8
                    row[label] = {"bits": bits, "cache_gb": cache_bytes / 1e9,
                                  "tokens_per_s": bandwidth / (shape["weight_bytes"] + cache_bytes)}  # fmt: skip
                rows.append(row)
    return rows


def predicted_markdown(rows: list[dict]) -> str:
    labels = [label for label in PREDICT_CACHES if label in rows[0]]
    lines = ["| GPU | model | context | " + " | ".join(f"{label} tok/s" for label in labels) + " |",
             "|---|---|---:|" + "---:|" * len(labels)]  # fmt: skip
    for row in rows:
        cells = [f"{row[label]['tokens_per_s']:.0f}" for label in labels]
        lines.append(f"| {row['gpu']} | {row['model']} | {row['context'] // 1024}K | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _time(fn, iters: int, device: str) -> float:
    """Median milliseconds of `fn()`."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def run(context: int, args: argparse.Namespace) -> dict:
    device, dim = args.device, args.head_dim
    dtype = torch.float16 if device == "cuda" else torch.float32  # the CPU smoke test runs SDPA in fp32
    torch.manual_seed(context)
    q = torch.randn(args.batch, args.q_heads, dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, args.kv_heads, context, dim, device=device, dtype=dtype)
    v = torch.randn(args.batch, args.kv_heads, context, dim, device=device, dtype=dtype)
    scale = dim**-0.5
    group = args.q_heads // args.kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(
            q[:, :, None], k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale
        )

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    plain = _case(q, k, v, scale, args, token_delta=False)
    delta = _case(q, k, v, scale, args, token_delta=True)
    sdpa_ms = _time(sdpa_gqa, args.iters, device)
    fused_ms = _time(plain["fused"], args.iters, device)
    return {
        "context": context,
        "sdpa_fp16_ms": sdpa_ms,
        "sdpa_fp16_repeat_kv_ms": _time(sdpa, args.iters, device),
        "fused_ms": fused_ms,
        "speedup": sdpa_ms / fused_ms,
        "fp16_cache_mib": 2 * k.numel() * 2 / 2**20,
        "packed_cache_mib": plain["mib"],
        "max_error_vs_reference": plain["error"],
        "delta_fused_ms": _time(delta["fused"], args.iters, device),
        "delta_packed_cache_mib": delta["mib"],
        "delta_max_error_vs_reference": delta["error"],
    }


def _case(q, k, v, scale, args, token_delta: bool) -> dict:
    """`k`, `v` stored as `--format` per token (QuantizedKVCache), or as DeltaKVCache(keys="token") stores them
    (pre-RoPE delta keys, RoPE redone in the kernel), and the fused attention through the model's dispatch."""
    from hf_deltakv import kernels
    from hf_deltakv.cache import TOKEN_DELTA_DEFAULTS
    from hf_deltakv.codecs import DeltaCodec, PlainCodec, RotatedCodec

    batch, kv_heads, context, dim = k.shape
    if token_delta:
        keys = RotatedCodec(DeltaCodec(kf=32, **TOKEN_DELTA_DEFAULTS))
        values = RotatedCodec(PlainCodec("q4_0"))
        keys.append(k.float().cumsum(2) / (1 + torch.arange(context, device=k.device)[:, None]))  # smooth, key-like
        freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64, device=k.device) / (dim // 2))
        positions = torch.arange(context, dtype=torch.int32, device=k.device).expand(batch, context).contiguous()
        rope = kernels.RopeAngles(positions, freqs)
    else:
        keys, values = PlainCodec(args.format), PlainCodec(args.format)
        keys.append(k.float())
        rope = None
    values.append(v.float())
    query = q.float().view(batch, kv_heads, -1, dim)
    empty = query.new_zeros(batch, kv_heads, 0, dim)
    call = (query, empty, empty, keys.layout(), values.layout(), rope, None, 1, context - 1, scale)

    def fused():
        return kernels.stream_attention(*call)

    error = (fused() - kernels.reference.stream_attention(*call)).abs().max().item()
    return {"fused": fused, "error": error, "mib": (keys.nbytes() + values.nbytes()) / 2**20}


@torch.no_grad()
def end_to_end(context: int, args: argparse.Namespace, new: int = 16) -> dict:
    """Decode tokens/s of the embedded model after a `context`-token prompt: DynamicCache against DeltaKVCache (its
    default keys, and keys="token" which has a Triton kernel); decode steps read the packed cache by default."""
    from transformers import DynamicCache

    from hf_deltakv import DeltaKVCache
    from hf_deltakv.models import load_model

    model, _ = load_model()
    model = model.to(args.device, torch.float16 if args.device == "cuda" else torch.float32)
    ids = torch.randint(100, 10000, (1, context), device=args.device, generator=None)
    speeds = {}
    makers = {
        "dynamic": DynamicCache,
        "delta": lambda: DeltaKVCache(model=model),
        "delta_token_keys": lambda: DeltaKVCache(model=model, keys="token"),
    }
    for name, make in makers.items():
        cache = make()
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        model(token, cache=cache, use_cache=True)  # warm-up (kernel compilation)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(new):
            logits = model(token, cache=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        speeds[name] = new / (time.perf_counter() - start)
        del cache
    return {"context": context, **{f"{name}_tokens_per_s": speed for name, speed in speeds.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--format", default="q4_0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--e2e", action="store_true", help="also end-to-end decode tokens/s of the embedded model")
    parser.add_argument("--e2e-contexts", default="4096,16384,65536")
    parser.add_argument("--out", default=str(RESULTS / "gpu_decode.json"))
    args = parser.parse_args(argv)
    predicted = predicted_rows()
    print("Predicted from bytes read per step (batch 1, peak bandwidth):\n" + predicted_markdown(predicted))
    if args.device == "cuda" and not torch.cuda.is_available():
        out = Path(args.out)
        previous = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps({**previous, "predicted": predicted}, indent=2) + "\n")
        print(f"no CUDA device: wrote the predicted table only to {out} (measured rows need a GPU; run with "
              "--device cpu under TRITON_INTERPRET=1 for a smoke test)", file=sys.stderr)  # fmt: skip
        return 0
    rows = [run(int(c), args) for c in args.contexts.split(",")]
    print(
        "| context | fp16 SDPA (ms) | q4_0 fused (ms) | speedup | delta fused (ms) | speedup "
        "| cache fp16 / q4_0 / delta (MiB) | max error q4_0 / delta |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']} | {r['sdpa_fp16_ms']:.3f} | {r['fused_ms']:.3f} | {r['speedup']:.2f}x "
            f"| {r['delta_fused_ms']:.3f} | {r['sdpa_fp16_ms'] / r['delta_fused_ms']:.2f}x "
            f"| {r['fp16_cache_mib']:.1f} / {r['packed_cache_mib']:.1f} / {r['delta_packed_cache_mib']:.1f} "
            f"| {r['max_error_vs_reference']:.1e} / {r['delta_max_error_vs_reference']:.1e} |"
        )
    e2e = [end_to_end(int(c), args) for c in args.e2e_contexts.split(",")] if args.e2e else []
    for r in e2e:
        print(
            f"end to end @ {r['context']}: DynamicCache {r['dynamic_tokens_per_s']:.1f} tok/s, DeltaKVCache "
            f"(compressed attention) {r['delta_tokens_per_s']:.1f} tok/s"
        )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"config": {**vars(args), "device_name": device_name}, "rows": rows, "end_to_end": e2e,
              "predicted": predicted}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
