"""Compile every Triton kernel for real GPU targets without a GPU: NVIDIA sm_80 and sm_90, AMD gfx942 and gfx90a.

Why: the kernels run on CPUs only under Triton's interpreter, which accepts code a GPU compiler refuses (or compiles
into more shared memory than the chip has). Triton compiles for a named target without the chip
(`triton.compile(ASTSource(...), target=GPUTarget(...))`), so each dispatched configuration is compiled here exactly
as a launch would compile it: the launchers (`decode_attention`, `delta_attention`, `quantize`, ...) are called on
CPU tensors with their kernels replaced by a recorder, and each recorded launch (arguments, constexprs, options) is
specialised by Triton's own binder for the target and compiled. (The Delta-KV article's MI50 is gfx906, which
Triton does not target.)

    python benchmarks/triton_compile.py          # every configuration, every target (over 30 min on 2 cores)
    python benchmarks/triton_compile.py --quick  # one pass over every kernel, format, head dim and option (CI's test)

Needs a clean process: under `TRITON_INTERPRET=1` the kernels are not compilable objects (the test starts one).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from paths import RESULTS

# Name -> (backend, arch, warp size), and the shared memory (LDS) one block may use on it, in bytes: 163 KB on the
# A100 (sm_80), 227 KB on the H100/H200 (sm_90), 64 KB on MI300X (gfx942) and MI200 (gfx90a).
TARGETS = {"sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64),
           "gfx90a": ("hip", "gfx90a", 64)}  # fmt: skip
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "gfx942": 64 * 1024, "gfx90a": 64 * 1024}
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 7)  # query heads per kv head: MHA, Llama-3-8B's GQA, Qwen2.5-0.5B's (7 pads to 8)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Launch:
    """One recorded kernel launch: which kernel, a label of its configuration, its arguments."""

    kernel: str
    config: str
    fn: object
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, name: str, fn, sink: list, label: list) -> None:
        self.name, self.fn, self.sink, self.label = name, fn, sink, label

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.sink.append(Launch(self.name, self.label[0], self.fn, args, kwargs))


@contextlib.contextmanager
def recording(sink: list, label: list):
    """Replace every `_*_kernel` of the Triton modules by a recorder for the duration."""
    from hf_deltakv.kernels.triton import KERNEL_MODULES

    saved = []
    for module in KERNEL_MODULES():
        for name, value in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                saved.append((module, name, value))
                setattr(module, name, _Recorder(name.strip("_"), value, sink, label))
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def launches(quick: bool = False) -> list[Launch]:
    """Every configuration the dispatch sends to a Triton kernel (`quick`: each format, head dim and option once,
    the others varied alongside), recorded from the launchers on CPU tensors."""
    from hf_deltakv import kernels
    from hf_deltakv.codecs import ChannelGroupCodec, PlainCodec, RotatedCodec
    from hf_deltakv.kernels.layout import KeptStream, LatentCoder, LatentStream, RopeAngles
    from hf_deltakv.kernels.triton import (
        adaptive_attention,
        adaptive_code,
        append,
        copy,
        decode_attention,
        delta_attention,
        delta_encode,
        kept,
        latent,
        quantize,
        reconstruct,
        residual,
        sparse_matvec,
        step,
    )
    from hf_deltakv.quant import QuantizedTensor, get_format

    sink: list[Launch] = []
    label = [""]
    g = torch.Generator().manual_seed(0)

    def product(*axes):
        combos = list(itertools.product(*axes))
        if not quick:
            return combos
        width = max(len(axis) for axis in axes)  # a covering pass: every value of every axis at least once
        return [tuple(axis[i % len(axis)] for axis in axes) for i in range(width)]

    with recording(sink, label), torch.no_grad():
        for fmt, dtype in product(("q4_0", "q4_1", "q8_0", "q4_0_16", "q4_1_16"), INPUT_DTYPES):
            label[0] = f"{fmt}, {str(dtype).removeprefix('torch.')} input"
            quantize.quantize(torch.randn(3, 64, generator=g).to(dtype), fmt)
        pairs = (("q4_0", "q4_0"), ("q4_1", "q4_1"), ("q8_0", "q8_0"), ("f16", "f16"), ("q3_0", "q4_0"),
                 ("q4_0_16", "q8_0"))  # fmt: skip
        variants = ("rotated keys", "plain", "keys before RoPE", "rotated keys before RoPE")
        for (kfmt, vfmt), dim, group, variant, masked in product(pairs, HEAD_DIMS, GROUPS, variants, (False, True)):
            label[0] = (f"{kfmt} keys, {vfmt} values, {variant}, head_dim {dim}, {group} queries per kv head, "
                        f"mask {masked}")  # fmt: skip
            wrap = RotatedCodec if variant.startswith("rotated") else (lambda codec: codec)
            keys, values = wrap(PlainCodec(kfmt)), PlainCodec(vfmt)
            keys.append(torch.randn(1, 2, 40, dim, generator=g))
            values.append(torch.randn(1, 2, 40, dim, generator=g))
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
            angles = RopeAngles(torch.arange(40, dtype=torch.int32)[None], freqs) if "RoPE" in variant else None
            mask = torch.ones(1, 1, 42, dtype=torch.bool) if masked else None
            query = torch.randn(1, 2, group, dim, generator=g)
            sinks = torch.randn(1, 2, 2, dim, generator=g).to(torch.float16)
            if decode_attention.supports(keys.layout(), values.layout(), mask):  # what the dispatch sends
                decode_attention.plain_attention(
                    query, sinks, sinks, keys.layout(), values.layout(), rope=angles, mask=mask, scale=0.1
                )
        kivi = (("q4_1", "q4_0", "q8_0"), ("q4_1", "q4_0", "f16"), HEAD_DIMS, GROUPS, (False, True), (False, True))
        for kfmt, vfmt, dim, group, rope, masked in product(*kivi):
            label[0] = (f"KIVI-style {kfmt} keys, {vfmt} values, head_dim {dim}, {group} queries per kv head, "
                        f"RoPE {rope}, mask {masked}")  # fmt: skip
            keys, values = ChannelGroupCodec(kfmt), PlainCodec(vfmt)
            keys.append(torch.randn(1, 2, 70, dim, generator=g))  # two groups and a tail
            values.append(torch.randn(1, 2, 70, dim, generator=g))
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
            angles = RopeAngles(torch.arange(70, dtype=torch.int32)[None], freqs) if rope else None
            mask = torch.ones(1, 1, 72, dtype=torch.bool) if masked else None
            query = torch.randn(1, 2, group, dim, generator=g)
            sinks = torch.randn(1, 2, 2, dim, generator=g).to(torch.float16)
            if decode_attention.supports(keys.layout(), values.layout(), mask):  # what the dispatch sends
                decode_attention.plain_attention(
                    query, sinks, sinks, keys.layout(), values.layout(), rope=angles, mask=mask, scale=0.1
                )
            # a completed group's channels quantized into the coded groups' rows (`ChannelGroupCodec._code`)
            tail = torch.randn(1, 2, 32, dim, generator=g).to(torch.float16)
            rows = tail.unflatten(2, (1, 32)).transpose(3, 4).reshape(1, 2, dim, 32)
            target = QuantizedTensor.empty(get_format(kfmt), (1, 2, 3, dim), 32, "cpu").map(lambda t: t.flatten(2, 3))
            append.quantize_at(rows, kfmt, False, target, dim)
        token_delta = (("q4_0", "q8_0"), HEAD_DIMS, GROUPS, (False, True), (False, True), ("q4_0_16", "q4_0"))
        for vfmt, dim, group, rope, masked, dfmt in product(*token_delta):
            label[0] = (f"token-delta keys ({dfmt} deltas), {vfmt} values, head_dim {dim}, {group} queries per kv "
                        f"head, RoPE {rope}, mask {masked}")  # fmt: skip
            keys = _token_delta_codec(dfmt)
            values = RotatedCodec(PlainCodec(vfmt))
            keys.append(torch.randn(1, 2, 70, dim, generator=g))
            values.append(torch.randn(1, 2, 70, dim, generator=g))
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
            angles = RopeAngles(torch.arange(70, dtype=torch.int32)[None], freqs) if rope else None
            mask = torch.ones(1, 1, 72, dtype=torch.bool) if masked else None
            query = torch.randn(1, 2, group, dim, generator=g)
            sinks = torch.randn(1, 2, 2, dim, generator=g).to(torch.float16)
            if delta_attention.supports(keys.layout(), values.layout(), mask):  # what the dispatch sends
                delta_attention.delta_attention(
                    query, sinks, sinks, keys.layout(), values.layout(), rope=angles, mask=mask, scale=0.1
                )
            label[0] = f"token-delta keys ({dfmt} deltas), head_dim {dim}, a decoding step's token, RoPE {rope}"
            inner = keys.inner
            rows = kernels.DeltaRows(inner.keyframes, 0, inner.deltas, 0, inner.means, 0, 70, 32, True, True)
            turn = (torch.arange(70, 70 + group)[None], freqs, torch.arange(dim) if masked else None) if rope else None
            delta_encode.delta_tokens(torch.randn(1, 2, group, dim, generator=g).to(torch.bfloat16), turn,
                                      min(dim, 128), inner.reference_state, inner.running_sum, inner.means[:, :, 0],
                                      rows)  # fmt: skip
        for dim, group, dtype, rope, masked, kf in product(HEAD_DIMS, GROUPS, INPUT_DTYPES, (True, False),
                                                          (False, True), (32, 16, 64, 8)):  # fmt: skip
            label[0] = (f"adaptive keys (groups of {kf}), rotated q4_0 values, head_dim {dim}, {group} queries per kv "
                        f"head, {str(dtype).removeprefix('torch.')} queries, RoPE {rope}, mask {masked}")  # fmt: skip
            keys = _adaptive_layout(kf, dim)  # recorded launches need no coding
            values = RotatedCodec(PlainCodec("q4_0", search_scale=True))
            values.append(torch.randn(1, 2, 3 * kf, dim, generator=g))
            positions = torch.arange(4, 4 + 3 * kf, dtype=torch.int32)[None]
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
            angles = RopeAngles(positions, freqs) if rope else None
            mask = torch.ones(1, 1, 4 + 3 * kf, dtype=torch.bool) if masked else None
            query = torch.randn(1, 2, group, dim, generator=g).to(dtype)
            sinks = torch.randn(1, 2, 4, dim, generator=g).to(torch.float16)
            adaptive_attention.adaptive_attention(
                query, sinks, sinks, keys, values.layout(), rope=angles, mask=mask, scale=0.1
            )
            append.add_query_energy(query, None, 2, None)
            append.undo_rope_into(query, positions[:, :group], freqs if rope else None, None,
                                  torch.empty(1, 2, 64, dim, dtype=torch.float16), 0)  # fmt: skip
            if group == GROUPS[0] and not masked and kf == 32:  # a prefill's keys, in tiles
                prompt = torch.randn(1, 2, 3 * kf, dim, generator=g).to(dtype)
                append.undo_rope_into(prompt, positions, freqs if rope else None, None,
                                      torch.empty(1, 2, 3 * kf, dim, dtype=torch.float16), 0)  # fmt: skip
            label[0] = f"adaptive keys (groups of {kf}), head_dim {dim}, {str(dtype).removeprefix('torch.')} history"
            reconstruct.decode_into(keys, torch.empty(1, 2, 3 * kf, dim, dtype=dtype), angles,
                                    torch.arange(dim) if masked else None)  # fmt: skip
            reconstruct.decode_into(values.layout(), torch.empty(1, 2, 3 * kf, dim, dtype=dtype))
            label[0] = f"groups of {kf}, head_dim {dim}, clipped ranges {masked}"
            tail = torch.randn(1, 2, 2 * kf, dim, generator=g).half()
            out = _adaptive_rows(kf, dim, 4)
            adaptive_code.code_groups(tail, 4, 2, None if rope else torch.rand(1, 2, 2, dim), 4 * dim, masked, out, 0)
        appended = (("q4_0", True), ("q4_0_16", False), ("q3_0", True), ("q4_1", False), ("q4_1_16", False),
                    ("q8_0", False), ("f16", False), ("q4_0", False))  # fmt: skip
        for (fmt, search), dim, rotation, dtype in product(appended, HEAD_DIMS, (True, False), INPUT_DTYPES):
            label[0] = f"{fmt}, head_dim {dim}, searched scale {search}, rotated {rotation}"
            x = torch.randn(1, 2, 1, dim, generator=g).to(dtype)
            target = PlainCodec(fmt)
            target.append(torch.randn(1, 2, 2, dim, generator=g))
            append.quantize_at(x, fmt, search, target.stored, 1, min(dim, 128) if rotation else 0)
            if dtype == INPUT_DTYPES[0]:  # a prefill's tokens: tiles of `append.ROWS_MOST` rows
                label[0] += ", a prefill's tile"
                prompt = torch.randn(1, 2, append.ROWS_MOST + 3, dim, generator=g).to(dtype)
                rows = QuantizedTensor.empty(get_format(fmt), (1, 2, append.ROWS_MOST + 3), dim, "cpu")
                append.quantize_at(prompt, fmt, search, rows, 0, min(dim, 128) if rotation else 0)
        stepped = (("q4_0", True), ("q4_1", False), ("q8_0", False))  # what `kernels.device_step_serves` takes
        for dim, group, dtype, (fmt, search), flags in product(HEAD_DIMS, GROUPS, INPUT_DTYPES, stepped,
                                                              ((True, True), (False, False))):  # fmt: skip
            rope, weights = flags  # a decoding step with device counters (`step.py`: `StaticDeltaKVCache` on GPUs)
            label[0] = f"a step with device counters, {fmt} values, head_dim {dim}, {group} queries per kv head, "
            label[0] += f"{str(dtype).removeprefix('torch.')}, RoPE undone {rope}, query weights {weights}"
            kf, capacity = 32, 4 + 3 * 32
            positions = torch.zeros(1, capacity, dtype=torch.int32)
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2)) if rope else None
            sinks = torch.zeros(1, 2, 4, dim, dtype=torch.float16 if dtype == torch.float32 else dtype)
            tail = torch.zeros(1, 2, kf, dim, dtype=torch.float16)
            values = QuantizedTensor.empty(get_format(fmt), (1, 2, capacity - 4), dim, "cpu")
            state = torch.zeros(4, dtype=torch.int64)
            x = torch.randn(1, 2, 1, dim, generator=g).to(dtype)
            step.append_step(x, x, None, sinks, sinks, tail, values, positions, freqs, None, state, group=kf, pad=4,
                             fmt=fmt, search_scale=search, rotation=min(dim, 128))  # fmt: skip
            query = torch.randn(1, 2 * group, 1, dim, generator=g).to(dtype)
            energy = torch.zeros(1, 2, dim)
            step.attention_step(query, torch.ones(1, 1, capacity, dtype=torch.bool), sinks, sinks,
                                _adaptive_rows(kf, dim, 3), tail, values, positions, freqs, None, energy, energy,
                                state, pad=4, total_bits=4 * dim, clip_range=True, query_weights=weights,
                                rotation=min(dim, 128), scale=0.1)  # fmt: skip
        label[0] = "grown storage: 4 copies of rows"
        copy.copy_rows([(torch.zeros(1, 2, 5, 4, 16, dtype=torch.uint8)[:, :, :3], torch.zeros(1, 2, 9, 4, 16,
                         dtype=torch.uint8)) for _ in range(4)])  # fmt: skip
        for dim, intra in product(HEAD_DIMS, (False, True)):
            label[0] = f"head_dim {dim}, blocks of 16, intra {intra}"
            x = torch.randn(2, 3, 32, dim, generator=g)
            delta_encode.delta_encode_groups(x, x if intra else None, x[:, :, 0], 16)
        label[0] = "latent groups at 2-8 bits"
        bits = [8, 6, 5, 4, 3, 2, 0]
        packed = torch.zeros(5, sum(32 * b // 8 for b in bits), dtype=torch.uint8)
        latent.dequantize_latent(packed, torch.ones(5, 6, dtype=torch.float16), bits)
        evicting = (HEAD_DIMS, GROUPS, INPUT_DTYPES, (False, True), (True, False))
        for dim, group, dtype, masked, observe in product(*evicting):
            label[0] = (f"kept tokens, head_dim {dim}, {group} queries per kv head, {str(dtype).removeprefix('torch.')}"
                        f" queries, mask {masked}, SnapKV {observe}")  # fmt: skip
            slots = torch.zeros(1, 2, 50, dim, dtype=torch.float16)
            stream = KeptStream(slots, slots, torch.arange(50, dtype=torch.int32).expand(1, 2, 50), 3, 40)
            query = torch.randn(1, 2, group, dim, generator=g).to(dtype)
            mask = torch.ones(1, 1, 60, dtype=torch.bool) if masked else None
            sinks = torch.zeros(1, 2, 4, dim, dtype=dtype)
            out, observed = kept.kept_attention(query, sinks, sinks, stream, mask, 0.1, 0 if observe else None)
            pending = torch.zeros(1, 2, 1, dtype=torch.int64)
            kept.keep_rows(torch.randn(1, 2, 1, dim, generator=g).to(dtype), sinks[:, :, :1], stream, 49, 70, pending)
            kept.compact_kept(stream, pending, stream)
            if observe:  # (the observation's buffers were allocated by the recorded launch: contents irrelevant)
                kept.snapkv_evicted(stream, observed, 1, 8, 7)
        bits = (6, 0, 5, 4, 3, 0, 6, 5, 4, 4, 3, 2)  # a layer like the built-in compressor's: 2-6 bits, groups dropped
        for dim, group, dtype, rope, masked in product(HEAD_DIMS, GROUPS, INPUT_DTYPES, (True, False), (False, True)):
            label[0] = (f"residual, head_dim {dim}, {group} queries per kv head, {str(dtype).removeprefix('torch.')}"
                        f" tokens, RoPE {rope}, mask {masked}")  # fmt: skip
            heads = 3 if dim == 64 else 2  # (SmolLM2's three kv heads: one split program, padded to four)
            width = heads * dim
            latent_dims = (4 * 32, 5 * 32)  # the stored key and value components of `bits`
            decoders = torch.float16 if heads == 3 else torch.float32  # (a checkpoint's fp16, as SmolLM2's)
            coder = LatentCoder(torch.zeros(width), torch.zeros(width), torch.zeros(width, latent_dims[0]),
                                torch.zeros(width, latent_dims[1]), torch.zeros(latent_dims[0], width, dtype=decoders),
                                torch.zeros(latent_dims[1], width, dtype=decoders))  # fmt: skip
            codes = LatentStream(torch.zeros(1, 40, sum(4 * b for b in bits), dtype=torch.uint8),
                                 torch.zeros(1, 40, 9, dtype=torch.float16), bits)  # fmt: skip
            freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
            positions = torch.arange(8, 48, dtype=torch.int32)[None]
            order = torch.arange(dim) if masked else None
            window = torch.zeros(1, heads, 32, dim, dtype=torch.float16 if dtype == torch.float32 else dtype)
            raw = torch.randn(1, heads, 16, dim, generator=g).to(dtype)
            residual.write_raw(raw[:, :, :1], raw[:, :, :1], window, window, 20)
            residual.encode_latent_into(raw, raw, positions[:, :16] if rope else None, freqs if rope else None, order,
                                        coder, bits, codes, 24)  # fmt: skip
            angles = RopeAngles(positions, freqs) if rope else None
            query = torch.randn(1, heads, group, dim, generator=g).to(dtype)
            mask = torch.ones(1, 1, 64, dtype=torch.bool) if masked else None
            parts = [(window[:, :, :8], window[:, :, :8], 0), (window[:, :, :16], window[:, :, :16], 48)]
            residual.latent_stream_attention(query, parts, codes, coder, angles, order, 8, mask, 0.1)
        chunks = (("adaptive", 64), ("q4_0", 128), ("kivi", 64), ("kept", 64), ("residual", 64), ("adaptive", 256),
                  ("token-delta", 128))  # fmt: skip
        for (kind, dim), n, masked in product(chunks, (8, 64), (False, True)):  # chunks of queries (grid axis 2)
            label[0] = f"a chunk of {n} queries, {kind} keys, head_dim {dim}, 4 queries per kv head, mask {masked}"
            query = torch.randn(1, n, 8, dim, generator=g).transpose(1, 2).unflatten(1, (2, 4))  # as transformers
            mask = torch.ones(1, n, 300, dtype=torch.bool) if masked else None
            sinks = torch.zeros(1, 2, 4, dim, dtype=torch.float16)
            if kind == "adaptive":
                keys = _adaptive_layout(32, dim)
                values = RotatedCodec(PlainCodec("q4_0", search_scale=True))
                values.append(torch.randn(1, 2, 3 * 32, dim, generator=g))
                freqs = 10000.0 ** -(torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
                angles = RopeAngles(torch.arange(4, 4 + 3 * 32, dtype=torch.int32)[None], freqs)
                options = dict(rope=angles, mask=mask, scale=0.1, n_queries=n, causal_offset=40)
                adaptive_attention.adaptive_attention(query, sinks, sinks, keys, values.layout(), **options)
                append.add_query_energies(query.flatten(1, 2), None, 2, torch.zeros(1, 2, dim), 30, 32)
            elif kind in ("q4_0", "kivi"):
                keys = PlainCodec(kind) if kind == "q4_0" else ChannelGroupCodec("q4_1")
                keys.append(torch.randn(1, 2, 70, dim, generator=g))
                values = PlainCodec("q4_0")
                values.append(torch.randn(1, 2, 70, dim, generator=g))
                options = dict(rope=None, mask=mask, scale=0.1, n_queries=n, causal_offset=10)
                decode_attention.plain_attention(query, sinks, sinks, keys.layout(), values.layout(), **options)
            elif kind == "token-delta":
                keys = _token_delta_codec("q4_0_16")
                keys.append(torch.randn(1, 2, 70, dim, generator=g))
                values = RotatedCodec(PlainCodec("q4_0"))
                values.append(torch.randn(1, 2, 70, dim, generator=g))
                options = dict(rope=None, mask=mask, scale=0.1, n_queries=n, causal_offset=10)
                delta_attention.delta_attention(query, sinks, sinks, keys.layout(), values.layout(), **options)
            elif kind == "kept":
                slots = torch.zeros(1, 2, 50, dim, dtype=torch.float16)
                stream = KeptStream(slots, slots, torch.arange(50, dtype=torch.int32).expand(1, 2, 50), 3, 40)
                out, observed = kept.kept_attention(query, sinks, sinks, stream, mask, 0.1, n - 4, n, 40)
                kept.snapkv_evicted(stream, observed, 6, 8, 7)
            else:
                coder = LatentCoder(torch.zeros(2 * dim), torch.zeros(2 * dim), torch.zeros(2 * dim, 128),
                                    torch.zeros(2 * dim, 160), torch.zeros(128, 2 * dim),
                                    torch.zeros(160, 2 * dim))  # fmt: skip
                codes = LatentStream(torch.zeros(1, 40, sum(4 * b for b in bits), dtype=torch.uint8),
                                     torch.zeros(1, 40, 9, dtype=torch.float16), bits)  # fmt: skip
                parts = [(sinks, sinks, 0), (sinks, sinks, 44)]
                residual.latent_stream_attention(query, parts, codes, coder, None, None, 4, mask, 0.1, n, 40)
        for dtype, bias in product(INPUT_DTYPES, (False, True)):
            label[0] = f"{str(dtype).removeprefix('torch.')} weights, bias {bias}"
            wt = torch.randn(64, 96, generator=g).to(dtype)
            x = torch.randn(2, 64, generator=g).to(dtype)
            sparse_matvec.sparse_matvec(x, wt, torch.randn(96).to(dtype) if bias else None, None, 0.0)
    return sink


def _token_delta_codec(delta_format: str):
    """`DeltaKVCache(keys="token")`'s key codec: rotated, q8_0 keyframes every 32 tokens, mean references, intra."""
    from hf_deltakv.codecs import DeltaCodec, RotatedCodec

    return RotatedCodec(DeltaCodec(kf=32, delta_format=delta_format, keyframe_format="q8_0", reference="previous",
                                   intra=True, mean_reference=True))  # fmt: skip


def _adaptive_rows(group: int, dim: int, rows: int) -> tuple[torch.Tensor, ...]:
    """Empty storage of `rows` coded adaptive groups at 4 bits (planes, packed depths, low, step)."""
    return (torch.zeros(1, 2, rows, 4 * dim, group // 8, dtype=torch.uint8),
            torch.full((1, 2, rows, dim // 2), 0x44, dtype=torch.uint8),
            torch.zeros(1, 2, rows, dim, dtype=torch.float16),
            torch.zeros(1, 2, rows, dim, dtype=torch.float16))  # fmt: skip


def _adaptive_layout(group: int, dim: int):
    """An adaptive key stream of two coded groups and a raw tail, as the kernels read it (contents irrelevant)."""
    from hf_deltakv.kernels.layout import AdaptiveStream

    planes, depths, low, step = _adaptive_rows(group, dim, 2)
    tail = torch.zeros(1, 2, group - 4, dim, dtype=torch.float16)
    return AdaptiveStream(planes, depths, low, step, tail, group, 4, dim, 3 * group)


def _registers(asm: dict) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes or registers) as the target's tools report them: the AMD assembly's
    metadata, or `cuobjdump --dump-resource-usage` of the NVIDIA cubin (REG, and STACK + LOCAL: the bytes of
    per-thread local memory, where spills go)."""
    if "amdgcn" in asm:
        text = asm["amdgcn"]
        vgpr = re.search(r"\.vgpr_count:\s+(\d+)", text)
        spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", text)
        return (int(vgpr.group(1)) if vgpr else None), (int(spill.group(1)) if spill else None)
    cuobjdump = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if "cubin" not in asm or not cuobjdump.exists():
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "kernel.cubin"
        binary.write_bytes(asm["cubin"])
        done = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(binary)], capture_output=True, text=True)
    used = re.search(r"REG:(\d+)", done.stdout)
    local = [int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", done.stdout)]
    return (int(used.group(1)) if used else None), (sum(local) if local else None)


def compile_launch(launch: Launch, target: str) -> dict:
    """Compile one recorded launch for `target` as Triton's launcher would; a result row (an error is recorded)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, row = launch.fn, {"kernel": launch.kernel, "config": launch.config, "target": target}
    started = time.monotonic()
    try:
        gpu = GPUTarget(*TARGETS[target])
        backend = make_backend(gpu)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*launch.args, **launch.kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)
        registers, spills = _registers(compiled.asm)
        row.update(shared=int(compiled.metadata.shared), shared_limit=SHARED_LIMIT[target], registers=registers,
                   spills=spills, num_warps=int(compiled.metadata.num_warps), error=None)  # fmt: skip
    except Exception as error:  # recorded, not raised: the report lists every failure
        row.update(error=f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error) else ''}")
    row["seconds"] = round(time.monotonic() - started, 2)
    return row


_LAUNCHES: list[Launch] = []


def _compile_index(job: tuple[int, str]) -> dict:
    index, target = job
    return compile_launch(_LAUNCHES[index], target)


def compile_all(quick: bool, targets: list[str], jobs: int) -> list[dict]:
    """Every recorded launch compiled for every target, unique (kernel, arguments' types, constexprs) once each."""
    global _LAUNCHES
    unique, seen = [], set()
    for launch in launches(quick):
        key = (launch.kernel, repr([_kind(a) for a in launch.args]), repr(sorted(launch.kwargs.items())))
        if key not in seen:
            seen.add(key)
            unique.append(launch)
    _LAUNCHES = unique
    work = [(i, t) for i in range(len(unique)) for t in targets]
    if jobs <= 1:
        return [_compile_index(job) for job in work]
    with ProcessPoolExecutor(jobs) as pool:  # forked workers inherit the recorded launches
        return list(pool.map(_compile_index, work))


def _kind(value) -> str:
    return f"{value.dtype}" if isinstance(value, torch.Tensor) else f"{type(value).__name__}:{value}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a covering pass instead of every combination")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated of " + ", ".join(TARGETS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    parser.add_argument("--out", default=str(RESULTS / "triton_compile.json"), help="JSON of every row ('' for none)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("triton_compile: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        print(f"triton_compile: unknown targets {unknown}; known: {sorted(TARGETS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows = compile_all(args.quick, targets, args.jobs)
    failed = [r for r in rows if r["error"] or r["shared"] > r["shared_limit"]]
    import triton

    result = {
        "config": {
            "triton": triton.__version__,
            "torch": torch.__version__,
            "targets": targets,
            "quick": args.quick,
            "seconds": round(time.monotonic() - started, 1),
            "date": time.strftime("%Y-%m-%d"),
            "shared_limit": {t: SHARED_LIMIT[t] for t in targets},
        },
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in failed:
        reason = row["error"] or f"shared memory {row['shared']} B > {row['shared_limit']} B"
        print(f"FAILED {row['kernel']} [{row['config']}] on {row['target']}: {reason}")
    seconds = result["config"]["seconds"]
    print(f"triton_compile: {len(rows) - len(failed)} of {len(rows)} compiled within limits in {seconds} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
