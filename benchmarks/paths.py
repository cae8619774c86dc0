"""Where the benchmarks read their text and write their results (one place for every script)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
WIKITEXT = HERE.parent.parent / "shared" / "data" / "wikitext-2"
WIKITEXT_TEST = WIKITEXT / "test.txt"
WIKITEXT_VALID = WIKITEXT / "valid.txt"
