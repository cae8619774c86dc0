"""Run by tests/test_tensor_parallel.py under `torchrun --nproc-per-node N`: greedy generation and decode logits of
each cache spec with transformers' tensor parallelism (gloo on the CPU), written by rank 0 with every rank's bytes.

python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py MODEL_DIR OUT.json SPEC [SPEC ...]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hf_deltakv.cache import total_nbytes
from hf_deltakv.registry import build_cache


def run(model, spec: str | None) -> dict:
    prompt = torch.arange(3, 3 + 40).remainder(120).add(3)[None]
    cache = build_cache(spec, model) if spec else None
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=6, do_sample=False, cache=cache, output_logits=True, return_dict_in_generate=True
        )
    result = {"tokens": out.sequences[0].tolist(), "logits": torch.stack(out.logits, 1)[0].tolist()}
    if cache is not None and hasattr(cache, "nbytes"):
        result["rank_nbytes"] = cache.nbytes()
        result["total_nbytes"] = total_nbytes(cache)
    return result


def main() -> None:
    model_dir, out_path, *specs = sys.argv[1:]
    distributed = "RANK" in __import__("os").environ
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto" if distributed else None).eval()
    results = {}
    for spec in [None, *specs]:
        try:
            results[spec or "dynamic"] = run(model, spec)
        except Exception as error:  # reported to the test, which decides
            results[spec or "dynamic"] = {"error": f"{type(error).__name__}: {error}"}
    if not distributed or dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
