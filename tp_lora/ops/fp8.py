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


def quantize_fp8_into(dsts: list[torch.Tensor], scale_dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """quantize_fp8_per_channel of each src [C_i, K] into dst (fp8 [C_i, K]) and scale_dst ([C_i]), batched for a
    slot image: the rows of every src of one (K, dtype) are quantized as one tensor, which gives each row what it
    gets alone (its own scale), in a few calls instead of a few per tensor."""
    groups: dict[tuple, list[int]] = {}
    for i, src in enumerate(srcs):
        groups.setdefault((src.shape[-1], src.dtype), []).append(i)
    to, frm = [], []
    for idx in groups.values():
        rows = [srcs[i].shape[0] for i in idx]
        w, scales = quantize_fp8_per_channel(torch.cat([srcs[i] for i in idx]))
        to += [dsts[i].view(torch.uint8) for i in idx] + [scale_dsts[i] for i in idx]
        frm += list(w.view(torch.uint8).split(rows)) + list(scales.split(rows))  # bytes: fp8 has no batched copy
    torch._foreach_copy_(to, frm)


def dequantize_fp8_per_channel(w_fp8: torch.Tensor, scales: torch.Tensor,
                               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8_per_channel (up to fp8 rounding): [..., C, K] in `dtype`."""
    return (w_fp8.float() * scales.float().unsqueeze(-1)).to(dtype)
