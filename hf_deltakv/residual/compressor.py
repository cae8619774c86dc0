"""The learned part of the residual cache: per layer, a linear encoder/decoder of key and value residuals.

A token's residual (its pre-RoPE key, or its value, minus the mean of its nearest references; heads concatenated)
is mapped by the encoder to a latent whose components are ordered by variance; each group of 32 latent components
is stored at its own bit depth (0 = dropped), chosen per layer from measured distortion (`fit.py`), and the decoder
maps the quantized latent back. The encoder is linear, so E(x) - E(base) = E(x - base) as in DeltaKV.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn

from ..quant import get_format
from ..quant.bitpack import GROUP, check_bits


@dataclass(frozen=True)
class ResidualLayout:
    """Where a residual cache keeps each token; the one place these options have defaults (the built-in
    compressor's: no references, 8 sinks, a 16-token raw window).

    Args:
        stride: every `stride`-th token after the sinks is a reference kept in `reference_format`; 0 = none.
        top_k: references averaged into a token's base.
        sink_tokens: first tokens kept raw.
        window: most recent tokens kept raw (coded as they slide out).
        reference_format: block format of references (`f16` raw, `q8_0`).
    """

    stride: int = 0
    top_k: int = 1
    sink_tokens: int = 8
    window: int = 16
    reference_format: str = "q8_0"

    def __post_init__(self) -> None:
        for name, low in (("stride", 0), ("top_k", 1), ("sink_tokens", 0), ("window", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        get_format(self.reference_format)


LAYOUT_FIELDS = tuple(f.name for f in fields(ResidualLayout))


@dataclass
class ResidualConfig:
    """Everything that defines a trained compressor and the cache layout it was trained for.

    Args:
        num_layers, kv_heads, head_dim: the model's KV shape (head_dim of keys and values).
        latent_dim: latent components per stream (keys, values), a multiple of 32 and >= kv_heads * head_dim.
        bits: per layer, the bit depth of each latent group, key groups first then value groups (0 = dropped).
        layout: where the cache keeps each token (`ResidualLayout`).
        uncompressed_layers: layers the cache keeps raw.
        model: what the compressor was trained for: `model_type`, `name`, and a weight `probe` checked at load.
        training: how it was made (text, steps, losses), for the record.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    latent_dim: int
    bits: list[list[int]]
    layout: ResidualLayout = field(default_factory=ResidualLayout)
    uncompressed_layers: list[int] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        dim = self.kv_heads * self.head_dim
        if self.latent_dim % GROUP or self.latent_dim < dim:
            raise ValueError(f"latent_dim must be a multiple of {GROUP} and >= {dim}, got {self.latent_dim}")
        if len(self.bits) != self.num_layers:
            raise ValueError(f"bits has {len(self.bits)} layers, the config {self.num_layers}")
        for layer_bits in self.bits:
            if len(layer_bits) != 2 * self.latent_dim // GROUP:
                raise ValueError(f"each layer needs {2 * self.latent_dim // GROUP} group bit depths")
            for b in layer_bits:
                if b:
                    check_bits(b)

    @property
    def stream_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def to_dict(self) -> dict:
        """JSON-ready, the layout's fields at the top level (the checkpoint format)."""
        flat = asdict(self)
        return {**{k: v for k, v in flat.items() if k != "layout"}, **flat["layout"]}

    @classmethod
    def from_dict(cls, payload: dict) -> ResidualConfig:
        payload = dict(payload)
        layout = ResidualLayout(**{name: payload.pop(name) for name in LAYOUT_FIELDS if name in payload})
        return cls(**payload, layout=layout)


class LayerCompressor(nn.Module):
    """Encoder/decoder of one layer's key and value residuals (`[..., kv_heads * head_dim]` each)."""

    def __init__(self, stream_dim: int, latent_dim: int) -> None:
        super().__init__()
        self.stream_dim, self.latent_dim = stream_dim, latent_dim
        for stream in ("key", "value"):
            self.register_parameter(f"{stream}_mean", nn.Parameter(torch.zeros(stream_dim)))
            self.register_parameter(f"{stream}_encoder", nn.Parameter(torch.eye(stream_dim, latent_dim)))
            self.register_parameter(f"{stream}_decoder", nn.Parameter(torch.eye(latent_dim, stream_dim)))

    def encode(self, key_residual: torch.Tensor, value_residual: torch.Tensor) -> torch.Tensor:
        """Latent `[..., 2 * latent_dim]` (keys' groups, then values')."""
        zk = (key_residual - self.key_mean) @ self.key_encoder
        zv = (value_residual - self.value_mean) @ self.value_encoder
        return torch.cat([zk, zv], dim=-1)

    def decode(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value residuals from a (quantized) latent."""
        zk, zv = latent.split(self.latent_dim, dim=-1)
        return zk @ self.key_decoder + self.key_mean, zv @ self.value_decoder + self.value_mean


class ResidualCompressor(nn.Module):
    """All layers' compressors plus the config that says how their codes are laid out."""

    @staticmethod
    def parameter_shapes(config: ResidualConfig) -> dict[str, tuple[int, ...]]:
        """The name and shape of every weight a compressor of `config` holds (what a checkpoint must contain)."""
        stream, latent = config.stream_dim, config.latent_dim
        shapes = {}
        for layer in range(config.num_layers):
            for name in ("key", "value"):
                shapes[f"layers.{layer}.{name}_mean"] = (stream,)
                shapes[f"layers.{layer}.{name}_encoder"] = (stream, latent)
                shapes[f"layers.{layer}.{name}_decoder"] = (latent, stream)
        return shapes

    def __init__(self, config: ResidualConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            LayerCompressor(config.stream_dim, config.latent_dim) for _ in range(config.num_layers)
        )

    def code_bits(self, layer_idx: int) -> int:
        """Bits of one compressed token's codes and scales in layer `layer_idx` (both streams)."""
        return sum(GROUP * b + 16 for b in self.config.bits[layer_idx] if b)

    def latent_rate(self) -> float:
        """Mean bits per cached scalar of a compressed token's codes and scales, over layers."""
        per_token = 2 * self.config.stream_dim
        return sum(self.code_bits(i) for i in range(self.config.num_layers)) / (self.config.num_layers * per_token)
