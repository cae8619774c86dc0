"""The long-context benchmark's short version on SmolLM2 (`benchmarks/long_context.py --quick`): each part runs
(error against length, retrieval, multi-turn, memory, eviction beside us) and its figures are the ones it claims."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"


@pytest.mark.real_model
def test_every_part_of_the_long_context_benchmark_runs_on_smollm2(tmp_path):
    out = tmp_path / "long_context.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                          cwd=SCRIPT.parent, timeout=1200)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["models"]
    assert run["model"] == "smollm2-135m" and run["tokens"] == 1024
    kl = {row["cache"]: [bucket["kl"] for bucket in row["buckets"]] for row in run["kl"]}
    assert set(kl) == {"delta", "snapkv"} and all(len(v) == 2 for v in kl.values())  # 0-512, 512-1K
    assert all(math.isfinite(x) and x >= 0 for v in kl.values() for x in v)
    assert max(kl["delta"]) < 0.05  # near-lossless at every length read
    assert kl["snapkv"][0] < 1e-6 < kl["snapkv"][-1]  # eviction is exact until it drops, then loses
    cells = {(row["cache"], row["cell"]) for row in run["retrieval"]}
    assert cells == {(c, 1024) for c in ("dynamic", "delta", "snapkv")} and len(run["retrieval"]) == 6
    assert all(math.isfinite(row["margin"]) for row in run["retrieval"])  # each answer's digit margin
    turns = run["multi_turn"]
    assert set(turns) == {"dynamic", "delta", "snapkv"}
    assert turns["dynamic"]["same_as_dynamic"] == turns["dynamic"]["of"] == 2
    memory = {row["cache"]: row for row in result["memory"]}
    assert set(memory) == {"dynamic", "delta"}
    assert memory["delta"]["held_after_prefill"] < 0.2 * memory["dynamic"]["held_after_prefill"]  # vs fp32
    assert memory["delta"]["held_after_decode"] > memory["delta"]["held_after_prefill"]
    assert 0 < memory["delta"]["peak_above_model"] < memory["delta"]["peak_rss"]
    assert run["bytes_held"]["delta"] < 0.35 * run["fp16_bytes"]
    for name in ("delta", "snapkv"):  # nbytes() is every storage the cache holds, on a real model too
        assert run["bytes_held"][name] == pytest.approx(run["reachable_bytes"][name], rel=0.02)


def test_a_run_of_some_models_keeps_the_other_rows(monkeypatch):
    """`--models X` (or `--memory-only`) replaces X's rows and the memory cells it measures; the rest of --out stays."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    long_context = importlib.import_module("long_context")
    earlier = {
        "config": {"caches": {"a": ["delta"], "b": ["delta"]}, "runs": [{"date": "then"}]},
        "models": [{"model": "a", "kl": 1}, {"model": "b", "kl": 2}],
        "memory": [{"model": "b", "cache": c, "tokens": n} for c in ("dynamic", "delta") for n in (8192, 32768)],
    }
    config, results, memory = long_context.kept(
        earlier, {"text": "t"}, {"b": (32768, ("delta", "snapkv"))}, {("b", "delta", 32768)}
    )
    assert config == {"text": "t", "caches": {"a": ["delta"], "b": ["delta", "snapkv"]}, "runs": [{"date": "then"}]}
    assert results == [{"model": "a", "kl": 1}]
    assert {(r["cache"], r["tokens"]) for r in memory} == {("dynamic", 8192), ("delta", 8192), ("dynamic", 32768)}
    assert earlier["config"]["runs"] == [{"date": "then"}]  # the earlier file's dict is not changed in place
    fresh, results, memory = long_context.kept(None, {"text": "t"}, {"a": (1024, ("delta",))}, set())
    assert fresh == {"text": "t", "caches": {"a": ["delta"]}, "runs": []} and results == memory == []


class _BytesTokenizer:
    """A tokenizer of one token per byte, with a chat template: enough to build the benchmark's document."""

    class _Ids:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    def __call__(self, text: str, return_tensors: str | None = None) -> _Ids:
        ids = list(text.encode())
        return self._Ids(torch.tensor([ids]) if return_tensors == "pt" else ids)

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        return "<user>" + messages[0]["content"] + "</user>" + ("<assistant>" if add_generation_prompt else "")


@pytest.mark.parametrize(("per_cell", "draw"), [(10, 0), (20, 0), (10, 1)])  # the default, --needles 20, --draw 1
def test_needles_sit_at_their_depth_inside_their_length_with_keys_unique(monkeypatch, per_cell, draw):
    """Each needle starts at its depth of its length in the document as built (needles before it included) and ends
    inside that length, so every question's answer is in the context it is asked over, and once: no key repeats.
    Another draw asks other keys and values at the same depths."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    long_context = importlib.import_module("long_context")
    monkeypatch.setattr(long_context, "NEEDLES_PER_CELL", per_cell)
    tokenizer = _BytesTokenizer()
    fixed = long_context.build_document(tokenizer, 32768, True)[1]
    monkeypatch.setattr(long_context, "DRAW", draw)
    ids, placed, prefix = long_context.build_document(tokenizer, 32768, True)
    if draw:
        assert [n["depth"] for n in placed] == [n["depth"] for n in fixed]
        assert sum(a["key"] == b["key"] or a["value"] == b["value"] for a, b in zip(placed, fixed, strict=True)) < 5
    assert len(placed) == len(long_context.CELLS) * long_context.NEEDLES_PER_CELL
    assert len({n["key"] for n in placed}) == len(placed)
    ids = ids.tolist()
    for needle in placed:
        sentence = tokenizer(f" One of the special magic numbers for {needle['key']} is: {needle['value']}. ").input_ids
        assert ids[needle["position"] : needle["end"]] == sentence
        assert needle["position"] == max(int(needle["depth"] * needle["cell"]), prefix)
        assert needle["end"] <= needle["cell"]
    # the shortest length's needles are drawn as they always were (its keys were free)
    assert [(n["key"], n["value"]) for n in long_context.needles(4096, 4096, draw=draw)] == [
        (n["key"], n["value"]) for n in placed if n["cell"] == 4096
    ]


def test_answer_margin_is_the_smallest_digit_margin_teacher_forced(monkeypatch):
    """The margin reads the logits that predict each token of " <value>" after the question and keeps the digits'
    smallest right-minus-best-other gap (the space before them is format, not the answer)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    long_context = importlib.import_module("long_context")
    tokenizer = _BytesTokenizer()
    tokenizer.decode = lambda tokens: bytes(tokens).decode()
    question = tokenizer("Q?", return_tensors="pt").input_ids
    seen = {}

    class Model:  # rows predict " ", "4", "2": the space loses by 5, "4" wins by 2, "2" loses by 0.5
        def __call__(self, ids, cache, use_cache, logits_to_keep):
            seen.update(ids=ids.tolist(), keep=logits_to_keep, cache=cache)
            logits = torch.zeros(1, logits_to_keep, 256)
            logits[0, 0, 32], logits[0, 0, 7] = -4.0, 1.0
            logits[0, 1, 52], logits[0, 1, 9] = 3.0, 1.0
            logits[0, 2, 50], logits[0, 2, 9] = 0.5, 1.0
            return type("Out", (), {"logits": logits})()

    margin = long_context.answer_margin(Model(), "cache", question, tokenizer, "42")
    assert margin == pytest.approx(-0.5)
    assert seen == {"ids": [list(b"Q? 42")], "keep": 4, "cache": "cache"}
