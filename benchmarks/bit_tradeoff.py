"""DeltaKVCache below its default bits: the trade-off curve toward ~3 bits per element, on the three real models.

Every layer alike: key bits per element at groups of 64 tokens (kf=64: the side information costs 0.63 bits per key
element instead of 1.25), values in q4_0 or q3_0 (3.5 bits). Then `bits=`: each layer's keys and values at the levels
the model's calibration (`calibrate_bits.py`, WikiText-2 valid) gives for that many nominal bits. KL divergence,
perplexity and top-1 agreement against the fp16 cache on WikiText-2 test, one forward per window, with the bits each
cache really holds.

    python benchmarks/bit_tradeoff.py                    # three models, 4 windows of 1024 tokens: ~40 min
    python benchmarks/bit_tradeoff.py --models smollm2-135m --windows 2
"""

from __future__ import annotations

import sys

from paths import RESULTS, WIKITEXT_TEST
from quality import comparison_main

CACHES = (
    "fp16",
    "delta",  # the default: 4.9 bits
    "delta:kf=64",
    "delta:kf=64,key_bits=3",
    "delta:kf=64,key_bits=3.5,values=q3_0",
    "delta:kf=64,key_bits=3,values=q3_0",
    "delta:kf=64,key_bits=2.75,values=q3_0",  # the ~3.5-bit point
    "delta:kf=64,key_bits=2.5,values=q3_0",
    "delta:kf=64,key_bits=2,values=q3_0",
    # Per layer, as the model's calibration says (`DeltaKVCache(bits=...)`, `calibrate_bits.py`): nominal bits
    "delta:kf=64,bits=4",
    "delta:kf=64,bits=3.5",
    "delta:kf=64,bits=3.25",
    "delta:kf=64,bits=3",
    "kivi-pre-rope",
)
MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b"


def main(argv: list[str] | None = None) -> int:
    return comparison_main(
        argv,
        __doc__.split("\n\n")[0],
        list(CACHES),
        WIKITEXT_TEST,
        RESULTS / "bit_tradeoff.json",
        separator=";",
        models=MODELS,
    )


if __name__ == "__main__":
    sys.exit(main())
