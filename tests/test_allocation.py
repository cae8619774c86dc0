"""`DeltaKVCache(bits=...)`: bits per layer where a calibration says they pay (`hf_deltakv.allocation`)."""

from __future__ import annotations

import json

import pytest

from hf_deltakv import DeltaKVCache
from hf_deltakv.allocation import CALIBRATIONS, KEY_LEVELS, VALUE_LEVELS, allocate, bit_range, key_element_bits
from hf_deltakv.persist import model_signature
from hf_deltakv.quant import FORMATS
from hf_deltakv.registry import build_cache

from .conftest import tiny_model


def sensitivity(key_probe, value_probe):
    """Whole-model KL halving with every half bit of keys, and a tenth of it from q3_0 to q4_0 to q8_0 values."""
    return {
        "keys_curve": {str(b): 0.1 * 2 ** (-2 * (b - KEY_LEVELS[0])) for b in KEY_LEVELS},
        "values_curve": {"q3_0": 0.02, "q4_0": 0.005, "q8_0": 0.0},
        "key_probe": key_probe,
        "value_probe": value_probe,
    }


def mean_bits(key_bits, values, kf):
    return sum(key_element_bits(b, kf) + FORMATS[v].bits_per_element for b, v in zip(key_bits, values, strict=True)) / (
        2 * len(values)
    )


@pytest.mark.parametrize("kf", [32, 64])
@pytest.mark.parametrize("bits", [3.1, 3.5, 4.0, 4.6])
def test_the_allocation_spends_the_budget_where_the_probes_say(bits, kf):
    table = sensitivity([0.001, 0.008, 0.002, -0.0001], [0.004, 0.0005, 0.0005, 0.0005])
    low, high = bit_range(kf)
    if not low <= bits <= high:
        with pytest.raises(ValueError, match="bits must be a number in"):
            allocate(table, bits, kf)
        return
    key_bits, values = allocate(table, bits, kf)
    spent = mean_bits(key_bits, values, kf)
    assert spent <= bits + 1e-9
    assert spent > bits - 0.5  # within one step: no upgrade that fits was left
    assert key_bits[1] == max(key_bits) and key_bits[3] == min(key_bits)  # the most / least sensitive keys
    assert VALUE_LEVELS.index(values[0]) == max(VALUE_LEVELS.index(v) for v in values)


def test_the_ends_of_the_range_are_every_layer_at_its_lowest_and_highest_level():
    table = sensitivity([0.001, 0.002], [0.003, 0.001])
    low, high = bit_range(64)
    assert allocate(table, low, 64) == ([KEY_LEVELS[0]] * 2, [VALUE_LEVELS[0]] * 2)
    assert allocate(table, high, 64) == ([KEY_LEVELS[-1]] * 2, [VALUE_LEVELS[-1]] * 2)
    for bad in (low - 0.01, high + 0.01, True, "3.5", None):
        with pytest.raises(ValueError, match="bits must be a number"):
            allocate(table, bad, 64)


def test_bits_builds_a_cache_of_per_layer_settings_and_refuses_what_it_cannot_honour():
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    cache = DeltaKVCache(kf=64, bits=3.5, model=model)
    key_bits, values = cache.options["key_bits"], cache.options["values"]
    assert len(key_bits) == len(values) == layers and cache.bits == 3.5
    assert "every layer alike" in cache.calibration  # the tiny model has no calibration of its own
    assert mean_bits(key_bits, values, 64) <= 3.5
    assert build_cache("delta:kf=64,bits=3.5", model).options == cache.options
    for kwargs, match in (
        ({"bits": 3.5}, "needs the model"),
        ({"bits": 3.5, "key_bits": 3, "model": model}, "give bits or those"),
        ({"bits": 3.5, "values": "q3_0", "model": model}, "give bits or those"),
        ({"bits": 3.5, "keys": "token", "model": model}, "give bits or those"),
        ({"bits": 2.0, "model": model}, "bits must be a number in"),
    ):
        with pytest.raises(ValueError, match=match):
            DeltaKVCache(kf=64, **kwargs)


@pytest.mark.parametrize("path", sorted(CALIBRATIONS.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_calibration_is_complete(path):
    table = json.loads(path.read_text())
    layers = table["model"]["num_layers"]
    found = table["sensitivity"]
    assert len(found["key_probe"]) == len(found["value_probe"]) == layers
    assert set(found["keys_curve"]) == {str(b) for b in KEY_LEVELS}
    assert set(found["values_curve"]) == set(VALUE_LEVELS)
    key_bits, values = allocate(found, 3.5, found["kf"])
    assert len(key_bits) == layers and mean_bits(key_bits, values, found["kf"]) <= 3.5


@pytest.mark.real_model
def test_the_default_model_takes_its_own_calibration():
    from hf_deltakv.models import load_model

    model, _ = load_model()
    cache = DeltaKVCache(kf=64, bits=3.5, model=model)
    assert cache.calibration == "calibrated on smollm2-135m"
    assert model_signature(model)["num_layers"] == len(cache.options["values"])
