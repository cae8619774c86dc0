"""Render docs/results.md and the README's summary table from the committed JSON in benchmarks/results/ (no model
run).

python benchmarks/readme_tables.py            # writes docs/results.md, prints the README's summary table
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from paths import RESULTS, SPEED_FLAGS

from hf_deltakv.compare import markdown_table

SEED_TITLES = {
    "a": "(a) ctx 512: fp16 / q8_0 / q4_0 / delta kf 16, 32, 64, with anchors, both protocols",
    "b": "(b) context sweep",
    "c": "(c) code vs prose",
    "d": "(d) keyframe interval sweep",
}


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _row(result: dict, cache: str, ctx: int, protocol: str = "one-forward") -> dict:
    for row in result["rows"]:
        if row["cache"] == cache and row["ctx"] == ctx and row.get("protocol", "one-forward") == protocol:
            return row
    raise KeyError((cache, ctx, protocol))


def seed_verdict(tables: dict[str, dict]) -> list[str]:
    """The seed's claims next to what the committed tables measured (no number typed by hand)."""
    lines = []
    if "a" in tables:
        a = tables["a"]["results"][0]
        q4, q8, d32 = (_row(a, c, 512) for c in ("q4_0", "q8_0", "delta:kf=32"))
        lines.append(
            f"- Seed, ctx 512: q4_0 +5.61 %, q8_0 -0.19 %, Delta-KV kf=32 +0.26 %. Measured here: q4_0 "
            f"{q4['delta_pct']:+.2f} %, q8_0 {q8['delta_pct']:+.2f} %, delta kf=32 {d32['delta_pct']:+.2f} % at "
            f"{d32['bits_per_element']:.2f} bits/element (KL {d32['kl_divergence']:.4f})."
        )
    if "b" in tables:
        b = tables["b"]["results"][0]
        ctxs = sorted({row["ctx"] for row in b["rows"]})
        sweep = ", ".join(f"{_row(b, 'delta:kf=32', n)['delta_pct']:+.2f} % @ {n}" for n in ctxs)
        kls = [_row(b, "delta:kf=32", n)["kl_divergence"] for n in ctxs]
        lines.append(
            f"- Seed: stable from 512 to 16K. Measured ({ctxs[0]} to {ctxs[-1]}; SmolLM2's window is 8K): delta "
            f"kf=32 {sweep}; KL {min(kls):.4f} to {max(kls):.4f}."
        )
    if "c" in tables:
        by_text = {r["config"]["text"]: r for r in tables["c"]["results"]}
        code = _row(by_text["stdlib-code"], "delta:kf=32", 1024)
        prose = _row(by_text["wikitext2-test"], "delta:kf=32", 1024)
        lines.append(
            f"- Seed: code 0.05-0.12 %. Measured at 1024: stdlib code {code['delta_pct']:+.2f} % (KL "
            f"{code['kl_divergence']:.4f}) vs WikiText-2 {prose['delta_pct']:+.2f} % (KL {prose['kl_divergence']:.4f})."
        )
    return lines


DOCS = Path(__file__).resolve().parent.parent / "docs" / "results.md"
# Long-context reruns after the needle document's fix, each in its own file: file -> (heading, how it ran).
RERUNS = {
    "long_context_16k.json": (
        "Long contexts to 16K on the fixed needle document",
        "`long_context.py --models qwen2.5-coder-0.5b --max-tokens 16384 --no-memory --out "
        "benchmarks/results/long_context_16k.json`: the document carries the needles of the 4K, 8K and 16K cells "
        "(not the 32K cell's).",
    ),
    "long_context_16k_draw1.json": (
        "The 16K cell, another draw of needles",
        "`long_context.py --models qwen2.5-coder-0.5b --caches delta --max-tokens 16384 --draw 1 --ask-cells 16384 "
        "--no-memory --out benchmarks/results/long_context_16k_draw1.json`: other keys and values at the fixed "
        "document's depths, 10 more trials of the 16K cell.",
    ),
    "long_context_32k.json": (
        "The 32K cell on the fixed needle document",
        "`long_context.py --models qwen2.5-coder-0.5b --caches delta --ask-cells 32768 --no-memory --out "
        "benchmarks/results/long_context_32k.json`: the whole 32K document (every cell's needles), the 32K cell's "
        "questions only, DeltaKVCache beside DynamicCache.",
    ),
    "long_context_key_grid.json": (
        "Keys' ranges on the prompt's grid over a long context",
        '`long_context.py --models smollm2-135m --caches "delta:kf=64,key_bits=2.75,values=q3_0;delta:kf=64,'
        'key_bits=3,values=q3_0,key_ranges=grid8" --max-tokens 8192 --no-memory --out '
        "benchmarks/results/long_context_key_grid.json`: the grid fitted on the first chunk of 1,024 tokens, used to "
        "8K, beside today's ranges at about the same bits.",
    ),
    "long_context_key_grid_short.json": (
        "Keys' ranges on a short prompt's grid over a long context",
        '`long_context.py --models smollm2-135m --caches "delta;delta:key_bits=4.5,key_ranges=grid8;delta:kf=64,'
        'key_bits=2.75,values=q3_0;delta:kf=64,key_bits=3,values=q3_0,key_ranges=grid8" --max-tokens 8192 '
        "--first-chunk 64 --no-memory --out benchmarks/results/long_context_key_grid_short.json`: the grid fitted on "
        "the first 60 tokens (a 64-token prompt less the 4 sinks), then the document in chunks of 1,024 to 8K.",
    ),
    "long_context_key_grid_short_margin025.json": (
        "Keys' ranges on a short prompt's grid, the grid's first margin",
        "The same run as the one above at commit 712a3ce, the grid reaching 0.25 of the fitted range beyond it "
        "(today 2.0): the tokens after the prompt are clipped.",
    ),
    "long_context_16k_20.json": (
        "The 16K cell with 20 needles",
        "`long_context.py --models qwen2.5-coder-0.5b --caches delta --max-tokens 16384 --needles 20 --ask-cells "
        "16384 --no-memory --out benchmarks/results/long_context_16k_20.json`: a document with 20 needles per cell "
        "(another draw of keys and values than the 10-needle one), the 16K cell's asked, DeltaKVCache beside "
        "DynamicCache.",
    ),
}
# Measured with the keys' grid's first margin (`key_grid.GRID_MARGIN` 0.25, up to commit 712a3ce), since widened to 2.0:
# their grid rows (their other rows are current)
FIRST_GRID_MARGIN = (
    "key_side.json",
    "key_ranges_quality.json",
    "long_context_key_grid.json",
    "long_context_key_grid_short_margin025.json",
)
CURRENT = (
    "quality.json",
    "ablation_kld.json",
    "weight_skip.json",
    "decode_speed.json",
    "decode_speed_residual.json",
    "decode_speed_8k.json",
    "decode_tp.json",
    "sliding_memory.json",
    "bit_tradeoff.json",
    "encode_cost.json",
    "long_context.json",
    "value_sensitivity.json",
    "value_basis.json",
    "value_basis_tables.json",
    "basis_quality.json",
    "key_ranges_margin.json",
    "compiled_decode.json",
    "compiled_decode_8k.json",
    "compiled_decode_others.json",
    "compiled_decode_residual.json",
    "ab_decode.json",
    "ab_decode_step_ops.json",
    "ab_caches_key_grid.json",
    *(name for name in RERUNS if name not in FIRST_GRID_MARGIN),
)
# decode_speed.py runs: each its own invocation, every ratio against DynamicCache measured in that same run
DECODE_RUNS = {
    "decode_speed.json": "",
    "decode_speed_residual.json": ", the residual cache coding 16 tokens at a time while decoding (`CODE_BATCH`)",
    "decode_speed_8k.json": ", 8K prompts in bf16",
}
SUMMARY_CACHES = ("delta", "delta-no-model", "kivi-pre-rope", "q4_0-rot", "q4_0", "q8_0")


def machine_line(config: dict) -> str:
    """Where a speed table was measured (`paths.machine()`, in its JSON since that was recorded; before: 2 cores of
    the project's machines, without AMX), a line and a blank one."""
    where = config.get("machine")
    if not where:
        return "Measured on 2 cores without AMX (the CPU was not recorded in this JSON).\n\n"
    flags = ", ".join(where["flags"]) or "none of " + ", ".join(SPEED_FLAGS)
    return f"Measured on {where['cpu']}, {where['threads']} threads of {where['cores']} cores ({flags}).\n\n"


def side_by_side(name: str, caches: tuple[str, ...] | None = None) -> str:
    """One line per cache of `name` (a comparison JSON), both real models side by side: bits, Δ perplexity, KL."""
    table = _load(name)
    if not table:
        return f"(run benchmarks/{name.replace('.json', '.py')})"
    models = list(table)
    caches = caches or tuple(r["cache"] for r in table[models[0]]["rows"] if r["kl_divergence"] is not None)
    head = "| cache | " + " | ".join(f"{m}: bits, Δ perplexity, KL" for m in models) + " |"
    lines = [head, "|---|" + "---:|" * len(models)]
    for cache in caches:
        cells = []
        for m in models:
            row = next((r for r in table[m]["rows"] if r["cache"] == cache), None)
            cells.append(
                "–"
                if row is None
                else f"{row['bits_per_element']:.2f}, {row['delta_pct']:+.2f} %, {row['kl_divergence']:.4f}"
            )
        lines.append(f"| `{cache}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    """A `## title` section with a Markdown table (the first column left-aligned, the others right-aligned)."""
    print(f"\n## {title}\n")
    print("| " + " | ".join(columns) + " |\n|---|" + "---:|" * (len(columns) - 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def summary() -> str:
    """Where we stand (quality.json), then DeltaKVCache below its default bits (bit_tradeoff.json), the supported
    models' line (supported_models.json) and the long-context tables (long_context.json)."""
    parts = [newcomer_times(), side_by_side("quality.json", SUMMARY_CACHES), side_by_side("bit_tradeoff.json")]
    parts.append(supported_models_line())
    return "\n\n".join([*parts, long_context_tables(brief=True)])


def newcomer_times() -> str:
    """The README's first command as `newcomer.py` timed it on a fresh clone and venv."""
    table = _load("newcomer.json")
    if not table:
        return "(run benchmarks/newcomer.py)"
    seconds = {row["step"]: row["seconds"] for row in table["rows"]}
    text = (
        f"measured by `benchmarks/newcomer.py` on a fresh clone and venv,"
        f" {table['config']['cores']} cores: the install "
        f"{seconds['install (command 1)']:.0f} s, then the table after {seconds['hf-deltakv ppl, first run']:.0f} s "
        f"the first time (the model converted once) and {seconds['hf-deltakv ppl, second run']:.0f} s when run again "
        "(the same command: it replaces its own earlier output)"
    )
    if "tests" in seconds:
        text += f"; the tests {seconds['tests'] / 60:.0f} min"
    return text


def supported_models_line() -> str:
    """One sentence from the family matrix: families served pre-RoPE or after it, families refused and why."""
    table = _load("supported_models.json")
    if not table:
        return "(run benchmarks/supported_models.py)"
    rows, refused = table["rows"], table["refused"]
    pre = [r["family"] for r in rows if r["pre_rope"]]
    post = [f"{r['family']} ({r['rope']})" for r in rows if not r["pre_rope"]]
    why = "; ".join(f"{r['family']}: {r['refused'].split(':')[0].split(', which')[0]}" for r in refused)
    return (
        f"**Supported models** (`benchmarks/supported_models.py`, tiny random models of transformers "
        f"{table['config']['transformers']}): `DeltaKVCache(kf=32, model=model)` serves all {len(rows)} families "
        f"tested; keys are coded before RoPE in {len(pre)} ({', '.join(pre)}) and as given in {len(post)} "
        f"({', '.join(post)}); fp16 storage gives DynamicCache's logits within "
        f"{max(r['fp16_max_logit_diff'] for r in rows):.0e}. Refused when the cache is built: {why}."
    )


def long_context_tables(brief: bool = False, name: str = "long_context.json") -> str:
    """Error against length, retrieval, multi-turn and memory (`name`, written by long_context.py); `brief`: the
    README's. A model row's `note` (what a later finding says of it) is printed above its tables."""
    result = _load(name)
    if not result:
        return "(run benchmarks/long_context.py)"
    out = []
    for run in result["models"]:
        if run.get("note"):
            out.append(f"**{run['model']}, `{name}`:** {run['note']}\n")
        buckets = [_span(b["from"], b["to"]) for b in run["kl"][0]["buckets"]]
        out.append(
            f"KL divergence from DynamicCache by position, {run['model']}, {run['tokens']} tokens of WikiText-2 test "
            f"in chunks of {run['chunk']} (bytes held at the end vs DynamicCache at fp16):\n"
        )
        out.append("| cache | " + " | ".join(buckets) + " | last / first 1K | held vs fp16 | nbytes / reachable |")
        out.append("|---|" + "---:|" * (len(buckets) + 3))
        for row in run["kl"]:
            kls = [b["kl"] for b in row["buckets"]]
            first = [b["kl"] for b in row["buckets"] if b["to"] <= 1024]
            base = sum(first) / len(first) if first else kls[0]
            growth = f"{kls[-1] / base:.2f}x" if base > 1e-5 else "–"  # eviction: exact until it first drops
            held = run["bytes_held"][row["cache"]] / run["fp16_bytes"]
            reach = run.get("reachable_bytes", {}).get(row["cache"])
            counted = f"{run['bytes_held'][row['cache']] / reach:.3f}" if reach else "–"
            cells = " | ".join(f"{k:.4f}" for k in kls)
            out.append(f"| `{row['cache']}` | {cells} | {growth} | {held:.2f}x | {counted} |")
        out.append("")
        if run["retrieval"]:
            cells = sorted({r["cell"] for r in run["retrieval"]})
            caches = list(dict.fromkeys(r["cache"] for r in run["retrieval"]))
            out.append(f"Retrieval ({run['model']}, RULER-style multi-key needles, correct of asked per context) and "
                       "multi-turn (the questions of the multi-turn cell in successive turns, cache carried: answers "
                       "equal to DynamicCache's; correct):\n")  # fmt: skip
            out.append("| cache | " + " | ".join(f"{c // 1024}K" for c in cells) + " | multi-turn same | correct |")
            out.append("|---|" + "---:|" * (len(cells) + 2))
            for cache in caches:
                cell_text = []
                for c in cells:
                    rows = [r for r in run["retrieval"] if r["cache"] == cache and r["cell"] == c]
                    cell_text.append(f"{sum(r['correct'] for r in rows)}/{len(rows)}")
                turns = run["multi_turn"].get(cache)
                same = f"{turns['same_as_dynamic']}/{turns['of']}" if turns else "–"
                correct = f"{turns['correct']}/{turns['of']}" if turns and "correct" in turns else "–"
                out.append(f"| `{cache}` | " + " | ".join(cell_text) + f" | {same} | {correct} |")
            out.append("")
    if result["memory"] and not brief:
        out.append("Memory: a fresh process per cache, prefill in chunks + 64 greedy decoding steps; peak resident "
                   "memory (VmHWM, reset after the model is loaded and paged in) and bytes held:\n")  # fmt: skip
        out.append("| model | cache | tokens | peak RSS MiB | vs DynamicCache | above model MiB | held after "
                   "prefill MiB | after decode MiB |")  # fmt: skip
        out.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for row in sorted(result["memory"], key=lambda r: (r["tokens"], r["cache"] != "dynamic")):  # by length
            same = [r for r in result["memory"] if (r.get("model"), r["tokens"]) == (row.get("model"), row["tokens"])]
            dynamic = [r["peak_rss"] for r in same if r["cache"] == "dynamic"]
            ratio = f"{row['peak_rss'] / dynamic[0]:.2f}x" if dynamic else "–"
            out.append(f"| {row.get('model', '')} | `{row['cache']}` | {row['tokens']} | "
                       f"{row['peak_rss'] / 2**20:.0f} | {ratio} | "
                       f"{row['peak_above_model'] / 2**20:.0f} | {row['held_after_prefill'] / 2**20:.1f} | "
                       f"{row['held_after_decode'] / 2**20:.1f} |")  # fmt: skip
    return "\n".join(out).rstrip()


def _span(start: int, end: int) -> str:
    """Token positions as the issue names them: 0-512, 512-1K, 1-2K, ..., 16-32K."""
    first = str(start // 1024) if start >= 1024 else str(start)
    return f"{first}-{end // 1024}K" if end >= 1024 else f"{first}-{end}"


def triton_table() -> None:
    """Per kernel and target: configurations compiled, the most shared memory, registers and spills."""
    result = _load("triton_compile.json")
    if not result:
        return
    cfg, rows = result["config"], result["rows"]
    print(f"\n## Triton kernels compiled without a GPU (Triton {cfg['triton']}, `triton_compile.json`, "
          f"{cfg['seconds']:.0f} s)\n")  # fmt: skip
    which = ("A covering pass (`--quick`: every kernel, format, head dim and option at least once, the others varied "
             "alongside; every combination took over 30 minutes on 2 cores once the default cache's kernels joined)"
             if cfg.get("quick") else "Every configuration the dispatch launches")  # fmt: skip
    print(which + ", compiled for each target; shared memory against the target's "
          "limit, registers per thread and spilled bytes as the backend reports them (AMD: the assembly's metadata; "
          "NVIDIA: `cuobjdump --dump-resource-usage` of the cubin, stack plus local memory; compile seconds with "
          "Triton's cache as the run found it). The Delta-KV article's MI50 is gfx906, which Triton does not "
          "target.\n")  # fmt: skip
    print("| kernel | target | configs | failed | max shared B (limit) | max registers | spills | compile s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kernel in sorted({r["kernel"] for r in rows}):
        for target in cfg["targets"]:
            mine = [r for r in rows if r["kernel"] == kernel and r["target"] == target]
            ok = [r for r in mine if r["error"] is None]
            regs = [r["registers"] for r in ok if r.get("registers") is not None]
            spills = [r["spills"] for r in ok if r.get("spills") is not None]
            print(f"| `{kernel}` | {target} | {len(mine)} | {len(mine) - len(ok)} | "
                  f"{max((r['shared'] for r in ok), default=0)} ({cfg['shared_limit'][target]}) | "
                  f"{max(regs) if regs else '–'} | {max(spills) if spills else '–'} | "
                  f"{sum(r['seconds'] for r in mine):.0f} |")  # fmt: skip


def compiled_tables(name: str, what: str, compiled: dict) -> None:
    """A `compiled_decode.py` run: decode tokens/s against the fastest uncompressed cache, and the bytes held."""
    from compiled_decode import markdown as compiled_table
    from compiled_decode import memory_markdown

    cfg = compiled["config"]
    print(
        f"\n## Compiled decoding on the CPU{what} (`compiled_decode.py`, `{name}`)\n\n"
        f"SmolLM2 through `generate`, {cfg['new']} tokens after the prompt, median of {cfg['rounds']} timed rounds "
        "per configuration (each in its own process after a warm-up generation that compiles); decode time: "
        + (
            "between the first and the last new token's logits in one generation; "
            if cfg.get("timing") == "stamps"
            else "a full generation less a prefill-only one; "
        )
        + "compiled: "
        "`CompileConfig(fullgraph=True, dynamic=False, mode=None)` with inductor's C++ code (no CUDA graphs on a "
        "CPU). Ratios against the fastest uncompressed cache (DynamicCache, StaticCache eager or compiled) at the "
        "same context and dtype.\n"
    )
    print(machine_line(cfg) + compiled_table(compiled["rows"]))
    if compiled.get("memory"):
        print("\nMemory at the same `max_cache_len` (fp16, `nbytes()`: the whole capacity, allocated up front):\n")
        print(memory_markdown(compiled["memory"]))


def gpu_path_tables() -> None:
    """The GPU path's launches and syncs per layer-step, bytes read and prefill memory (`gpu_path.json`)."""
    result = _load("gpu_path.json")
    if not result:
        return
    from gpu_path import markdown

    budget = result["budget"]
    print("\n## The GPU path, counted without a GPU (`gpu_path.py`, `gpu_path.json`)\n")
    print(
        f"Per layer and decoding step on the path a CUDA device takes (`HF_DELTAKV_KERNELS=triton`, Triton's "
        f"interpreter on CPU tensors), {result['model']}: aten ops that compute plus Triton launches (each at least "
        "one GPU kernel) and host-device syncs inside the cache's `update` and attention call, the most of "
        f"{result['rows'][0]['steps']} decoding steps after the prompt (the first included); a step that codes a "
        f"group of keys apart. Budget of the default cache: ≤ {budget['launches']} launches, ≤ "
        f"{budget['coding_launches']} on a coding step, {budget['syncs']} syncs. At 200 tokens the whole path is "
        "interpreted; at 4,096 the prompt is encoded by the CPU kernels (the same bytes) and the kernels' bodies "
        "are skipped while counting (no sync: nothing on the host depends on them; at 200 tokens the counts are "
        "the same either way, tested). A cache without a Triton kernel for an op runs its PyTorch reference: "
        "those rows are what a GPU would launch today. The last column: the largest buffer a step that grows "
        "no stored buffer allocates, against what the layer holds (DynamicCache's concatenation: half).\n"
    )
    print(markdown(result["rows"]))
    chunks = result.get("chunk_rows")
    if chunks:
        print(f"\nSteps of {chunks[0]['chunk']} tokens at once (a chunked prefill, assisted decoding's candidates: "
              "each query sees the tokens up to its own), the same counts (kernel bodies skipped after a 2K prompt; "
              "SnapKV's run with them after 600 tokens, as its choice of the slots to evict reads what attention "
              "wrote):\n")  # fmt: skip
        print(markdown(chunks))
    print(
        '\n`delta:keys=token` (`DeltaKVCache(keys="token")`, outside the registry) is counted with it: a '
        "step's tokens are coded in one kernel (RoPE undone, rotated, keyframe or closed-loop delta, running "
        "mean) and attention rebuilds the keys from keyframes and deltas in registers. Not served by Triton "
        "kernels yet (the PyTorch reference runs there on GPUs, launches and syncs as above do not hold): "
        "`ResidualKVCache` with references (`stride` > 0; the built-in compressor has none), chunks of more "
        "than 64 queries (a prefill: the history decoded into the attention's dtype in one kernel, then "
        "SDPA), and a token-delta chunk of more than 64 tokens after the prompt (coded by whole groups)."
    )
    read = result.get("bytes_read")
    if read:
        print(f"\nBytes read by one decoding step at {read['length']:,} tokens (the distinct bytes each program of its "
              f"kernels loads, summed over programs): {read['bytes_read']:,} against the layers' `nbytes()` "
              f"{read['layers_nbytes']:,} plus queries and outputs {read['query_and_output_bytes']:,}: "
              f"**{read['ratio']:.3f}x** (budget ≤ {result['bytes_budget']}x; the positions, 4 bytes a token read by "
              "each kv head's programs, are most of the excess). By kernel: "
              + ", ".join(f"`{k.strip('_')}` {v:,}" for k, v in read["by_kernel"].items()) + ".")  # fmt: skip
    others = result.get("bytes_read_others")
    if others:
        print(f"\nThe other caches' decoding steps at {others[0]['length']:,} tokens, the same measure. "
              "ResidualKVCache also reads its decoders and means (model weights outside `nbytes()`): every split "
              "program the key decoder's columns of its kv heads, every merge program its kv head's value decoder; "
              "the ratio counts them once per program, a GPU's L2 serves them after the first (`weights once`: "
              "counted once per launch; `history`: left out). Its split programs each take every kv head of a token "
              "range (the latent codes, shared by the heads, read once).\n")  # fmt: skip
        print("| cache | bytes read | layers' nbytes + queries and outputs | ratio | history | weights per program / "
              "once |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
        for o in others:
            weights = o.get("weights_per_program")
            history = f"{o['history_ratio']:.3f}x" if weights else "-"
            weights = f"{weights:,} / {o['weights_once_per_launch']:,}" if weights else "-"
            print(f"| `{o['cache']}` | {o['bytes_read']:,} | {o['layers_nbytes'] + o['query_and_output_bytes']:,} | "
                  f"{o['ratio']:.3f}x | {history} | {weights} |")  # fmt: skip
    memory = result.get("prefill_memory")
    if memory:
        print("\nA prefill's transient memory, one layer of the default cache (8 kv heads × 128, bf16): the peak its "
              "coding and the history it hands attention allocate, above what it holds after, against its fp16 keys "
              f"and values (budget ≤ {result['prefill_budget']}x; on the GPU path the kernels' bodies are skipped: "
              "they allocate nothing).\n")  # fmt: skip
        print("| tokens | path | peak MiB | held after MiB | fp16 K+V MiB | transient / fp16 K+V |")
        print("|---:|---|---:|---:|---:|---:|")
        for m in memory:
            path = {"triton": "GPU (Triton)", "auto": "CPU (C++)"}.get(m["path"], m["path"])
            print(f"| {m['length']:,} | {path} | {m['peak_bytes'] / 2**20:.0f} | {m['held_after_bytes'] / 2**20:.1f} "
                  f"| {m['fp16_kv_bytes'] / 2**20:.0f} | {m['transient_over_fp16_kv']:.2f}x |")  # fmt: skip


def gpu_prediction_table() -> None:
    result = _load("gpu_decode.json")
    if not result or "predicted" not in result:
        return
    from gpu_decode import GPU_BANDWIDTH, predicted_markdown

    print("\n## GPU decoding predicted from bytes read per step (`gpu_decode.py`, `gpu_decode.json`)\n")
    print("Batch 1 decoding is bound by memory bandwidth: tokens/s = bandwidth / (weights read + cache read), "
          "bf16 weights, the cache at the bits measured on SmolLM2, published peak bandwidth ("
          + ", ".join(f"{gpu} {bw / 1e12:.2f} TB/s" for gpu, bw in GPU_BANDWIDTH.items())
          + "). A prediction, and an upper bound: it counts bytes only. Each Triton launch also costs the host "
          "time (Triton's Python launcher: tens of microseconds a launch as reported elsewhere, not measured here; "
          "an 8B layer's fp16 history at 8K reads in 7 µs at 4.8 TB/s): a cache's 3-7 launches a layer "
          "(`gpu_path.json`) against DynamicCache's 3 may cost more than its bytes save at short contexts (no CUDA "
          "graphs).\n")  # fmt: skip
    print(predicted_markdown(result["predicted"]))
    measured = result.get("rows")
    if measured and "adaptive" in measured[0]:
        print(f"\nMeasured on {result['config']['device_name']} (attention of one decoding step, batch 1):\n")
        print("| shape | context | fp16 SDPA ms | default delta ms | vs SDPA | q4_0 ms | vs SDPA | of peak bandwidth |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in measured:
            a, p = r["adaptive"], r["plain"]
            share = f"{a['bandwidth_fraction']:.0%}" if a.get("bandwidth_fraction") else "-"
            print(f"| {r['shape']} | {r['context']:,} | {r['sdpa_fp16_ms']:.3f} | {a['ms']:.3f} | "
                  f"{a['speedup_vs_sdpa']:.2f}x | {p['ms']:.3f} | {p['speedup_vs_sdpa']:.2f}x | {share} |")  # fmt: skip
        for r in result.get("end_to_end", []):
            ratio = r.get("vs_dynamic") or {}
            cells = ", ".join(f"`{n}` {v:.1f} tok/s ({ratio.get(n, float('nan')):.2f}x)"
                              for n, v in r["tokens_per_s"].items())  # fmt: skip
            print(f"\nEnd to end, {r['shape']} at {r['context']:,}: {cells}.")


def results() -> None:
    """Every table, as docs/results.md holds them."""
    print("# Results\n")
    print(
        "Generated by `python benchmarks/readme_tables.py` from `benchmarks/results/*.json` (each written by a "
        "script in `benchmarks/`, `seed_*.json` by seed_tables.py, the others by the script of their name, with "
        "its full config). Bits/element are measured: 8 × bytes held "
        "by the cache / cached scalars. KL divergence is from the fp16 cache's next-token distribution.\n"
    )
    print(
        f"**Freshness.** {', '.join(f'`{n}`' for n in CURRENT)} were measured on the current code; "
        f"{', '.join(f'`{n}`' for n in FIRST_GRID_MARGIN)} too, but for their `key_ranges=grid8` rows: those had the "
        "keys' grid's first margin (0.25 of the fitted range, up to commit 712a3ce; `key_side.py --margin 0.25`). The "
        "other tables "
        "(the seed tables, formats and error growth, the residual cache's) were measured before DeltaKVCache's "
        "per-channel key codec landed (commit 3193d4f): their `delta` rows show the earlier per-token key codec "
        "(now `delta:keys=token`). Rerun their scripts to refresh them.\n"
    )
    for name, title in (
        ("quality.json", "Quality"),
        ("bit_tradeoff.json", "Below the default bits"),
        ("basis_quality.json", "Values in each head's own directions, through the cache (`bit_tradeoff.py --caches "
                               "... --out results/basis_quality.json`: `values=basis-q3_0`, the reference path)"),
        ("key_ranges_quality.json", "Keys' ranges on a grid, through the cache (`bit_tradeoff.py --caches ... --out "
                                    "results/key_ranges_quality.json`: `key_ranges=grid8`, the reference coder, the "
                                    "grid's first margin, 0.25)"),
        ("key_ranges_margin.json", "Keys' ranges on a grid reaching 2.0 of the prompt's range beyond it, through the "
                                   "cache (`bit_tradeoff.py --caches ... --out results/key_ranges_margin.json`)"),
    ):  # fmt: skip
        for result in (_load(name) or {}).values():
            cfg = result["config"]
            print(
                f"\n## {title}: {cfg['model']}, {Path(cfg['text']).name}, {cfg['windows']} windows of "
                f"{cfg['ctx'][0]} tokens (`{name}`)\n"
            )
            print(markdown_table(result))
    sensitivity = _load("value_sensitivity.json")
    if sensitivity:
        from value_sensitivity import markdown as sensitivity_table

        print(
            "\n## Where values below four bits lose (`value_sensitivity.py`, `value_sensitivity.json`)\n\n"
            f"KL from the unmodified model on WikiText-2 {sensitivity['text']} when only values are coded, inside "
            f"attention of one forward (rotated, searched scale, the first {sensitivity['sinks']} tokens raw; keys "
            "exact). Bits a value: q3_0 3.5, q4_0 4.5, q8_0 8.5 (a 32-value block's fp16 scale included); the "
            f"causal choice of tokens sees the queries of the {sensitivity['window']} tokens after each.\n"
        )
        print("\n\n".join(sensitivity_table(result) for result in sensitivity["results"]))
    basis = _load("value_basis.json")
    if basis:
        from value_basis import markdown as basis_table

        cfg = basis["config"]
        print(
            "\n## Values in each head's own directions (`value_basis.py`, `value_basis.json`)\n\n"
            "KL from the unmodified model when only values are coded, as above (keys exact, the first "
            f"{cfg['sinks']} tokens raw), for value coders below four bits: the bases, means and bits calibrated on "
            f"{cfg['calib']}, measured on WikiText-2 validation (`(self)`: fitted on the measured window's own values, "
            "`(prefix)`: on its first half; the options: `value_basis.py`'s docstring). Bits a value count the codes "
            "and the per-token or per-block fp16 scales; the per-model tables are not spread over tokens, the "
            "per-sequence ones (fitted on the window) are in their own column: spread over the window's tokens, and "
            "over 8K and 32K.\n"
        )
        print("\n\n".join(basis_table(result) for result in basis["results"]))
    tables = _load("value_basis_tables.json")
    if tables:
        print(
            "\n### What a prompt-fitted basis's tables cost (`value_basis.py --only fallback`, "
            "`value_basis_tables.json`)\n\n"
            "The coders with the fallback again, with two cheaper tables per sequence: `(spreads: ...)` keeps the "
            "directions calibrated per model and fits only the mean, the spreads along them and the bits on the "
            "window (or its first half); `table=int8` holds the fitted basis in 8 bits.\n"
        )
        print("\n\n".join(basis_table(result) for result in tables["results"]))
    side = _load("key_side.json")
    if side:
        from key_side import markdown as side_table

        print(
            "\n## Keys' side information (`key_side.py`, `key_side.json`)\n\n"
            "KL from the unmodified model when only keys are coded (values exact, the first 4 tokens restored), before "
            "RoPE in groups of kf tokens as DeltaKVCache codes them, with each form of a group's channel ranges "
            "(`key_side.py`'s docstring): today's fp16 low and step, 8-bit floats, codes on a per-sequence grid "
            "(`gridN`: N bits for each end; the grid fitted on the window's first half), or the grid's range alone. "
            "Each cell: bits a key element (codes, side information, the per-sequence grid over the window), KL.\n"
        )
        print("\n\n".join(side_table(result) for result in side["results"]))
    cost = _load("encode_cost.json")
    if cost:
        cfg = cost["config"]
        _table(
            f"The clipped key ranges' cost: {cfg['model']}, {cfg['dtype']}, {cfg['ctx']}-token prompt, {cfg['new']} "
            f"decoded tokens, median of {cfg['rounds']} rounds (`encode_cost.json`)",
            ["clip_range", "prefill tok/s", "decode tok/s"],
            [[str(r["clip_range"]), f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}"] for r in cost["rows"]],
        )
    table = _load("supported_models.json")
    if table:
        _table(
            "Supported models (`supported_models.json`, tiny random models)",
            ["family", "config", "keys coded", "RoPE found", "windowed layers", "fp16 max logit diff", "generates"],
            [[r["family"], r["config"], "before RoPE" if r["pre_rope"] else "after RoPE", r["rope"],
              "yes" if r["windowed_layers"] else "no", f"{r['fp16_max_logit_diff']:.1e}", "yes" if r["generated"]
              else "no"] for r in table["rows"]]
            + [[r["family"], r["config"], "refused", r["refused"], "", "", ""] for r in table["refused"]],
        )  # fmt: skip
    if _load("long_context.json"):
        print("\n## Long contexts (`long_context.py`, `long_context.json`)\n")
        print(long_context_tables())
    for name, (heading, how) in RERUNS.items():
        if _load(name):
            print(f"\n## {heading} (`{name}`)\n\n{how}\n")
            print(long_context_tables(name=name))
    runs = (("compiled_decode.json", ""), ("compiled_decode_8k.json", ", 8K prompts"),
            ("compiled_decode_others.json", ": the other caches"),
            ("compiled_decode_residual.json", ": the learned residual cache"))  # fmt: skip
    for name, what in runs:
        compiled = _load(name)
        if compiled:
            compiled_tables(name, what, compiled)
    for name in ("ab_decode.json", "ab_decode_step_ops.json"):  # each change timed against the revision before it
        ab = _load(name)
        if not ab:
            continue
        from ab_decode import markdown as ab_table

        cfg = ab["config"]
        print(
            f"\n## A change's decode speed, its revisions run alternately (`ab_decode.py`, `{name}`)\n\n"
            f"`compiled_decode.py` configurations at base {cfg['base'][:7]} and head {cfg['head'][:7]}"
            + (" (with changes not yet committed then)" if cfg["head_has_uncommitted_changes"] else "")
            + f", {cfg['pairs']} runs of each alternated, {cfg['rounds']} timed rounds a run, medians.\n\n"
            + machine_line(cfg).removesuffix("\n")
        )
        print(ab_table(ab["rows"]))
    for name in ("ab_caches_key_grid.json",):  # caches' decoding steps interleaved in one process
        ab = _load(name)
        if not ab:
            continue
        from ab_caches import markdown as caches_table

        cfg = ab["config"]
        print(f"\n## Caches' decoding steps interleaved (`ab_caches.py`, `{name}`)\n\n`ab_caches.py --caches "
              f"\"{cfg['caches']}\"`: {cfg['new']} steps of each cache in turn after a {cfg['ctx']}-token prompt, "
              f"{cfg['dtype']}, medians over the steps.\n\n" + machine_line(cfg).removesuffix("\n"))  # fmt: skip
        print(caches_table(ab["rows"]))
    gpu_path_tables()
    triton_table()
    gpu_prediction_table()
    sliding = _load("sliding_memory.json")
    if sliding:
        print("\n## Sliding-window layers: Gemma-3-270M, bytes held (`sliding_memory.json`)\n")
        print("| cache | tokens | MiB held | vs DynamicCache at fp16 |\n|---|---:|---:|---:|")
        for row in sliding["rows"]:
            fp16 = next(r["bytes"] for r in sliding["rows"] if r["tokens"] == row["tokens"] and "fp16" in r["cache"])
            print(f"| {row['cache']} | {row['tokens']} | {row['bytes'] / 2**20:.2f} | {row['bytes'] / fp16:.2f}x |")
    legacy()


def main() -> int:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        results()
    DOCS.write_text(buffer.getvalue())
    print(summary())
    print(f"wrote {DOCS}", file=sys.stderr)
    return 0


def legacy() -> None:
    seeds = {name: table for name in "abcd" if (table := _load(f"seed_{name}.json"))}
    if seeds:
        print("\n## The seed's claims\n")
        print("\n".join(seed_verdict(seeds)))
        for name, table in seeds.items():
            for result in table["results"]:
                cfg = result["config"]
                print(
                    f"\n### {SEED_TITLES[name]}: {cfg['text']}, {cfg['windows']} windows per length "
                    f"(`seed_{name}.json`)\n"
                )
                print(markdown_table(result))
    core = _load("core_formats.json")
    if core:
        cfg = core["config"]
        print(f"\n## Formats: {cfg['model']}, {cfg['text']}, {cfg['windows']} windows of {cfg['ctx'][0]} tokens\n")
        print(markdown_table(core))
        if "growth" in core:
            g = core["growth"]["config"]
            print(f"\n## Error growth with context ({g['windows']} windows per length)\n")
            print(markdown_table(core["growth"]))
    ablation = _load("ablation_kld.json")
    for name, result in (ablation or {}).items():
        a = result["config"]
        print(
            f"\n## Ablation: {name}, {a['text']} ({a['windows']} windows of {a['ctx'][0]} tokens; "
            "`ablation_kld.json`)\n"
        )
        print(markdown_table(result))
    from decode_speed import markdown as decode_table

    for name, what in DECODE_RUNS.items():
        decode = _load(name)
        if decode and "ctx" in decode["rows"][0]:
            print(f"\n## Decoding on the CPU{what} ({decode['config']['new']} new tokens after the prompt; `{name}`)\n")
            print(machine_line(decode["config"]) + decode_table(decode["rows"]))
    tp = _load("decode_tp.json")
    if tp:
        print(
            f"\n## Decoding under tensor parallelism on the CPU ({tp['config']['new']} new tokens; `decode_tp.json`)\n"
        )
        print(
            "SmolLM2 has 3 KV heads, so its TP runs use 3 ranks (1 thread each) on the 2 cores that one process "
            "uses with 2 threads. Bytes and peak memory are summed over the ranks.\n"
        )
        print(decode_table(tp["rows"]))
    residual = _load("residual_cache.json")
    if residual:
        for result in residual["results"]:
            cfg = result["config"]
            print(
                f"\n## Residual cache side by side: {cfg['text']}, {cfg['windows']} windows per length "
                "(`residual_cache.json`)\n"
            )
            print(markdown_table(result))
    tradeoff = _load("residual_tradeoff.json")
    if tradeoff:
        cfg = tradeoff["config"]
        _table(
            f"Residual cache trade-off: {cfg['text']}, {cfg['windows']} windows of {cfg['ctx']} tokens, "
            "fitted compressors (`residual_tradeoff.json`)",
            ["variant", "bits/element", "perplexity", "Δ", "KL"],
            [
                [r["name"], f"{r['bits']:.2f}", f"{r['perplexity']:.3f}", f"{r['delta_pct']:+.2f} %", f"{r['kl']:.4f}"]
                for r in tradeoff["rows"]
            ],
        )
    skip = _load("weight_skip.json")
    if skip:
        from weight_skip import allocation
        from weight_skip import markdown as skip_table

        cfg = skip["config"]
        print(
            f"\n## Weight skip: {cfg['text']}, {cfg['windows']} window(s) of {cfg['ctx']} tokens, the first "
            f"{cfg.get('perplexity_prompt', 1)} prefilled, the rest fed one at a time; decode speed after a "
            f"{cfg['prompt']}-token prompt, {cfg['threads']} threads, median of {cfg['rounds']} rounds; the last "
            f"column: {cfg.get('sim_windows', 0)} windows of the same text, each in one forward with the rule applied "
            "to every token (`SkipSimulator`) (`weight_skip.json`)\n"
        )
        print(skip_table(skip["rows"]))
        if any("kind_levels" in r for r in skip["rows"]):
            print("\nWhere the allocation put the sparsity (fraction of each kind's input channels skipped):\n")
            print(allocation(skip["rows"]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
