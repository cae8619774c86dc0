"""Decode attention on a GPU: fp16 SDPA over a full-precision cache against our kernels reading packed codes, and
end-to-end decoding, after the first-contact checks of issue 62 (`first_contact`: batch 64 x 32K, a model split
over two GPUs).

For each model shape (`--shapes`: 1B = 32 query heads on 8 kv heads of 64, 8B = 32 on 8 of 128, batch 1) and context
length: one decoding step's attention, latency by CUDA events (median of `--iters`), the bytes it reads and their
rate against the chip's peak, and each kernel's largest error against its PyTorch reference. Three layouts through
the dispatch the model uses (`kernels.stream_attention`): the default `DeltaKVCache(kf=32, model=model)` (adaptive
per-channel keys coded before RoPE, RoPE re-applied in the kernel, rotated q4_0 values with searched scales, 4 raw
sinks: `triton/adaptive_attention.py`), q4_0 keys and values (QuantizedKVCache), and the token-delta layout of
`DeltaKVCache(keys="token")`. With `--e2e`, end-to-end decode tokens/s of random-weight models of both shapes (no
hub), DynamicCache against the caches of `--e2e-caches` (ours, the token-delta variant and the eviction baselines): the
history is filled by each layer's `update` with random keys and values (decoding's cost depends on the history's size,
not its content; a real prefill at 128K would take minutes), then `--new` greedy steps are timed. Written to
benchmarks/results/gpu_decode.json with the device's name.

    python benchmarks/gpu_decode.py --e2e                          # ~5 min on one H200 (untimed so far)

`--e2e` ends with compiled decoding (issue 63, `--e2e-compiled`, `--compiled-contexts`): StaticCache against
`StaticQuantizedKVCache` (q4_0, rotated) and `StaticDeltaKVCache(kf=32)`, each compiled as `generate` compiles it
(`mode="reduce-overhead"`: CUDA graphs), the same random-weight shapes.
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --device cpu --contexts 128 --iters 1 --shapes 1B --e2e \
        --e2e-contexts 64 --e2e-caches dynamic,delta --new 2 --first-contact 3,48 --out /tmp/gpu_decode.json  # smoke
    TRITON_INTERPRET=1 python benchmarks/gpu_decode.py --device cpu --contexts 128 --iters 1 --shapes 1B   # smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from paths import RESULTS, machine

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


SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B's attention and sizes
    "1B": {"q_heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 16, "hidden": 2048, "ffn": 8192},
    "8B": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 32, "hidden": 4096, "ffn": 14336},
}
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "MI300X": 5.3e12}  # bytes/s, by a word of the device's name


def _peak(device_name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in device_name), None)


def run(context: int, shape: str, args: argparse.Namespace) -> dict:
    device, cfg = args.device, SHAPES[shape]
    dim, kv_heads = cfg["head_dim"], cfg["kv_heads"]
    dtype = torch.float16 if device == "cuda" else torch.float32  # the CPU smoke test runs SDPA in fp32
    torch.manual_seed(context)
    q = torch.randn(args.batch, cfg["q_heads"], dim, device=device, dtype=dtype)
    k = torch.randn(args.batch, kv_heads, context, dim, device=device, dtype=dtype)
    v = torch.randn(args.batch, kv_heads, context, dim, device=device, dtype=dtype)
    scale = dim**-0.5

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    sdpa_ms = _time(sdpa_gqa, args.iters, device)
    fp16_bytes = 2 * k.numel() * k.element_size()
    peak = _peak(torch.cuda.get_device_name() if device == "cuda" else "")
    row = {"shape": shape, "context": context, "sdpa_fp16_ms": sdpa_ms, "fp16_cache_mib": fp16_bytes / 2**20,
           "sdpa_bandwidth_fraction": fp16_bytes / (sdpa_ms / 1e3) / peak if peak else None}  # fmt: skip
    for layout in ("adaptive", "plain", "token"):
        try:
            case = _case(q, k, v, scale, args, layout)
            ms = _time(case["fused"], args.iters, device)
        except Exception as error:  # a failing layout is a row of the table, not the end of a device lease
            row[layout] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"{shape} @ {context}, {layout}: {row[layout]['error']}", file=sys.stderr, flush=True)
            continue
        row[layout] = {"ms": ms, "speedup_vs_sdpa": sdpa_ms / ms, "cache_mib": case["bytes"] / 2**20,
                       "bandwidth_fraction": case["bytes"] / (ms / 1e3) / peak if peak else None,
                       "max_error_vs_reference": case["error"]}  # fmt: skip
        del case
    return row


def _case(q, k, v, scale, args, layout: str) -> dict:
    """`k`, `v` stored as `layout` stores them ("adaptive": the default DeltaKVCache, pre-RoPE keys with RoPE redone
    in the kernel and 4 raw sinks; "plain": `--format` per token; "token": DeltaKVCache(keys="token")), and the fused
    attention through the model's dispatch."""
    from hf_deltakv import kernels
    from hf_deltakv.cache import TOKEN_DELTA_DEFAULTS
    from hf_deltakv.codecs import DeltaCodec, PlainCodec, RotatedCodec
    from hf_deltakv.codecs.adaptive import AdaptiveChannelCodec

    batch, kv_heads, context, dim = k.shape
    sinks = 4 if layout == "adaptive" else 0
    stream = context - sinks
    smooth = k[:, :, sinks:].float().cumsum(2) / (1 + torch.arange(stream, device=k.device)[:, None])  # key-like
    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64, device=k.device) / (dim // 2))
    positions = torch.arange(sinks, context, dtype=torch.int32, device=k.device).expand(batch, stream).contiguous()
    rope = kernels.RopeAngles(positions, freqs)
    if layout == "adaptive":
        keys = AdaptiveChannelCodec(group=32, bits=4.0, offset=sinks)
        values = RotatedCodec(PlainCodec("q4_0", search_scale=True))
        keys.append(smooth)
    elif layout == "token":
        keys = RotatedCodec(DeltaCodec(kf=32, **TOKEN_DELTA_DEFAULTS))
        values = RotatedCodec(PlainCodec("q4_0"))
        keys.append(smooth)
    else:
        keys, values = PlainCodec(args.format), PlainCodec(args.format)
        keys.append(k.float())
        rope = None
    values.append(v[:, :, sinks:].float())
    query = q.float().view(batch, kv_heads, -1, dim)
    sink_k, sink_v = k[:, :, :sinks].half(), v[:, :, :sinks].half()
    call = (query, sink_k, sink_v, keys.layout(), values.layout())
    options = dict(rope=rope, mask=None, n_queries=1, causal_offset=context - 1, scale=scale)

    def fused():
        return kernels.stream_attention(*call, **options)

    error = (fused() - kernels.reference.stream_attention(*call, **options)).abs().max().item()
    read = keys.nbytes() + values.nbytes() + sink_k.nbytes + sink_v.nbytes + (positions.nbytes if rope else 0)
    return {"fused": fused, "error": error, "bytes": read}


E2E_CACHES = "dynamic,delta,delta-no-model,q4_0,q8_0,kivi-pre-rope,streaming-llm,snapkv,residual,delta:keys=token"


@torch.no_grad()
def end_to_end(shape: str, context: int, args: argparse.Namespace) -> dict:
    """Decode tokens/s of a random-weight Llama of `shape` (bf16) whose every layer's history holds `context`
    random tokens, for each cache of `--e2e-caches` (registry names; `residual` with a compressor of the shape's
    size, identity weights, 4 bits a latent group: its cost is its shape's, not its weights')."""
    cfg = SHAPES[shape]
    model, config = _model(cfg, context, args.device)
    speeds, errors = {}, {}
    for name in args.e2e_caches.split(","):
        try:
            speeds[name] = _decode_speed(name, model, config, cfg, context, args)
        except Exception as error:  # recorded, and the other caches still run
            errors[name] = f"{type(error).__name__}: {error}"[:500]
            print(f"end to end, {shape} @ {context}, {name}: {errors[name]}", file=sys.stderr, flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    del model
    base = speeds.get("dynamic")
    return {"shape": shape, "context": context, "tokens_per_s": speeds, "errors": errors,
            "vs_dynamic": {n: v / base for n, v in speeds.items()} if base else None}  # fmt: skip


def _decode_speed(name: str, model, config, cfg: dict, context: int, args: argparse.Namespace) -> float:
    """Tokens/s of `--new` greedy steps of `model` over a history of `context` random tokens in cache `name`."""
    cache = _filled(_cache(name, model, config, cfg), cfg, context, 1, args)
    token = torch.tensor([[11]], device=args.device)
    model(token, cache=cache, use_cache=True)  # warm-up (kernel compilation)
    _sync(args.device)
    start = time.perf_counter()
    for _ in range(args.new):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    _sync(args.device)
    return args.new / (time.perf_counter() - start)


COMPILED_CACHES = ("static", "q4_0-rot-static", "delta-static")  # compiled decoding (issue 63): StaticCache, ours


@torch.no_grad()
def compiled_speed(name: str, shape: str, context: int, args: argparse.Namespace) -> float:
    """Tokens/s of `--new` greedy steps of a random-weight model of `shape` compiled as `generate` compiles it
    (`fullgraph`, static shapes; on CUDA `mode="reduce-overhead"`: CUDA graphs), over a history of `context` random
    tokens in a cache of capacity `context + new + 4`: `static` (transformers' StaticCache), `q4_0-rot-static`
    (`StaticQuantizedKVCache("q4_0", "q4_0", rotate=True)`) or `delta-static` (`StaticDeltaKVCache(kf=32)`: on CUDA
    its decoding ops keep their counters on the device, so the CUDA graphs take them in)."""
    from transformers import StaticCache

    from hf_deltakv import StaticDeltaKVCache, StaticQuantizedKVCache

    cfg = SHAPES[shape]
    model, config = _model(cfg, context, args.device)
    capacity = context + args.new + 4
    if name == "static":
        cache = StaticCache(config=config, max_cache_len=capacity)
    elif name == "q4_0-rot-static":
        cache = StaticQuantizedKVCache("q4_0", "q4_0", rotate=True, max_cache_len=capacity, model=model)
    elif name == "delta-static":
        cache = StaticDeltaKVCache(kf=32, max_cache_len=capacity, model=model)
    else:
        raise ValueError(f"--e2e-compiled takes {COMPILED_CACHES}, got {name!r}")
    _filled(cache, cfg, context, 1, args)
    token = torch.tensor([[11]], device=args.device)
    if name == "delta-static":  # one eager step: the history moves from the eager layers into the storage
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    mode = "reduce-overhead" if args.device == "cuda" else None
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode)
    for _ in range(3):  # compile, then record the CUDA graph
        token = step(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    _sync(args.device)
    start = time.perf_counter()
    for _ in range(args.new - 3):
        token = step(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    _sync(args.device)
    speed = (args.new - 3) / (time.perf_counter() - start)
    del model, cache, step
    torch._dynamo.reset()
    return speed


FIRST_CONTACT_CACHES = ("delta", "q8_0", "streaming-llm", "delta:keys=token")  # every kernel family once


@torch.no_grad()
def first_contact(args: argparse.Namespace) -> dict:
    """What the CPU tests can only simulate (issue 62), on the GPU in about a minute:

    - batch 64 x 32K tokens on 8 kv heads of 128 (two layers of the 8B shape): buffers past 2**31 elements, where
      int32 offsets would wrap. Per cache of `FIRST_CONTACT_CACHES`: 8 decoding steps' tokens/s, and the last
      sequence's first-step logits against the same sequence decoded alone (batch 1, the same history);
    - with two GPUs or more, a model split by a `device_map` (half of its layers on each): the default cache's
      logits over 8 greedy steps against the same model on one GPU (every launch must run on its layer's device)."""
    cfg = {**SHAPES["8B"], "layers": 2}
    batch, context = (int(n) for n in args.first_contact.split(","))
    model, config = _model(cfg, context, args.device)
    checks = {}
    for name in FIRST_CONTACT_CACHES:
        try:
            wide = _filled(_cache(name, model, config, cfg), cfg, context, batch, args)
            token = torch.full((batch, 1), 11, device=args.device)
            last = model(token, cache=wide, use_cache=True).logits[-1, -1].float()
            _sync(args.device)
            start = time.perf_counter()
            for _ in range(8):
                token = model(token, cache=wide, use_cache=True).logits[:, -1:].argmax(-1)
            _sync(args.device)
            speed = 8 * batch / (time.perf_counter() - start)
            del wide
            alone = _filled(_cache(name, model, config, cfg), cfg, context, batch, args, row=batch - 1)
            single = model(torch.full((1, 1), 11, device=args.device), cache=alone, use_cache=True).logits[0, -1]
            error = ((single.float() - last).abs().max() / last.abs().max()).item()
            checks[name] = {"tokens_per_s": speed, "last_row_vs_alone": error, "finite": bool(last.isfinite().all())}
            del alone
        except Exception as error:  # recorded: the other caches still run
            checks[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        print(f"first contact, batch {batch} x {context}, {name}: {checks[name]}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    del model
    return {"batch": batch, "context": context, "caches": checks, "two_devices": _two_devices(args)}


def _two_devices(args: argparse.Namespace) -> dict:
    """The default cache on a model whose layers sit on two GPUs, against the same weights on one."""
    count = torch.cuda.device_count() if args.device == "cuda" else 0
    if count < 2:
        return {"skipped": f"needs two GPUs, found {count}"}
    from accelerate import dispatch_model

    from hf_deltakv import DeltaKVCache

    cfg = {**SHAPES["1B"], "layers": 4}
    model, _ = _model(cfg, 8192, "cuda:0")
    ids = torch.randint(0, 32000, (2, 300), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    one = model.generate(ids, cache=DeltaKVCache(kf=32, model=model), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
             "model.layers.3": 1, "model.norm": 1, "model.rotary_emb": 0, "lm_head": 1}  # fmt: skip
    model = dispatch_model(model, device_map=split)
    two = model.generate(ids, cache=DeltaKVCache(kf=32, model=model), max_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    pairs = zip(one.logits, two.logits, strict=True)
    difference = max((a.float().cpu() - b.float().cpu()).abs().max().item() for a, b in pairs)
    return {"devices": 2, "same_tokens": torch.equal(one.sequences.cpu(), two.sequences.cpu()),
            "max_logit_difference": difference}  # fmt: skip


def _model(cfg: dict, context: int, device: str):
    """A random-weight Llama of shape `cfg` (bf16 on CUDA, fp32 elsewhere) and its config."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["q_heads"],
                         num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                         max_position_embeddings=max(context * 2, 8192))  # fmt: skip
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), config


def _cache(name: str, model, config, cfg: dict):
    """A new cache of registry spec `name` (`dynamic`: DynamicCache; `residual`: `_residual_cache`)."""
    from transformers import DynamicCache

    from hf_deltakv.registry import build_cache

    if name == "dynamic":
        return DynamicCache(config=config)
    return _residual_cache(model, cfg) if name == "residual" else build_cache(name, model)


def _filled(cache, cfg: dict, context: int, batch: int, args, row: int | None = None):
    """`cache` with every layer holding `context` random tokens of `batch` sequences (`row`: only that sequence of
    them, as batch 1: the same keys and values); the history is what a prefill's attention leaves (groups coded,
    eviction done)."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    positions = torch.arange(context, device=args.device)[None].expand(batch if row is None else 1, context)
    for layer in range(cfg["layers"]):
        g = torch.Generator(device=args.device).manual_seed(layer)
        shape_kv = (batch, cfg["kv_heads"], context, cfg["head_dim"])
        keys = torch.randn(shape_kv, generator=g, device=args.device, dtype=dtype)
        values = torch.randn(shape_kv, generator=g, device=args.device, dtype=dtype)
        if row is not None:
            keys, values = keys[row : row + 1].clone(), values[row : row + 1].clone()
        cache.update(keys, values, layer, position_ids=positions)
        del keys, values
        stored = cache.layers[layer]
        flush = getattr(getattr(stored, "key_codec", None), "flush", None)
        if flush is not None:
            flush()
        if hasattr(stored, "read_done"):
            stored.read_done()
    return cache


def _residual_cache(model, cfg: dict):
    """ResidualKVCache with a compressor of the model's shape: identity encoder and decoder, every latent group at
    4 bits (the built-in compressor's layout: no references, 8 sinks, a window of 16)."""
    from hf_deltakv import ResidualKVCache
    from hf_deltakv.residual import ResidualCompressor, ResidualConfig

    stream = cfg["kv_heads"] * cfg["head_dim"]
    config = ResidualConfig(num_layers=cfg["layers"], kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                            latent_dim=stream, bits=[[4] * (2 * stream // 32)] * cfg["layers"])  # fmt: skip
    compressor = ResidualCompressor(config).to(next(model.parameters()).device)
    return ResidualKVCache(model=model, compressor=compressor)


def _versions() -> dict[str, str]:
    import transformers
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda or "", "hip": torch.version.hip or ""}  # fmt: skip


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--shapes", default="1B,8B")
    parser.add_argument("--format", default="q4_0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--e2e", action="store_true", help="also end-to-end decode tokens/s of both shapes")
    parser.add_argument("--e2e-contexts", default="8192,131072")
    parser.add_argument("--new", type=int, default=16, help="decoded tokens timed end to end")
    parser.add_argument("--e2e-caches", default=E2E_CACHES, help="registry specs timed end to end (and 'residual')")
    parser.add_argument("--first-contact", default="64,32768", help="batch,context of --e2e's first check")
    parser.add_argument("--e2e-compiled", default=",".join(COMPILED_CACHES), help="caches --e2e also times compiled")
    parser.add_argument("--compiled-contexts", default="8192,32768", help="contexts of the compiled rows")
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
    started = time.perf_counter()
    shapes = args.shapes.split(",")
    rows, e2e, first = [], [], {}
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"

    def write() -> None:  # after every row: a lease that ends early still leaves what was measured
        result = {"config": {**vars(args), "device_name": device_name, "host": machine(), "versions": _versions(),
                             "seconds": round(time.perf_counter() - started)},
                  "rows": rows, "end_to_end": e2e, "first_contact": first, "predicted": predicted}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    for shape in shapes:
        for c in args.contexts.split(","):
            rows.append(run(int(c), shape, args))
            write()
    print(
        "| shape | context | fp16 SDPA (ms) | default delta (ms) | speedup | q4_0 (ms) | speedup | delta keys=token "
        "(ms) | speedup | max error default / q4_0 / token |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        a, p, t = r["adaptive"], r["plain"], r["token"]
        if any("error" in case for case in (a, p, t)):
            print(f"| {r['shape']} | {r['context']} | {r['sdpa_fp16_ms']:.3f} | failed: see the JSON |")
            continue
        print(f"| {r['shape']} | {r['context']} | {r['sdpa_fp16_ms']:.3f} | {a['ms']:.3f} "
              f"| {a['speedup_vs_sdpa']:.2f}x "
              f"| {p['ms']:.3f} | {p['speedup_vs_sdpa']:.2f}x | {t['ms']:.3f} | {t['speedup_vs_sdpa']:.2f}x "
              f"| {a['max_error_vs_reference']:.1e} / {p['max_error_vs_reference']:.1e} / "
              f"{t['max_error_vs_reference']:.1e} |")  # fmt: skip
    if args.e2e:
        first.update(first_contact(args))  # the checks a lent GPU runs first (issue 62): batch 64 x 32K, two GPUs
        write()
        for c in args.e2e_contexts.split(","):  # every shape at the shortest context first
            for shape in shapes:
                e2e.append(end_to_end(shape, int(c), args))
                write()
                r = e2e[-1]
                ratio = r["vs_dynamic"] or {}
                cells = [f"{n} {v:.1f} tok/s ({ratio.get(n, float('nan')):.2f}x)" for n, v in r["tokens_per_s"].items()]
                print(f"end to end, {shape} @ {c}: " + ", ".join(cells), flush=True)
        for c in args.compiled_contexts.split(",") if args.e2e_compiled else ():
            for shape in shapes:
                speeds, errors = {}, {}
                for name in args.e2e_compiled.split(","):
                    try:
                        speeds[name] = compiled_speed(name, shape, int(c), args)
                    except Exception as error:  # recorded, and the other rows still run
                        errors[name] = f"{type(error).__name__}: {error}"[:500]
                base = speeds.get("static")
                e2e.append(
                    {
                        "shape": shape,
                        "context": int(c),
                        "compiled": True,
                        "tokens_per_s": speeds,
                        "errors": errors,
                        "vs_static": {n: v / base for n, v in speeds.items()} if base else None,
                    }
                )
                write()
                print(f"compiled, {shape} @ {c}: {speeds} {errors or ''}", flush=True)
    write()
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
