"""Stream codecs: closed-loop delta coding, packed storage, continuation across calls."""

from __future__ import annotations

import pytest
import torch

from hf_deltakv.codecs import ChannelGroupCodec, PlainCodec, RotatedCodec
from hf_deltakv.formats import QuantizedTensor
from hf_deltakv.ops.hadamard import rotate
from hf_deltakv.ops.layout import SNAPSHOTS

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
    from hf_deltakv.ops.reference import segmented_prefix_sum

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    resets = torch.tensor([[False, False, True, False, True]])
    assert segmented_prefix_sum(values, resets, dim=1).tolist() == [[1.0, 3.0, 3.0, 7.0, 5.0]]
