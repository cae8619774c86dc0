"""The oldest transformers served: checked when hf_deltakv is imported, and the same as pyproject.toml's pin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_deltakv import _compat


def test_a_transformers_without_cache_keyword_stops_the_import_saying_why():
    with pytest.raises(ImportError, match=r"transformers>=5\.24 \(found 5\.17\.0\).*cache="):
        _compat._check_transformers("5.17.0")
    _compat._check_transformers("5.24.0")
    _compat._check_transformers(_compat._installed_transformers())


def test_the_pin_is_the_checked_version():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    (pin,) = re.findall(r'"transformers>=([0-9.]+)"', pyproject)
    assert pin == _compat.MIN_TRANSFORMERS
