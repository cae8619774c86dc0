"""What a decoding step costs on the GPU path, measured without a GPU: launches, host-device syncs, bytes read, and a
prefill's transient memory.

The GPU path is the branch every op takes on a CUDA device (`HF_DELTAKV_KERNELS=triton`: Triton kernels where one
exists, else the PyTorch reference, never C++), run here on CPU tensors under Triton's interpreter.
- Launches and syncs: a tiny random Llama (2 layers, 4 query heads sharing 2 kv heads of 32 channels) prefills a
  prompt, then decodes `--steps` tokens greedily; each step's aten ops that compute and Triton launches (each at
  least one GPU kernel) and syncs inside the cache's `update` and its attention call are counted per layer
  (`hf_deltakv.eval.gpu_path.LaunchCounter`; the model's own work is not counted). A step that codes a group of keys
  is reported apart: its budget is larger. At 200 tokens the whole path is interpreted; at 4,096 the prompt is
  encoded by the CPU kernels (the same bytes) and the kernels' bodies are skipped while counting (nothing on the
  host depends on them: no sync), as the interpreter takes minutes a step there.
- Allocations: the largest buffer one layer's decoding step allocates (on steps that grow no stored buffer; growth
  copies the history once per 1/ROOM_FRACTION of it), against what the layer stores.
- Bytes read: the distinct bytes each program of one decoding step's kernels loads, summed (`LoadTracer`), against
  the layers' `nbytes()` plus queries and outputs, at 4K for the default cache and at `BYTES_OTHERS_LENGTH` for the
  others.
- Prefill memory: one layer of the default cache, 8 kv heads x 128, bf16: the peak its coding and its
  reconstruction for attention allocate, above what it holds after, against its fp16 keys and values
  (`MemoryTracker`; on the GPU path the kernels' bodies are skipped: they allocate nothing).
Written to benchmarks/results/gpu_path.json; docs/results.md shows the tables.

    python benchmarks/gpu_path.py                                   # every registry cache and VARIANTS, 200, 4,096
    python benchmarks/gpu_path.py --caches delta --lengths 200 --steps 4 --no-bytes
    python benchmarks/gpu_path.py --only-chunks                     # the chunked steps only, into the JSON
    python benchmarks/gpu_path.py --caches delta:keys=token --merge # one cache's rows, into the JSON

The tests hold the budgets (tests/test_gpu_path.py): `BUDGET`, `BYTES_BUDGET`, `PREFILL_BUDGET` below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # (before Triton is imported: CPU tensors need its interpreter)

import contextlib

import torch
from paths import RESULTS

# Per layer and decoding step on the GPU path, for the default cache: launches on a step that codes no group and on
# one that does, and host-device syncs on any step.
BUDGET = {"launches": 8, "coding_launches": 16, "syncs": 0}
BYTES_BUDGET = 1.15  # distinct bytes a decoding step's programs load, over the layers' storage + queries + outputs
PREFILL_BUDGET = 2.0  # a prefill's transient memory over the layer's fp16 keys and values
LENGTHS = (200, 4096)
VARIANTS = ["delta:keys=token"]  # caches outside the registry with kernels of their own, counted with it
BYTES_OTHERS_LENGTH = 1024  # the other caches' bytes read are measured at this length (interpreted: ~10 s each)


@contextlib.contextmanager
def kernels_path(path: str):
    """Every op on `path` (`HF_DELTAKV_KERNELS`) within."""
    saved = os.environ.get("HF_DELTAKV_KERNELS")
    os.environ["HF_DELTAKV_KERNELS"] = path
    try:
        yield
    finally:
        if saved is None:
            del os.environ["HF_DELTAKV_KERNELS"]
        else:
            os.environ["HF_DELTAKV_KERNELS"] = saved


def tiny_llama(max_positions: int = 8192):
    """The counted model: 2 layers, 4 query heads on 2 kv heads of 32 channels, random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


_COMPRESSORS: dict = {}


def build(spec: str, model):
    """The registry's cache `spec` for `model`; `residual`: with a compressor fitted (not trained) for this model,
    in the built-in compressor's layout (no references, 8 sinks, a window of 16; the registry's is SmolLM2's)."""
    from hf_deltakv import ResidualKVCache
    from hf_deltakv.registry import build_cache

    if spec != "residual":
        return build_cache(spec, model)
    from hf_deltakv.residual import ResidualLayout
    from hf_deltakv.residual.fit import fit_compressor

    key = id(model)
    if key not in _COMPRESSORS:
        windows = [torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(s)) for s in range(2)]
        with torch.no_grad():
            _COMPRESSORS[key] = (model, fit_compressor(model, windows, 4.0, ResidualLayout(), sensitivity_windows=0))
    return ResidualKVCache(model=model, compressor=_COMPRESSORS[key][1])


def coded_groups(cache) -> int:
    """Groups of keys coded so far over the cache's layers (adaptive and KIVI-style keys, the residual cache's
    tokens; 0 for other caches)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        total += getattr(layer, "compressed", 0)
        codec = getattr(layer, "key_codec", None)
        codec = getattr(codec, "inner", codec)
        coded = getattr(codec, "coded", None)
        if coded is None and getattr(codec, "groups", None) is not None:
            coded = codec.groups.codes.shape[2]
        total += coded or 0
    return total


@torch.no_grad()
def count(spec: str, length: int, steps: int, model=None, prompt_path: str = "triton", bodies: bool = True,
          chunk: int = 1) -> dict:  # fmt: skip
    """Per-step, per-layer launches and syncs of `spec` on the GPU path after a `length`-token prompt (encoded on
    `prompt_path`: "auto" takes the CPU kernels, which store the same bytes, in seconds where the interpreter takes
    minutes). `bodies=False` skips the interpreted kernels' bodies while counting: with no sync, nothing on the host
    depends on what a kernel computes, so the counts are the same (tested at 200 tokens), in seconds instead of the
    interpreter's minutes per step at 4K. `chunk`: tokens each step feeds (more than one: a chunked prefill's, or
    assisted decoding's candidates)."""
    from hf_deltakv.eval.gpu_path import LaunchCounter, per_layer

    model = model if model is not None else tiny_llama()
    cache = build(spec, model)
    ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))
    start = time.perf_counter()
    with kernels_path(prompt_path):
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1:].argmax(-1)
    rows = []
    skipped = contextlib.nullcontext() if bodies else _skip_kernels()
    with kernels_path("triton"), skipped, LaunchCounter(cache) as counter:
        for _ in range(steps):
            before = coded_groups(cache)
            fed = token if chunk == 1 else torch.cat([token, torch.randint(3, 128, (1, chunk - 1))], dim=1)
            with counter.step() as step:
                logits = model(fed, cache=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            layers = per_layer(step)
            rows.append({
                "coding": coded_groups(cache) > before,
                "grew": any(t.growths for t in layers.values()),
                "largest_allocation": max(t.largest for t in layers.values()),
                "launches": max(t.launches for t in layers.values()),
                "syncs": max(t.sync_count for t in layers.values()),
                "mean_launches": sum(t.launches for t in layers.values()) / len(layers),
                "ops": {str(layer): dict(t.ops) for layer, t in layers.items()},
                "kernels": {str(layer): dict(t.kernels) for layer, t in layers.items()},
                "sync_sites": {str(layer): dict(t.syncs) for layer, t in layers.items()},
            })  # fmt: skip
    plain = [r for r in rows if not r["coding"]]
    coding = [r for r in rows if r["coding"]]
    return {
        "cache": spec,
        "length": length,
        "steps": steps,
        "prompt_path": prompt_path,
        "kernel_bodies": bodies,
        "launches": max((r["launches"] for r in plain), default=None),
        "coding_launches": max((r["launches"] for r in coding), default=None),
        "syncs": max(r["syncs"] for r in rows),
        "triton_launches": max(sum(sum(k.values()) for k in r["kernels"].values()) / len(r["kernels"]) for r in rows),
        # the largest buffer one layer's step allocates where no stored buffer grows (growth is amortized: one
        # history-sized copy per 1/ROOM_FRACTION of the history), against what one layer stores
        "largest_allocation": max((r["largest_allocation"] for r in rows if not r["grew"]), default=None),
        "layer_nbytes": max(_layer_nbytes(layer) for layer in cache.layers),
        "seconds": time.perf_counter() - start,
        "per_step": rows,
    }


def _layer_nbytes(layer) -> int:
    """What one layer stores (`nbytes()`; transformers' layers: their keys and values)."""
    from hf_deltakv.quant import nbytes_of

    return layer.nbytes() if hasattr(layer, "nbytes") else nbytes_of([layer.keys, layer.values])


@torch.no_grad()
def bytes_read(length: int = 4096, spec: str = "delta") -> dict:
    """Distinct bytes the programs of one decoding step's Triton kernels load (`LoadTracer`), summed, against the
    layers' storage (`nbytes()`) plus each layer's queries and output: a step that codes nothing and grows nothing,
    in the middle of a group, after a `length`-token prompt (encoded by the CPU kernels) and one step."""
    from hf_deltakv.eval.gpu_path import LoadTracer

    model = tiny_llama()
    cache = build(spec, model)
    config = model.config
    ids = torch.randint(3, 128, (1, length - 16), generator=torch.Generator().manual_seed(0))
    with kernels_path("auto"):
        token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    with kernels_path("triton"):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)  # (grows the storage)
        stored = sum(layer.nbytes() for layer in cache.layers)
        with LoadTracer(shared=_weights(cache)) as tracer:
            model(token, cache=cache, use_cache=True)
    head_dim = config.hidden_size // config.num_attention_heads
    query_and_output = 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * 4  # fp32 model
    by_kernel = tracer.bytes_by_kernel()
    total = sum(by_kernel.values())
    history = sum(tracer.bytes_by_kernel(shared="not").values())
    once = sum(tracer.bytes_by_kernel(shared="once").values())
    return {"cache": spec, "length": length, "bytes_read": total, "layers_nbytes": stored,
            "query_and_output_bytes": query_and_output, "ratio": total / (stored + query_and_output),
            "history_ratio": history / (stored + query_and_output), "weights_per_program": total - history,
            "weights_once_per_launch": once - history, "by_kernel": by_kernel}  # fmt: skip


def _weights(cache) -> list[torch.Tensor]:
    """What every program of a launch reads alike and no layer stores: the residual layers' decoders and means (as
    their kernels read them)."""
    from hf_deltakv.residual.attention import latent_coder

    layers = [layer for layer in cache.layers if hasattr(layer, "compressor")]
    coders = [latent_coder(layer.compressor, tuple(layer.bits)) for layer in layers]
    return [t for coder in coders for t in vars(coder).values()]


@torch.no_grad()
def prefill_memory(length: int, heads: int = 8, dim: int = 128, path: str = "triton") -> dict:
    """A prefill's transient memory in one layer of the default cache (`heads` kv heads × `dim`, bf16): the peak of
    what its update (coding) and the history it hands attention (`reconstruct`) allocate, above what the layer holds
    after, against the layer's fp16 keys and values. On the interpreted GPU path the kernels' bodies are skipped: the
    memory is what the path allocates (kernels write into what their launchers allocate, and allocate nothing)."""
    from hf_deltakv import DeltaKVCache
    from hf_deltakv.eval.gpu_path import MemoryTracker
    from hf_deltakv.rope import RopeForm

    g = torch.Generator().manual_seed(length)
    keys = torch.randn(1, heads, length, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(1, heads, length, dim, generator=g).to(torch.bfloat16)
    cache = DeltaKVCache(kf=32)
    freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    cache._rope_forms = [RopeForm(freqs)]  # keys coded before RoPE, as with model=
    positions = torch.arange(length)[None]
    skipped = _skip_kernels() if path == "triton" else contextlib.nullcontext()
    with kernels_path(path), skipped, MemoryTracker() as memory:
        pair = cache.update(keys, values, 0, position_ids=positions)
        history = cache.layers[0].reconstruct()
        del pair, history
        held_after = memory.live()
    fp16_kv = 2 * keys.numel() * 2
    transient = memory.peak - held_after
    return {"length": length, "heads": heads, "head_dim": dim, "path": path, "peak_bytes": memory.peak,
            "held_after_bytes": held_after, "fp16_kv_bytes": fp16_kv, "transient_over_fp16_kv": transient / fp16_kv,
            "layer_nbytes": cache.layers[0].nbytes()}  # fmt: skip


@contextlib.contextmanager
def _skip_kernels():
    """Interpreted Triton launches return at once (their outputs' memory is allocated by the launchers)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


CHUNK = 8  # tokens a chunked step feeds (a chunked prefill's, assisted decoding's candidates)
CHUNK_LENGTH = 2048


def chunk_rows(specs: list[str], model) -> list[dict]:
    """Each cache's steps of `CHUNK` tokens after a `CHUNK_LENGTH`-token prompt (kernel bodies skipped, as at 4K;
    SnapKV's at 600 tokens with them: its choice of the slots to evict reads what the attention kernel wrote)."""
    rows = []
    for spec in specs:
        bodies = spec == "snapkv"
        row = count(spec, 600 if bodies else CHUNK_LENGTH, 3, model, prompt_path="auto", bodies=bodies, chunk=CHUNK)
        row["chunk"] = CHUNK
        rows.append(_slim(row))
        print(f"{spec}, chunks of {CHUNK}: {row['launches']} launches ({row['coding_launches']} coding), "
              f"{row['syncs']} syncs", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cache | tokens | launches per layer-step | on a step coding a group | syncs | of them Triton (most) "
             "| largest allocation / layer's bytes |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        coding = "-" if r["coding_launches"] is None else r["coding_launches"]
        largest = "-" if r["largest_allocation"] is None else f"{r['largest_allocation'] / r['layer_nbytes']:.3f}"
        tokens = f"{r['length']:,}" + (f" + {r['chunk']} a step" if r.get("chunk") else "")
        plain = "-" if r["launches"] is None else r["launches"]  # (every step coded)
        lines.append(f"| `{r['cache']}` | {tokens} | {plain} | {coding} | {r['syncs']} "
                     f"| {r['triton_launches']:.0f} | {largest} |")  # fmt: skip
    return "\n".join(lines)


def _slim(row: dict) -> dict:
    """A count's row for the JSON: every step's totals, the breakdown of the costliest plain and coding steps."""
    steps = row.pop("per_step")
    worst = {}
    for coding in (False, True):
        chosen = [s for s in steps if s["coding"] == coding]
        if chosen:
            top = max(chosen, key=lambda s: s["launches"])
            worst["coding" if coding else "plain"] = {k: top[k] for k in ("launches", "ops", "kernels", "sync_sites")}
    row["steps_launches"] = [s["launches"] for s in steps]
    row["steps_coding"] = [s["coding"] for s in steps]
    row["worst"] = worst
    return row


def counted_caches() -> list[str]:
    """The caches the table counts: the registry's (transformers' own quantized ones need optional backends) and
    `VARIANTS`."""
    from hf_deltakv.registry import CACHES

    return [n for n, e in CACHES.items() if e.available() and not n.startswith("hf-")] + VARIANTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default=",".join(counted_caches()))
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--steps", type=int, default=34, help="decoding steps (34: a coding step at any length)")
    parser.add_argument("--no-bytes", action="store_true", help="skip the bytes-read measurement (minutes at 4K)")
    parser.add_argument("--out", default=str(RESULTS / "gpu_path.json"))
    parser.add_argument("--only-chunks", action="store_true",
                        help="count the chunked steps only, into the existing JSON (the rest kept)")  # fmt: skip
    parser.add_argument("--merge", action="store_true",
                        help="the rows of --caches replace theirs in the existing JSON (the rest kept, prefill "
                             "memory and the default cache's bytes not remeasured)")  # fmt: skip
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = tiny_llama()
    chunks = chunk_rows(args.caches.split(","), model)
    print(markdown(chunks))
    if args.only_chunks:
        with open(args.out) as f:
            result = json.load(f)
        result["chunk_rows"] = chunks
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote the chunked steps into {args.out}", file=sys.stderr)
        return 0
    rows = []
    for length in map(int, args.lengths.split(",")):
        for spec in args.caches.split(","):
            short = length <= 256  # the whole path interpreted; longer: the prompt on the CPU, no kernel bodies
            row = count(spec, length, args.steps, model, prompt_path="triton" if short else "auto", bodies=short)
            rows.append(_slim(row))
            print(f"{spec} @ {length}: {row['launches']} launches ({row['coding_launches']} coding), {row['syncs']} "
                  f"syncs, {row['seconds']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    print(markdown(rows))
    if args.merge:
        return _merge(args.out, args.caches.split(","), rows, chunks, args.no_bytes)
    cases = [(2048, "triton"), (2048, "auto"), (32768, "triton")]  # (the CPU path at 32K: ~10 minutes)
    memory = [prefill_memory(n, path=p) for n, p in cases]
    for m in memory:
        print(f"prefill {m['length']} ({m['path']}): transient {m['transient_over_fp16_kv']:.2f}x the layer's fp16 K+V")
    read = None if args.no_bytes else bytes_read(4096)
    if read:
        print(f"bytes read by a decoding step at 4K: {read['ratio']:.3f}x the layers' storage + queries + outputs")
    others = [] if args.no_bytes else [bytes_read(BYTES_OTHERS_LENGTH, spec) for spec in args.caches.split(",")
                                       if spec not in ("dynamic", "delta")]  # fmt: skip
    for other in others:
        print(f"bytes read by a decoding step of {other['cache']} at {BYTES_OTHERS_LENGTH}: {other['ratio']:.3f}x")
    result = {"budget": BUDGET, "bytes_budget": BYTES_BUDGET, "prefill_budget": PREFILL_BUDGET,
              "model": "tiny Llama: 2 layers, 4 query heads on 2 kv heads of 32 channels, fp32, random weights",
              "rows": rows, "chunk_rows": chunks, "prefill_memory": memory, "bytes_read": read,
              "bytes_read_others": others,
              "seconds": round(time.perf_counter() - started)}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _merge(out: str, specs: list[str], rows: list[dict], chunks: list[dict], no_bytes: bool) -> int:
    """`rows`, `chunks` and (unless `no_bytes`) the bytes read of `specs` in place of theirs in the JSON at `out`."""
    with open(out) as f:
        result = json.load(f)
    keep = lambda entries: [e for e in entries if e["cache"] not in specs]  # noqa: E731
    result["rows"] = keep(result["rows"]) + rows
    result["chunk_rows"] = keep(result["chunk_rows"]) + chunks
    if not no_bytes:
        others = [bytes_read(BYTES_OTHERS_LENGTH, spec) for spec in specs if spec not in ("dynamic", "delta")]
        for other in others:
            print(f"bytes read by a decoding step of {other['cache']} at {BYTES_OTHERS_LENGTH}: {other['ratio']:.3f}x "
                  f"(history {other['history_ratio']:.3f}x)")  # fmt: skip
        result["bytes_read_others"] = keep(result["bytes_read_others"]) + others
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"merged {', '.join(specs)} into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
