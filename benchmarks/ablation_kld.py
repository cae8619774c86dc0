"""How DeltaKVCache's defaults were chosen: KL divergence from the fp16 cache on the VALIDATION split of WikiText-2,
on both real models. Each row changes one thing from the default, or isolates keys or values by storing the other
stream in fp16. Tuning uses valid, never test; the reported comparison (quality.py) uses test.

    python benchmarks/ablation_kld.py                     # both models, 4 windows of 1024 tokens: ~40 min
    python benchmarks/ablation_kld.py --models smollm2-135m --windows 2
"""

from __future__ import annotations

import sys

from paths import RESULTS, WIKITEXT_VALID
from quality import comparison_main

VARIANTS = (
    "fp16",
    "delta",
    "kivi-pre-rope",
    "delta:keys=token",  # the earlier per-token delta keys
    "delta:sink_tokens=0",
    "delta:search_scale=false",
    "delta:rotate=false",
    "delta-no-model",  # keys after RoPE
    # keys alone (values in fp16): the per-channel key codec's choices against KIVI's per-channel 4 bits
    "delta:values=f16",
    "delta:values=f16,query_weights=false",
    "delta:values=f16,clip_range=false",
    "delta:kf=64,key_bits=3,values=f16",  # keys at 3 bits, with and without the clipped ranges
    "delta:kf=64,key_bits=3,values=f16,clip_range=false",
    "delta:values=f16,keys=token",
    "kivi-pre-rope:v_format=f16",
    # values alone (keys in fp16)
    "q4_0-rot:k_format=f16",
    "delta:kf=64,values=q3_0,key_bits=8",  # q3_0 values (keys at 8 bits: KL ~1e-5)
)


def main(argv: list[str] | None = None) -> int:
    # specs hold commas (`delta:values=f16,keys=token`): separated by ';' on the command line
    return comparison_main(
        argv, __doc__.split("\n\n")[0], list(VARIANTS), WIKITEXT_VALID, RESULTS / "ablation_kld.json", separator=";"
    )


if __name__ == "__main__":
    sys.exit(main())
