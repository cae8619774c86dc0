"""What a kernel is told about one packed stream: a small dataclass per storage scheme, named fields only.

Codecs own encoding and their state; each describes that state as one of these (`StreamCodec.layout()`), and every
op (the PyTorch references, the C++ and Triton kernels) reads only these: ops never see a codec. The C++ kernels read
the fields by name, and the integers they switch on (`StreamKind`, `quant.Kind`) are handed to them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from ..quant import QuantizedTensor

# Room a growing store keeps for later appends (decoding), as a fraction of what it holds (at least ROOM_MIN tokens):
# appending a token then copies nothing most of the time, and a regrowth copies the history once per 1/ROOM_FRACTION
# of its length. The first append (a prefill) gets no room. The room is held memory, so `nbytes` counts it (the
# buffer's whole storage).
ROOM_FRACTION = 32
ROOM_MIN = 1


class StreamKind(IntEnum):
    """The storage scheme of a stream (what the C++ kernel switches on)."""

    PLAIN = 0
    DELTA = 1
    CHANNEL = 2
    ADAPTIVE = 3
    BASIS = 4


@dataclass(frozen=True)
class SnapshotSchedule:
    """When a delta stream snapshots its running mean: at each of `points`, then at `last`, then every `interval`
    tokens (the mean settles fast, so early snapshots are dense). A token at stream position t is coded against the
    newest snapshot taken when the stream held at most t tokens (causal)."""

    points: tuple[int, ...] = (16, 64, 256)
    last: int = 1024
    interval: int = 2048

    def count(self, t: int) -> int:
        """How many snapshots exist once the stream holds `t` tokens (Python integers: the per-token path)."""
        if t < self.last:
            return sum(t >= point for point in self.points)
        return len(self.points) + 1 + (t - self.last) // self.interval

    def counts(self, t: torch.Tensor) -> torch.Tensor:
        """`count` of every position in `t` (any integer tensor)."""
        t = t.long()
        growing = sum((t >= point).long() for point in self.points)
        later = len(self.points) + 1 + (t - self.last) // self.interval
        return torch.where(t < self.last, growing, later)


SNAPSHOTS = SnapshotSchedule()


@dataclass(frozen=True)
class RopeAngles:
    """RoPE to re-apply to stored keys (kept in the canonical order of `hf_deltakv.rope`): pair `c` (channels `c` and
    `c + D/2`) of stored token `t` turns by `positions[b, t] * freqs[c]` radians. Kernels compute the angles; no
    table is kept.

    Args:
        positions: int32 `[batch, stored tokens]` (rows contiguous).
        freqs: float64 `[D / 2]`.
    """

    positions: torch.Tensor
    freqs: torch.Tensor

    def cos_sin(self, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin fp32 `[batch, end - start, D/2]` of stored tokens `start:end` (`hf_deltakv.rope.rope_cos_sin`)."""
        from ..rope import rope_cos_sin

        return rope_cos_sin(self.positions[:, start:end], self.freqs)


def stored_inputs(
    query: torch.Tensor,
    sink_keys: torch.Tensor,
    positions: torch.Tensor,
    freqs: torch.Tensor | None,
    order: torch.Tensor | None,
    end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, RopeAngles | None]:
    """What an attention kernel over a preallocated layer's storage takes for a step's `query` `[batch, heads, n, dim]`
    and its raw `sink_keys` `[batch, kv_heads, sinks, dim]`: both in the stored keys' channel order (`order`: the
    canonical order of `hf_deltakv.rope`, None when keys are stored as given), the query as `[batch, kv_heads,
    heads / kv_heads, n, dim]` (a view), and the RoPE of the stream's tokens (the positions after the sinks, up to
    `end`; None without `freqs`: keys stored after RoPE)."""
    sinks, kv_heads = sink_keys.shape[2], sink_keys.shape[1]
    if order is not None:
        query, sink_keys = query[..., order], sink_keys[..., order]
    rope = RopeAngles(positions[:, sinks:end], freqs) if freqs is not None else None
    return query.unflatten(1, (kv_heads, query.shape[1] // kv_heads)), sink_keys, rope


@dataclass(frozen=True)
class PlainStream:
    """Every token quantized on its own: `blocks` `[batch, heads, length, ...]` in one block format."""

    blocks: QuantizedTensor
    dim: int
    length: int
    rotation: int = 0  # Hadamard block size the stream was rotated with (0: not rotated)
    kind: StreamKind = StreamKind.PLAIN


@dataclass(frozen=True)
class DeltaStream:
    """Keyframes plus closed-loop deltas (`codecs.delta`).

    keyframes: `[batch, heads, groups, ...]`, one per `kf` tokens. deltas: `[batch, heads, length - groups, ...]`, the
    other tokens in order (None when there are none); with `intra`, a block whose scale has its lowest mantissa bit
    set is coded against the long-term reference (the mean snapshot, fp16 `means [batch, heads, snapshots, dim]`, or
    zero when `means` is None) instead of the previous token (`reference="previous"`) or the keyframe.
    """

    keyframes: QuantizedTensor
    deltas: QuantizedTensor | None
    means: torch.Tensor | None
    kf: int
    reference: str
    intra: bool
    dim: int
    length: int
    snapshots: SnapshotSchedule = SNAPSHOTS
    rotation: int = 0
    kind: StreamKind = StreamKind.DELTA


@dataclass(frozen=True)
class DeltaRows:
    """Where a delta stream's next tokens are written (`reference.delta_tokens`): storage with room, rows reserved.

    The stream holds `start` tokens; of the new ones, those at a multiple of `kf` are keyframes, written from row
    `key_at` of `keyframes` on, the others deltas from row `delta_at` of `deltas` (None: none among them). A mean
    snapshot due once the stream holds t tokens (`snapshots`) goes into `means` (fp16 `[batch, heads, rows, dim]`,
    None: no mean reference) from row `mean_at` on. `previous`: deltas from the previous token's reconstruction (else
    from the keyframe's); `intra`: a block may be coded against the long-term reference instead.
    """

    keyframes: QuantizedTensor
    key_at: int
    deltas: QuantizedTensor | None
    delta_at: int
    means: torch.Tensor | None
    mean_at: int
    start: int
    kf: int
    previous: bool
    intra: bool
    snapshots: SnapshotSchedule = SNAPSHOTS

    @staticmethod
    def counts(start: int, new: int, kf: int, snapshots: SnapshotSchedule, means: bool) -> tuple[int, int, int]:
        """(keyframes, deltas, mean snapshots) among `new` tokens after `start` (`means`: snapshots taken)."""
        keys = -(-(start + new) // kf) + (-start // kf)  # multiples of kf in [start, start + new): ceil - ceil
        taken = snapshots.count(start + new) - snapshots.count(start) if means else 0
        return keys, new - keys, taken


@dataclass(frozen=True)
class ChannelStream:
    """KIVI-style: each channel quantized along the tokens of a group. groups: `[batch, heads, n_groups, dim, ...]`
    (one block of `group` tokens per channel), tail: fp16 `[batch, heads, < group, dim]` not yet grouped."""

    groups: QuantizedTensor | None
    tail: torch.Tensor
    group: int
    dim: int
    length: int
    rotation: int = 0
    kind: StreamKind = StreamKind.CHANNEL


@dataclass(frozen=True)
class AdaptiveStream:
    """Per-channel groups with a bit depth per channel (`codecs.adaptive`).

    Tokens are grouped by absolute position: group `g` covers slots `g * group ... (g + 1) * group - 1`, and the stream
    starts at slot `offset` of group 0 (the slots before it are the raw sink tokens; they are coded as padding and
    never read). Per group and channel: `bits` (1..8, two per byte as `quant.pack_4bit` packs them, `uint8
    [batch, heads, groups, dim / 2]`), `low` and `step` (fp16 `[batch, heads, groups, dim]`), and codes as bit planes
    (`quant.bitplanes`, `uint8 [batch, heads, groups, planes, group / 8]`): a value is `low + code * step`. `tail`:
    fp16 `[batch, heads, t, dim]`, the tokens after the last coded group, raw until their group is complete.
    """

    planes: torch.Tensor | None
    bits: torch.Tensor | None
    low: torch.Tensor | None
    step: torch.Tensor | None
    tail: torch.Tensor
    group: int
    offset: int
    dim: int
    length: int
    rotation: int = 0
    kind: StreamKind = StreamKind.ADAPTIVE


@dataclass(frozen=True)
class KeptStream:
    """The tokens an evicting cache keeps at full precision, in slots (`layers.evicting`): `keys` and `values` fp16
    `[batch, heads, slots, dim]`, `index` int32 `[batch, heads, slots]`, each slot's position (-1: evicted). Slots
    before `first` are evicted in every head; from `first` on, slots hold tokens in the order of their positions, `live`
    of them not evicted in each head (an evicted slot stays until the storage is compacted)."""

    keys: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor
    first: int
    live: int

    @property
    def slots(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class Observation:
    """What SnapKV observes of a forward's attention, as the attention kernel leaves it: each query row's scaled
    scores on each slot (fp32 `[batch * heads, rows_pad, slots]`, -inf where not attended) and its softmax's final max
    and sum over the sinks and the slots (fp32 `[batch * heads, rows_pad]`). Row `g * n_queries + i` is query `i` of
    the kv head's `g`-th query head; rows from `rows` on are padding; queries before `observe_from` are not observed."""

    scores: torch.Tensor
    maximum: torch.Tensor
    total: torch.Tensor
    rows: int
    n_queries: int = 1
    observe_from: int = 0


@dataclass(frozen=True)
class LatentStream:
    """The residual cache's coded tokens (`residual.layer`, no references): `codes` uint8 `[batch, tokens, bytes]`
    (each latent group of `quant.bitpack.GROUP` components packed at its depth, group after group) and `scales` fp16
    `[batch, tokens, kept groups]`; `bits`: every latent group's depth, the keys' groups then the values' (0: not
    stored, decoded as zeros)."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.codes.shape[1]


@dataclass(frozen=True)
class LatentCoder:
    """A residual layer's linear coder as the kernels read it, made once per device (`residual.attention`): the
    stored latent components only, fp32. `key_encoder` `[stream, kept key components]` and `value_encoder` map a
    token's residual less its mean (heads concatenated; keys before RoPE in the canonical channel order) to them;
    `key_decoder` `[kept key components, stream]` and `value_decoder` map them back, before the means are added (the
    decoders fp16 where that holds them exactly, as a checkpoint stored in fp16 does: every attention program reads
    them, at half the bytes; products in fp32 either way)."""

    key_mean: torch.Tensor
    value_mean: torch.Tensor
    key_encoder: torch.Tensor
    value_encoder: torch.Tensor
    key_decoder: torch.Tensor
    value_decoder: torch.Tensor


@dataclass(frozen=True)
class BasisStream:
    """Values coded in each kv head's own directions, or per token in the fallback format's rotated blocks
    (`kernels.basis`): `rows` uint8 `[batch, heads, length, row bytes]`, the tables `[batch, heads, ...]` (fp16 `mean`
    `[.., D]`, `basis` `[.., D, D]`, `spread` `[.., D]`, uint8 `bits` `[.., D]`), `fmt` the fallback format. Read by the
    reference only (no kernel yet)."""

    rows: torch.Tensor
    mean: torch.Tensor
    basis: torch.Tensor
    spread: torch.Tensor
    bits: torch.Tensor
    fmt: str
    dim: int
    length: int
    rotation: int = 0  # (the fallback's rotation is the codec's own: rows decode to the values themselves)
    kind: StreamKind = StreamKind.BASIS


StreamLayout = PlainStream | DeltaStream | ChannelStream | AdaptiveStream | BasisStream


def constants() -> dict[str, int]:
    """The integers the C++ kernels switch on, by macro name (handed to the compiler as `-D` definitions)."""
    from ..quant import Kind
    from ..quant.bitpack import GROUP

    table = {f"HFD_KIND_{k.name}": int(k) for k in Kind}
    table.update({f"HFD_STREAM_{k.name}": int(k) for k in StreamKind})
    table["HFD_LATENT_GROUP"] = GROUP
    return table
