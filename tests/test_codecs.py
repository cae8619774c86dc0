"""Stream codecs: closed-loop delta coding, packed storage, continuation across calls."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.codecs import ChannelGroupCodec, PlainCodec, RotatedCodec
from hf_deltakv.kernels.hadamard import rotate
from hf_deltakv.kernels.layout import SNAPSHOTS
from hf_deltakv.quant import QuantizedTensor

from .conftest import delta_codec


def smooth_stream(tokens: int = 96, seed: int = 0) -> torch.Tensor:
    """Keys-like data: a slowly drifting vector per head plus an outlier channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, tokens, 64, generator=g).cumsum(2) * 0.05 + torch.randn(2, 3, 1, 64, generator=g)
    x[..., 7] += 15
    return x


CODECS = {
    "plain": lambda: PlainCodec("q4_0"),
    "rotated": lambda: RotatedCodec(PlainCodec("q4_0")),
    "channel": lambda: ChannelGroupCodec("q4_1"),
    "delta": lambda: delta_codec(kf=8),
    "delta-no-intra": lambda: delta_codec(kf=8, intra=False),
    "delta-keyframe-ref": lambda: delta_codec(kf=8, reference="keyframe"),
    "delta-rotated": lambda: RotatedCodec(delta_codec(kf=8)),
}


@pytest.mark.parametrize("name", CODECS)
def test_chunked_appends_equal_one_shot(name):
    x = smooth_stream(50)
    whole, pieces = CODECS[name](), CODECS[name]()
    whole.append(x)
    for chunk in (x[:, :, :13], x[:, :, 13:14], x[:, :, 14:31], x[:, :, 31:]):
        pieces.append(chunk)
    assert whole.length == pieces.length == 50
    torch.testing.assert_close(whole.decode(), pieces.decode(), rtol=0, atol=1e-5)


def test_snapshot_count_of_one_position_equals_the_tensor_version():
    positions = [*range(0, 1100), 3071, 3072, 5119, 5120, 100_000]
    expected = SNAPSHOTS.counts(torch.tensor(positions)).tolist()
    assert [SNAPSHOTS.count(t) for t in positions] == expected
    assert expected[:17] == [0] * 16 + [1] and SNAPSHOTS.count(1024) == 4 and SNAPSHOTS.count(3072) == 5


@pytest.mark.parametrize(
    "make",
    [
        lambda: delta_codec(kf=5),
        lambda: delta_codec(kf=8, delta_format="q4_0_16", reference="keyframe"),
        lambda: delta_codec(kf=32, intra=False, keyframe_format="f16"),
        lambda: delta_codec(kf=6, mean_reference=False, delta_format="q4_1"),
    ],
)
def test_token_by_token_stores_the_same_bytes(make):
    """Decoding's one-token path (`_append_token`) against the general path on the same tokens, across keyframes and
    mean snapshot points (16, 64)."""
    x = smooth_stream(90)
    whole, steps = make(), make()
    whole.append(x)
    steps.append(x[:, :, :3])
    for t in range(3, 90):
        steps.append(x[:, :, t : t + 1])
    for name in whole.state_names():
        if name == "running_sum":  # an fp32 accumulator: its rounding depends on how the tokens were chunked
            continue
        a, b = getattr(whole, name), getattr(steps, name)
        if a is None or b is None:
            assert a is b, name
            continue
        for ta, tb in zip(a.tensors(), b.tensors(), strict=True) if isinstance(a, QuantizedTensor) else [(a, b)]:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name


@pytest.mark.parametrize("name", CODECS)
def test_storage_is_packed(name):
    codec = CODECS[name]()
    codec.append(smooth_stream(256))
    held = []
    inner = codec.inner if isinstance(codec, RotatedCodec) else codec
    for attr in inner.state_names():
        value = getattr(inner, attr)
        if isinstance(value, QuantizedTensor):
            held += [(attr, t.dtype) for t in value.tensors()]
    assert held and all(dtype in (torch.uint8, torch.float16) for _, dtype in held)
    # Far below fp16 (16 bits): 256 tokens cost under 5.5 bits each, closed-loop state and mean snapshots included.
    assert 8 * codec.nbytes() / (2 * 3 * 256 * 64) < 5.5


def test_closed_loop_error_does_not_grow_within_a_group():
    x = smooth_stream(256)
    codec = delta_codec(kf=256, intra=False)
    codec.append(x)
    err = (codec.decode() - x).pow(2).mean(dim=(0, 1, 3)).sqrt()
    early, late = err[1:32].mean(), err[-32:].mean()
    assert late < 2 * early  # open-loop drift would grow like sqrt(distance)


def test_closed_loop_beats_open_loop_reference():
    x = smooth_stream(128)
    closed, open_loop = delta_codec(kf=64, intra=False), delta_codec(kf=64, intra=False, reference="keyframe")
    closed.append(x)
    open_loop.append(x)
    assert (closed.decode() - x).pow(2).mean() < (open_loop.decode() - x).pow(2).mean()


def test_delta_helps_keys_with_outlier_channels():
    x = smooth_stream(128)
    plain, delta = PlainCodec("q4_0"), delta_codec(kf=32)
    plain.append(x)
    delta.append(x)
    assert (delta.decode() - x).pow(2).mean() < 0.5 * (plain.decode() - x).pow(2).mean()


def test_intra_never_worse_than_inter_per_token():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 64, generator=g) * 3  # white noise: deltas are larger than values
    inter, both = delta_codec(kf=64, intra=False), delta_codec(kf=64)
    inter.append(x)
    both.append(x)
    assert (both.decode() - x).pow(2).mean() < (inter.decode() - x).pow(2).mean()


def test_kf_one_is_all_keyframes():
    x = smooth_stream(10)
    codec = delta_codec(kf=1, keyframe_format="q8_0")
    codec.append(x)
    assert codec.deltas is None and codec.keyframes.codes.shape[2] == 10


def test_rotation_is_orthogonal():
    x = torch.randn(5, 96)
    torch.testing.assert_close(rotate(rotate(x), inverse=True), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotate(x).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_kf(bad):
    with pytest.raises(ValueError, match="kf"):
        delta_codec(kf=bad)


def test_bad_reference_and_format():
    with pytest.raises(ValueError, match="previous"):
        delta_codec(reference="next")
    with pytest.raises(ValueError, match="allowed"):
        delta_codec(delta_format="q2")


def test_segmented_prefix_sum_reference():
    from hf_deltakv.kernels.reference import segmented_prefix_sum

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    resets = torch.tensor([[False, False, True, False, True]])
    assert segmented_prefix_sum(values, resets, dim=1).tolist() == [[1.0, 3.0, 3.0, 7.0, 5.0]]


# --- the adaptive per-channel codec (DeltaKVCache's keys) -----------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_deltakv.codecs.adaptive import AdaptiveChannelCodec, allocate_bits  # noqa: E402
from hf_deltakv.kernels.reference import pair_energy  # noqa: E402
from hf_deltakv.quant.bitplanes import pack_planes, unpack_planes  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), dim=st.sampled_from([16, 48, 64, 96, 128, 256]), seed=st.integers(0, 999))
def test_a_rotated_row_does_not_depend_on_the_rows_rotated_with_it(rows, dim, seed):
    """The rotation is row by row (butterflies): any subset or chunking of the rows gives each row's same bits."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, dim, generator=g) * 10
    whole = rotate(x)
    pick = torch.randperm(rows, generator=g)[: max(1, rows // 2)]
    assert torch.equal(rotate(x[pick]), whole[pick])
    assert torch.equal(torch.cat([rotate(part) for part in x.split(5)]), whole)
    assert torch.equal(rotate(x[:1, :1]), whole[:1, :1])


@settings(max_examples=60, deadline=None)
@given(dim=st.sampled_from([2, 8, 64, 256]), rate=st.sampled_from([1.0, 2.5, 4.0, 5.25, 8.0]), seed=st.integers(0, 999))
def test_allocation_spends_the_budget_exactly_and_follows_the_scores(dim, rate, seed):
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(3, dim, generator=g) ** 8 * 1e4
    score[0, : dim // 2] = 0  # dead channels
    score[1, 0] = float("nan")
    total = int(rate * dim)
    bits = allocate_bits(score, total)
    assert bits.dtype == torch.uint8 and ((bits >= 1) & (bits <= 8)).all()
    assert (bits.long().sum(-1) == total).all()
    row = bits[2].long()
    order = score[2].argsort()
    assert (row[order].diff() >= -1).all()  # a larger score never gets more than one bit less (rounding)


@settings(max_examples=40, deadline=None)
@given(group=st.sampled_from([8, 16, 32, 64]), dim=st.integers(1, 12), seed=st.integers(0, 999))
def test_bit_planes_round_trip(group, dim, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 9, (dim,), generator=g).expand(2, 3, dim)
    codes = (torch.rand(2, 3, group, dim, generator=g) * (2 ** bits.unsqueeze(-2))).floor().to(torch.uint8)
    planes = pack_planes(codes, bits)
    assert planes.shape == (2, 3, int(bits[0, 0].sum()), group // 8)
    assert torch.equal(unpack_planes(planes, bits).to(torch.uint8), codes)


def _adaptive(**kw):
    return AdaptiveChannelCodec(**{"group": 32, "bits": 4.0, "offset": 4, **kw})


def test_adaptive_chunks_and_tokens_store_the_same_bytes_as_one_shot():
    x = smooth_stream(100)
    energy = torch.rand(2, 3, 104, 64, generator=torch.Generator().manual_seed(3)) * 5
    whole, steps = _adaptive(), _adaptive()
    whole.append(x)
    whole.observe(energy, 0)
    whole.flush()
    steps.append(x[:, :, :10])
    steps.observe(energy[:, :, :14], 0)
    for t in range(10, 100):
        steps.append(x[:, :, t : t + 1])
        steps.observe(energy[:, :, 4 + t : 5 + t], 4 + t)
        steps.flush()
    for name in ("planes", "depths", "low", "step", "tail"):
        assert torch.equal(getattr(whole, name).view(torch.uint8), getattr(steps, name).view(torch.uint8)), name
    torch.testing.assert_close(whole.decode(), steps.decode())


def test_adaptive_groups_are_aligned_to_absolute_positions_and_causal():
    """Group 0 holds the 28 tokens after 4 sinks; a group is coded from the queries before its start only, whenever
    they arrive."""
    x = smooth_stream(92)
    energy = torch.ones(2, 3, 96, 64)
    late = energy.clone()
    late[:, :, 40:, :8] = 1e6  # queries from position 40 on weigh 8 channels heavily
    a, b, c = _adaptive(), _adaptive(), _adaptive()
    for codec, e in ((a, energy), (b, late)):
        codec.append(x)
        codec.observe(e, 0)
        codec.flush()
    assert a.coded == b.coded == 3 and a.tail.shape[2] == b.tail.shape[2] == 0
    assert torch.equal(a.depths[:, :, :2], b.depths[:, :, :2])  # groups 0 and 1 start at 0 and 32: before 40
    assert not torch.equal(a.depths[:, :, 2], b.depths[:, :, 2])  # group 2 starts at 64: it sees them
    c.append(x)
    c.observe(late[:, :, :50], 0)
    c.observe(late[:, :, 50:], 50)  # later queries (64 on) arrive after the snapshot of group 2's start
    c.observe(torch.full_like(late, 1e9), 0)  # and positions already observed are ignored
    c.flush()
    assert torch.equal(c.depths, b.depths)


def test_adaptive_places_bits_where_queries_look():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 64, 16, generator=g)
    energy = torch.ones(1, 1, 64, 16)
    energy[..., 3] = energy[..., 11] = 1e4  # channel 3 and its RoPE partner 11
    codec = AdaptiveChannelCodec(group=32, bits=4.0, offset=0)
    codec.append(x)
    codec.observe(energy, 0)
    codec.flush()
    from hf_deltakv.quant import unpack_4bit

    second = unpack_4bit(codec.depths[0, 0, 1])  # the second group saw the queries
    assert second[3] == second[11] == 8 and second.sum() == 64
    error = (codec.decode() - x)[0, 0, 32:].abs().amax(0)
    assert error[3] < error.median() / 10


def test_adaptive_damage_stays_in_its_channel_and_group():
    x = smooth_stream(96)
    x[0, 1, 40, 5] = float("nan")
    codec = _adaptive()
    codec.append(x)
    out = codec.decode()
    bad = ~torch.isfinite(out)
    assert bad[0, 1, 28:60, 5].all()  # the group of positions 32..63 (stream 28..59) in channel 5
    assert bad.sum() == 32


def test_adaptive_storage_is_packed_and_counted():
    codec = _adaptive()
    codec.append(smooth_stream(252))  # 8 groups of 32 positions after 4 sinks
    codec.flush()
    assert codec.tail.shape[2] == 0
    assert codec.planes.dtype == torch.uint8 and codec.low.dtype == codec.step.dtype == torch.float16
    # 4 bits of codes + fp16 low and step per 32 tokens + 4 bits of depth per 32 tokens (1.125 bits)
    assert 8 * codec.nbytes() / (2 * 3 * 252 * 64) == pytest.approx(5.125 * 256 / 252, rel=1e-3)


def test_pair_energy_is_the_same_before_and_after_rope():
    from hf_deltakv.rope import rotate_pairs

    q = torch.randn(2, 4, 5, 64)
    angle = torch.rand(5, 32) * 6
    torch.testing.assert_close(pair_energy(rotate_pairs(q, angle.cos(), angle.sin())), pair_energy(q))


@pytest.mark.parametrize("bad", [{"group": 24}, {"bits": 0.5}, {"bits": 9}, {"bits": True}])
def test_adaptive_refuses_bad_options(bad):
    with pytest.raises(ValueError):
        _adaptive(**bad)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2.0, 3.0, 4.0]), seed=st.integers(0, 999), spikes=st.integers(0, 6))
def test_clipped_ranges_never_code_a_channel_worse_than_its_whole_range(bits, seed, spikes):
    """Each channel of a group keeps the candidate range with the least squared error; the whole range is a candidate,
    and the depths do not depend on the choice."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 64, 16, generator=g)
    x[0, :, torch.randint(0, 64, (spikes,), generator=g), :4] *= 12  # a few tokens far out in some channels
    x = x.half().float()  # what the codec holds until a group is coded, and measures its error against
    coded = {}
    for clip in (True, False):
        codec = AdaptiveChannelCodec(group=32, bits=bits, offset=0, clip_range=clip)
        codec.append(x)
        codec.flush()
        coded[clip] = codec
    assert torch.equal(coded[True].depths, coded[False].depths)
    sse = {clip: (c.decode() - x).double().pow(2).view(1, 2, 2, 32, 16).sum(3) for clip, c in coded.items()}
    # The choice is made on the fp32 codes; a coded value is then rounded to fp16 (at most 2^-11 of it; 2^-10 of the
    # input's magnitude allowed), which may add to either error by up to that much per token.
    rounding = (x.double().abs() * 2**-10).pow(2).view(1, 2, 2, 32, 16).sum(3)
    assert (sse[True].sqrt() <= sse[False].sqrt() * (1 + 1e-5) + 2 * rounding.sqrt() + 1e-9).all()
    if spikes:
        assert sse[True].sum() < sse[False].sum()


def test_clipped_ranges_are_coded_in_chunks_that_give_the_same_bytes(monkeypatch):
    import hf_deltakv.codecs.adaptive as adaptive

    x = smooth_stream(256)
    whole = _adaptive()
    whole.append(x)
    whole.flush()
    monkeypatch.setattr(adaptive, "CLIP_ELEMENTS", 1)  # one group per pass
    chunked = _adaptive()
    chunked.append(x)
    chunked.flush()
    for name in ("planes", "depths", "low", "step"):
        assert torch.equal(getattr(whole, name).view(torch.uint8), getattr(chunked, name).view(torch.uint8)), name


def test_keys_that_require_grad_are_coded():
    """A forward outside `torch.no_grad()` hands the cache keys that require grad: coding them must not trip autograd
    (the clipped-range search works in place)."""
    x = smooth_stream(64).requires_grad_()
    codec = _adaptive()
    codec.append(x * 1.0)
    codec.flush()
    torch.testing.assert_close(codec.decode(), _coded_without_grad(x.detach()))


def _coded_without_grad(x: torch.Tensor) -> torch.Tensor:
    codec = _adaptive()
    codec.append(x)
    codec.flush()
    return codec.decode()
