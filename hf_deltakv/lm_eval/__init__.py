"""lm-evaluation-harness model `hf-deltakv`: any registered cache, with log-likelihoods scored through it.

lm-eval scores log-likelihoods in one forward pass without a cache, which would make any KV compression
invisible. Here every log-likelihood forward is split into chunks of `chunk_size` tokens fed through a fresh
cache, so each chunk attends to the earlier chunks as the cache stores them (and, for our caches, to its own
reconstruction too); `generate_until` generates through the cache. Importing this module registers the model;
`python -m hf_deltakv.lm_eval ...` does so and runs lm-eval's command line with our offline tasks on its
include path.

    python -m hf_deltakv.lm_eval run --model hf-deltakv --model_args cache=delta,kf=32 \\
        --tasks hf_deltakv_python_docs --device cpu
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("the lm-eval model needs lm-evaluation-harness: pip install 'hf-deltakv[lm-eval]'") from err

from ..models import load_model
from ..registry import build_cache, parse_spec

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
_HFLM_ARGS = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs"}


@register_model("hf-deltakv")
class DeltaKVLM(HFLM):
    """HFLM whose forwards go through a compressed KV cache from our registry.

    Model args: `pretrained` (hub id or local path; default the embedded SmolLM2-135M-Instruct), `cache` (a
    registry name, default `delta`), `chunk_size` (tokens per chunked-prefill step, default 32), any HFLM
    argument, and any other key as a parameter of the cache (`kf=64`, `values=q4_1`, ...).
    """

    def __init__(
        self,
        pretrained: str | torch.nn.Module | None = None,
        cache: str = "delta",
        chunk_size: int = 32,
        **kwargs,
    ) -> None:
        hflm_kwargs = {k: v for k, v in kwargs.items() if k in _HFLM_ARGS}
        cache_params = {k: v for k, v in kwargs.items() if k not in _HFLM_ARGS}
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = int(chunk_size)
        params = ",".join(f"{k}={v}" for k, v in cache_params.items())
        self.cache_spec = f"{cache}:{params}" if params else str(cache)
        parse_spec(self.cache_spec)  # unknown cache name: fail before loading anything
        if isinstance(pretrained, torch.nn.Module):  # a loaded model (Python API), as HFLM accepts
            model, tokenizer = pretrained, hflm_kwargs.pop("tokenizer", None)
            if tokenizer is None:
                raise ValueError("pass tokenizer= along with a loaded model")
        else:
            if isinstance(pretrained, str) and pretrained.lower() in ("", "default", "smollm2"):
                pretrained = None
            model, tokenizer = load_model(pretrained)
        build_cache(self.cache_spec, model)  # bad cache parameters: fail now, not mid-evaluation
        hflm_kwargs.setdefault("device", str(next(model.parameters()).device))
        super().__init__(pretrained=model, tokenizer=tokenizer, **hflm_kwargs)

    def new_cache(self):
        """A fresh cache of the configured spec for this model."""
        return build_cache(self.cache_spec, self.model)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of `inps` [batch, seq], computed chunk by chunk through a fresh compressed cache.

        lm-eval right-pads batches; pads come after the real tokens, so causal attention keeps them out of every
        scored position, with or without a cache.
        """
        if attn_mask is not None or labels is not None:
            raise ValueError("hf-deltakv supports decoder-only (causal) models only")
        cache = self.new_cache()
        logits = []
        with torch.no_grad():
            for start in range(0, inps.shape[1], self.chunk_size):
                chunk = inps[:, start : start + self.chunk_size]
                logits.append(self.model(chunk, cache=cache, use_cache=True).logits)
        return torch.cat(logits, dim=1)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """Generation through a fresh compressed cache."""
        generation_kwargs.setdefault("cache", self.new_cache())
        return super()._model_generate(context, max_length, stop, **generation_kwargs)
