"""Which transformers families `DeltaKVCache(kf=32, model=model)` serves, and how: the family matrix of the tests
(tiny random models of each family, tests/families.py), run once and written down for the README.

python benchmarks/supported_models.py        # ~1 min: writes benchmarks/results/supported_models.json

Per family: whether keys are coded before RoPE (the probed RoPE form: rotate-half or interleaved pairs, over how many
channels, layers without RoPE), whether layers are sliding or chunked, the largest logit difference of fp16 storage
from DynamicCache, and whether greedy generate ran on a left-padded batch; for the refused families, the sentence
the cache says when it is built.
"""

from __future__ import annotations

import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from paths import RESULTS
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_deltakv import DeltaKVCache, QuantizedKVCache
from hf_deltakv.compare import write_json
from hf_deltakv.rope import find_rotary_embedding, probe_rope
from tests.families import FAMILIES, REFUSED, family_model


def describe_rope(model) -> str:
    """The probed RoPE in words."""
    if find_rotary_embedding(model) is None:
        return "no RoPE"
    probe = probe_rope(model)
    if probe.forms is None:
        return f"not understood ({probe.reason})"
    forms = [f for f in probe.forms if f is not None]
    if not forms:
        return "keys without RoPE"
    form = forms[0]
    dim = form.head_dim
    order = form.order if form.order is not None else torch.arange(dim)
    pairs = [(int(order[c]), int(order[c + dim // 2])) for c in range(dim // 2) if form.freqs[c] != 0]
    kind = "interleaved" if all(b - a == 1 for a, b in pairs) else "rotate-half"
    channels = sorted(c for pair in pairs for c in pair)
    where = "" if len(channels) == dim else f" at the {'front' if channels[0] == 0 else 'back'}"
    parts = [f"{kind}, {len(channels)}/{dim} channels{where}"]
    if len(forms) < len(probe.forms):
        parts.append(f"{len(probe.forms) - len(forms)} of {len(probe.forms)} layers without RoPE")
    return "; ".join(parts)


def family_row(name: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family_model(name)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    with torch.no_grad():
        reference = model(ids[1:], cache=DynamicCache(config=model.config), use_cache=True).logits
        stored = model(ids[1:], cache=QuantizedKVCache("f16", "f16", model=model, pre_rope=None), use_cache=True)
    cache = DeltaKVCache(kf=32, model=model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache=cache)
    types = sorted({layer.window is not None for layer in cache.layers})
    return {
        "family": name,
        "config": FAMILIES[name][0],
        "pre_rope": cache.pre_rope,
        "rope": describe_rope(model),
        "windowed_layers": True in types,
        "fp16_max_logit_diff": float((stored.logits - reference).abs().max()),
        "generated": out.shape[1] == ids.shape[1] + 4,
    }


def refused_row(name: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family_model(name)
    try:
        DeltaKVCache(kf=32, model=model)
        reason = None
    except ValueError as err:
        reason = str(err)
    return {"family": name, "config": REFUSED[name][0], "refused": reason}


def main() -> int:
    started = time.time()
    rows = [family_row(name) for name in FAMILIES]
    refused = [refused_row(name) for name in REFUSED]
    config = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - started, 1),
        "protocol": "tiny random models (tests/families.py): fp16 storage (pre-RoPE where understood) vs DynamicCache "
        "logits on one sequence; DeltaKVCache(kf=32, model=model) greedy generate on a left-padded batch of 2",
    }
    write_json({"config": config, "rows": rows, "refused": refused}, RESULTS / "supported_models.json")
    for row in rows:
        print(f"{row['family']:12s} pre-RoPE {row['pre_rope']!s:5s} {row['rope']:45s} windowed {row['windowed_layers']}"
              f" fp16 {row['fp16_max_logit_diff']:.1e} generated {row['generated']}")  # fmt: skip
    for row in refused:
        print(f"{row['family']:12s} refused: {row['refused']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
