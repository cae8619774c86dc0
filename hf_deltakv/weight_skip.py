"""Weight skip: during decoding, `nn.Linear` layers read only the weights of the input channels that matter.

Decoding one token reads every weight once, and the weights are most of what a decode step reads. An input channel
`i` of a linear layer contributes `x_i * W[:, i]` to its output; when that contribution is negligible, the column
`W[:, i]` need not be read. Three modes:

- `sparsity=s` (calibrated, after TEAL and WINA): channel `i` is skipped when `|x_i| * ||W[:, i]||` is below a
  threshold, a group's threshold at level `l` being the `l`-quantile of these scores on real activations (measured at
  the levels of `LEVELS`, interpolated between). `s` is the fraction of all selected weights left unread; it is spread
  over the projection kinds (q/k/v, o, gate/up, down, the output head: a group's name without its layer index) by a
  greedy allocation on the model's own output: calibration measures, per kind, the KL divergence of the logits from
  the plain model's when that kind alone skips at each of `CURVE_LEVELS`, and `allocate` raises, step by step, the
  level of the kind whose next step costs the least KL per weight left unread. This assumes the kinds' costs add up
  (they nearly do on SmolLM2), and pays because they differ by an order of magnitude: down_proj inputs are sparse,
  q/k/v inputs (after a norm) are not (the curves are in `SkipCalibration.kinds`). An allocation by each layer's own
  output error was tried first and doubled the KL: a layer's own error says little about what it does to the logits.
  Projections that read the same input (q/k/v, gate/up) are found during calibration and form one group: one
  threshold, one list of kept channels and one fused weight read per token. Calibrations are cached per model and can
  be saved and loaded (`SkipCalibration`).
- `threshold=t > 0` (the bound rule): blocks of `block_size` channels are skipped smallest bound first, the bound of a
  block being `block_size * max|w| * max|x|`, while the skipped bounds add up to at most `t` times their sum, which
  bounds every output's error. Kept as a reference point; it skips little before quality moves.
- `threshold=0` (exact): only channels that are zero in every sequence are skipped (the sums are the kernel's, in
  fp32: with bf16 weights the outputs differ from torch's matvec by rounding). With fp32 weights each layer is watched
  for its first `WATCH_CALLS` decode calls, and one whose zero channels would not pay for the kernel (fewer than
  `EXACT_BREAK_EVEN`) goes back to its own forward (no cost at all). With bf16/fp16 weights on the CPU the kernel
  beats torch's dense matvec even when it reads every row, so every layer takes it from the start.

Where the weights are not read: while enabled, each group's weights are stored input-major in one tensor `[in, out]`
(the parameters become views of it, so every other use of them is unchanged and no memory is added), and a
decode-shaped input (one new token per sequence, no gradients) goes to `kernels.sparse_matvec`: one pass that lists the
kept channels and streams only their rows (C++ on the CPU, Triton on GPUs). Other inputs take the layer's normal
path. Changes to the weights while enabled (`model.to(...)`, `load_state_dict`, replacing `.data`, in-place writes
under `no_grad`) are followed; in-place writes through `.data` are invisible to PyTorch (no version bump): re-enable;
`state_dict()` returns contiguous weights; `remove()` restores the layers with the weights they have then.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

__all__ = [
    "SkipCalibration",
    "SkipSimulator",
    "SkipStats",
    "WeightSkipHandle",
    "calibrate",
    "enable_weight_skip",
    "keep_mask",
]

LEVELS = tuple(round(0.05 * k, 2) for k in range(20))  # per-group sparsity levels calibrated: 0, 0.05, ... 0.95
CURVE_LEVELS = tuple(round(0.1 * k, 1) for k in range(1, 10))  # levels at which each kind's KL cost is measured
MAX_SPARSITY = CURVE_LEVELS[-1]  # the largest `sparsity=` (and per-kind level) the allocation can place
ALLOCATION_STEP = 0.025  # per-kind level increment of the greedy allocation
CALIBRATION_ROWS = 512  # activation rows per group whose scores set its thresholds
CALIBRATION_TOKENS = 1024  # default calibration text length, in tokens
CURVE_TOKENS = 512  # tokens of the first calibration window run per KL measurement (the last half scored)
CALIBRATION_VERSION = 5  # bumped when the calibration's meaning changes: older files are measured again
WATCH_CALLS = 2  # exact mode: decode calls a layer is watched for zero input channels before it settles (each
# watched call costs ~20 us per layer: 8 calls cost SmolLM2 4 % of a 24-token decode in fp32, 2 calls 1.3 %)
# Exact mode: the fraction of skipped (zero) channels from which the kernel beats the layer's dense matvec (fp32:
# between sparsity 0.25 and 0.4 in benchmarks/weight_skip.py, SmolLM2 and Gemma 3, 2 CPU cores). 0: always, on the
# CPU taken from the start without a watch (CPU dense bf16/fp16 matvecs are slower than the kernel reading every row).
EXACT_BREAK_EVEN = {torch.float32: 0.3, torch.bfloat16: 0.0, torch.float16: 0.0}


@dataclass
class SkipStats:
    """Counts for one module, summed over decode calls: input channels seen and skipped (their weights not read).
    On a GPU `channels_skipped` is summed on the device (a 0-dim tensor: a decoding step reads nothing back); it is
    read when asked for (`skipped_fraction`, the handle's `stats()`)."""

    calls: int = 0
    channels_seen: int = 0
    channels_skipped: int | torch.Tensor = 0

    @property
    def skipped_fraction(self) -> float:
        return int(self.channels_skipped) / self.channels_seen if self.channels_seen else 0.0

    def as_dict(self) -> dict:
        return {"calls": self.calls, "channels_seen": self.channels_seen,
                "channels_skipped": int(self.channels_skipped), "skipped_fraction": self.skipped_fraction}  # fmt: skip


class _Readback:
    """A count summed on the device, brought to the host without waiting for it: copied into pinned memory behind an
    event on a GPU, `value()` None until it has landed (on the CPU at once). `seen`: what it is a count out of."""

    def __init__(self, count: int | torch.Tensor, seen: int) -> None:
        self.seen, self.event, self.host = seen, None, count
        if isinstance(count, torch.Tensor) and count.device.type == "cuda":
            self.host = torch.empty((), dtype=count.dtype, pin_memory=True)
            self.host.copy_(count, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def value(self) -> int | None:
        if self.event is not None and not self.event.query():
            return None
        return int(self.host.numpy()) if isinstance(self.host, torch.Tensor) else int(self.host)


def block_max(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """max|t| over blocks of `block_size` along the last dimension (zero-padded): [..., blocks]."""
    pad = -t.shape[-1] % block_size
    if pad:
        t = F.pad(t, (0, pad))
    return t.abs().unflatten(-1, (-1, block_size)).amax(-1)


def keep_mask(bounds: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which blocks to compute, per row of `bounds` [rows, blocks]: skip smallest first while the skipped bounds sum
    to at most `threshold × total` (see module docstring). `threshold=0` skips only zero bounds."""
    if threshold == 0:
        return bounds > 0
    ordered, order = bounds.sort(dim=-1)
    budget = threshold * bounds.sum(-1, keepdim=True)
    skip_sorted = ordered.cumsum(-1) <= budget
    return ~torch.zeros_like(skip_sorted).scatter(-1, order, skip_sorted)


# --- calibration ----------------------------------------------------------------------------------------------------


def kind_of(group: str) -> str:
    """A group's projection kind: its name with the layer indices replaced by `*` (`model.layers.*.mlp.down_proj`)."""
    return re.sub(r"\.\d+\.", ".*.", group)


def _interpolate(levels: tuple[float, ...], values: list[float], level: float) -> float:
    """`values` (one per level, rising levels) at `level`, linear between the two nearest."""
    if level <= levels[0]:
        return values[0]
    below = min(max(i for i, v in enumerate(levels) if v <= level + 1e-12), len(levels) - 2)
    frac = (level - levels[below]) / (levels[below + 1] - levels[below])
    return (1 - frac) * values[below] + frac * values[below + 1]


@dataclass
class SkipCalibration:
    """Per group of projections reading the same input (named by its members joined with ","), the score threshold
    at each level of `LEVELS` (scores `|x_i| * ||W[:, i]||` of the group's stacked weights, on calibration text);
    per projection kind (`kind_of`), its share of the selected weights and the KL divergence of the model's logits
    when that kind alone skips at each of `CURVE_LEVELS`; and what it was measured on."""

    groups: dict[str, dict] = field(default_factory=dict)  # "a,b" -> {"thresholds": [per level]}
    kinds: dict[str, dict] = field(default_factory=dict)  # kind -> {"share": fraction of weights, "kl": [per level]}
    model: str = ""
    tokens: int = 0

    def members(self) -> list[list[str]]:
        return [key.split(",") for key in self.groups]

    def kind_levels(self, sparsity: float) -> dict[str, float]:
        """Per kind, the fraction of its input channels to skip so that `sparsity` of all the weights is left unread
        at the least summed KL: greedy, `ALLOCATION_STEP` at a time, to the kind whose next step costs the least KL
        per weight saved (its measured curve, linear between levels, 0 at 0)."""
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity <= MAX_SPARSITY:
            raise ValueError(f"sparsity must be a number in [0, {MAX_SPARSITY}], got {sparsity!r}")
        missing = {kind_of(key) for key in self.groups} - set(self.kinds)
        if missing:
            raise ValueError(f"the calibration has no measured KL for {sorted(missing)[:3]}; calibrate again")
        levels = (0.0, *CURVE_LEVELS)
        cost = {kind: [0.0, *entry["kl"]] for kind, entry in self.kinds.items()}
        placed = dict.fromkeys(self.kinds, 0.0)

        def price(kind: str) -> float:  # KL per weight saved of the kind's next step
            step = min(ALLOCATION_STEP, MAX_SPARSITY - placed[kind])
            now, after = (_interpolate(levels, cost[kind], placed[kind] + d) for d in (0.0, step))
            return (after - now) / (self.kinds[kind]["share"] * step)

        saved = 0.0
        while saved < sparsity - 1e-9 and (open_kinds := [k for k in placed if placed[k] < MAX_SPARSITY - 1e-9]):
            best = min(open_kinds, key=price)
            share = self.kinds[best]["share"]
            step = min(ALLOCATION_STEP, MAX_SPARSITY - placed[best], (sparsity - saved) / share)
            placed[best] += step
            saved += share * step
        return placed

    def allocate(self, sparsity: float) -> dict[str, float]:
        """Per-group score thresholds leaving `sparsity` of the selected weights unread on the calibration text, spread
        over the kinds by `kind_levels`."""
        placed = self.kind_levels(sparsity)
        return {
            key: _interpolate(LEVELS, group["thresholds"], placed[kind_of(key)]) for key, group in self.groups.items()
        }

    def save(self, path: str | Path) -> Path:
        """Write as JSON, atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        payload = {"version": CALIBRATION_VERSION, "levels": LEVELS, "curve_levels": CURVE_LEVELS, **asdict(self)}
        tmp.write_text(json.dumps(payload) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> SkipCalibration:
        """Read a saved calibration; one of another version, other levels or a malformed one is refused."""
        try:
            payload = json.loads(Path(path).read_text())
            if payload.pop("version", None) != CALIBRATION_VERSION:
                raise ValueError("it was made by another version of hf_deltakv; calibrate again")
            if tuple(payload.pop("levels", ())) != LEVELS or tuple(payload.pop("curve_levels", ())) != CURVE_LEVELS:
                raise ValueError("it was calibrated at other sparsity levels; calibrate again")
            calibration = cls(**payload)
            for key, group in calibration.groups.items():
                values = [float(v) for v in group["thresholds"]]
                if len(values) != len(LEVELS) or not all(math.isfinite(v) and v >= 0 for v in values):
                    raise ValueError(f"group {key!r} needs one finite, non-negative threshold per level")
                if values != sorted(values):
                    raise ValueError(f"group {key!r}: thresholds must rise with the level")
                if kind_of(key) not in calibration.kinds:
                    raise ValueError(f"group {key!r} has no measured kind")
            for kind, entry in calibration.kinds.items():
                share, kl = float(entry["share"]), [float(v) for v in entry["kl"]]
                if not 0 < share <= 1 or len(kl) != len(CURVE_LEVELS) or not all(math.isfinite(v) for v in kl):
                    raise ValueError(f"kind {kind!r} needs a share in (0, 1] and one finite KL per curve level")
            if calibration.kinds and abs(sum(float(e["share"]) for e in calibration.kinds.values()) - 1) > 1e-6:
                raise ValueError("the kinds' shares of the weights must add up to 1")
        except (OSError, TypeError, KeyError, ValueError, AttributeError) as error:
            raise ValueError(f"{path} is not a weight-skip calibration: {error}") from None
        return calibration


def _column_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W[:, i]||_2 of a linear weight `[out, in]`, fp32 `[in]`."""
    return weight.detach().float().pow(2).sum(0).sqrt()


@torch.no_grad()
def calibrate(model: nn.Module, names: list[str], tokens: torch.Tensor | None = None) -> SkipCalibration:
    """Group the named linears by shared input, measure every group's score thresholds at `LEVELS` and every kind's
    KL cost at `CURVE_LEVELS` on `tokens` [windows, length] or [length] (default: `CALIBRATION_TOKENS` tokens of
    Python's documentation, on every install): one forward per window for the thresholds, then one of the first
    `CURVE_TOKENS` per kind and curve level (5 × 9 on a Llama-style model with its head)."""
    named = dict(model.named_modules())
    if tokens is None:
        tokens = _default_tokens(model)
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    inputs: dict[str, list[int]] = {name: [] for name in names}  # per call, which input (a running count)
    last = {"input": None, "count": 0}  # the input of the latest call, held so that `is` stays meaningful

    def capture(module, args, name):
        if args[0] is not last["input"]:
            last["input"], last["count"] = args[0], last["count"] + 1
        inputs[name].append(last["count"])
        captured[name].append(args[0].detach())

    hooks = [named[name].register_forward_pre_hook(lambda m, args, name=name: capture(m, args, name)) for name in names]
    try:
        device = next(model.parameters()).device
        for window in tokens.reshape(-1, tokens.shape[-1]):
            model(window[None].to(device))
    finally:
        for hook in hooks:
            hook.remove()
        last["input"] = None
    calibration = SkipCalibration(model=_model_key(model), tokens=int(tokens.numel()))
    generator = torch.Generator().manual_seed(0)
    shared: dict[tuple, list[str]] = {}  # linears called in a row on the very same tensors (q/k/v, gate/up)
    for name in names:
        shared.setdefault(tuple(inputs[name]) or (name,), []).append(name)
    norms: dict[str, torch.Tensor] = {}
    for members in shared.values():
        x = torch.cat([c.reshape(-1, c.shape[-1]) for c in captured[members[0]]]).float()
        x = x[torch.randperm(len(x), generator=generator)[:CALIBRATION_ROWS]]
        key = ",".join(members)
        norms[key] = _group_norms(named, key)
        ordered = (x.abs() * norms[key]).flatten().sort().values
        thresholds = [float(ordered[int(level * (len(ordered) - 1))]) if level else 0.0 for level in LEVELS]
        calibration.groups[key] = {"thresholds": thresholds}
    captured.clear()
    calibration.kinds = _kind_costs(model, named, calibration, norms, tokens.reshape(-1, tokens.shape[-1])[0])
    return calibration


def _skipping_hook(scale: torch.Tensor, limit: float):
    """A forward pre-hook zeroing the input channels the kernel would not read (score `|x_i| * scale_i < limit`),
    each token on its own."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (x * (x.abs() * scale >= limit).to(x.dtype), *args[1:])

    return hook


def _group_norms(named: dict[str, nn.Module], key: str) -> torch.Tensor:
    """The score weights `||W[:, i]||` of a group (its members' weights stacked), as the calibration measured them."""
    return _column_norms(torch.cat([named[m].weight.detach() for m in key.split(",")]))


@contextmanager
def _skipping(named: dict[str, nn.Module], norms: dict[str, torch.Tensor], limits: dict[str, float]) -> Iterator[None]:
    """Weight skip's rule applied by hooks to every token of an ordinary forward (each token its own kept channels) in
    each group of `limits` (group key -> score threshold) while the context is open: what a skip costs, measured in one
    pass over a text. The calibration's KL curves and `SkipSimulator` use it."""
    hooks = []
    try:
        for key, limit in limits.items():
            members = [named[member] for member in key.split(",")]
            hook = _skipping_hook(norms[key].to(members[0].weight.device), limit)
            hooks += [member.register_forward_pre_hook(hook) for member in members]
        yield
    finally:
        for hook in hooks:
            hook.remove()


class SkipSimulator:
    """`enable_weight_skip(model, sparsity=s)`'s arithmetic on every token of an ordinary forward, to measure its
    quality on long texts in one pass per window (decoding applies the same rule one token at a time, through a
    kernel tested against the same rule): `with SkipSimulator(model).skipping(0.25): model(ids)`. The arguments are
    `enable_weight_skip`'s."""

    def __init__(
        self,
        model: nn.Module,
        modules: Iterable[str] | None = None,
        include_lm_head: bool = True,
        calibration: SkipCalibration | str | Path | torch.Tensor | None = None,
    ) -> None:
        names = _selected(model, modules, include_lm_head)
        self.calibration = _calibration(model, names, calibration)
        self._named = dict(model.named_modules())
        self._norms = {key: _group_norms(self._named, key) for key in self.calibration.groups}

    def skipping(self, sparsity: float) -> AbstractContextManager[None]:
        """A context in which the model's forwards skip as `enable_weight_skip(model, sparsity=sparsity)` decodes."""
        return _skipping(self._named, self._norms, self.calibration.allocate(sparsity))


def _kind_costs(
    model: nn.Module, named: dict, calibration: SkipCalibration, norms: dict[str, torch.Tensor], tokens: torch.Tensor
) -> dict[str, dict]:
    """Per kind: its share of the selected weights and the KL divergence of the logits from the plain model's when
    that kind alone skips at each of `CURVE_LEVELS`, on the first `CURVE_TOKENS` of `tokens`. Every token of a
    forward gets its own kept channels, as it would decoding one token at a time."""
    device = next(model.parameters()).device
    window = tokens[:CURVE_TOKENS][None].to(device)
    scored = max(1, window.shape[1] // 2)  # later positions: what a long context does to them

    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def logprobs() -> torch.Tensor:
        out = model(window, logits_to_keep=scored) if takes_keep else model(window)
        logits = out.logits if hasattr(out, "logits") else out
        if not isinstance(logits, torch.Tensor):
            raise ValueError("calibrating sparsity needs a model whose forward returns logits")
        return logits[:, -scored:].float().log_softmax(-1)

    plain = logprobs()
    by_kind: dict[str, list[str]] = {}
    for key in calibration.groups:
        by_kind.setdefault(kind_of(key), []).append(key)
    size = {key: sum(named[m].weight.numel() for m in key.split(",")) for key in calibration.groups}
    total = sum(size.values())
    kinds = {}
    for kind, keys in by_kind.items():
        kl = []
        for level in CURVE_LEVELS:
            limits = {key: _interpolate(LEVELS, calibration.groups[key]["thresholds"], level) for key in keys}
            with _skipping(named, norms, limits):
                skipped = logprobs()
            kl.append(float((plain.exp() * (plain - skipped)).sum(-1).mean()))
        kinds[kind] = {"share": sum(size[key] for key in keys) / total, "kl": kl}
    return kinds


def _default_tokens(model: nn.Module) -> torch.Tensor:
    from .eval.texts import load_text

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    except Exception as error:  # no config, no tokenizer files, no network
        raise ValueError(
            f"weight skip could not load this model's tokenizer to calibrate ({type(error).__name__}); "
            "pass calibration=<token ids [windows, length]> or a saved SkipCalibration"
        ) from None
    ids = tokenizer(load_text("python-docs")[: 40 * CALIBRATION_TOKENS], return_tensors="pt").input_ids[0]
    length = CALIBRATION_TOKENS // 2
    return ids[: len(ids) // length * length][:CALIBRATION_TOKENS].view(-1, length)


def _model_key(model: nn.Module, names: list[str] = ()) -> str:
    """A name for the calibration cache: the model's config, a probe of its weights and the selected modules."""
    config = model.config.to_json_string() if hasattr(model, "config") else type(model).__name__
    digest = hashlib.sha256(config.encode())
    digest.update(",".join(names).encode())
    for parameter in list(model.parameters())[:8]:
        flat = parameter.detach().flatten()
        digest.update(flat[:: max(flat.numel() // 64, 1)][:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _cache_path(model: nn.Module, names: list[str]) -> Path:
    root = os.environ.get("HF_DELTAKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_deltakv")
    return Path(root) / "weight_skip" / f"{_model_key(model, names)}.json"


# --- the hook -------------------------------------------------------------------------------------------------------


class _SkippingGroup:
    """Linears reading one input, with their weights stacked input-major in one tensor and one skip rule.

    Modes: "calibrated" (`score`: threshold of `|x_i| * ||W[:, i]||`), "bounded" (`threshold > 0`, one member),
    "exact" (`threshold == 0`, one member). A decode call of any member computes the whole group's outputs and keeps
    the other members' for their own call on the same input tensor (q/k/v, gate/up are called in a row)."""

    def __init__(
        self, members: list[tuple[str, nn.Linear]], threshold: float, block_size: int, score: float | None
    ) -> None:
        self.names = [name for name, _ in members]
        self.modules = [module for _, module in members]
        self.threshold, self.block_size, self.score_threshold = threshold, block_size, score
        self.mode = "calibrated" if score is not None else "bounded" if threshold > 0 else "exact"
        self.stats = SkipStats()  # every member's: a decode call of one computes them all
        self._widths = [module.out_features for module in self.modules]
        self._offsets = [sum(self._widths[:k]) for k in range(len(self.modules))]
        self._prepared_key = None
        self._pending: list = [None] * len(members)  # outputs kept for members not called yet: (input, version, out)
        self._settled = False  # exact mode: the watch is over and the kernel pays here
        self._watched: _Readback | None = None  # exact mode: the watch's count, on its way to the host
        self.patched: list[tuple[nn.Module, str, object]] = []
        for index, module in enumerate(self.modules):
            module._weight_skip = True
            # With accelerate's device_map hooks, `forward` moves inputs to the weight's device and then calls
            # `_old_forward`: patch that one so the hook keeps working.
            target = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
            plain = getattr(module, target)
            self.patched.append((module, target, plain))
            setattr(module, target, self._member_forward(index, plain))
            module._weight_skip_state_hook = module._register_state_dict_hook(_contiguous_weight)
        weight = self.modules[0].weight
        if self.mode == "exact" and weight.device.type == "cpu" and EXACT_BREAK_EVEN.get(weight.dtype) == 0.0:
            self._settled = True  # the kernel pays even with nothing to skip: no watch
        if self.mode != "exact" or self._settled:
            self._prepared()  # the input-major weights and the score weights, made now rather than by the first call

    # weights

    def _stacked_views(self) -> bool:
        """Whether the members' weights are still the views of one input-major tensor made by `_stack`."""
        base = self.modules[0].weight
        total = sum(self._widths)
        offset = 0
        for module in self.modules:
            w = module.weight
            if w.stride() != (1, total) or w.data_ptr() != base.data_ptr() + offset * w.element_size():
                return False
            if w.dtype != base.dtype or w.device != base.device:
                return False
            offset += w.shape[0]
        return True

    def _stack(self) -> torch.Tensor:
        """The group's weights as one `[in, out_total]` tensor, the parameters made views of it (again when
        something replaced them: `model.to(...)`, assigning `.data`)."""
        first = self.modules[0].weight
        if not self._stacked_views():
            stacked = torch.cat([m.weight.data for m in self.modules]).t().contiguous()
            offset = 0
            for module in self.modules:
                rows = module.weight.shape[0]
                module.weight.data = stacked[:, offset : offset + rows].t()
                offset += rows
            first = self.modules[0].weight
        total = sum(self._widths)
        return first.data.t().as_strided((first.shape[1], total), (total, 1))

    def _bias(self) -> torch.Tensor | None:
        biases = [m.bias for m in self.modules]
        if all(b is None for b in biases):
            return None
        return torch.cat(
            [
                b if b is not None else m.weight.new_zeros(m.weight.shape[0])
                for m, b in zip(self.modules, biases, strict=True)
            ]
        )

    def _version_key(self) -> tuple:
        """What `_prepared` depends on: each weight's and bias's identity, storage and version (the members' weights
        are views of one tensor and share its version counter)."""
        key = []
        for module in self.modules:
            weight, bias = module._parameters["weight"], module._parameters["bias"]
            key += (id(weight), weight.data_ptr(), weight._version, id(bias), -1 if bias is None else bias._version)
        return tuple(key)

    def _prepared(self) -> tuple:
        """(stacked weight, bias, score weights, kernel), made again only when a weight or bias changed (replaced,
        moved, cast or written in place): checked on every call, so it costs a few comparisons."""
        if self._version_key() != self._prepared_key:
            wt = self._stack()
            derived = None
            if self.mode == "calibrated":
                derived = _column_norms(wt.t()).contiguous()
            elif self.mode == "bounded":
                derived = block_max(wt.t().detach(), self.block_size).amax(0).float()
            kernel = kernels.sparse_matvec_kernel(wt.device) or kernels.reference.sparse_matvec
            self._prepared_value = (wt, self._bias(), derived, kernel)
            self._prepared_key = self._version_key()
        return self._prepared_value

    # calls

    def _member_forward(self, index: int, plain):
        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if args or kwargs or x.dim() < 2 or x.shape[-2] != 1 or torch.is_grad_enabled():
                return plain(x, *args, **kwargs)
            if self.mode == "exact":
                return self._watch(index, x, plain)
            pending = self._pending[index]
            if pending is not None:
                self._pending[index] = None
                if pending[0] is x and pending[1] == x._version:
                    return pending[2]
            return self._compute(index, x, plain)

        return forward

    def _compute(self, index: int, x: torch.Tensor, plain) -> torch.Tensor:
        wt, bias, derived, kernel = self._prepared()
        if x.dtype != wt.dtype:
            return plain(x)
        if self.mode == "calibrated":
            out, kept = kernel(x, wt, bias, derived, self.score_threshold)
        elif self.mode == "bounded":
            flat = x.reshape(-1, x.shape[-1])
            bounds = self.block_size * derived * block_max(flat.float(), self.block_size)
            keep = keep_mask(bounds, self.threshold).any(0)
            columns = keep.repeat_interleave(self.block_size)[: flat.shape[-1]]
            out, kept = kernel(x * columns.to(x.dtype), wt, bias, None, 0.0)
        else:
            out, kept = kernel(x, wt, bias, None, 0.0)
        stats = self.stats
        stats.calls += 1
        stats.channels_seen += x.shape[-1]
        stats.channels_skipped += x.shape[-1] - kept
        if len(self.modules) == 1:
            return out
        version = x._version
        for other, (offset, width) in enumerate(zip(self._offsets, self._widths, strict=True)):
            if other != index:
                self._pending[other] = (x, version, out.narrow(-1, offset, width))
        return out.narrow(-1, self._offsets[index], self._widths[index])

    def _watch(self, index: int, x: torch.Tensor, plain) -> torch.Tensor:
        """Exact mode (one member): skip only channels that are zero in every sequence, once the watch showed that
        enough of them are (see `EXACT_BREAK_EVEN`); otherwise step aside."""
        if self._settled:
            return self._compute(index, x, plain)
        kept = (x.reshape(-1, x.shape[-1]) != 0).any(0).sum()  # summed on the device; read once, at the decision
        stats = self.stats
        stats.calls += 1
        stats.channels_seen += x.shape[-1]
        stats.channels_skipped += x.shape[-1] - kept
        if stats.calls >= WATCH_CALLS and self._watched is None:
            self._watched = _Readback(stats.channels_skipped, stats.channels_seen)
        skipped = None if self._watched is None else self._watched.value()
        if skipped is not None:  # (on a GPU a call or two later: the decision never waits for the device)
            fraction = skipped / self._watched.seen
            if fraction > 0 and fraction >= EXACT_BREAK_EVEN.get(x.dtype, 0.0):
                self._settled = True
                self._stack()
            else:
                self._unpatch()  # too little to skip here: out of the way
        return plain(x)

    def _unpatch(self) -> None:
        for module, target, plain in self.patched:
            setattr(module, target, plain)
            if target == "forward":
                del module.forward  # back to the class's forward
        self.patched = []

    def remove(self) -> None:
        self._unpatch()
        self._pending = [None] * len(self.modules)
        for module in self.modules:
            module._weight_skip = False
            module._weight_skip_state_hook.remove()
            if not module.weight.is_contiguous():
                module.weight.data = module.weight.data.contiguous()  # the weights as they are now


def _contiguous_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict() of a layer with weight skip: its weight as a contiguous tensor (what savers expect)."""
    key = prefix + "weight"
    if key in state_dict and not state_dict[key].is_contiguous():
        state_dict[key] = state_dict[key].contiguous()


class WeightSkipHandle:
    """Returned by `enable_weight_skip`: `.stats()`, `.remove()`, `.calibration`, `.groups`, and a context manager
    that removes on exit."""

    def __init__(self, groups: list[_SkippingGroup], calibration: SkipCalibration | None) -> None:
        self._groups = groups
        self._removed = False
        self.calibration = calibration

    @property
    def groups(self) -> list[list[str]]:
        """The module names of each group (projections sharing their input and their kept channels)."""
        return [list(g.names) for g in self._groups]

    def stats(self) -> dict[str, dict]:
        """Per module name: calls, channels_seen, channels_skipped, skipped_fraction; plus `total` (weighted by each
        module's output width: the fraction of the weights not read)."""
        out = {}
        total = SkipStats()
        for group in self._groups:
            s = group.stats
            for name, module in zip(group.names, group.modules, strict=True):
                out[name] = s.as_dict()
                total.calls += s.calls
                total.channels_seen += s.channels_seen * module.out_features
                total.channels_skipped += s.channels_skipped * module.out_features
        out["total"] = total.as_dict()
        return out

    def remove(self) -> None:
        """Restore every module's forward and weight layout (the stats stay readable). Idempotent."""
        if not self._removed:
            for group in self._groups:
                group.remove()
        self._removed = True

    def __enter__(self) -> WeightSkipHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def enable_weight_skip(
    model: nn.Module,
    sparsity: float | None = None,
    threshold: float | None = None,
    block_size: int = 32,
    modules: Iterable[str] | None = None,
    include_lm_head: bool = True,
    calibration: SkipCalibration | str | Path | torch.Tensor | None = None,
) -> WeightSkipHandle:
    """Make the selected `nn.Linear` modules of `model` skip negligible input channels on decode-shaped inputs.

    Args:
        model: any module tree (a transformers model for the default calibration text).
        sparsity: fraction of the selected weights to leave unread, calibrated (see the module docstring).
        threshold: the bound rule's relative budget in [0, 1); 0 (the default when `sparsity` is not given) is exact.
        block_size: input channels per block of the bound rule.
        modules: names (as in `model.named_modules()`) to patch; default every `nn.Linear`.
        include_lm_head: patch the output head too (`lm_head`, or whatever `get_output_embeddings()` returns): it is
            a fifth of SmolLM2's weights and most of Gemma-3-270M's, read once per token like the others.
        calibration: for `sparsity`: a `SkipCalibration`, a saved one's path, or calibration token ids
            `[windows, length]`; default: this model's cached calibration, made (and cached) on first use.

    Returns:
        a handle with `.stats()` and `.remove()`, usable as a context manager.
    """
    if sparsity is not None and threshold is not None:
        raise ValueError("pass sparsity (calibrated) or threshold (bound rule), not both")
    if sparsity is not None and (isinstance(sparsity, bool) or not isinstance(sparsity, (int, float))):
        raise ValueError(f"sparsity must be a number in [0, {MAX_SPARSITY}], got {sparsity!r}")
    if sparsity is None and calibration is not None:
        raise ValueError("calibration is used with sparsity=; the threshold modes need none")
    threshold = 0.0 if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a number in [0, 1), got {threshold!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    names = _selected(model, modules, include_lm_head)
    named = dict(model.named_modules())
    found = None
    if sparsity is not None:
        found = _calibration(model, names, calibration)
        allocation = found.allocate(float(sparsity))
        groups = [
            _SkippingGroup([(n, named[n]) for n in members], 0.0, block_size, allocation[",".join(members)])
            for members in found.members()
        ]
    else:
        groups = [_SkippingGroup([(n, named[n])], float(threshold), block_size, None) for n in names]
    return WeightSkipHandle(groups, found)


def _selected(model: nn.Module, modules: Iterable[str] | None, include_lm_head: bool) -> list[str]:
    named = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if modules is None:
        names = [n for n, m in named.items() if isinstance(m, nn.Linear) and (include_lm_head or m is not head)]
    else:
        names = list(modules)
        for name in names:
            if name not in named:
                raise ValueError(f"no module named {name!r} in the model")
            if not isinstance(named[name], nn.Linear):
                raise TypeError(f"{name!r} is a {type(named[name]).__name__}, not an nn.Linear")
        if include_lm_head and head is not None:
            names += [n for n, m in named.items() if m is head and n not in names]
    for name in names:
        if getattr(named[name], "_weight_skip", False):
            raise ValueError(f"weight skip is already enabled on {name!r}; remove the other handle first")
    return names


def _calibration(model: nn.Module, names: list[str], given) -> SkipCalibration:
    """The calibration to use for `names`: the one given (checked to cover exactly these modules), or the cached
    one, or a new one (then cached)."""
    if isinstance(given, (str, Path)):
        given = SkipCalibration.load(given)
    if isinstance(given, torch.Tensor):
        return calibrate(model, names, given)
    if isinstance(given, SkipCalibration):
        covered = sorted(n for members in given.members() for n in members)
        if covered != sorted(names):
            missing = sorted(set(names) - set(covered))
            extra = sorted(set(covered) - set(names))
            raise ValueError(
                f"the calibration does not match the selected modules (missing {missing[:3]}, extra {extra[:3]}); "
                "calibrate for these modules"
            )
        return given
    if given is not None:
        raise TypeError(f"calibration must be a SkipCalibration, a path or token ids, got {type(given).__name__}")
    path = _cache_path(model, names)
    if path.is_file():
        try:
            return SkipCalibration.load(path)
        except ValueError:
            pass  # another version's file, or damaged: measure again
    made = calibrate(model, names)
    try:
        made.save(path)
    except OSError:  # a read-only cache: calibrate again next time
        pass
    return made
