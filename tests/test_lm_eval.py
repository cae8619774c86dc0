"""lm-evaluation-harness model `hf-deltakv` on the offline rolling-perplexity task: an uncompressed cache scores
what plain `hf` scores, 4-bit caches score worse, and the command line runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="needs the lm-eval extra")

METADATA = {"text": "python-docs", "doc_chars": 1200, "max_docs": 2}
TASK = "hf_deltakv_python_docs"


def _word_perplexity(lm, manager) -> float:
    results = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=manager, metadata=METADATA)
    return results["results"][TASK]["word_perplexity,none"]


@pytest.fixture(scope="module")
def scores(real_model):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_deltakv.lm_eval import TASKS_DIR, DeltaKVLM

    manager = TaskManager(include_path=str(TASKS_DIR), metadata=METADATA)  # indexing lm-eval's tasks takes ~13 s
    model, tokenizer = real_model
    out = {"hf": _word_perplexity(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), manager)}
    for cache in ("dynamic", "fp16", "q4_0", "delta"):
        lm = DeltaKVLM(pretrained=model, tokenizer=tokenizer, cache=cache, chunk_size=64)
        out[cache] = _word_perplexity(lm, manager)
    return out


@pytest.mark.real_model
def test_uncompressed_cache_scores_like_plain_hf(scores):
    assert scores["dynamic"] == pytest.approx(scores["hf"], rel=1e-5)  # chunking alone changes nothing
    assert scores["fp16"] == pytest.approx(scores["hf"], rel=1e-3)  # fp16 storage of an fp32 model's cache


@pytest.mark.real_model
def test_compressed_caches_are_visible_to_lm_eval(scores):
    assert scores["q4_0"] > scores["fp16"] * 1.02  # q4_0 costs several percent on this model
    assert scores["fp16"] < scores["delta"] < scores["q4_0"]


@pytest.mark.real_model
def test_model_args_split_between_hflm_and_cache(real_model):
    from hf_deltakv.lm_eval import DeltaKVLM

    model, tokenizer = real_model
    lm = DeltaKVLM(pretrained=model, tokenizer=tokenizer, cache="delta", kf=64, values="q4_1", batch_size=2)
    assert lm.cache_spec == "delta:kf=64,values=q4_1" and lm.batch_size == 2
    with pytest.raises(ValueError, match="allowed"):
        DeltaKVLM(pretrained=model, tokenizer=tokenizer, cache="zip")
    with pytest.raises(ValueError, match="bad parameters"):
        DeltaKVLM(pretrained=model, tokenizer=tokenizer, cache="q4_0", colour="red")


@pytest.mark.real_model
def test_command_line_runs_a_local_task_offline(real_model, tmp_path):
    metadata = '{"doc_chars": 600, "max_docs": 1}'
    args = ["--model", "hf-deltakv", "--model_args", "cache=q4_0", "--tasks", TASK, "--device", "cpu"]
    cmd = [sys.executable, "-m", "hf_deltakv.lm_eval", "run", *args, "--metadata", metadata]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "word_perplexity" in done.stdout and TASK in done.stdout
