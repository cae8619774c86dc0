"""Undo and redo a model's rotary position embedding, so keys can be coded before RoPE.

Before RoPE, a key channel keeps its sign and scale from token to token; after it, channel pairs spin at
position-dependent speeds, which makes neighbouring keys differ more and spreads outlier channels over their
partners. The cache receives keys after RoPE; it turns them back by their positions (the `position_ids` the model
passes to `Cache.update`), codes them, and turns the reconstruction forward again.

How the cache knows a model's RoPE: it measures it (`probe_rope`) instead of reading its code. transformers' families
rotate in several forms (pairs `c, c + D/2` or interleaved pairs, over the whole head or part of it, at the front or
at the back as DeepSeek's MLA; tables of half or full width, complex numbers in Llama 4; layers without RoPE; scaled
frequencies). Every one of them turns each pair of a key's channels by `position * frequency`. The probe runs the
model on single tokens at a few positions, where nothing but RoPE depends on the position, finds which channels pair
up and at what frequency, and describes the layer as a `RopeForm`: the head's channels put in the order where pairs
are `c, c + D/2` (rotate-half, the form every kernel here reads) and one frequency per pair (0: not rotated). A layer
whose keys change with the position in any other way is not understood, and the cache codes its keys as given.

Undo and redo use the same angles, so the round trip is exact whatever the measurement's precision: an imprecise
frequency only leaves keys turning slowly with the position (as after a change of the model's frequencies past its
trained context, dynamic NTK or LongRoPE), which costs bits, never correctness. No cos/sin table is kept: angles are
computed from the positions when needed.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn channel pairs `c, c + D/2` of `x` `[..., D]` by the angles whose cos and sin are `[..., D/2]`."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 `[*positions.shape, len(freqs)]` of the angles `position * freq` (computed in float64, so large
    positions stay exact): the specification the kernels' angles are held to."""
    if freqs.device != positions.device:  # (callers on a decoding step pass `RopeForm.on`'s copy: nothing moves)
        freqs = freqs.to(positions.device)
    angle = positions.to(torch.float64).unsqueeze(-1) * freqs.to(torch.float64)
    return angle.cos().float(), angle.sin().float()


def find_rotary_embedding(model: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (a `*RotaryEmbedding`), or None for models without RoPE."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            return module
    return None


@dataclass(frozen=True, eq=False)
class RopeForm:
    """One layer's RoPE in the cache's canonical form.

    Args:
        freqs: float64 `[D/2]`: pair `c` (canonical channels `c` and `c + D/2`) turns by `position * freqs[c]`
            radians; 0 for channels RoPE leaves alone.
        order: int64 `[D]`: canonical channel `c` is the model's channel `order[c]`; None when they are the same.
    """

    freqs: torch.Tensor
    order: torch.Tensor | None = None

    @property
    def head_dim(self) -> int:
        return 2 * self.freqs.numel()

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(freqs float64, order or None) on `device`, made once per device and kept (a decoding step reads them in
        every layer: a copy from the host per step would stall the GPU's queue)."""
        kept = self.__dict__.setdefault("_on", {})
        if device not in kept:
            moved = [t if t is None or t.device == device else t.to(device) for t in (self.freqs, self.order)]
            kept[device] = (moved[0].double(), moved[1])
        return kept[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 `[*positions.shape, D/2]` (`rope_cos_sin`)."""
        return rope_cos_sin(positions, self.on(positions.device)[0])

    def to_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """The model's channel order `[..., D]` to the canonical one."""
        return x if self.order is None else x[..., self.on(x.device)[1]]

    def from_canonical(self, x: torch.Tensor) -> torch.Tensor:
        """The canonical channel order back to the model's."""
        return x if self.order is None else x[..., self.on(x.device)[1].argsort()]

    def undo(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys after RoPE `[batch, heads, n, D]` (model order) at `positions` `[batch, n]` -> canonical, before RoPE
        (fp32)."""
        cos, sin = self.cos_sin(positions[:, None])
        return rotate_pairs(self.to_canonical(keys.float()), cos, -sin)

    def redo(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Canonical keys before RoPE -> after RoPE, in the model's channel order."""
        cos, sin = self.cos_sin(positions[:, None])
        return self.from_canonical(rotate_pairs(keys, cos, sin))


@dataclass(frozen=True)
class RopeProbe:
    """What `probe_rope` found: a form per layer (None: the layer's keys do not depend on the position, as in NoPE
    layers or models without RoPE), or why the model's RoPE is not understood (then `forms` is None)."""

    forms: list[RopeForm | None] | None
    reason: str = ""


PROBE_TOKENS = 8  # single-token sequences per probe forward (every kv head adds a sample)
PROBE_MAX_POSITION = 1 << 14  # the largest position probed (within the model's trained context)
# Relative misfit of a pair's rotation allowed, by the keys' dtype: its rounding, with room.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe_rope(model: nn.Module) -> RopeProbe:
    """Measure `model`'s RoPE, layer by layer (see the module docstring); memoised per model."""
    if model not in _PROBES:
        _PROBES[model] = _probe(model)
    return _PROBES[model]


def _probe_positions(config) -> list[int]:
    """0, 1, 2, 4, ... up to half the context the model was trained for (where scaled RoPE keeps its frequencies)."""
    limits = [PROBE_MAX_POSITION, getattr(config, "max_position_embeddings", None) or PROBE_MAX_POSITION]
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("original_max_position_embeddings"):
        limits.append(rope["original_max_position_embeddings"])
    top = max(min(limits) // 2, 2)
    return [0] + [1 << k for k in range(int(math.log2(top)) + 1)]


@torch.no_grad()
def _probe_keys(model: nn.Module, positions: list[int]) -> list[list[torch.Tensor]]:
    """Per position, each layer's keys `[tokens * kv_heads, D]` (float64) of single tokens at that position."""
    from transformers.cache_utils import DynamicCache

    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator().manual_seed(0)
    vocab = min(getattr(config, "vocab_size", 1000) or 1000, 1 << 15)
    ids = torch.randint(3, max(vocab, 4), (PROBE_TOKENS, 1), generator=generator).to(device)
    training = model.training
    model.eval()  # dropout would change the hidden states between probes
    try:
        keys = []
        for p in positions:
            cache = DynamicCache(config=model.config)
            position_ids = torch.full_like(ids, p)
            model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True)
            keys.append([layer.keys.transpose(1, 2).reshape(-1, layer.keys.shape[-1]).double().cpu()
                         for layer in cache.layers])  # fmt: skip
        return keys
    finally:
        model.train(training)


def _candidate_orders(dim: int) -> list[tuple[str, torch.Tensor]]:
    """Canonical orders to try, most common first: rotate-half or interleaved pairs over the whole head, then over
    `r` channels at its front or its back (the rest not rotated)."""
    orders = []
    for rotated in range(dim, 0, -2):
        for start in (0, dim - rotated) if rotated < dim else (0,):
            block = torch.arange(start, start + rotated)
            rest = torch.cat([torch.arange(0, start), torch.arange(start + rotated, dim)])
            for kind in ("rotate-half", "interleaved"):
                if kind == "rotate-half":
                    first, second = block[: rotated // 2], block[rotated // 2 :]
                else:
                    first, second = block[0::2], block[1::2]
                half_rest = rest.numel() // 2
                order = torch.cat([first, rest[:half_rest], second, rest[half_rest:]])
                orders.append((kind, order))
    return orders


def _fit_layer(keys: list[torch.Tensor], positions: list[int], tolerance: float) -> RopeForm | str | None:
    """The form of one layer from its probe keys (one `[samples, D]` per position), None when the keys do not depend
    on the position, or a sentence saying why none fits."""
    base = keys[0]
    dim = base.shape[-1]
    scale = base.norm() + 1e-30
    if all((k - base).norm() <= tolerance * scale for k in keys[1:]):
        return None
    if dim % 2:
        return f"keys of odd width {dim} change with the position"
    half = dim // 2
    for _, order in _candidate_orders(dim):
        k0 = base[:, order]
        lo0, hi0 = k0[:, :half], k0[:, half:]
        energy = (lo0.square() + hi0.square()).sum(0) + 1e-300
        angles, fits = [], True
        for k in keys[1:]:
            kc = k[:, order]
            lo, hi = kc[:, :half], kc[:, half:]
            c = (lo * lo0 + hi * hi0).sum(0) / energy  # least squares of [lo, hi] = R(angle) [lo0, hi0]
            s = (hi * lo0 - lo * hi0).sum(0) / energy
            misfit = (lo - (c * lo0 - s * hi0)).square().sum(0) + (hi - (c * hi0 + s * lo0)).square().sum(0)
            if misfit.sum().sqrt() > tolerance * (kc.norm() + 1e-30):
                fits = False
                break
            angles.append(torch.atan2(s, c))
        if fits:
            freqs = _frequencies(angles, positions[1:], tolerance)
            if freqs is None:
                return "key pairs turn by angles that do not grow in proportion to the position"
            identity = torch.equal(order, torch.arange(dim))
            return RopeForm(freqs, None if identity else order)
    return "keys change with the position in a way that is not a rotation of channel pairs"


def _frequencies(angles: list[torch.Tensor], positions: list[int], tolerance: float) -> torch.Tensor | None:
    """Radians per position of every pair from its angles at positions 1, 2, 4, ... (unwrapped as the position
    doubles), or None when an angle is not the position times one frequency."""
    freq = angles[0] / positions[0]
    for angle, p in zip(angles[1:], positions[1:], strict=True):
        turns = torch.round((p * freq - angle) / (2 * math.pi))
        freq = (angle + 2 * math.pi * turns) / p
    for angle, p in zip(angles, positions, strict=True):
        error = torch.remainder(p * freq - angle + math.pi, 2 * math.pi) - math.pi
        if error.abs().max() > 20 * tolerance + 1e-6:
            return None
    return freq


def _probe(model: nn.Module) -> RopeProbe:
    config = getattr(model, "config", None)
    if config is None:
        return RopeProbe(None, f"{type(model).__name__} has no config to run it by")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    positions = _probe_positions(text)
    try:
        keys = _probe_keys(model, positions)
    except Exception as error:  # a model that cannot run single tokens this way: code its keys as given
        return RopeProbe(None, f"probing its RoPE failed ({type(error).__name__}: {error})")
    tolerance = PROBE_TOLERANCE.get(next(model.parameters()).dtype, 4e-2)
    forms = []
    for index in range(len(keys[0])):
        form = _fit_layer([k[index] for k in keys], positions, tolerance)
        if isinstance(form, str):
            return RopeProbe(None, f"layer {index}: {form}")
        forms.append(form)
    return RopeProbe(forms)
