"""Calibrate `DeltaKVCache(bits=...)` for the real models: measure each layer's key and value sensitivity (see
`hf_deltakv.calibrate`) on WikiText-2 valid and ship it as `hf_deltakv/allocation/tables/<model>.json`.

The test split stays for `bit_tradeoff.py`, which measures the allocations these tables give.

    python benchmarks/calibrate_bits.py                              # the three real models: ~1 h on 2 cores
    python benchmarks/calibrate_bits.py --models smollm2-135m --windows 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paths import WIKITEXT_VALID, machine

from hf_deltakv.allocation import CALIBRATIONS, allocate, bit_range
from hf_deltakv.calibrate import measure_sensitivity
from hf_deltakv.models import load_model
from hf_deltakv.persist import model_signature


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    parser.add_argument("--text", default=str(WIKITEXT_VALID))
    parser.add_argument("--kf", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", default=str(CALIBRATIONS), help="folder of the tables")
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        model, tokenizer = load_model(name)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        found = measure_sensitivity(model, tokenizer, args.text, layers, args.kf, args.ctx, args.windows, True)
        found = {**found, "text": Path(args.text).name, "machine": machine()}
        table = {"model": model_signature(model), "sensitivity": found}
        path = Path(args.out) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"{name}: base KL {found['base']:.5f}; keys {found['keys_curve']}; values {found['values_curve']}")
        low, high = bit_range(args.kf)
        for bits in (3.0, 3.5, 4.0):
            if low <= bits <= high:
                key_bits, values = allocate(found, bits, args.kf)
                print(f"  {bits} bits: key_bits {key_bits}; values {values}")
        print(f"wrote {path} ({found['seconds']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
