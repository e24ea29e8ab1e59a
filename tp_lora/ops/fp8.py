"""FP8 (e4m3) storage for LoRA weights: per-output-channel scales, dequantised inside the kernels."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C, K] -> (w_fp8 [..., C, K] float8_e4m3fn, scales [..., C] float32), w ~= w_fp8 * scales[..., None].

    One scale per row: for B [L, out, r] that is per output channel, for A [L, r, in] per rank row, the channels
    the ops' b_scales / a_scales expect. All-zero rows (empty or zero-padded slots) get scale 1 and stay exact 0."""
    amax = w.detach().abs().amax(dim=-1).float()
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w_fp8 = (w.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scales


def dequantize_fp8_per_channel(w_fp8: torch.Tensor, scales: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8_per_channel (up to fp8 rounding): [..., C, K] in `dtype`."""
    return (w_fp8.float() * scales.float().unsqueeze(-1)).to(dtype)
