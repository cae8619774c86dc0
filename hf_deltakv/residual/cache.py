"""`ResidualKVCache`: the learned residual cache users construct (DeltaKV, arXiv 2602.08005, for `generate`)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torch import nn

from ..cache import StreamCache
from .checkpoint import DEFAULT_COMPRESSOR, check_compatible, load_compressor
from .compressor import ResidualCompressor
from .layer import ResidualLayer


class ResidualKVCache(StreamCache):
    """KV cache storing each token as a small learned code of its residual against similar earlier tokens.

    Every `stride`-th token is a reference kept in `reference_format`; each other token, once it leaves the raw
    recent `window`, is stored as packed latent codes of (its pre-RoPE key and value) minus (the mean of its `top_k`
    nearest earlier references), through a per-layer encoder/decoder trained for the model
    (`hf-deltakv train-residual`). The first `sink_tokens` tokens stay raw. Everything is counted in `nbytes()`.

    Paper: DeltaKV, https://arxiv.org/abs/2602.08005 (their code is a vLLM fork; this is for `transformers`).

    Args:
        model: the model (required: keys are coded before RoPE, and the compressor is checked against it).
        compressor: a `ResidualCompressor`, or a checkpoint directory or built-in name; default: the built-in
            compressor of the embedded default model (`"smollm2-135m"`).
        stride, top_k, window, sink_tokens, reference_format: override the layout the compressor was trained with
            (`ResidualLayout`).
        uncompressed_layers: layers kept entirely raw (fp16; counted in the bytes), as DeltaKV keeps a few early
            layers; default: the compressor's.

    >>> cache = ResidualKVCache(model=model)            # doctest: +SKIP
    >>> model.generate(**inputs, cache=cache)           # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        compressor: ResidualCompressor | str | Path | None = None,
        stride: int | None = None,
        top_k: int | None = None,
        window: int | None = None,
        sink_tokens: int | None = None,
        reference_format: str | None = None,
        uncompressed_layers: tuple[int, ...] | None = None,
    ) -> None:
        if model is None or not isinstance(model, nn.Module):
            raise ValueError("ResidualKVCache needs the model (model=...): its compressor is trained for one model")
        if _sharded(model):
            raise ValueError(
                "ResidualKVCache cannot run under tensor parallelism: its per-layer encoder mixes all KV heads of a "
                "layer, so a compressor cannot be split into the heads one rank holds. Use DeltaKVCache (or any "
                "other cache of hf_deltakv) under tp_plan, or place whole layers per device (device_map)"
            )
        if compressor is None:
            compressor = DEFAULT_COMPRESSOR
        if not isinstance(compressor, ResidualCompressor):
            compressor = load_compressor(compressor, model)  # checked against the model before allocating
        check_compatible(compressor.config, model)
        config = compressor.config
        self.compressor = compressor
        overrides = {
            "stride": stride,
            "top_k": top_k,
            "window": window,
            "sink_tokens": sink_tokens,
            "reference_format": reference_format,
        }
        self.layout = dataclasses.replace(config.layout, **{k: v for k, v in overrides.items() if v is not None})
        raw = config.uncompressed_layers if uncompressed_layers is None else uncompressed_layers
        if any(not isinstance(i, int) or not 0 <= i < config.num_layers for i in raw):
            raise ValueError(f"uncompressed_layers must be layer indices in [0, {config.num_layers}), got {raw!r}")
        self.uncompressed_layers = frozenset(raw)
        super().__init__(self.layout.sink_tokens, model, pre_rope=None)

    @classmethod
    def from_pretrained(cls, path_or_name: str | Path, model: nn.Module, **overrides) -> ResidualKVCache:
        """A cache using the compressor saved at `path_or_name` (a directory or a built-in name)."""
        return cls(model=model, compressor=path_or_name, **overrides)

    def _make_layer(self, layer_idx: int) -> ResidualLayer:
        if layer_idx >= len(self.compressor.layers):
            raise ValueError(f"the compressor has {len(self.compressor.layers)} layers; layer {layer_idx} was asked")
        raw = layer_idx in self.uncompressed_layers
        return ResidualLayer(
            self.compressor.layers[layer_idx],
            self.compressor.config.bits[layer_idx],
            dataclasses.replace(self.layout, window=sys.maxsize) if raw else self.layout,
            self._rope(layer_idx),
            self.positions,
            self._window(layer_idx),
        )


def _sharded(model: nn.Module) -> bool:
    """Whether `model` was loaded with a tensor-parallel plan (its weights are DTensors split over ranks)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())
