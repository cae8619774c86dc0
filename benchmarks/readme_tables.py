"""Render the README's result tables from the committed JSON in benchmarks/results/ (no model run).

python benchmarks/readme_tables.py > /tmp/tables.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from paths import RESULTS

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


def main() -> int:
    seeds = {name: table for name in "abcd" if (table := _load(f"seed_{name}.json"))}
    if seeds:
        print("### The seed's claims\n")
        print("\n".join(seed_verdict(seeds)))
        for name, table in seeds.items():
            for result in table["results"]:
                cfg = result["config"]
                print(
                    f"\n#### {SEED_TITLES[name]}: {cfg['text']}, {cfg['windows']} windows per length "
                    f"(`seed_{name}.json`)\n"
                )
                print(markdown_table(result))
    core = _load("core_formats.json")
    if core:
        cfg = core["config"]
        print(f"\n### Formats: {cfg['model']}, {cfg['text']}, {cfg['windows']} windows of {cfg['ctx'][0]} tokens\n")
        print(markdown_table(core))
        if "growth" in core:
            g = core["growth"]["config"]
            print(f"\n### Error growth with context ({g['windows']} windows per length)\n")
            print(markdown_table(core["growth"]))
    ablation = _load("ablation_kld.json")
    if ablation:
        a = ablation["config"]
        print(f"\n### Ablation on {a['text']} ({a['windows']} windows of {a['ctx'][0]} tokens)\n")
        print(markdown_table(ablation))
    decode = _load("decode_speed.json")
    if decode and "ctx" in decode["rows"][0]:
        from decode_speed import markdown as decode_table

        print(f"\n### Decoding on the CPU ({decode['config']['new']} new tokens after the prompt)\n")
        print(decode_table(decode["rows"]))
    residual = _load("residual_cache.json")
    if residual:
        for result in residual["results"]:
            cfg = result["config"]
            print(
                f"\n### Residual cache side by side: {cfg['text']}, {cfg['windows']} windows per length "
                "(`residual_cache.json`)\n"
            )
            print(markdown_table(result))
    tradeoff = _load("residual_tradeoff.json")
    if tradeoff:
        cfg = tradeoff["config"]
        print(
            f"\n### Residual cache trade-off: {cfg['text']}, {cfg['windows']} windows of {cfg['ctx']} tokens, "
            f"fitted compressors (`residual_tradeoff.json`)\n"
        )
        print("| variant | bits/element | perplexity | Δ | KL |\n|---|---:|---:|---:|---:|")
        for row in tradeoff["rows"]:
            print(
                f"| {row['name']} | {row['bits']:.2f} | {row['perplexity']:.3f} | {row['delta_pct']:+.2f} % | "
                f"{row['kl']:.4f} |"
            )
    skip = _load("weight_skip.json")
    if skip:
        from weight_skip import markdown as skip_table

        print(f"\n### Weight skip ({skip['config']['text']}, tokens fed one at a time)\n")
        print(skip_table(skip["rows"]))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
