"""The Cache classes users construct: validate arguments, build one compressed layer per model layer.

>>> from hf_deltakv import DeltaKVCache
>>> cache = DeltaKVCache(kf=32)                      # doctest: +SKIP
>>> model.generate(**inputs, cache=cache)           # doctest: +SKIP
>>> cache.bits_per_element()                        # doctest: +SKIP
4.9
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers.cache_utils import Cache

from .codecs.base import StreamCodec
from .codecs.channel import ChannelGroupCodec
from .codecs.delta import DeltaCodec
from .codecs.plain import PlainCodec
from .codecs.rotation import RotatedCodec
from .formats import FORMATS, get_format
from .layers import CompressedLayer, PositionLog, StreamLayer
from .rope import RopeInverter, find_rotary_embedding

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _check_sinks(sink_tokens: int) -> int:
    if not isinstance(sink_tokens, int) or isinstance(sink_tokens, bool) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")
    return sink_tokens


class StreamCache(Cache):
    """Base of every hf_deltakv cache: a list of `StreamLayer`s created as the model reaches them.

    Args:
        sink_tokens: first tokens kept raw (attention sinks), counted in the bytes.
        model: the model the cache serves. Optional; with it, keys can be coded before RoPE (when `pre_rope`) and
            layer types the cache cannot serve are refused up front.
        pre_rope: code keys before RoPE; needs `model`. Defaults to True when `model` is given.
    """

    def __init__(self, sink_tokens: int = 0, model: nn.Module | None = None, pre_rope: bool | None = None) -> None:
        super().__init__(layers=[])
        self.sink_tokens = _check_sinks(sink_tokens)
        self.positions = PositionLog()
        self._layer_types: list[str] | None = None
        self._rotary = None
        if pre_rope and model is None:
            raise ValueError("pre_rope=True needs the model: pass model=... (its rotary embedding undoes RoPE)")
        if model is not None:
            if not isinstance(model, nn.Module):
                raise ValueError(f"model must be a torch nn.Module, got {type(model).__name__}")
            self._layer_types = model_layer_types(model)
            if pre_rope is None or pre_rope:
                self._rotary = find_rotary_embedding(model)
                if self._rotary is None and pre_rope:
                    raise ValueError(f"pre_rope=True but {type(model).__name__} has no *RotaryEmbedding module")

    def _rope(self, layer_idx: int) -> RopeInverter | None:
        if self._rotary is None:
            return None
        layer_type = self._layer_types[layer_idx] if self._layer_types else None
        return RopeInverter(self._rotary, layer_type)

    def _make_layer(self, layer_idx: int) -> StreamLayer:
        raise NotImplementedError

    @property
    def pre_rope(self) -> bool:
        return self._rotary is not None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode new keys/values of layer `layer_idx` and return the reconstruction of all its cached tokens."""
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        while len(self.layers) <= layer_idx:
            self.layers.append(self._make_layer(len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def nbytes(self) -> int:
        """Bytes of all state held: every layer's packed storage plus the shared position log."""
        return sum(layer.nbytes() for layer in self.layers) + self.positions.nbytes()

    def bits_per_element(self) -> float:
        """8 × nbytes() / number of cached key and value scalars."""
        n = sum(layer.num_elements() for layer in self.layers)
        return 8 * self.nbytes() / n if n else 0.0

    def fp16_nbytes(self) -> int:
        """What the same tokens would take in an fp16 cache, for ratios."""
        return 2 * sum(layer.num_elements() for layer in self.layers)

    def reset(self) -> None:
        super().reset()
        self.positions.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.positions.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.positions.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.positions.map_batch(lambda t: t[indices])


class CompressedKVCache(StreamCache):
    """A cache whose layers code keys and values with one codec each (`CompressedLayer`).

    Args:
        key_codec: factory of each layer's key codec.
        value_codec: factory of each layer's value codec.
        sink_tokens, model, pre_rope: see `StreamCache`.
    """

    def __init__(
        self,
        key_codec: Callable[[], StreamCodec],
        value_codec: Callable[[], StreamCodec],
        sink_tokens: int = 0,
        model: nn.Module | None = None,
        pre_rope: bool | None = None,
    ) -> None:
        super().__init__(sink_tokens, model, pre_rope)
        self._key_codec, self._value_codec = key_codec, value_codec

    def _make_layer(self, layer_idx: int) -> CompressedLayer:
        return CompressedLayer(
            self._key_codec, self._value_codec, self.sink_tokens, self._rope(layer_idx), self.positions
        )


def _maybe_rotated(codec: StreamCodec, rotate: bool) -> StreamCodec:
    return RotatedCodec(codec) if rotate else codec


def model_layer_types(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    for idx, kind in enumerate(layer_types):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"layer {idx} of {type(model).__name__} is of type {kind!r}, which hf_deltakv caches cannot hold; "
                f"supported: {SUPPORTED_LAYER_TYPES}"
            )
    return layer_types


class QuantizedKVCache(CompressedKVCache):
    """llama.cpp-style quantized KV cache (`-ctk/-ctv`): every token quantized on its own, per block of 32.

    Args:
        k_format: block format of keys (`q4_0`, `q4_1`, `q8_0`, `f16`).
        v_format: block format of values.
        rotate: Hadamard-rotate head vectors before quantizing, as current llama.cpp does.
        sink_tokens, model, pre_rope: see `CompressedKVCache`.

    >>> cache = QuantizedKVCache(k_format="q8_0", v_format="q4_0")
    """

    def __init__(
        self,
        k_format: str = "q4_0",
        v_format: str = "q4_0",
        rotate: bool = False,
        sink_tokens: int = 0,
        model: nn.Module | None = None,
        pre_rope: bool | None = False,
    ) -> None:
        get_format(k_format), get_format(v_format)
        super().__init__(
            lambda: _maybe_rotated(PlainCodec(k_format), rotate),
            lambda: _maybe_rotated(PlainCodec(v_format), rotate),
            sink_tokens,
            model,
            pre_rope,
        )


class KIVIKVCache(CompressedKVCache):
    """KIVI-style layout: keys quantized per channel over groups of 32 tokens, values per token.

    Tokens of an unfinished key group stay in fp16 until the group fills (counted in the bytes).
    Paper: KIVI, https://arxiv.org/abs/2402.02750.

    Args:
        k_format: format applied along the token axis of each key channel (`q4_1`: KIVI's asymmetric 4-bit).
        v_format: per-token format of values.
        sink_tokens, model, pre_rope: see `CompressedKVCache` (`pre_rope=True` quantizes keys before RoPE).

    >>> cache = KIVIKVCache()
    """

    def __init__(
        self,
        k_format: str = "q4_1",
        v_format: str = "q4_1",
        sink_tokens: int = 0,
        model: nn.Module | None = None,
        pre_rope: bool | None = False,
    ) -> None:
        get_format(v_format)
        ChannelGroupCodec(k_format)
        super().__init__(
            lambda: ChannelGroupCodec(k_format), lambda: PlainCodec(v_format), sink_tokens, model, pre_rope
        )


class DeltaKVCache(CompressedKVCache):
    """Video-codec KV cache: a keyframe every `kf` tokens, every other token a closed-loop 4-bit delta.

    Keys are delta-coded (neighbouring keys share their large per-channel components, which a delta removes);
    values, which carry no such structure, are quantized per token by default (`values="q4_0"`); pass
    `values="delta"` to delta-code them too, or a dict of `DeltaCodec` options for separate settings. Head vectors
    are Hadamard-rotated before coding, each delta block may fall back to plain coding (`intra`), the first
    `sink_tokens` tokens stay raw, and with `model=` keys are coded before RoPE. See `docs/codec.md` for the
    measurements behind each default.

    Source idea: the Delta-KV llama.cpp fork; closed-loop prediction as in video codecs (DPCM).

    Args:
        kf: keyframe interval in tokens (>= 1).
        delta_format: block format of key deltas: 4-bit codes with one fp16 scale per 16 channels (`q4_0_16`) by
            default; any of `hf_deltakv.quant.FORMATS`.
        keyframe_format: block format of keyframes.
        reference: `"previous"` (closed loop on the previous token) or `"keyframe"`.
        intra: per block of channels, code against the long-term reference when that reconstructs better (the flag
            bit rides in the scale's lowest mantissa bit).
        mean_reference: the long-term reference is the stream's running mean (snapshotted, causal), else zero.
        values: `"delta"`, a block format name for plain per-token values, or a dict of `DeltaCodec` options.
        rotate: Hadamard-rotate head vectors before coding.
        sink_tokens: first tokens kept raw.
        model: the model; enables pre-RoPE key coding and checks its layer types.
        pre_rope: code keys before RoPE (default: when `model` is given).

    >>> cache = DeltaKVCache(kf=32)
    >>> cache.kf
    32
    """

    def __init__(
        self,
        kf: int = 32,
        delta_format: str = "q4_0_16",
        keyframe_format: str = "q8_0",
        reference: str = "previous",
        intra: bool = True,
        mean_reference: bool = True,
        values: str | dict = "q4_0",
        rotate: bool = True,
        sink_tokens: int = 4,
        model: nn.Module | None = None,
        pre_rope: bool | None = None,
    ) -> None:
        key_options = {
            "kf": kf,
            "delta_format": delta_format,
            "keyframe_format": keyframe_format,
            "reference": reference,
            "intra": intra,
            "mean_reference": mean_reference,
        }
        DeltaCodec(**key_options)  # validate now, not at the first forward
        if isinstance(values, dict):
            value_options = {**key_options, **values}
            DeltaCodec(**value_options)
            make_values = partial(DeltaCodec, **value_options)
        elif values == "delta":
            make_values = partial(DeltaCodec, **key_options)
        elif isinstance(values, str) and values in FORMATS:
            make_values = partial(PlainCodec, values)
        else:
            raise ValueError(
                f"values must be 'delta', a dict of DeltaCodec options or one of {sorted(FORMATS)}, got {values!r}"
            )
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate must be True or False, got {rotate!r}")
        self.kf = kf
        self.options = {**key_options, "values": values, "rotate": rotate, "sink_tokens": sink_tokens}
        super().__init__(
            lambda: _maybe_rotated(DeltaCodec(**key_options), rotate),
            lambda: _maybe_rotated(make_values(), rotate),
            sink_tokens,
            model,
            pre_rope,
        )
