"""Code residuals into packed latent groups and back, and the same arithmetic differentiably for training.

`encode_residuals` / `decode_residuals` are what the cache stores and reads; `fake_code_residuals` returns exactly
`decode(encode(.))` with straight-through gradients, so training optimises what inference will see.
"""

from __future__ import annotations

import torch

from ..kernels import dequantize_latent, quantize_latent
from ..quant.bitpack import GROUP, fake_quantize_group
from .compressor import LayerCompressor


def _groups(latent: torch.Tensor) -> torch.Tensor:
    return latent.reshape(*latent.shape[:-1], latent.shape[-1] // GROUP, GROUP)


def encode_residuals(
    compressor: LayerCompressor, bits: list[int], key_residual: torch.Tensor, value_residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes `uint8 [..., code_bytes]` and scales `fp16 [..., kept groups]` of residuals `[..., dim]`."""
    return quantize_latent(compressor.encode(key_residual.float(), value_residual.float()), bits)


def decode_residuals(
    compressor: LayerCompressor, bits: list[int], packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value residuals `[..., dim]` (fp32) from what `encode_residuals` stored."""
    return compressor.decode(dequantize_latent(packed, scales, bits))


def fake_code_residuals(
    compressor: LayerCompressor, bits: list[int], key_residual: torch.Tensor, value_residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_residuals(encode_residuals(.))` with straight-through gradients to the encoder and decoder."""
    groups = _groups(compressor.encode(key_residual.float(), value_residual.float()))
    coded = [
        fake_quantize_group(groups[..., g, :], b) if b else torch.zeros_like(groups[..., g, :])
        for g, b in enumerate(bits)
    ]
    latent = torch.stack(coded, dim=-2)
    return compressor.decode(latent.reshape(*latent.shape[:-2], -1))
