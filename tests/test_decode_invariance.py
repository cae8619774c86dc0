"""A token's reconstruction is a function of its stored bytes (and position) alone, on every path: decoding a random
subset, a chunking, a crop, or a selection of batch rows of a stream gives each token the same bits as decoding the
whole stream at once. A rotation or decode whose rounding depends on how many rows it handles together (a matrix
product) fails here; see issue 45's example in `test_cache_ops.py`."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hf_deltakv.kernels import triton_available
from hf_deltakv.layers.compressed import CompressedLayer
from hf_deltakv.registry import CACHES, build_cache

from .conftest import tiny_model

HEADS, DIM, BATCH = 2, 32, 3  # tiny_model("llama"): 2 kv heads of 32
PATHS = ["reference", "auto", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(),
                                                                             reason="needs Triton"))]  # fmt: skip
# Every registry cache whose layers store codes we decode (the residual cache has its own test below; transformers'
# own QuantizedCache, the eviction caches' fp16 rows and DynamicCache decode nothing of ours).
CODED = [name for name, entry in CACHES.items() if name.startswith(("fp16", "q", "kivi", "delta"))]
MODEL = tiny_model("llama")


def _stream(name: str, chunks: list[int], seed: int):
    """A registry cache fed `sum(chunks)` tokens in updates of `chunks` tokens (positions in order) to each of the
    model's layers (a forward that stops before its last layer is undone by the next crop)."""
    return _fed(build_cache(name, MODEL), MODEL, chunks, seed)


def _fed(cache, model, chunks: list[int], seed: int):
    """`cache` fed `sum(chunks)` random tokens in updates of `chunks` tokens to each of `model`'s layers."""
    g = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    keys = torch.randn(BATCH, HEADS, total, DIM, generator=g).cumsum(2) * 0.3 + torch.randn(DIM, generator=g) * 2
    values = torch.randn(BATCH, HEADS, total, DIM, generator=g)
    begin = 0
    for n in chunks:
        ids = torch.arange(begin, begin + n).expand(BATCH, n)
        for layer in range(model.config.num_hidden_layers):
            cache.update(keys[:, :, begin : begin + n], values[:, :, begin : begin + n], layer, {"position_ids": ids})
        begin += n
    return cache


def test_every_coded_registry_cache_is_covered():
    assert {"fp16", "q8_0", "q4_0", "q4_1", "q4_0-rot", "kivi", "kivi-pre-rope", "delta", "delta-no-model"} <= set(
        CODED
    )
    for name in CODED:
        assert isinstance(_stream(name, [3], 0).layers[0], CompressedLayer), name


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", CODED)
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    cuts=st.lists(st.tuples(st.integers(0, 160), st.integers(1, 160)), min_size=1, max_size=4),
    rows=st.permutations(range(BATCH)),
    drop=st.integers(1, 60),
    seed=st.integers(0, 99),
)
# A crop into a coded group (tokens 32-63 of a 32-token group): its kept tokens went back to the fp16 tail as fp32
# decodes rounded to fp16, one fp16 step from what they decoded to before; coded groups decode to fp16 values now.
@example(chunks=[100], cuts=[(0, 1)], rows=[0, 1, 2], drop=50, seed=0)
def test_a_token_decodes_to_the_same_bits_whatever_is_decoded_with_it(monkeypatch, path, name, chunks, cuts, rows,
                                                                     drop, seed):  # fmt: skip
    monkeypatch.setenv("HF_DELTAKV_KERNELS", path)
    cache = _stream(name, chunks, seed)
    layer = cache.layers[0]
    keys, values = layer.reconstruct()
    for codec in (layer.key_codec, layer.value_codec):  # the stream's codes (after the sinks), decoded by ranges
        if not codec.length:
            continue
        whole = codec.decode()
        for a, n in cuts:
            a = min(a, codec.length - 1)
            b = min(a + n, codec.length)
            assert torch.equal(codec.decode_range(a, b), whole[:, :, a:b]), (a, b)
        ends = [min(max(end - layer.sink_tokens, 0), codec.length) for end in itertools.accumulate(chunks)]
        for a, b in zip([0, *ends], ends, strict=False):  # decoded in the chunks it was appended in
            assert torch.equal(codec.decode_range(a, b), whole[:, :, a:b]), (a, b)
    picked = copy.deepcopy(cache)  # a selection (and order) of batch rows decodes each row as before
    picked.batch_select_indices(torch.tensor(rows[:2]))
    for got, want in zip(picked.layers[0].reconstruct(), (keys, values), strict=True):
        assert torch.equal(got, want[list(rows[:2])])
    one = copy.deepcopy(cache)
    one.batch_select_indices(torch.tensor([rows[0]]))
    for got, want in zip(one.layers[0].reconstruct(), (keys, values), strict=True):
        assert torch.equal(got, want[rows[0] : rows[0] + 1])
    kept = max(keys.shape[2] - drop, 1)  # a crop leaves every kept token as it was
    cache.crop(kept)
    for got, want in zip(cache.layers[0].reconstruct(), (keys, values), strict=True):
        assert torch.equal(got, want[:, :, :kept])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunks", [[35], [20, 15], [7, 1, 1, 26]])
def test_the_residual_cache_decodes_each_row_and_kept_token_as_before(monkeypatch, path, chunks):
    """The learned residual cache (a compressor fitted for a tiny 2-kv-head model): a selection of batch rows, one
    row alone, and a crop within its raw window (all it allows) reconstruct bitwise as before. The eviction caches
    are not here: they hold fp16 rows that attention reads as stored, with nothing decoded."""
    from hf_deltakv import ResidualKVCache

    from .conftest import tiny_compressor

    model = tiny_model("llama-mha")
    compressor = tiny_compressor(model)
    monkeypatch.setenv("HF_DELTAKV_KERNELS", path)
    cache = _fed(ResidualKVCache(model=model, compressor=compressor), model, chunks, len(chunks))
    whole = cache.layers[0].reconstruct()
    for rows in ([2, 0], [1]):
        picked = copy.deepcopy(cache)
        picked.batch_select_indices(torch.tensor(rows))
        for got, want in zip(picked.layers[0].reconstruct(), whole, strict=True):
            assert torch.equal(got, want[rows])
    cache.crop(-2)
    for got, want in zip(cache.layers[0].reconstruct(), whole, strict=True):
        assert torch.equal(got, want[:, :, :-2])
