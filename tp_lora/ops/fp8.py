"""FP8 (e4m3) storage for LoRA weights: per-output-channel scales, dequantised inside the kernels."""
from __future__ import annotations

import threading

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _channel_scales(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C, K] -> (w_fp8 [..., C, K] float8_e4m3fn, scales [..., C] float32), w ~= w_fp8 * scales[..., None].

    One scale per row: for B [L, out, r] that is per output channel, for A [L, r, in] per rank row, the channels
    the ops' b_scales / a_scales expect. All-zero rows (empty or zero-padded slots) get scale 1 and stay exact 0."""
    scales = _channel_scales(w.detach().abs().amax(dim=-1).float())
    w_fp8 = (w.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scales


_local = threading.local()


def quantize_fp8_into(dsts: list[torch.Tensor], scale_dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """quantize_fp8_per_channel of each src [C_i, K] into dst (fp8 [C_i, K]) and scale_dst ([C_i]), the same values,
    batched for a slot image on the host: the rows of every src of one width K are gathered into one float32 buffer
    kept for the thread and quantized in place there, in a few calls instead of a few per tensor. Fresh memory for
    the intermediates would cost more than the arithmetic (its page faults)."""
    groups: dict[int, list[int]] = {}
    for i, src in enumerate(srcs):
        groups.setdefault(src.shape[-1], []).append(i)
    for k, idx in groups.items():
        rows = [srcs[i].shape[0] for i in idx]
        n = sum(rows) * k
        if getattr(_local, "buf", None) is None or _local.buf.numel() < n:
            _local.buf = torch.empty(n, dtype=torch.float32)
        x = _local.buf[:n].view(-1, k)
        torch._foreach_copy_(list(x.split(rows)), [srcs[i] for i in idx])
        scales = _channel_scales(torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()))  # faster than aminmax
        x.div_(scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
        torch._foreach_copy_([dsts[i] for i in idx] + [scale_dsts[i] for i in idx],
                             list(x.split(rows)) + list(scales.split(rows)))
