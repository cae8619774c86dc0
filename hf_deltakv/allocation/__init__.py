"""Bits per layer for `DeltaKVCache(bits=...)`: each layer's keys and values at the levels a measured sensitivity
says, for a mean number of bits per element.

A calibration (`hf_deltakv.calibrate.measure_sensitivity`, shipped for the models in `tables/`) holds, for one
model, the KL divergence of the whole model at each key level and value format (every layer alike) and how it splits
over layers (one layer at a time at the lowest level). The cost of layer `i` at level `b` is modelled as its share
of that split times the whole-model KL at `b`; `allocate` starts every stream at its lowest level and upgrades, one
stream at a time, the one that removes the most KL per bit spent, while the mean bits stay within the budget.

Bits are nominal: the codes and side information of coded groups (a key's low, step and depth per channel and
group: `KEY_SIDE_BYTES` bytes, that is `8 * KEY_SIDE_BYTES / kf` bits per element; a value block's fp16 scale). The
raw sink tokens and a group not yet complete add to what `nbytes()` counts (~0.08 bits per element at 1K tokens).

For a model without a calibration, the default model's calibration is used with every layer alike (its curves set the
split between keys and values; `source` says so).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..persist import same_model
from ..quant import FORMATS

KEY_LEVELS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0)  # key bits per element a layer may take (the last: the probes' base)
KEY_PROBE = 2.0  # the level of a layer's keys in its probe
VALUE_LEVELS = ("q3_0", "q4_0", "q8_0")  # value formats a layer may take, from the cheapest
KEY_SIDE_BYTES = 5  # low and step (fp16) and depth (uint8) per channel and group (`codecs.adaptive`)
CALIBRATIONS = Path(__file__).parent / "tables"
DEFAULT_CALIBRATION = "smollm2-135m"  # the embedded default model's


def key_element_bits(bits: float, kf: int) -> float:
    """Nominal bits per key element of a coded group: the codes plus their share of the side information."""
    return bits + 8 * KEY_SIDE_BYTES / kf


def load_calibration(model: nn.Module) -> tuple[dict, str]:
    """The calibration shipped for `model` (matched by shape and a probe of its weights), else the default model's
    with every layer alike; and its source, in words."""
    tables = {path.stem: path for path in sorted(CALIBRATIONS.glob("*.json"))}
    for name, path in tables.items():
        table = json.loads(path.read_text())
        if same_model(table["model"], model) is None:
            return table["sensitivity"], f"calibrated on {name}"
    table = json.loads(tables[DEFAULT_CALIBRATION].read_text())["sensitivity"]
    layers = _layers(model)
    alike = {**table, "key_probe": [1.0] * layers, "value_probe": [1.0] * layers}
    return alike, f"no calibration for this model: {DEFAULT_CALIBRATION}'s curves, every layer alike"


def _layers(model: nn.Module) -> int:
    text = model.config.get_text_config(decoder=True) if hasattr(model, "config") else None
    if text is None:
        raise ValueError("bits= needs the model (model=...): it allocates the bits per layer")
    return text.num_hidden_layers


def bit_range(kf: int) -> tuple[float, float]:
    """The least and the most nominal bits per element `allocate` can reach at groups of `kf` tokens."""
    low = (key_element_bits(KEY_LEVELS[0], kf) + FORMATS[VALUE_LEVELS[0]].bits_per_element) / 2
    high = (key_element_bits(KEY_LEVELS[-1], kf) + FORMATS[VALUE_LEVELS[-1]].bits_per_element) / 2
    return low, high


def allocate(sensitivity: dict, bits: float, kf: int) -> tuple[list[float], list[str]]:
    """Key bits and a value format per layer, at most `bits` nominal bits per element on average (keys and values
    hold as many elements), spent where `sensitivity` says they remove the most KL.

    Raises:
        ValueError: when `bits` is outside `bit_range(kf)`.
    """
    low, high = bit_range(kf)
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not low <= bits <= high:
        raise ValueError(f"bits must be a number in [{low:.3f}, {high:.3f}] at kf={kf}, got {bits!r}")
    keys_curve, values_curve = sensitivity["keys_curve"], sensitivity["values_curve"]
    streams = []  # (share, [(bits, kl, level), ...]) per layer's keys, then per layer's values
    for probe, levels in (
        (sensitivity["key_probe"], [(key_element_bits(b, kf), keys_curve[str(b)], b) for b in KEY_LEVELS]),
        (sensitivity["value_probe"], [(FORMATS[v].bits_per_element, values_curve[v], v) for v in VALUE_LEVELS]),
    ):
        floor = max(max(probe) * 1e-3, 1e-12)  # a layer measured as free (noise) still costs something
        total = sum(max(p, floor) for p in probe)
        streams += [(max(p, floor) / total, levels) for p in probe]
    at = [0] * len(streams)
    budget = bits * len(streams)
    spent = sum(levels[0][0] for _, levels in streams)
    while True:
        best = None
        for i, (share, levels) in enumerate(streams):
            here = levels[at[i]]
            for j in range(at[i] + 1, len(levels)):
                cost = levels[j][0] - here[0]
                gain = share * (here[1] - levels[j][1]) / cost
                if gain > 0 and spent + cost <= budget + 1e-9 and (best is None or gain > best[0]):
                    best = (gain, i, j, cost)
        if best is None:
            break
        _, i, j, cost = best
        at[i], spent = j, spent + cost
    n = len(streams) // 2
    return [streams[i][1][at[i]][2] for i in range(n)], [streams[n + i][1][at[n + i]][2] for i in range(n)]


def allocation_for(model: nn.Module, bits: float, kf: int) -> tuple[list[float], list[str], str]:
    """`allocate` with `model`'s calibration: key bits and value formats per layer, and the calibration's source."""
    sensitivity, source = load_calibration(model)
    if len(sensitivity["key_probe"]) != _layers(model):
        raise ValueError(f"the calibration has {len(sensitivity['key_probe'])} layers; the model {_layers(model)}")
    key_bits, values = allocate(sensitivity, bits, kf)
    return key_bits, values, source
