"""The Cache classes users construct: validate arguments, build one compressed layer per model layer.

>>> from hf_deltakv import DeltaKVCache
>>> cache = DeltaKVCache(kf=32)                      # doctest: +SKIP
>>> model.generate(**inputs, cache=cache)           # doctest: +SKIP
>>> cache.bits_per_element()                        # doctest: +SKIP
4.9
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache

from .allocation import allocation_for
from .codecs.adaptive import GROUPS, AdaptiveChannelCodec
from .codecs.base import StreamCodec
from .codecs.basis import BASIS_VALUES, BasisCodec
from .codecs.channel import ChannelGroupCodec
from .codecs.delta import MAX_KF, DeltaCodec
from .codecs.plain import PlainCodec
from .codecs.rotation import RotatedCodec
from .layers import CompressedLayer, EvictingLayer, ForwardLog, PositionLog, StreamLayer
from .persist import (
    CACHE_FORMAT,
    model_signature,
    read_header,
    read_tensors,
    restore_state,
    same_model,
    state_of,
    write_file,
)
from .quant import FORMATS, SEARCHABLE_KINDS, get_format, nbytes_of
from .rope import RopeForm, find_rotary_embedding, probe_rope

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
        pre_rope: code keys before RoPE; needs `model`. Defaults to True when `model` is given and its RoPE is
            understood (`hf_deltakv.rope.probe_rope`; otherwise keys are coded after RoPE, with one warning).
    """

    options: dict | None = None  # the constructor's arguments but `model` (a cache of a named class can be saved)

    def __init__(self, sink_tokens: int = 0, model: nn.Module | None = None, pre_rope: bool | None = None) -> None:
        super().__init__(layers=[])
        self.sink_tokens = _check_sinks(sink_tokens)
        self._signature = model_signature(model) if isinstance(model, nn.Module) else None
        self.positions = PositionLog()
        self._layer_types: list[str] | None = None
        self._sliding_window: int | None = None
        self._chunk_size: int | None = None
        self._rope_forms: list[RopeForm | None] | None = None
        self._attention: str | None = None  # the model's attention implementation, when given the model
        self.forward = ForwardLog()  # the state when the current forward started (`_recover`)
        if pre_rope and model is None:
            raise ValueError("pre_rope=True needs the model: pass model=... (its RoPE is measured to undo it)")
        if model is not None:
            if not isinstance(model, nn.Module):
                raise ValueError(f"model must be a torch nn.Module, got {type(model).__name__}")
            self._layer_types = model_layer_types(model)
            self._attention = getattr(text_config(model), "_attn_implementation", None)
            self._sliding_window = getattr(text_config(model), "sliding_window", None)
            self._chunk_size = getattr(text_config(model), "attention_chunk_size", None)
            if pre_rope is None or pre_rope:
                self._rope_forms = rope_forms(model, required=bool(pre_rope))

    def _window(self, layer_idx: int) -> int | None:
        """The sliding window of layer `layer_idx` (None: full attention, or a model the cache was not told of). A
        chunked-attention layer keeps as much as a window of its chunk size, as transformers' own caches do (its
        queries never see further back; the mask draws the chunk boundaries)."""
        types = self._layer_types or []
        kind = types[layer_idx] if layer_idx < len(types) else None
        window = {"sliding_attention": self._sliding_window, "chunked_attention": self._chunk_size}.get(kind)
        return int(window) if window else None

    def _rope(self, layer_idx: int) -> RopeForm | None:
        """Layer `layer_idx`'s RoPE when its keys are coded before it (None: coded as given)."""
        if self._rope_forms is None or layer_idx >= len(self._rope_forms):
            return None
        return self._rope_forms[layer_idx]

    def _make_layer(self, layer_idx: int) -> StreamLayer:
        raise NotImplementedError

    @property
    def pre_rope(self) -> bool:
        """Whether some layer codes its keys before RoPE."""
        return self._rope_forms is not None and any(form is not None for form in self._rope_forms)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode new keys/values of layer `layer_idx` and return the reconstruction of all its cached tokens."""
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        if self._layer_types and layer_idx >= len(self._layer_types):
            raise ValueError(
                f"this cache was built for a model of {len(self._layer_types)} layers; layer {layer_idx} was asked "
                "(a cache serves the model it was built with)"
            )
        if layer_idx == 0:  # a forward starts: its starting state is kept until its last layer has been read
            self._recover()
            layers = len(self._layer_types) if self._layer_types else len(self.layers)
            per_layer = {index: layer._snapshot() for index, layer in enumerate(self.layers)}
            saved = [(self.positions, dict(vars(self.positions)))]  # the shared log, even before any layer exists
            saved += [entry for entries in per_layer.values() for entry in entries]
            self.forward.start(len(self.layers), saved, layers, per_layer)
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
            if getattr(self, "_record_past", None) is not None:
                self.layers[-1].activate_past_recording(**self._record_past)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _recover(self) -> None:
        """Undo a forward that stopped midway (an exception after some layers had updated, e.g. Ctrl-C in
        `generate`): when the layers disagree on how many tokens they hold, or fewer layers exist than the model has,
        every layer goes back to its state when that forward started, so the cache can be used again as if it had
        never run. Called where a forward starts (layer 0's update, what generate and the mask ask of layer 0
        first) and by operations on the whole cache, never between two layers of a running forward. (Without
        `model=` the layer count is known only once a forward has completed.) Whatever happens to the layers next,
        their updates take new snapshots rather than the forward's (`ForwardLog.claim`)."""
        self.forward.unclaimed = {}
        if self.forward.saved is None:
            return
        lengths = {layer.cumulative_length for layer in self.layers}
        expected = len(self._layer_types) if self._layer_types else None
        if len(lengths) <= 1 and (expected is None or len(self.layers) in (0, expected)):
            return
        count, saved = self.forward.saved
        StreamLayer._restore(saved)
        del self.layers[count:]
        self.forward.saved = None
        warnings.warn(
            "hf_deltakv: the last forward did not reach every layer of the model (stopped midway, or layers fed by "
            "hand); the cache is back to its state before that forward",
            RuntimeWarning,
            stacklevel=3,
        )

    def nbytes(self) -> int:
        """Bytes of all state held: every layer's packed storage, the shared position log, and, during a forward (or
        after one stopped midway), the state it replaced, kept to undo it; each storage once."""
        self._recover()
        before = [attributes for _, attributes in self.forward.saved[1]] if self.forward.saved else []
        return nbytes_of([[layer.held() for layer in self.layers], self.positions.tensors(), before])

    def _new_layer(self, layer_idx: int) -> StreamLayer:
        layer = self._make_layer(layer_idx)
        layer.forward, layer.layer_index = self.forward, layer_idx
        layer.notices = self.__dict__.setdefault("_notices", set())  # warnings given once per cache
        layer.attention_implementation = self._attention
        return layer

    def save(self, path: str | Path) -> Path:
        """Write this cache to one safetensors file (its state as held, plus a JSON header: class, options, the
        model's signature; checksummed), so that a long shared prompt is encoded once and reused, in this process or
        another: `type(cache).load(path, model=model)`. The file is `nbytes()` plus the header.

        >>> cache.save("prompt.safetensors")                              # doctest: +SKIP
        >>> again = DeltaKVCache.load("prompt.safetensors", model=model)  # doctest: +SKIP
        """
        self._recover()
        if self.options is None:
            raise ValueError(f"{type(self).__name__} is built from codec factories: save a cache of a named class")
        if self._signature is None:
            raise ValueError("save needs to know the model: build the cache with model=... (the file is tied to it)")
        tensors: dict[str, torch.Tensor] = {}
        skip = (nn.Module, RopeForm, PositionLog, ForwardLog, partial)
        layers = [state_of(layer, f"layers.{i}", tensors, skip) for i, layer in enumerate(self.layers)]
        if self.positions.ids is not None:
            tensors["positions.ids"] = self.positions.ids
        header = {"format": CACHE_FORMAT, "class": type(self).__name__, "options": self.options,
                  "model": self._signature, "rope": _rope_fingerprint(self._rope_forms), "layers": layers,
                  "positions": "positions.ids" if self.positions.ids is not None else None}  # fmt: skip
        return write_file(path, header, tensors)

    @classmethod
    def load(cls, path: str | Path, model: nn.Module, device: torch.device | str | None = None):
        """A cache saved by `save`, for `model` (the one it was saved for: refused otherwise, as is a file of another
        cache class, a file changed since it was written, or one that is not a saved cache); checked before anything
        is built. Tensors go to `device` (default: the model's)."""
        header, shapes = read_header(path)
        if header.get("format") != CACHE_FORMAT:
            raise ValueError(
                f"{path}: cache file format {header.get('format')!r}; this hf_deltakv reads {CACHE_FORMAT}"
            )
        if header.get("class") != cls.__name__:
            raise ValueError(f"{path} holds a {header.get('class')!r}, not a {cls.__name__}: load it with that class")
        if not isinstance(model, nn.Module):
            raise ValueError("load needs the model the cache was saved for (model=...)")
        if (differs := same_model(header.get("model") or {}, model)) is not None:
            raise ValueError(f"{path} was saved for another model ({differs})")
        options = header.get("options")
        if not isinstance(options, dict) or not isinstance(header.get("layers"), list):
            raise ValueError(f"{path}: its header has no options or layers")
        cache = cls(**options, model=model)  # the constructor checks the options
        if _rope_fingerprint(cache._rope_forms) != header.get("rope"):
            raise ValueError(f"{path} was saved with another RoPE measurement of the model: refused")
        layers = header["layers"]
        if len(layers) > (len(cache._layer_types or []) or len(layers)):
            raise ValueError(f"{path} holds {len(layers)} layers; the model has {len(cache._layer_types)}")
        _check_tensors(path, header, shapes)
        tensors = read_tensors(path, header)
        device = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
        for index, state in enumerate(layers):
            layer = cache._new_layer(index)
            restore_state(layer, state, tensors, device, LAZY_STATE)
            if layer.is_initialized:
                layer.device = device
            cache.layers.append(layer)
        if header.get("positions"):
            cache.positions.record(0, tensors["positions.ids"].shape[1], tensors["positions.ids"].to(device))
        lengths = {layer.cumulative_length for layer in cache.layers}
        if len(lengths) > 1 or (cache.positions.ids is not None and cache.positions.ids.shape[1] not in lengths):
            raise ValueError(f"{path}: its layers disagree on how many tokens they hold")
        return cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx == 0:  # what generate asks before a forward (a layer may ask for its own during one: Llama 4)
            self._recover()
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx == 0:
            self._recover()
        return super().get_mask_sizes(query_length, layer_idx)

    def crop(self, max_length: int) -> None:
        self._recover()
        super().crop(max_length)

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
        self.forward.saved, self.forward.unclaimed = None, {}

    def activate_past_recording(self, **kwargs) -> None:
        """Sliding layers keep what a crop back to the current forward needs (transformers' assisted decoding), also
        the layers created later. Keyword arguments (`recurrent_states_to_keep` since transformers 5.25) go to each
        layer as transformers passes them; attention layers have no recurrent state to keep."""
        self._record_past = dict(kwargs)
        super().activate_past_recording(**kwargs)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._recover()
        super().reorder_cache(beam_idx)
        self.positions.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._recover()
        super().batch_repeat_interleave(repeats)
        self.positions.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._recover()
        super().batch_select_indices(indices)
        self.positions.map_batch(lambda t: t[indices])


class CompressedKVCache(StreamCache):
    """A cache whose layers code keys and values with one codec each (`CompressedLayer`).

    Args:
        key_codec: factory of each layer's key codec, or a list of them, one per layer.
        value_codec: factory of each layer's value codec, or a list of them, one per layer.
        sink_tokens, model, pre_rope: see `StreamCache`.
    """

    def __init__(
        self,
        key_codec: Callable[[], StreamCodec] | list[Callable[[], StreamCodec]],
        value_codec: Callable[[], StreamCodec] | list[Callable[[], StreamCodec]],
        sink_tokens: int = 0,
        model: nn.Module | None = None,
        pre_rope: bool | None = None,
    ) -> None:
        super().__init__(sink_tokens, model, pre_rope)
        self._key_codec, self._value_codec = key_codec, value_codec

    def _make_layer(self, layer_idx: int) -> CompressedLayer:
        return CompressedLayer(
            _of_layer(self._key_codec, layer_idx, "key codecs"),
            _of_layer(self._value_codec, layer_idx, "value codecs"),
            self.sink_tokens,
            self._rope(layer_idx),
            self.positions,
            self._window(layer_idx),
        )


def _of_layer(factory, layer_idx: int, what: str):
    """Layer `layer_idx`'s factory: `factory` itself, or its entry when it is a list of one per layer."""
    if not isinstance(factory, list):
        return factory
    if layer_idx >= len(factory):
        raise ValueError(f"the cache has {what} for {len(factory)} layers; layer {layer_idx} has none")
    return factory[layer_idx]


# Attributes a layer gets at its first update (`StreamLayer.lazy_initialization`): a saved layer may carry them.
LAZY_STATE = frozenset({"dtype", "device", "batch_size", "kv_heads", "head_dim", "value_dim", "sink_dtype"})
SAFETENSORS_DTYPES = {"U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32"}


def _rope_fingerprint(forms: list[RopeForm | None] | None) -> list | None:
    """What a saved cache's RoPE was measured as (frequencies rounded; channel orders), to refuse another."""
    if forms is None:
        return None
    return [None if f is None else [[round(float(x), 6) for x in f.freqs],
                                     None if f.order is None else f.order.tolist()] for f in forms]  # fmt: skip


def _check_tensors(path, header: dict, shapes: dict) -> None:
    """The file's tensors are exactly those its header refers to, of allowed types, each layer's with its batch
    first (read from the file's header only)."""
    referenced = set()

    def collect(value) -> None:
        if isinstance(value, dict):
            for key in ("tensor",):
                if key in value:
                    referenced.add(value[key])
            if "quantized" in value:
                parts = ("codes", "scales", "mins") if value.get("mins") else ("codes", "scales")
                referenced.update(f"{value['quantized']}.{p}" for p in parts)
            if "counts" in value and isinstance(value["counts"], dict):
                referenced.update(f"{value['tensors']}.{k}" for k in value["counts"])
            for item in value.values():
                collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    collect(header["layers"])
    if header.get("positions"):
        referenced.add("positions.ids")
    if referenced != set(shapes):
        odd = sorted(referenced ^ set(shapes))[:3]
        raise ValueError(f"{path}: its tensors do not match its header ({odd})")
    for name, (dtype, shape) in shapes.items():
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has type {dtype}")
        if name.startswith("layers."):
            batch = header["layers"][int(name.split(".")[1])].get("batch_size")
            if not shape or shape[0] != batch:
                raise ValueError(f"{path}: tensor {name} of shape {shape} is not of the layer's batch {batch}")


def _codec(cls, rotate: bool = False, /, **options) -> Callable[[], StreamCodec]:
    """A picklable factory of a layer's codec (a cache holds factories: each layer gets its own codec)."""
    make = partial(cls, **options)
    return partial(RotatedCodec.around, make) if rotate else make


def text_config(model: nn.Module):
    """The decoder's config of `model` (the text config of a multimodal model)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_layer_types(model: nn.Module) -> list[str]:
    """The attention type of every layer (`SUPPORTED_LAYER_TYPES`); models whose cache is not keys and values of
    every layer are refused, with the reason."""
    text = text_config(model)
    if text is None:
        return []
    name = type(model).__name__
    if any("mamba" in key.lower() for key in vars(text)):
        raise ValueError(
            f"{name} interleaves attention with Mamba (state-space) layers, whose state is not keys and values: "
            "hf_deltakv caches serve attention-only models"
        )
    if getattr(text, "num_kv_shared_layers", 0):
        raise ValueError(
            f"{name}'s last {text.num_kv_shared_layers} layers reuse the keys and values of earlier layers (KV "
            "sharing), which hf_deltakv caches do not model: they serve models whose every layer has its own cache"
        )
    layer_types = getattr(text, "layer_types", None)
    if not layer_types:  # inferred as transformers' caches infer it: a window or chunk size applies to every layer
        kind = "full_attention"
        if getattr(text, "sliding_window", None) is not None:
            kind = "sliding_attention"
        elif getattr(text, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        layer_types = [kind] * text.num_hidden_layers
    for idx, kind in enumerate(layer_types):
        if kind not in SUPPORTED_LAYER_TYPES:
            raise ValueError(
                f"layer {idx} of {name} is of type {kind!r}, which hf_deltakv caches cannot hold (not softmax "
                f"attention over keys and values); supported: {SUPPORTED_LAYER_TYPES}"
            )
    return layer_types


def rope_forms(model: nn.Module, required: bool = False) -> list[RopeForm | None] | None:
    """Each layer's RoPE for pre-RoPE coding (`hf_deltakv.rope.probe_rope`), or None: keys coded as given. A model
    without RoPE needs nothing undone; one whose RoPE is not understood is coded after RoPE with a warning, or
    refused when pre-RoPE coding was asked for (`required`)."""
    if find_rotary_embedding(model) is None:  # keys without RoPE are coded as given: that is pre-RoPE already
        return None
    probe = probe_rope(model)
    if probe.forms is None:
        message = f"keys of {type(model).__name__} are coded after RoPE: its RoPE is not understood ({probe.reason})"
        if required:
            raise ValueError(f"pre_rope=True, but {message}")
        warnings.warn(f"hf_deltakv: {message}", RuntimeWarning, stacklevel=4)
    return probe.forms


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
        _check_flag("rotate", rotate)
        self.options = {"k_format": k_format, "v_format": v_format, "rotate": rotate, "sink_tokens": sink_tokens,
                        "pre_rope": pre_rope}  # fmt: skip
        super().__init__(
            _codec(PlainCodec, rotate, fmt=k_format),
            _codec(PlainCodec, rotate, fmt=v_format),
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
        self.options = {"k_format": k_format, "v_format": v_format, "sink_tokens": sink_tokens, "pre_rope": pre_rope}
        super().__init__(
            _codec(ChannelGroupCodec, fmt=k_format), _codec(PlainCodec, fmt=v_format), sink_tokens, model, pre_rope
        )


KEY_CODINGS = ("channel", "token")
DEFAULT_KEY_BITS, DEFAULT_VALUES = 4.0, "q4_0"  # DeltaKVCache's key bits per element and value format


class DeltaKVCache(CompressedKVCache):
    """Video-codec KV cache: tokens coded in groups of `kf` (a keyframe interval), bits placed where attention needs
    them.

    Keys, before RoPE when the model is given (`model=`), are coded per group of `kf` tokens and per channel, each
    channel at its own bit depth: `key_bits` bits per key element on average, placed by reverse water-filling on the
    channel's range times the mean squared query it meets (observed causally as attention reads the cache; see
    `codecs.adaptive`). Values are quantized per token (`values`, q4_0 by default) after a Hadamard rotation, each
    block's scale searched for the least error. The first `sink_tokens` tokens stay raw. See `docs/codec.md` for the
    measurements behind each default.

    `keys="token"` selects the earlier codec of the keys: a keyframe every `kf` tokens and closed-loop 4-bit deltas
    from the previous token's reconstruction (`delta_format`, `keyframe_format`, `reference`, `intra`,
    `mean_reference` apply to it only, and `values="delta"` codes values that way).

    Source idea: the Delta-KV llama.cpp fork; closed-loop prediction and bit allocation as in video codecs.

    Args:
        kf: tokens per group (8, 16, 32 or 64; for `keys="token"`, the keyframe interval, 1-4096).
        key_bits: mean bits per key element (`key_bits * head_dim` a whole number), or a list of one per layer.
        values: a block format name for values (per token: `q4_0`, or `q3_0` below 4 bits) or `"delta"`, or a list
            of format names, one per layer (spend the bits where a layer's values are sensitive); or `"basis-q3_0"`,
            `"basis-q4_0"`: each head's values in its own directions fitted on the prompt, per token falling back
            to that format's rotated blocks, in its bytes (`codecs.basis`; experimental: no kernel reads it yet).
        keys: `"channel"` (default) or `"token"` (see above).
        rotate: Hadamard-rotate values (and token-coded keys) before coding.
        search_scale: search each block's scale for the least error (values in the q4_0 family or q3_0).
        sink_tokens: first tokens kept raw.
        model: the model; enables pre-RoPE key coding and checks its layer types.
        pre_rope: code keys before RoPE (default: when `model` is given).
        query_weights: place the key bits by the queries' channel weights as well as the ranges (off: ranges
            alone; an ablation switch).
        clip_range: code each key channel of a group over the clipped range that reconstructs it best (off: from its
            minimum to its maximum; an ablation switch).
        bits: instead of `key_bits` and `values`, a mean number of bits per element (nominal: codes and side
            information), spent per layer where the model's calibration (`hf_deltakv.allocation`) says keys or
            values lose the most; needs `model`. `kf=64` leaves the most of them to the codes.
        key_ranges: how a key group's channel range is held: `"fp16"` (low and step) or `"grid8"` (a byte each for
            its low and high on a grid fitted on the prompt: 0.31 bits a key element of side information at kf=64
            instead of 0.56; experimental, coded by the reference: `kernels.key_grid`).

    >>> cache = DeltaKVCache(kf=32)
    >>> cache.kf
    32
    """

    def __init__(
        self,
        kf: int = 32,
        key_bits: float | list[float] = DEFAULT_KEY_BITS,
        values: str | list[str] = DEFAULT_VALUES,
        keys: str = "channel",
        rotate: bool = True,
        search_scale: bool = True,
        sink_tokens: int = 4,
        model: nn.Module | None = None,
        pre_rope: bool | None = None,
        query_weights: bool = True,
        clip_range: bool = True,
        delta_format: str | None = None,
        keyframe_format: str | None = None,
        reference: str | None = None,
        intra: bool | None = None,
        mean_reference: bool | None = None,
        bits: float | None = None,
        key_ranges: str = "fp16",
    ) -> None:
        if keys not in KEY_CODINGS:
            raise ValueError(f"keys must be one of {KEY_CODINGS}, got {keys!r}")
        if keys == "channel" and kf not in GROUPS:
            raise ValueError(f"kf must be one of {GROUPS} with keys='channel' (any of 1..{MAX_KF} with keys='token')")
        self.bits, self.calibration = bits, None
        if bits is not None:
            if keys != "channel" or key_bits != DEFAULT_KEY_BITS or values != DEFAULT_VALUES:
                raise ValueError("bits= chooses key_bits and values per layer (keys='channel'): give bits or those")
            if not isinstance(model, nn.Module):
                raise ValueError("bits= needs the model (model=...): the bits are allocated per layer")
            if key_ranges != "fp16":
                raise ValueError("bits= budgets fp16 key ranges: give key_bits and values with key_ranges")
            key_bits, values, self.calibration = allocation_for(model, bits, kf)
        key_bits, values = [list(x) if isinstance(x, tuple) else x for x in (key_bits, values)]
        layers = getattr(text_config(model), "num_hidden_layers", None) if isinstance(model, nn.Module) else None
        key_bits_of, values_of = _per_layer("key_bits", key_bits, layers), _per_layer("values", values, layers)
        if keys == "token" and isinstance(key_bits, list):
            raise ValueError("key_bits applies to keys='channel' only: it cannot be given per layer with keys='token'")
        if keys == "channel":
            for entry in key_bits_of:
                if isinstance(entry, bool) or not isinstance(entry, (int, float)) or not 1 <= entry <= 8:
                    raise ValueError(f"key_bits must be a number in [1, 8] (or a list of them), got {key_bits!r}")
        for name in ("rotate", "search_scale", "query_weights", "clip_range"):
            _check_flag(name, locals()[name])
        token_options = {
            "delta_format": delta_format,
            "keyframe_format": keyframe_format,
            "reference": reference,
            "intra": intra,
            "mean_reference": mean_reference,
        }
        given = sorted(name for name, value in token_options.items() if value is not None)
        if keys == "channel" and (given or "delta" in values_of):
            raise ValueError(f"{given or 'values=delta'} apply to keys='token' only")
        if keys == "token" and not (query_weights and clip_range and key_ranges == "fp16"):
            raise ValueError("query_weights, clip_range and key_ranges apply to keys='channel' only")
        defaults = TOKEN_DELTA_DEFAULTS
        token_options = {"kf": kf, **{k: defaults[k] if v is None else v for k, v in token_options.items()}}
        if keys == "channel":
            channel_options = {"group": kf, "offset": _check_sinks(sink_tokens), "query_weights": query_weights,
                               "clip_range": clip_range, "ranges": key_ranges}  # fmt: skip
            make_keys = [_codec(AdaptiveChannelCodec, bits=entry, **channel_options) for entry in key_bits_of]
            for make in make_keys:
                make()  # validate now, not at the first forward
        else:
            DeltaCodec(**token_options)
            make_keys = [_codec(DeltaCodec, rotate, **token_options)]
        make_values = []
        for fmt in values_of:
            if fmt == "delta":
                make_values.append(_codec(DeltaCodec, rotate, **token_options))
            elif isinstance(fmt, str) and fmt in FORMATS:
                search = search_scale and FORMATS[fmt].kind in SEARCHABLE_KINDS
                make_values.append(_codec(PlainCodec, rotate, fmt=fmt, search_scale=search))
            elif isinstance(fmt, str) and fmt in BASIS_VALUES:  # (rotates its fallback itself, scales searched)
                make_values.append(_codec(BasisCodec, fmt=BASIS_VALUES[fmt]))
            else:
                raise ValueError(f"values must be 'delta' or one of {sorted(FORMATS) + sorted(BASIS_VALUES)} (or a "
                                 f"list of them), got {values!r}")  # fmt: skip
        self.kf = kf
        self.options = {"kf": kf, "key_bits": key_bits, "values": values, "keys": keys, "rotate": rotate,
                        "search_scale": search_scale, "sink_tokens": sink_tokens, "pre_rope": pre_rope,
                        "query_weights": query_weights, "clip_range": clip_range, "delta_format": delta_format,
                        "keyframe_format": keyframe_format, "reference": reference, "intra": intra,
                        "mean_reference": mean_reference, "key_ranges": key_ranges}  # fmt: skip
        super().__init__(_one_or_each(make_keys, key_bits), _one_or_each(make_values, values), sink_tokens, model,
                         pre_rope)  # fmt: skip


def _per_layer(name: str, setting, layers: int | None) -> list:
    """The settings `setting` names: itself alone, or the entries of a list of one per layer (as many as the model's
    layers, when the model is known)."""
    if not isinstance(setting, list):
        return [setting]
    if not setting:
        raise ValueError(f"{name}: a list needs one entry per layer, got an empty one")
    if layers is not None and len(setting) != layers:
        raise ValueError(f"{name} has {len(setting)} entries; the model has {layers} layers")
    return setting


def _one_or_each(factories: list, setting):
    """The one factory of a setting given once, or the list of one per layer."""
    return factories if isinstance(setting, list) else factories[0]


# The token-delta key codec's options, used only with keys="token" (their one default).
TOKEN_DELTA_DEFAULTS = {
    "delta_format": "q4_0_16",
    "keyframe_format": "q8_0",
    "reference": "previous",
    "intra": True,
    "mean_reference": True,
}


class EvictionCache(StreamCache):
    """A cache that drops tokens instead of compressing them (the baseline users pick instead): full-precision (fp16)
    keys and values of `keep` of the tokens seen, chosen by `policy` (see `layers.evicting`).

    Args:
        policy: "streaming" (StreamingLLM: sinks + recent) or "snapkv" (SnapKV: most attended + recent).
        keep: fraction of the tokens seen kept, in (0, 1] (0.3: about the bytes of `DeltaKVCache`'s 4.9 bits).
        sink_tokens: first tokens always kept.
        window: recent tokens always kept (SnapKV: the queries it observes).
        kernel: SnapKV's pooling width over positions (odd).
        model: see `StreamCache` (keys are kept as given: there is nothing to code before RoPE).
    """

    def __init__(
        self,
        policy: str,
        keep: float = 0.3,
        sink_tokens: int = 0,
        window: int = 32,
        kernel: int = 7,
        model: nn.Module | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise ValueError(f"keep must be a fraction in (0, 1], got {keep!r}")
        for name, value in (("window", window), ("kernel", kernel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be odd (a window centred on each position), got {kernel}")
        EvictingLayer(policy, keep)  # validate the policy now
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") if model else "sdpa"
        if model is not None and getattr(text_config(model), "kv_lora_rank", None):
            raise ValueError(
                f"{type(model).__name__} caches compressed latents (multi-head latent attention) that it expands "
                "after reading them: an evicting cache needs attention to read the cache directly"
            )
        if implementation != "sdpa":
            raise ValueError(
                f"an evicting cache serves scaled_dot_product_attention only, and {type(model).__name__} runs "
                f"{implementation!r} attention (a dense history cannot say which tokens were dropped): load it with "
                "attn_implementation='sdpa' where the model allows"
            )
        self.options = {"policy": policy, "keep": keep, "sink_tokens": sink_tokens, "window": window, "kernel": kernel}
        self._layer_options = dict(self.options)
        super().__init__(sink_tokens, model, pre_rope=False)

    def _make_layer(self, layer_idx: int) -> EvictingLayer:
        return EvictingLayer(**self._layer_options)


class StreamingLLMCache(EvictionCache):
    """StreamingLLM (https://arxiv.org/abs/2309.17453): the first `sink_tokens` tokens and the most recent ones,
    `keep` of all tokens seen, in fp16.

    >>> cache = StreamingLLMCache(keep=0.3)
    """

    def __init__(self, keep: float = 0.3, sink_tokens: int = 4, model: nn.Module | None = None) -> None:
        super().__init__("streaming", keep, sink_tokens, window=1, model=model)
        self.options = {"keep": keep, "sink_tokens": sink_tokens}


class SnapKVCache(EvictionCache):
    """SnapKV-style (https://arxiv.org/abs/2404.14469): per kv head, the tokens the last `window` queries of each
    forward attended to most (pooled over `kernel` positions) and the `window` most recent, `keep` of all tokens
    seen, in fp16.

    >>> cache = SnapKVCache(keep=0.3)
    """

    def __init__(self, keep: float = 0.3, window: int = 32, kernel: int = 7, model: nn.Module | None = None) -> None:
        super().__init__("snapkv", keep, 0, window, kernel, model=model)
        self.options = {"keep": keep, "window": window, "kernel": kernel}


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def total_nbytes(cache, group=None) -> int:
    """`cache.nbytes()` summed over the ranks of `group` (default: all of them) when torch.distributed is initialized:
    under tensor parallelism each rank holds, and `nbytes()` counts, only its own KV heads. Every rank must call it
    (a collective); without a process group it is `cache.nbytes()`."""
    import torch.distributed as dist

    held = cache.nbytes()
    if not (dist.is_available() and dist.is_initialized()):
        return held
    total = torch.tensor([held], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(total, group=group)
    return int(total.item())


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective of `group` must live: NCCL's (and its ROCm twin's) communicate GPU memory only,
    the rank's current GPU; gloo and the others the CPU's."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
