"""KIVI-style per-channel quantization: each channel quantized over groups of tokens.

Keys have a few channels of much larger magnitude than the rest; a scale per channel (shared by a group of
tokens) instead of per token keeps those outliers from drowning the small channels (KIVI, arXiv 2402.02750).
The arithmetic is llama.cpp's Q4_1 (or another block format) applied along the token axis: a group of 32 tokens
of one channel is one block. Tokens of a group not yet complete are held in fp16 (counted in the bytes) until it
fills, so decoding appends without re-encoding history.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quant import get_format, owned, quantize, saturate_fp16
from .base import StreamCodec, append_along_seq


class ChannelGroupCodec(StreamCodec):
    """Per-channel block quantization over groups of tokens.

    Args:
        fmt: block format applied along the token axis (`q4_1` is KIVI's asymmetric 4-bit).
    """

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = get_format(fmt)
        if self.fmt.name == "f16":
            raise ValueError("ChannelGroupCodec needs a block-quantized format (q4_0, q4_1, q8_0), not f16")
        self.group = self.fmt.block_size
        self.groups = None  # QuantizedTensor [B, H, n_groups, D, 1, code_bytes]
        self.tail = None  # fp16 [B, H, < group, D]

    def state_names(self) -> tuple[str, ...]:
        return ("groups", "tail")

    def append(self, x: torch.Tensor) -> None:
        pending = saturate_fp16(x) if self.tail is None else torch.cat([self.tail, saturate_fp16(x)], dim=2)
        batch, heads, n, dim = pending.shape
        full = n // self.group * self.group
        if full:
            blocks = pending[:, :, :full].float().reshape(batch, heads, full // self.group, self.group, dim)
            coded = quantize(blocks.transpose(3, 4).contiguous(), self.fmt.name)
            self.groups = append_along_seq(self.groups, coded)
        self.tail = owned(pending[:, :, full:])
        self.length += x.shape[2]

    def _coded(self) -> int:
        return self.length - self.tail.shape[2]

    def droppable(self, tokens: int) -> int:
        return min(tokens, self._coded()) // self.group * self.group

    def drop_front(self, tokens: int) -> None:
        self.groups = self.groups.map(lambda t: owned(t[:, :, tokens // self.group :]))
        self.length -= tokens

    def truncate(self, tokens: int) -> None:
        coded = self._coded()
        if tokens >= coded:
            self.tail = owned(self.tail[:, :, : tokens - coded])
        else:  # the cut group's kept tokens go back to the fp16 tail, as they were stored
            keep = tokens // self.group
            partial = saturate_fp16(kernels.decode_stream(self.layout(), keep * self.group, tokens))
            self.groups = self.groups.map(lambda t: owned(t[:, :, :keep])) if keep else None
            self.tail = partial.contiguous()
        self.length = tokens

    def layout(self) -> kernels.ChannelStream:
        return kernels.ChannelStream(self.groups, self.tail, self.group, self.tail.shape[-1], self.length)
