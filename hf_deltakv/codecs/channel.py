"""KIVI-style per-channel quantization: each channel quantized over groups of tokens.

Keys have a few channels of much larger magnitude than the rest; a scale per channel (shared by a group of
tokens) instead of per token keeps those outliers from drowning the small channels (KIVI, arXiv 2402.02750).
The arithmetic is llama.cpp's Q4_1 (or another block format) applied along the token axis: a group of 32 tokens
of one channel is one block. Tokens of a group not yet complete are held in fp16 (counted in the bytes) until it
fills, so decoding appends without re-encoding history; both are stored in buffers with room (`base.GrowingRows`).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..quant import QuantizedTensor, get_format, owned, saturate_fp16
from .base import RawTailCodec, batched_growth, growth_pending


class ChannelGroupCodec(RawTailCodec):
    """Per-channel block quantization over groups of tokens.

    New tokens are written (saturated to fp16; keys turned back by their RoPE first when asked) into the raw tail's
    room, and every group the tail completes is quantized channel by channel straight into the room of the coded
    groups (`kernels.quantize_at` over the group's channels: one kernel each on GPUs), so a decoding step copies
    nothing of the history.

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

    def _append_tail(self, x: torch.Tensor, write) -> None:
        """The tokens written into the raw tail (`RawTailCodec`), then its complete groups coded (`flush`), or at the
        next read when a buffer grown by this update has its old rows still to be copied (at the update's end,
        `base.batched_growth`)."""
        super()._append_tail(x, write)
        if not growth_pending():
            self.flush()

    def flush(self) -> None:
        """Code every complete group of the tail into the rows of the coded groups."""
        complete = 0 if self.tail is None else self.tail.shape[2] // self.group
        if complete:
            with batched_growth():  # the coded groups' buffers grown (when they are) in one copy
                self._code(complete)
            self._drop_rows("tail", complete * self.group, keep_room=2 * self.group)  # (a prompt's tail is let go)

    def _code(self, complete: int) -> None:
        """The tail's first `complete` groups quantized per channel into the rows of the coded groups: each channel
        of a group is one block of `group` tokens, a row of `quantize_at` (the groups' rows and channels seen as one
        sequence of rows; the tail's groups transposed into a copy of their own size)."""
        batch, heads, _, dim = self.tail.shape
        group = self.group
        make = lambda rows: QuantizedTensor.empty(self.fmt, (batch, heads, rows, dim), group, self.tail.device)  # noqa: E731
        buffer, at = self._reserve("groups", complete, make)
        blocks = self.tail[:, :, : complete * group].unflatten(2, (complete, group)).transpose(3, 4)
        rows = blocks.reshape(batch, heads, complete * dim, group)  # [B, H, groups x channels, group tokens]
        kernels.quantize_at(rows, self.fmt.name, False, buffer.map(lambda t: t.flatten(2, 3)), at * dim)
        self._commit_rows("groups", complete)

    def _coded(self) -> int:
        return self.length - self.tail.shape[2]

    def droppable(self, tokens: int) -> int:
        return min(tokens, self._coded()) // self.group * self.group

    def drop_front(self, tokens: int) -> None:
        self.groups = self.groups.map(lambda t: owned(t[:, :, tokens // self.group :]))  # the dropped groups are freed
        self._release_rows()
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
        self._release_rows()
        self.length = tokens

    def layout(self) -> kernels.ChannelStream:
        self.flush()
        return kernels.ChannelStream(self.groups, self.tail, self.group, self.tail.shape[-1], self.length)
