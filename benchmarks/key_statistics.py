"""Why keys are coded against their running mean: per-layer statistics of pre-RoPE keys and of values.

For one window of WikiText-2 valid, after the Hadamard rotation the codec applies, prints the RMS of the vectors,
of their deviation from the per-channel mean (what the mean reference leaves to code), of the difference from the
previous token (what a delta leaves to code), and the per-channel lag-1 autocorrelation.

    python benchmarks/key_statistics.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache

from hf_deltakv.codecs.rotation import rotate
from hf_deltakv.eval.texts import load_text
from hf_deltakv.models import load_model
from hf_deltakv.rope import RopeInverter, find_rotary_embedding

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"


def rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def stream_stats(x: torch.Tensor) -> tuple[float, float, float, float]:
    """(RMS, RMS around the per-channel mean, RMS of the previous-token delta, mean lag-1 autocorrelation)."""
    centered = x - x.mean(dim=2, keepdim=True)
    delta = x[:, :, 1:] - x[:, :, :-1]
    lag1 = (centered[:, :, 1:] * centered[:, :, :-1]).sum(2) / centered[:, :, :-1].pow(2).sum(2).clamp_min(1e-12)
    return rms(x), rms(centered), rms(delta), lag1.mean().item()


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--sinks", type=int, default=4, help="leading tokens left out, as the cache keeps them raw")
    args = parser.parse_args(argv)

    model, tokenizer = load_model()
    ids = tokenizer(load_text(args.text), return_tensors="pt").input_ids[:, : args.ctx]
    cache = DynamicCache()
    model(ids, cache=cache, use_cache=True)
    rope = RopeInverter(find_rotary_embedding(model))
    head_dim = cache.layers[0].keys.shape[-1]
    cos, sin = rope.cos_sin(torch.arange(ids.shape[1]).unsqueeze(0), head_dim)
    print("| layer | stream | RMS | RMS around mean | RMS of delta | lag-1 autocorrelation |")
    print("|---:|---|---:|---:|---:|---:|")
    for index, layer in enumerate(cache.layers):
        keys = rope.undo(layer.keys.float(), cos, sin)
        for name, x in (("keys (pre-RoPE)", keys), ("values", layer.values.float())):
            stats = stream_stats(rotate(x[:, :, args.sinks :]))
            print(f"| {index} | {name} | " + " | ".join(f"{v:.2f}" for v in stats) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
