"""Per-channel groups with the bits placed where attention needs them: DeltaKVCache's key codec.

Keys (before RoPE especially) have channels of very different ranges, and queries weigh channels very differently.
A group of `group` tokens (aligned to absolute positions, like a video codec's group of pictures) stores, per
channel, a range (`low`, fp16, and a step, fp16: the clipped range that codes the channel's tokens best, `CLIPS`),
and every token's code in that channel at the channel's own bit depth (1-8 bits, `quant.bitplanes`). The depths
of a group spend a fixed budget of `bits * dim` bits per token where they reduce the attention-score error most:
channel `c` gets about `bits + log2(range_c * sqrt(w_c)) - mean` bits (reverse water-filling), `w_c` being the mean
squared query of that channel, paired as RoPE pairs channels, over the positions before the group (causal: observed
by the cache layer when attention reads it, `observe`). Before any query is seen (the first group, or attention that
never goes through the layer), all channels weigh the same.

Tokens of an unfinished group, and complete groups not yet flushed, are held raw (fp16, counted in the bytes): a
group is coded when it is complete and the queries before it have been observed (`flush`, at the next read).

Measured on both real models (benchmarks/ablation_kld.py, keys alone): KL divergence 0.0019 (SmolLM2) / 0.0091
(Gemma 3) against 0.0075 / 0.0123 for KIVI's per-channel 4 bits; the query weights pay on SmolLM2 (0.0033 without)
but not on Gemma 3 (0.0084 without). Per-channel prediction from the previous token (closed-loop DPCM, chosen per
channel and group) did not pay and is not used here.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import key_grid
from ..kernels.reference import CLIP_ELEMENTS, CLIPS, allocate_bits, clipped_codes  # noqa: F401 - the codec's spec
from ..quant import owned, saturate_fp16
from ..quant.bitplanes import MAX_BITS
from .base import RawTailCodec, batched_growth

GROUPS = (8, 16, 32, 64)  # token group sizes (a plane is a whole number of bytes; the kernels read up to 64)
CODED = ("planes", "depths", "low", "step")  # the state of coded groups, one row per group
RANGES = {"fp16": CODED, "grid8": ("planes", "depths", "low_code", "high_code")}  # a range's form -> that state


class AdaptiveChannelCodec(RawTailCodec):
    """Groups of tokens coded per channel at query-weighted bit depths.

    Args:
        group: tokens per group (8, 16, 32 or 64), aligned to absolute positions.
        bits: mean bits per code (a budget of `bits * dim` per token, `bits * dim` an integer).
        offset: absolute position of the stream's first token (the cache layer's raw sink tokens come before it).
        query_weights: weigh the channels by the queries observed (off: by their ranges alone; for the ablation).
        clip_range: code each channel over the clipped range of `CLIPS` with the least error (off: its whole range).
        ranges: how a group's channel range is held: `"fp16"` (low and step, 32 bits) or `"grid8"` (a byte each
            for its low and high on a grid fitted per sequence on the first tokens coded: `kernels.key_grid`;
            experimental: its candidates rounded onto the grid by the reference and searched by the C++ kernel on
            the CPU (by the reference on GPUs), read by every kernel through the fp16 ranges it derives).
    """

    def __init__(
        self,
        *,
        group: int,
        bits: float,
        offset: int,
        query_weights: bool = True,
        clip_range: bool = True,
        ranges: str = "fp16",
    ) -> None:
        super().__init__()
        if group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
        if ranges not in RANGES:
            raise ValueError(f"key ranges must be one of {sorted(RANGES)}, got {ranges!r}")
        if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 1 <= bits <= MAX_BITS:
            raise ValueError(f"bits must be a number in [1, {MAX_BITS}], got {bits!r}")
        self.group, self.bits, self.query_weights, self.clip_range = group, float(bits), query_weights, clip_range
        # The stream's first token sits in absolute group `first_group`, at slot `pad` of it.
        self.first_group, self.pad = divmod(offset, group)
        self.ranges = ranges
        self.planes = self.depths = self.low = self.step = None  # coded groups
        self.low_code = self.high_code = self.origin = self.unit = None  # (grid ranges: the codes and the grid)
        self.tail = None  # fp16 [B, H, t, D]: tokens not yet coded
        self.coded = 0  # coded groups
        # Encoder state: summed pair energies of the queries observed (fp32 [B, H, D]) and over how many positions;
        # the same sums before the start of each absolute group still to code (group -> (sum, positions)).
        self.energy = None
        self.observed = 0
        self.before_group: dict[int, tuple[torch.Tensor, int]] = {}

    @property
    def coded_names(self) -> tuple[str, ...]:
        """The state of coded groups, one row per group (`RANGES`)."""
        return RANGES[self.ranges]

    @property
    def observes_queries(self) -> bool:
        return self.query_weights

    def state_names(self) -> tuple[str, ...]:
        grid = ("origin", "unit") if self.ranges == "grid8" else ()
        return (*self.coded_names, *grid, "tail", "energy")

    def held(self) -> list:
        return [*super().held(), self.before_group]

    def map_batch(self, fn) -> None:
        super().map_batch(fn)
        self.before_group = {g: (fn(e), n) for g, (e, n) in self.before_group.items()}

    def _budget(self, dim: int) -> int:
        total = self.bits * dim
        if total != int(total):
            raise ValueError(f"bits * head_dim must be a whole number of bits, got {self.bits} * {dim}")
        return int(total)

    def _append_tail(self, x: torch.Tensor, write) -> None:
        if self.tail is None:
            self._budget(x.shape[-1])
        super()._append_tail(x, write)

    def observe(self, energy: torch.Tensor, first: int) -> None:
        """Queries' pair energies `[B, H, n, D]` at absolute positions `first ... first + n - 1`, in order; positions
        already observed are skipped. Records the sums before every group start they cross."""
        skip = max(self.observed - first, 0)
        energy = energy[:, :, skip:].float()
        first += skip
        n = energy.shape[2]
        if not n:
            return
        total = self.energy if self.energy is not None else torch.zeros_like(energy[:, :, 0])
        running = energy.cumsum(2)  # running[:, :, k - 1]: the first k positions' sum (one pass, not one per group)
        start = -(-(first + 1) // self.group) * self.group  # group starts s with first < s <= first + n
        for s in range(start, first + n + 1, self.group):
            if s // self.group >= self.first_group + self.coded:
                self.before_group[s // self.group] = (total + running[:, :, s - first - 1], s)
        self.energy = total + running[:, :, -1]
        self.observed = first + n

    def observe_chunk(self, query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, first: int) -> None:
        """`observe` of a chunk's queries `[batch, q_heads, n, dim]` at positions `first...` in one op
        (`kernels.add_query_energies`): the sums before the group starts the chunk crosses and the new total are the
        rows of one new tensor, kept as views of it, never copied."""
        skip = max(self.observed - first, 0)
        if skip >= query.shape[2]:  # seen already
            return
        query, first = query[:, :, skip:], first + skip
        n = query.shape[2]
        sums = kernels.add_query_energies(query, order, kv_heads, self.energy, first, self.group)
        starts = kernels.reference.group_starts(first, n, self.group)
        if (first + n) % self.group == 0:  # the chunk ends where a group starts: its total is the sum before it
            starts.append(first + n)
        for row, s in enumerate(starts):
            if s // self.group >= self.first_group + self.coded:
                self.before_group[s // self.group] = (sums[:, :, row], s)
        self.energy = sums[:, :, -1]
        self.observed = first + n

    def observe_one(self, query: torch.Tensor, order: torch.Tensor | None, kv_heads: int, position: int) -> None:
        """`observe` of one position's queries (a decoding step), in one op (`kernels.add_query_energy`): the new sum
        is a new tensor, so the sum before a group's start is that tensor itself, kept, never copied."""
        if position < self.observed:  # seen already
            return
        self.energy = kernels.add_query_energy(query, order, kv_heads, self.energy)
        self.observed = position + 1
        if self.observed % self.group == 0 and self.observed // self.group >= self.first_group + self.coded:
            self.before_group[self.observed // self.group] = (self.energy, self.observed)

    def flush(self) -> None:
        """Code every complete group of the tail, with the query weights observed before each, into the rows of the
        coded groups' storage (`kernels.code_groups`: one kernel on GPUs)."""
        if self.tail is None:
            return
        slots = self.pad + self.length  # slots from the start of the stream's first group
        complete = slots // self.group - self.coded
        if complete <= 0:
            return
        dim = self.tail.shape[-1]
        pad = self.pad if self.coded == 0 else 0
        take = complete * self.group - pad
        first = self.first_group + self.coded
        weights = self._weights(range(first, first + complete), self.tail)
        total = self._budget(dim)
        shapes = ((total, self.group // 8), (dim // 2,), (dim,), (dim,))
        dtypes = (torch.uint8, torch.uint8) + ((torch.float16,) * 2 if self.ranges == "fp16" else (torch.uint8,) * 2)
        grid = None
        if self.ranges == "grid8":  # the grid: fitted on the tokens held raw at the first coding (a prompt's)
            grid = (self.origin, self.unit) if self.origin is not None else key_grid.fit_base(self.tail)
        with batched_growth():  # the coded groups' four buffers grown (when they are) in one copy
            self._code(complete, pad, weights, total, shapes, dtypes, grid)
        if grid is not None:
            self.origin, self.unit = grid
        self._drop_rows("tail", take, keep_room=2 * self.group)  # (a prompt's whole tail is let go)
        for g in range(first, first + complete):
            self.before_group.pop(g, None)
        self.coded += complete

    def _code(self, complete: int, pad: int, weights, total: int, shapes, dtypes, grid=None) -> None:
        batch, heads = self.tail.shape[:2]
        out, rows = [], set()
        for name, shape, dtype in zip(self.coded_names, shapes, dtypes, strict=True):
            make = lambda n, s=shape, d=dtype: torch.empty(batch, heads, n, *s, dtype=d, device=self.tail.device)  # noqa: E731
            buffer, at = self._reserve(name, complete, make)
            out.append(buffer)
            rows.add(at)
        assert rows == {self.coded}, (rows, self.coded)  # the four tensors of the coded groups stay aligned
        kernels.code_groups(self.tail, pad, complete, weights, total, self.clip_range, tuple(out), at, grid)
        for name in self.coded_names:
            self._commit_rows(name, complete)  # in a buffer with room: a flush does not copy the history

    def _weights(self, groups: range, like: torch.Tensor) -> torch.Tensor | None:
        """Mean query pair energy before each absolute group's start `[B, H, groups, D]`, None when none was seen
        (or `query_weights` is off: depths from the ranges alone, for the ablation)."""
        if not self.query_weights:
            return None
        rows = []
        for g in groups:
            total, count = self.before_group.get(g, (None, 0))
            if not count and self.energy is not None and self.observed <= g * self.group:
                total, count = self.energy, self.observed
            rows.append(total / count if count else None)
        if all(r is None for r in rows):
            return None
        if len(rows) == 1:  # a decoding step's group: a view, no copy
            return rows[0].unsqueeze(2)
        ones = torch.ones(like.shape[:2] + like.shape[3:], dtype=torch.float32, device=like.device)
        return torch.stack([ones if r is None else r for r in rows], dim=2)

    def _coded_tokens(self) -> int:
        """Stream tokens held in coded groups (the first coded group may start after sink slots)."""
        return self.coded * self.group - self.pad if self.coded else 0

    def droppable(self, tokens: int) -> int:
        """Whole coded groups only: the first holds `group - pad` tokens, the others `group`."""
        tokens = min(tokens, self._coded_tokens())
        if tokens < self.group - self.pad:
            return 0
        return (tokens + self.pad) // self.group * self.group - self.pad

    def drop_front(self, tokens: int) -> None:
        groups = (tokens + self.pad) // self.group
        for name in self.coded_names:
            setattr(self, name, owned(getattr(self, name)[:, :, groups:]))  # the dropped groups are freed
        self._release_rows()
        self.coded -= groups
        self.first_group += groups
        self.pad = 0
        self.length -= tokens

    def truncate(self, tokens: int) -> None:
        """Keep the first `tokens`: a cut inside a coded group decodes its kept tokens back into the raw tail (they
        are coded again when the group fills up). Query statistics gathered so far are kept."""
        coded = self._coded_tokens()
        if tokens >= coded:
            self.tail = owned(self.tail[:, :, : tokens - coded])
        else:
            keep = (tokens + self.pad) // self.group  # whole groups before the cut
            start = keep * self.group - self.pad if keep else 0
            partial = saturate_fp16(kernels.decode_stream(self.layout(), start, tokens))
            for name in self.coded_names:
                value = owned(getattr(self, name)[:, :, :keep])
                setattr(self, name, value if keep else None)
            self._release_rows()
            self.coded = keep
            self.tail = partial.contiguous()
        self.length = tokens
        if not self.coded:  # (no group coded on the grid: it is fitted anew at the next coding)
            self.origin = self.unit = None
        self.observed = min(self.observed, self.first_group * self.group + self.pad + tokens)
        first_open = self.first_group + self.coded
        self.before_group = {g: v for g, v in self.before_group.items() if g >= first_open}

    def _ranges(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp16 low and step of the coded groups, as the kernels read them (grid ranges: derived from the codes)."""
        if self.ranges == "fp16" or self.low_code is None:
            return self.low, self.step
        return kernels.grid_ranges(self.low_code, self.high_code, self.depths, self.origin, self.unit)

    def layout(self) -> kernels.AdaptiveStream:
        self.flush()
        low, step = self._ranges()
        return kernels.AdaptiveStream(
            planes=self.planes,
            bits=self.depths,
            low=low,
            step=step,
            tail=self.tail,
            group=self.group,
            offset=self.pad,
            dim=self.tail.shape[-1],
            length=self.length,
        )
