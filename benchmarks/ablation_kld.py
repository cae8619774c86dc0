"""How the DeltaKVCache defaults were chosen: KL divergence from the uncompressed model, on the VALIDATION split.

Each row changes one thing from the default (or isolates keys or values by storing the other stream in fp16).
Tuning uses WikiText-2 valid, never test; reported perplexities (core_formats.py) use test.

    python benchmarks/ablation_kld.py          # ~12 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from hf_deltakv.eval.divergence import ReferenceDistributions
from hf_deltakv.eval.perplexity import token_windows
from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model
from hf_deltakv.registry import build_cache

HERE = Path(__file__).resolve().parent
DEFAULT_TEXT = HERE.parent.parent / "shared" / "data" / "wikitext-2" / "valid.txt"

VARIANTS = (
    "q4_0",
    "kivi-pre-rope",
    "delta",
    "delta:delta_format=q4_0",
    "delta:delta_format=q4_0,values=q4_0_16",
    "delta:mean_reference=false",
    "delta:intra=false",
    "delta:pre_rope=false",
    "delta:rotate=false",
    "delta:reference=keyframe",
    "delta:kf=64",
    # keys alone (values in fp16) and values alone (keys in fp16)
    "delta:values=f16",
    "delta:values=f16,mean_reference=false",
    "delta:values=f16,delta_format=q4_0",
    "kivi-pre-rope:v_format=f16",
    "q4_0-rot:k_format=f16",
    "q4_0-rot:k_format=f16,v_format=q4_0_16",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--out", default=str(HERE / "results" / "ablation_kld.json"))
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[0]
    reference = ReferenceDistributions(model, token_windows(ids, args.ctx, args.windows))
    rows = []
    print("| cache | KL divergence | top-1 agreement | Δ perplexity | bits/element |")
    print("|---|---:|---:|---:|---:|")
    for spec in VARIANTS:
        result = reference.compare(lambda spec=spec: build_cache(spec, model))
        rows.append({"cache": spec, **asdict(result)})
        print(
            f"| {spec} | {result.kl_divergence:.5f} | {100 * result.top1_agreement:.2f} % "
            f"| {result.delta_ppl_pct:+.2f} % | {result.bits_per_element:.3f} |",
            flush=True,
        )
    config = {"text": Path(args.text).name, "windows": args.windows, "ctx": args.ctx, "model": "SmolLM2-135M-Instruct"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
