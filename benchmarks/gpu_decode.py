"""Decode attention on a GPU: fp16 SDPA over a full-precision cache vs our fused kernel reading packed codes.

For each context length: one decode step's attention (SmolLM2-like shapes scaled up: 32 query heads, 8 kv heads,
head_dim 128, batch 1 by default), latency by CUDA events (median of `--iters`), bytes of the cache read, and the
kernel's maximum error against the PyTorch reference. Written to benchmarks/results/gpu_decode.json.

    python benchmarks/gpu_decode.py                                # < 5 min on one H200
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --device cpu --contexts 64 --iters 1   # smoke test

End-to-end tokens/s needs attention to read the compressed cache inside the model (not wired yet); this script
measures the attention op the speed comes from.
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

from hf_deltakv.kernels import reference
from hf_deltakv.quant import quantize


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
    from hf_deltakv.kernels.triton.decode_attention import decode_attention

    device, dim = args.device, args.head_dim
    dtype = torch.float16 if device == "cuda" else torch.float32  # the CPU smoke test runs SDPA in fp32
    torch.manual_seed(context)
    q = torch.randn(args.batch, args.q_heads, dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, args.kv_heads, context, dim, device=device, dtype=dtype)
    v = torch.randn(args.batch, args.kv_heads, context, dim, device=device, dtype=dtype)
    kq, vq = quantize(k, args.format), quantize(v, args.format)
    scale = dim**-0.5
    group = args.q_heads // args.kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(
            q[:, :, None], k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale
        )

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    def fused():
        return decode_attention(q, kq, vq, scale)

    expected = reference.decode_attention(q.float(), kq, vq, scale)
    error = (fused() - expected).abs().max().item()
    sdpa_ms = _time(sdpa_gqa, args.iters, device)
    fused_ms = _time(fused, args.iters, device)
    return {
        "context": context,
        "sdpa_fp16_ms": sdpa_ms,
        "sdpa_fp16_repeat_kv_ms": _time(sdpa, args.iters, device),
        "fused_ms": fused_ms,
        "speedup": sdpa_ms / fused_ms,
        "fp16_cache_mib": 2 * k.numel() * 2 / 2**20,
        "packed_cache_mib": (kq.nbytes() + vq.nbytes()) / 2**20,
        "max_error_vs_reference": error,
    }


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
    parser.add_argument("--out", default=str(RESULTS / "gpu_decode.json"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu under TRITON_INTERPRET=1 for a smoke test", file=sys.stderr)
        return 1
    rows = [run(int(c), args) for c in args.contexts.split(",")]
    print("| context | fp16 SDPA (ms) | fused packed (ms) | speedup | cache fp16 / packed (MiB) | max error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']} | {r['sdpa_fp16_ms']:.3f} | {r['fused_ms']:.3f} | {r['speedup']:.2f}x "
            f"| {r['fp16_cache_mib']:.1f} / {r['packed_cache_mib']:.1f} | {r['max_error_vs_reference']:.1e} |"
        )
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"config": {**vars(args), "device_name": device_name}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
