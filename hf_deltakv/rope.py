"""Undo and redo a model's rotary position embedding, so keys can be coded before RoPE.

Before RoPE, a key channel keeps its sign and scale from token to token; after it, channel pairs spin at
position-dependent speeds, which makes neighbouring keys differ more and spreads outlier channels over their
partners. The cache receives keys after RoPE; we rotate them back with the model's own rotary embedding and the
`position_ids` the model passes to `Cache.update`, code them, and rotate the reconstruction forward again. Both
directions use the same cos/sin, so the round trip is exact for any rotary variant of the rotate-half form.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half form, as `transformers` applies it."""
    return x * cos + _rotate_half(x) * sin


def find_rotary_embedding(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (the one `*RotaryEmbedding` called with `(x, position_ids)`)."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            return module
    return None


class RopeInverter:
    """cos/sin at given positions from a model's rotary embedding, for one layer type.

    Args:
        rotary_emb: the model's rotary embedding module.
        layer_type: passed through for models whose rotary embedding depends on it (e.g. Gemma 3).
    """

    def __init__(self, rotary_emb: nn.Module, layer_type: str | None = None) -> None:
        self.rotary_emb = rotary_emb
        params = inspect.signature(rotary_emb.forward).parameters
        self.extra = {"layer_type": layer_type} if "layer_type" in params and layer_type is not None else {}

    @torch.no_grad()
    def cos_sin(self, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[batch, 1, seq, head_dim]` in fp32 for `positions` `[batch, seq]`."""
        dummy = torch.zeros(1, device=positions.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(dummy, positions.long(), **self.extra)
        if cos.shape[-1] != head_dim:
            raise ValueError(
                f"pre-RoPE coding needs a rotary embedding over the whole head ({head_dim} channels); this model "
                f"rotates {cos.shape[-1]}. Pass pre_rope=False."
            )
        return cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def undo(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse rotation (divided by cos² + sin², which is not 1 under attention scaling)."""
        return (x * cos - _rotate_half(x) * sin) / (cos * cos + sin * sin)

    def redo(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)
