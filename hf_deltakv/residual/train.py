"""Train a residual compressor for a frozen model: next-token loss through the coded cache + reconstruction error.

Each step reads one window of the training text through `TrainingCache`, which returns every layer's keys and
values as the cache would store them (`code_window`, straight-through quantization), so the language-model loss
sees the compressed cache; the loss is that next-token loss + `mse_weight` × the mean relative reconstruction error
(DeltaKV weighs them 1:1). The next-token loss is, by default, the KL divergence from the uncompressed model's
own predictions (`loss="kl"`): with DeltaKV's cross-entropy on the text (`loss="ce"`), the learned cache also
adapts the frozen model to the training text (on WikiText-2 it beat the uncompressed model by 0.1 nats within 20
steps), which is fine-tuning, not compression, and would flatter perplexity on text like the training text.

The encoder/decoder start from `fit_compressor` and only they are trained; the bit allocation stays fixed. The
last `validation_windows` windows of the text are held out: their KL divergence is logged before the first step
and at every save. Every `save_every` steps the compressor, the optimizer and the step are saved in `out_dir`
(safetensors + JSON), so an interrupted run resumes where it stopped; `loss_log.jsonl` gets one line per step
(and one per validation).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from ..cache import rope_forms
from ..rope import RopeForm
from .checkpoint import load_compressor, save_compressor
from .compressor import ResidualCompressor, ResidualLayout
from .fit import SENSITIVITY_WINDOWS, fit_compressor
from .window import code_window

STATE_NAME = "training_state.json"
OPTIMIZER_NAME = "optimizer.safetensors"
LOG_NAME = "loss_log.jsonl"


class TrainingCache(DynamicCache):
    """A one-forward cache that hands attention the differentiable reconstruction of each layer's window."""

    def __init__(
        self, compressor: ResidualCompressor, layout: ResidualLayout, forms: list[RopeForm | None] | None
    ) -> None:
        super().__init__()
        self.compressor, self.layout = compressor, layout
        self.forms = forms  # each layer's RoPE (`cache.rope_forms`): keys are coded before it, as the cache does
        self.errors: list[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.compressor.config.uncompressed_layers:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        keys = key_states.float()
        rope = self.forms[layer_idx] if self.forms is not None else None
        if rope is not None:
            positions = torch.arange(keys.shape[2], device=keys.device).unsqueeze(0)
            keys = rope.undo(keys, positions)
        layer = self.compressor.layers[layer_idx]
        bits = self.compressor.config.bits[layer_idx]
        keys, values, error = code_window(layer, bits, self.layout, keys, value_states)
        if rope is not None:
            keys = rope.redo(keys, positions)
        self.errors.append(error)
        return super().update(keys.to(key_states.dtype), values.to(value_states.dtype), layer_idx, *args, **kwargs)


@dataclass
class TrainConfig:
    """What a training run does (saved with the checkpoint)."""

    steps: int = 100
    ctx: int = 512
    lr: float = 2e-5
    warmup: int = 20
    mse_weight: float = 1.0
    loss: str = "kl"
    rate: float = 4.3
    key_weight: float = 1.0
    calibration_windows: int = 8
    sensitivity_windows: int = SENSITIVITY_WINDOWS  # of the calibration windows; 0: bits spread evenly
    validation_windows: int = 4
    save_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse settings that would fail later, after minutes of fitting."""
        checks = {
            "steps": self.steps >= 1,
            "ctx": self.ctx >= 2,
            "lr": self.lr > 0,
            "warmup": self.warmup >= 0,
            "mse_weight": self.mse_weight >= 0,
            "rate": 0 < self.rate <= 8,
            "key_weight": self.key_weight > 0,
            "calibration_windows": self.calibration_windows >= 1,
            "sensitivity_windows": 0 <= self.sensitivity_windows <= self.calibration_windows,
            "validation_windows": self.validation_windows >= 0,
            "save_every": self.save_every >= 1,
        }
        wrong = [name for name, ok in checks.items() if not ok]
        if wrong:
            bounds = "steps, calibration_windows, save_every >= 1; ctx >= 2; lr, key_weight > 0; 0 < rate <= 8; "
            bounds += "0 <= sensitivity_windows <= calibration_windows"
            raise ValueError(f"bad training settings {wrong} ({bounds}; warmup, mse_weight, validation_windows >= 0)")
        if self.loss not in ("kl", "ce"):
            raise ValueError(f"loss must be 'kl' or 'ce', got {self.loss!r}")


def _learning_rate(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(config.steps - config.warmup, 1)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def validation_kl(
    model: nn.Module, compressor: ResidualCompressor, layout: ResidualLayout, windows: list[torch.Tensor]
) -> float:
    """Mean KL divergence from the uncompressed model over `windows`, through the coded cache (no gradients)."""
    forms = rope_forms(model)
    total = 0.0
    for ids in windows:
        reference = model(ids).logits[0, :-1].float().log_softmax(-1)
        coded = model(ids, cache=TrainingCache(compressor, layout, forms), use_cache=True).logits
        logprobs = coded[0, :-1].float().log_softmax(-1)
        total += nn.functional.kl_div(logprobs, reference, log_target=True, reduction="batchmean").item()
    return total / len(windows)


def _window(ids: torch.Tensor, ctx: int, step: int, seed: int) -> torch.Tensor:
    start = random.Random(seed * 1_000_003 + step).randrange(0, ids.numel() - ctx)
    return ids[start : start + ctx].unsqueeze(0)


def _save_state(out: Path, compressor, optimizer, step: int, config: TrainConfig, text_name: str) -> None:
    from safetensors.torch import save_file

    compressor.config.training.update({"steps_done": step, "train": vars(config), "text": text_name})
    save_compressor(compressor, out / "checkpoint", dtype=torch.float32)
    flat = {}
    for i, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            flat[f"{i}.{key}"] = torch.as_tensor(value).float().reshape(-1) if key == "step" else value
    # Each file is written beside its name and renamed over it; the step is written last, so a run killed at any
    # point resumes from a complete save.
    save_file(flat, str(out / f"{OPTIMIZER_NAME}.tmp"))
    os.replace(out / f"{OPTIMIZER_NAME}.tmp", out / OPTIMIZER_NAME)
    state = {"step": step, "config": vars(config), "text": text_name}
    (out / f"{STATE_NAME}.tmp").write_text(json.dumps(state) + "\n")
    os.replace(out / f"{STATE_NAME}.tmp", out / STATE_NAME)


RESUME_MUST_MATCH = ("rate", "key_weight", "loss", "ctx", "seed")  # what a resumed run cannot change


def _load_optimizer(out: Path, optimizer: torch.optim.Optimizer) -> None:
    from safetensors.torch import load_file

    flat = load_file(str(out / OPTIMIZER_NAME))
    state = optimizer.state_dict()
    for name, value in flat.items():
        index, key = name.split(".", 1)
        state["state"].setdefault(int(index), {})[key] = value.reshape(()) if key == "step" else value
    optimizer.load_state_dict(state)


def train_residual(
    model: nn.Module,
    train_ids: torch.Tensor,
    out_dir: str | Path,
    config: TrainConfig | None = None,
    layout: ResidualLayout | None = None,
    text_name: str = "",
    progress: bool = True,
) -> ResidualCompressor:
    """Fit (or resume) and train a compressor for `model` on token ids `train_ids` (1-D); returns it trained.

    Writes `out_dir/checkpoint/` (loadable by `ResidualKVCache.from_pretrained`), the optimizer state, the step
    and `loss_log.jsonl`. Calling again with the same `out_dir` resumes from the last save.
    """
    config = config or TrainConfig()
    if config.loss not in ("kl", "ce"):
        raise ValueError(f"loss must be 'kl' or 'ce', got {config.loss!r}")
    layout = layout or ResidualLayout()
    held_out = config.ctx * config.validation_windows
    if train_ids.dim() != 1 or train_ids.numel() - held_out <= config.ctx * max(config.calibration_windows, 1):
        raise ValueError(f"training text too short: {train_ids.numel()} tokens for windows of {config.ctx}")
    validation = [
        train_ids[-held_out + i * config.ctx :][: config.ctx].unsqueeze(0) for i in range(config.validation_windows)
    ]
    train_ids = train_ids[: train_ids.numel() - held_out]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().requires_grad_(False)
    start_step = 0
    if (out / STATE_NAME).is_file():
        saved = json.loads((out / STATE_NAME).read_text())
        compressor = load_compressor(out / "checkpoint", model)  # refuses a compressor of another model
        if compressor.config.layout != layout:
            raise ValueError(
                f"{out} holds a run with layout {compressor.config.layout}, not {layout}: resume it with the same "
                "layout, or train into another folder"
            )
        changed = [k for k in RESUME_MUST_MATCH if saved["config"].get(k) != getattr(config, k)]
        if changed:
            raise ValueError(f"{out} holds a run with other {changed}; resume it with the same, or use another folder")
        start_step = saved["step"]
    else:
        size = config.calibration_windows * config.ctx
        stride = max((train_ids.numel() - size) // max(config.calibration_windows, 1), config.ctx)
        calibration = [
            train_ids[i * stride : i * stride + config.ctx].unsqueeze(0) for i in range(config.calibration_windows)
        ]
        compressor = fit_compressor(
            model, calibration, config.rate, layout, config.key_weight, sensitivity_windows=config.sensitivity_windows
        )
    compressor.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(compressor.parameters(), lr=config.lr, weight_decay=0.0)
    if start_step:
        _load_optimizer(out, optimizer)
    forms = rope_forms(model)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, initial=start_step, desc="train-residual")
    log = (out / LOG_NAME).open("a")

    def validate(step: int) -> None:
        if validation:
            kl = validation_kl(model, compressor, layout, validation)
            log.write(json.dumps({"step": step, "validation_kl": kl}) + "\n")
            log.flush()

    try:
        if start_step == 0:
            validate(0)
        for step in range(start_step, config.steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, config)
            ids = _window(train_ids, config.ctx, step, config.seed)
            began = time.perf_counter()
            with torch.no_grad():
                reference_logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
                reference = nn.functional.nll_loss(reference_logprobs, ids[0, 1:]).item()
            cache = TrainingCache(compressor, layout, forms)
            logprobs = model(ids, cache=cache, use_cache=True).logits[0, :-1].float().log_softmax(-1)
            ce = nn.functional.nll_loss(logprobs, ids[0, 1:])
            kl = nn.functional.kl_div(logprobs, reference_logprobs, log_target=True, reduction="batchmean")
            mse = torch.stack(cache.errors).mean()
            loss = (kl if config.loss == "kl" else ce) + config.mse_weight * mse
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            record = {
                "step": step + 1,
                "loss": loss.item(),
                "ce": ce.item(),
                "ce_reference": reference,
                "kl": kl.item(),
                "mse": mse.item(),
                "lr": optimizer.param_groups[0]["lr"],
                "seconds": round(time.perf_counter() - began, 3),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(kl=f"{record['kl']:.4f}", mse=f"{record['mse']:.4f}")
            if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
                validate(step + 1)
                _save_state(out, compressor, optimizer, step + 1, config, text_name)
    finally:
        log.close()
        if bar is not None:
            bar.close()
    return compressor.eval().requires_grad_(False)
