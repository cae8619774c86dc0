"""Why keys are coded against their running mean: per-layer statistics of pre-RoPE keys and of values.

For one window of WikiText-2 valid, after the Hadamard rotation the codec applies, prints the RMS of the vectors,
of their deviation from the per-channel mean (what the mean reference leaves to code), of the difference from the
previous token (what a delta leaves to code), and the per-channel lag-1 autocorrelation.

    python benchmarks/key_statistics.py
"""

from __future__ import annotations

import argparse
import sys

from paths import WIKITEXT_VALID

from hf_deltakv.eval.kv_statistics import layer_statistics
from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(WIKITEXT_VALID))
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4, help="leading tokens left out, as the cache keeps them raw")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[:, : args.ctx]
    print("| layer | stream | RMS | RMS around mean | RMS of delta | lag-1 autocorrelation |")
    print("|---:|---|---:|---:|---:|---:|")
    for index, layer in enumerate(layer_statistics(model, ids, args.sinks)):
        for name, s in (("keys (pre-RoPE)", layer["keys"]), ("values", layer["values"])):
            values = (s.rms, s.rms_around_mean, s.rms_of_delta, s.lag1_autocorrelation)
            print(f"| {index} | {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
