"""Weight skip: during decoding, `nn.Linear` layers skip the input blocks whose contribution is negligible.

Decoding one token reads every weight once. For each block of `block_size` input features, the contribution of the
block to any output is at most `bound = block_size × max|w| × max|x|` (max|w| over the block's weights in every
row, computed once when enabled; max|x| over the block's activations, computed each step). A block is skipped when
its bound is negligible, and its weights are never read.

The rule is relative: blocks are skipped smallest bound first while the skipped bounds add up to at most
`threshold × (sum of all bounds)`. So every output's error is at most `threshold` times the sum of the bounds: a
scale-free guarantee, the same for every layer and model, where an absolute threshold would need tuning per layer.
`threshold=0` skips only blocks whose bound is exactly zero (all-zero activations or weights), so outputs equal the
plain module's up to floating-point summation order.

Where the weights are not read: on the CPU, each selected weight is re-laid out input-major (the parameter becomes a
transposed view of that storage, so every other use of it is unchanged and no memory is added) and a decode step
that skips enough blocks gathers only the kept input rows (`embedding_bag` with the activations as per-sample
weights); one that skips few reads all rows in one product, which is faster (`GATHER_BELOW`). `stats()` counts
both the blocks skipped and the blocks whose weights were read. On CUDA/ROCm a Triton kernel loops over the kept
blocks only. Inputs that are not decode-shaped (more than one new token per
sequence) take the module's normal path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .ops import use_triton

__all__ = ["SkipStats", "WeightSkipHandle", "enable_weight_skip", "keep_mask"]


@dataclass
class SkipStats:
    """Counts for one module, summed over decode calls: input blocks seen, skipped (left out of the product) and
    read (whose weights were loaded; on the CPU a product that skips only a few blocks reads them all, see
    `GATHER_BELOW`)."""

    calls: int = 0
    blocks_seen: int = 0
    blocks_skipped: int = 0
    blocks_read: int = 0

    @property
    def skipped_fraction(self) -> float:
        return self.blocks_skipped / self.blocks_seen if self.blocks_seen else 0.0


def block_max(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """max|t| over blocks of `block_size` along the last dimension (zero-padded): [..., blocks]."""
    pad = -t.shape[-1] % block_size
    if pad:
        t = F.pad(t, (0, pad))
    return t.abs().unflatten(-1, (-1, block_size)).amax(-1)


def keep_mask(bounds: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which blocks to compute, per row of `bounds` [rows, blocks]: skip smallest first while the skipped bounds sum
    to at most `threshold × total` (see module docstring). `threshold=0` skips only zero bounds."""
    if threshold == 0:
        return bounds > 0
    ordered, order = bounds.sort(dim=-1)
    budget = threshold * bounds.sum(-1, keepdim=True)
    skip_sorted = ordered.cumsum(-1) <= budget
    return ~torch.zeros_like(skip_sorted).scatter(-1, order, skip_sorted)


# On the CPU, gathering the kept rows costs more per row than one dense product over all of them (SmolLM2's
# shapes, benchmarks/matvec_layouts.py: a full gather is 1.0-1.6x a full product), so rows are gathered only when
# fewer than this fraction of the blocks is kept; otherwise skipped blocks are zeroed in the activations and all
# weights read.
GATHER_BELOW = 0.7


class _SkippingLinear:
    """State and decode path of one linear module with weight skip."""

    def __init__(self, name: str, module: nn.Linear, threshold: float, block_size: int) -> None:
        self.name, self.module, self.threshold, self.block_size = name, module, threshold, block_size
        self.stats = SkipStats()
        weight = module.weight
        self.in_features = weight.shape[1]
        self.weight_block_max = block_max(weight.detach(), block_size).amax(0).float()  # [blocks]: read first
        self.use_triton = use_triton(weight.device) and not block_size & (block_size - 1)
        module._weight_skip = True
        if not self.use_triton:
            # Input-major storage: a kept input feature's weights are one contiguous row to gather.
            self.transposed = weight.detach().t().contiguous()
            weight.data = self.transposed.t()
        # With accelerate's device_map hooks, `forward` moves inputs to the weight's device and then calls
        # `_old_forward`: patch that one so the hook keeps working.
        self.target = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
        self.plain_forward = getattr(module, self.target)
        setattr(module, self.target, self.forward)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or x.dim() < 2 or x.shape[-2] != 1 or torch.is_grad_enabled():
            return self.plain_forward(x, *args, **kwargs)
        flat = x.reshape(-1, self.in_features)  # [batch, in]: one token per sequence
        bounds = self.block_size * self.weight_block_max * block_max(flat.float(), self.block_size)
        keep = keep_mask(bounds, self.threshold).any(0)  # a block needed by any sequence is computed for all
        blocks, kept = keep.numel(), int(keep.sum())
        self.stats.calls += 1
        self.stats.blocks_seen += blocks
        self.stats.blocks_skipped += blocks - kept
        out = self._matvec(flat, keep, kept / blocks)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _matvec(self, flat: torch.Tensor, keep: torch.Tensor, kept_fraction: float) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if self.use_triton:
            from .ops.triton.skip_matvec import skip_matvec

            self.stats.blocks_read += int(keep.sum())
            return skip_matvec(flat, weight, bias, keep, self.block_size)
        columns = keep.repeat_interleave(self.block_size)[: self.in_features]
        if kept_fraction >= GATHER_BELOW:
            self.stats.blocks_read += keep.numel()
            if kept_fraction < 1:
                flat = flat * columns.to(flat.dtype)
            return F.linear(flat, weight, bias)  # the weight is the transposed view: input-major GEMV
        self.stats.blocks_read += int(keep.sum())
        rows = columns.nonzero().squeeze(1)
        batch = flat.shape[0]
        offsets = torch.arange(batch, device=flat.device) * rows.numel()
        out = F.embedding_bag(
            rows.repeat(batch),
            self.transposed,
            offsets,
            mode="sum",
            per_sample_weights=flat[:, rows].to(self.transposed.dtype).reshape(-1),
        )
        return out if bias is None else out + bias

    def remove(self) -> None:
        self.module._weight_skip = False
        setattr(self.module, self.target, self.plain_forward)
        if self.target == "forward":
            del self.module.forward  # back to the class's forward
        if not self.use_triton:
            self.module.weight.data = self.transposed.t().contiguous()


class WeightSkipHandle:
    """Returned by `enable_weight_skip`: `.stats()`, `.remove()`, and a context manager that removes on exit."""

    def __init__(self, linears: list[_SkippingLinear]) -> None:
        self._linears = linears
        self._removed = False

    def stats(self) -> dict[str, dict]:
        """Per module name: calls, blocks_seen, blocks_skipped, blocks_read, skipped_fraction; plus `total`."""
        out = {}
        total = SkipStats()
        for linear in self._linears:
            s = linear.stats
            out[linear.name] = {**asdict(s), "skipped_fraction": s.skipped_fraction}
            total.calls += s.calls
            total.blocks_seen += s.blocks_seen
            total.blocks_skipped += s.blocks_skipped
            total.blocks_read += s.blocks_read
        out["total"] = {**asdict(total), "skipped_fraction": total.skipped_fraction}
        return out

    def remove(self) -> None:
        """Restore every module's forward and weight layout (the stats stay readable). Idempotent."""
        if not self._removed:
            for linear in self._linears:
                linear.remove()
        self._removed = True

    def __enter__(self) -> WeightSkipHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def enable_weight_skip(
    model: nn.Module,
    threshold: float = 0.0,
    block_size: int = 32,
    modules: Iterable[str] | None = None,
    include_lm_head: bool = False,
) -> WeightSkipHandle:
    """Make the selected `nn.Linear` modules of `model` skip negligible input blocks on decode-shaped inputs.

    Args:
        model: any module tree.
        threshold: relative budget in [0, 1): see the module docstring. 0 skips only exactly-zero contributions.
        block_size: input features per block; a dimension that it does not divide gets a zero-padded last block.
        modules: names (as in `model.named_modules()`) to patch; default every `nn.Linear` but the output head.
        include_lm_head: also patch the output head (`lm_head`, or whatever `get_output_embeddings()` returns).

    Returns:
        a handle with `.stats()` and `.remove()`, usable as a context manager.
    """
    if not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a number in [0, 1), got {threshold!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    named = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if modules is None:
        names = [n for n, m in named.items() if isinstance(m, nn.Linear) and (include_lm_head or m is not head)]
    else:
        names = list(modules)
        for name in names:
            if name not in named:
                raise ValueError(f"no module named {name!r} in the model")
            if not isinstance(named[name], nn.Linear):
                raise TypeError(f"{name!r} is a {type(named[name]).__name__}, not an nn.Linear")
        if include_lm_head and head is not None:
            names += [n for n, m in named.items() if m is head and n not in names]
    for name in names:
        if getattr(named[name], "_weight_skip", False):
            raise ValueError(f"weight skip is already enabled on {name!r}; remove the other handle first")
    return WeightSkipHandle([_SkippingLinear(name, named[name], float(threshold), block_size) for name in names])
