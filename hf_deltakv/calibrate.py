"""How much each layer's keys and values cost a model when coded below four bits: the measurements behind
`DeltaKVCache(bits=...)`'s per-layer allocation (`hf_deltakv.allocation`).

Every figure is the KL divergence of the model's next-token distribution from the fp16 cache's, one forward per window,
in the real cache (packed storage, the kernels the machine has):
- `keys_curve` / `values_curve`: every layer's keys at each of `KEY_LEVELS` (values at q8_0) / every layer's values
  at each of `VALUE_LEVELS` (keys at `KEY_LEVELS[-1]`);
- `key_probe` / `value_probe`: one layer at a time at the lowest level, every other layer as in the base
  (keys at `KEY_LEVELS[-1]`, values at q8_0), minus the base's KL: how the whole-model cost splits over layers.
"""

from __future__ import annotations

import time

from .allocation import KEY_LEVELS, VALUE_LEVELS
from .compare import compare_caches


def _spec(kf: int, key_bits: list[float] | float, values: list[str] | str) -> str:
    def text(x):
        return "/".join(str(v) for v in x) if isinstance(x, list) else str(x)

    return f"delta:kf={kf},key_bits={text(key_bits)},values={text(values)}"


def measure_sensitivity(model, tokenizer, text, layers: int, kf: int = 64, ctx: int = 1024, windows: int = 2,
                        progress: bool = False) -> dict:  # fmt: skip
    """Measure the curves and per-layer probes above on `windows` windows of `ctx` tokens of `text`.

    Returns:
        a JSON-ready dict: `kf`, `ctx`, `windows`, `base` (KL with keys at the top level, values at q8_0),
        `keys_curve`, `values_curve` ({level: KL}), `key_probe`, `value_probe` (a KL increase per layer), `seconds`.
    """
    start = time.perf_counter()
    top, low_key, low_value = KEY_LEVELS[-1], KEY_LEVELS[0], VALUE_LEVELS[0]
    base = _spec(kf, top, "q8_0")
    keys_curve = {b: _spec(kf, b, "q8_0") for b in KEY_LEVELS[:-1]}
    values_curve = {v: _spec(kf, top, v) for v in VALUE_LEVELS if v != "q8_0"}
    key_probe = [_spec(kf, [low_key if i == layer else top for i in range(layers)], "q8_0") for layer in range(layers)]
    value_probe = [
        _spec(kf, top, [low_value if i == layer else "q8_0" for i in range(layers)]) for layer in range(layers)
    ]
    specs = ["fp16", base, *keys_curve.values(), *values_curve.values(), *key_probe, *value_probe]
    found = compare_caches(model, tokenizer, text=text, caches=tuple(specs), ctx=(ctx,), windows=windows,
                           progress=progress, protocols=("one-forward",))  # fmt: skip
    kl = {row["cache"]: row["kl_divergence"] for row in found["rows"]}
    return {
        "kf": kf,
        "ctx": ctx,
        "windows": windows,
        "base": kl[base],
        "keys_curve": {**{str(b): kl[s] for b, s in keys_curve.items()}, str(top): kl[base]},
        "values_curve": {**{v: kl[s] for v, s in values_curve.items()}, "q8_0": kl[base]},
        "key_probe": [kl[s] - kl[base] for s in key_probe],
        "value_probe": [kl[s] - kl[base] for s in value_probe],
        "seconds": round(time.perf_counter() - start, 1),
    }
