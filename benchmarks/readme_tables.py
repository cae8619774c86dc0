"""Render the README's result tables from the committed JSON in benchmarks/results/ (no model run).

python benchmarks/readme_tables.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hf_deltakv.eval.compare import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    core = json.loads((RESULTS / "core_formats.json").read_text())
    ablation = json.loads((RESULTS / "ablation_kld.json").read_text())
    cfg = core["config"]
    print(f"### Formats: {cfg['model']}, {cfg['text']}, {cfg['windows']} windows of {cfg['ctx'][0]} tokens\n")
    print(markdown_table(core))
    if "growth" in core:
        g = core["growth"]["config"]
        print(f"\n### Error growth with context ({g['windows']} windows per length)\n")
        print(markdown_table(core["growth"]))
    a = ablation["config"]
    print(f"\n### Ablation on {a['text']} ({a['windows']} windows of {a['ctx'][0]} tokens)\n")
    print(markdown_table(ablation))
    return 0


if __name__ == "__main__":
    sys.exit(main())
