"""A cache layer for compiled decoding: packed per-token storage preallocated to a capacity, written in place.

transformers' `StaticLayer` with its fp16/bf16 history replaced by block-quantized codes (`quant`): the storage of
`max_cache_len` tokens is allocated at the first update (zeros), marked as a static address, and every later update
writes its tokens' codes at positions read from the layer's `cumulative_length` *tensor* (no Python int changes
between steps, nothing grows), so a decoding step is one graph that `torch.compile` (and CUDA graphs) replay without
recompiling. The new tokens are coded as `QuantizedKVCache` codes them (the same bytes: `reference.quantize_at`'s
arithmetic, the Hadamard rotation first when asked).

Attention: in a decoding step `update` returns `attention.packed` placeholders, and SDPA on them reads the packed
storage through one op (`hf_deltakv::plain_attention`: the C++ kernel on the CPU, Triton on GPUs), over every slot
under transformers' mask (it spans `max_cache_len`, as for `StaticCache`; unwritten slots are zeros, masked). A
prompt or chunk of several tokens, or a model whose attention is not SDPA, gets the decoded capacity in the model's
dtype instead (unwritten slots decode to zeros).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import StaticLayer

from .. import kernels
from ..attention.packed import packed_classes, packed_pair
from ..kernels import ops  # noqa: F401  (registers hf_deltakv::plain_attention)
from ..kernels.hadamard import rotate, rotation_block
from ..quant import QuantizedTensor, check_search_scale, dequantize, get_format, quantize, saturate_fp16


def _zeros(fmt_name: str, lead: tuple[int, ...], dim: int, device: torch.device) -> QuantizedTensor:
    """Storage of `[*lead, dim]` in `fmt_name`, zeroed: an unwritten slot decodes to exactly 0 (never NaN, which a
    masked attention weight of 0 would still turn into NaN)."""
    return QuantizedTensor.empty(get_format(fmt_name), lead, dim, device).map(torch.zeros_like)


class PackedStaticLayer(StaticLayer):
    """`StaticLayer` holding keys and values packed (`k_format`, `v_format`), Hadamard-rotated first with `rotate`.

    Args:
        max_cache_len: tokens the layer can hold (its storage is allocated for all of them).
        k_format: block format of keys (`q4_0`, `q4_1`, `q8_0`, `q3_0`, `f16`, ...).
        v_format: block format of values.
        rotate: Hadamard-rotate head vectors before quantizing (decoded back on the way out).
        search_scale: search each block's scale for the least error (q4_0 family and q3_0).
    """

    def __init__(
        self,
        max_cache_len: int,
        k_format: str,
        v_format: str,
        rotate: bool = False,
        search_scale: bool = False,
        packed_attention: bool = True,
    ) -> None:
        super().__init__(max_cache_len)
        self.packed = packed_classes(self) if packed_attention else None
        self.formats = tuple(check_search_scale(fmt, search_scale).name for fmt in (k_format, v_format))
        self.rotate, self.search_scale = rotate, search_scale
        self.stored: tuple[QuantizedTensor, QuantizedTensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        lead = (self.batch_size, self.num_heads, self.max_cache_len)
        dims = (self.k_head_dim, self.v_head_dim)
        self.stored = tuple(_zeros(fmt, lead, dim, self.device) for fmt, dim in zip(self.formats, dims, strict=True))
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # (as StaticLayer: fixed addresses, no recompiles, CUDA graphs)
            for t in (*self.tensors(), self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def tensors(self) -> list[torch.Tensor]:
        """Every storage tensor (codes, scales, mins of keys and values)."""
        return [t for stored in self.stored or () for t in stored.tensors()]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Code the new tokens into their slots (after `cumulative_length`) and return keys and values `[batch, heads,
        max_cache_len, dim]` in the input dtype: for one new token `attention.packed` placeholders (SDPA on them
        reads the storage), else the decoded capacity."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if not torch.compiler.is_compiling() and int(self.cumulative_length) + n > self.max_cache_len:
            raise ValueError(
                f"this cache holds at most max_cache_len={self.max_cache_len} tokens; {int(self.cumulative_length)} "
                f"are held and {n} more were given: make the cache with a larger max_cache_len"
            )
        if torch.compiler.is_compiling():  # in the graph: at the positions the length tensor gives
            positions = torch.arange(n, device=self.device) + self.cumulative_length
            for stored, fmt, x in zip(self.stored, self.formats, (key_states, value_states), strict=True):
                new = quantize(rotate(x) if self.rotate else x.float(), fmt, self.search_scale)
                for target, rows in zip(stored.tensors(), new.tensors(), strict=True):
                    target.index_copy_(2, positions, rows)
        else:  # eager: the dispatched kernel (C++ on the CPU, Triton on GPUs), the same bytes (tested)
            at = int(self.cumulative_length)
            for stored, fmt, x in zip(self.stored, self.formats, (key_states, value_states), strict=True):
                kernels.quantize_at(
                    x, fmt, self.search_scale, stored, at, rotation_block(x.shape[-1]) if self.rotate else 0
                )
        self.cumulative_length.add_(n)
        if self.packed is not None and n == 1:  # a decoding step: SDPA on these reads the packed storage
            shape = (self.batch_size, self.num_heads, self.max_cache_len)
            return packed_pair(self.packed, (*shape, self.k_head_dim), (*shape, self.v_head_dim), self.dtype,
                               self.device)  # fmt: skip
        return self.decoded(0), self.decoded(1)

    def attend_packed(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """`scaled_dot_product_attention(query, keys, values, mask)` over every slot, read from the packed storage
        (`kernels.ops.plain_attention`). `query` `[batch, heads, n, dim]`: the layer's kv heads times a group (GQA's
        query heads, or transformers' `pack_gqa` rows as queries); `mask` bool `[batch | 1, 1, n, slots]` or None
        (causal: the slots held)."""
        batch, heads, n, _ = query.shape
        slots = self.max_cache_len
        if mask is None:
            last = self.cumulative_length - n + torch.arange(n, device=self.device)  # each query's last slot
            mask = (torch.arange(slots, device=self.device)[None] <= last[:, None])[None, None]
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != slots:
            raise RuntimeError(f"a compiled cache layer takes a mask [batch, 1, n, {slots}], got {tuple(mask.shape)}")
        keys, values = self.stored
        out = torch.ops.hf_deltakv.plain_attention(
            query.float().unflatten(1, (self.num_heads, heads // self.num_heads)),
            keys.codes,
            keys.scales,
            keys.mins,
            values.codes,
            values.scales,
            values.mins,
            mask[:, 0].expand(batch, n, slots),
            k_format=self.formats[0],
            v_format=self.formats[1],
            value_dim=self.v_head_dim,
            rotate=self.rotate,
            scale=float(scale),
        )
        return out.reshape(batch, heads, n, self.v_head_dim).to(query.dtype)

    def decoded(self, index: int) -> torch.Tensor:
        """Keys (0) or values (1) of every slot, decoded in the model's dtype (fp16 saturates)."""
        x = dequantize(self.stored[index])
        if self.rotate:
            x = rotate(x)  # (the rotation is its own inverse)
        return saturate_fp16(x) if self.dtype == torch.float16 else x.to(self.dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows of the batch reordered in place (the storage keeps its address)."""
        if self.is_initialized:
            for t in self.tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "a cache with max_cache_len keeps its batch size: expand the inputs before the prompt"
        )

    batch_select_indices = batch_repeat_interleave

    def reset(self) -> None:
        if self.is_initialized:
            for t in self.tensors():
                t.zero_()
            self.cumulative_length.zero_()

    def nbytes(self) -> int:
        """Bytes held: the whole capacity's storage (allocated up front)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        """Bytes of the slots written so far (what a cache grown as needed would hold)."""
        return self.nbytes() * int(self.cumulative_length) // self.max_cache_len
