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
        heads = _head_digests(cache.layers[0])
        result["layer0_heads"] = _gathered(heads)
    return result


def _head_digests(layer) -> list[str]:
    """A digest of what layer `layer` stores for each of its kv heads (every state tensor's bytes of that head)."""
    import hashlib

    from hf_deltakv.quant import QuantizedTensor

    tensors = []
    for item in layer.held():
        for t in item.tensors() if isinstance(item, QuantizedTensor) else [item]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                tensors.append(t)
    digests = []
    for head in range(layer.kv_heads):
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t[:, head].contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(digest.hexdigest())
    return digests


def _gathered(heads: list[str]) -> list[str]:
    """Every rank's heads in rank order (a rank holds the kv heads of its shard), or this process's."""
    if not (dist.is_available() and dist.is_initialized()):
        return heads
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, heads)
    return [digest for part in parts for digest in part]


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
