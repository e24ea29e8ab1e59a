"""GEMMs over 16-bit weights, x [T, K] @ w [N, K]^T: the base layers' projections and the LM head.

Up to tp_lora.ops.triton.fp8_gemm.MAX_ROWS rows of 16-bit activations, weights in their dtype and the Triton kernels
on, the split-K GEMM w8a16_mm without scales (tiles by fp8_gemm.w16_config) runs
- the LM head's vocabulary shard (head) of at least HEAD_MIN_ROWS rows, which it streams faster than cuBLAS;
- the layers whose reader takes their K shares' sums (sums: qkv into decode attention, one rank's o and down into the
  next norm, a MoE router into its top-k): it leaves them as SplitSums and joins the decode chain's programmatic
  dependent launch (cuBLAS cannot).
Elsewhere (other layers, where cuBLAS is as fast alone; the CPU, float32, more rows) x @ w^T;
tp_lora.ops.fp8.w8a16_mm_ref is the kernel's reference."""
from __future__ import annotations

import torch

from tp_lora.ops.fused import use_kernels
from tp_lora.ops.split_sums import SplitSums

HEAD_MIN_ROWS = 16384  # vocabulary rows from which the LM head runs the kernel


def mm16(x: torch.Tensor, w: torch.Tensor, sums: bool = False, head: bool = False) -> torch.Tensor | SplitSums:
    """sums: the reader takes the output as SplitSums. head: w is a vocabulary shard (the LM head)."""
    if (x.dim() == 2 and x.shape[0] and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype
            and w.stride(-1) == 1 and (sums or (head and w.shape[0] >= HEAD_MIN_ROWS))
            and use_kernels(x)):
        from tp_lora.ops.triton import fp8_gemm  # noqa: PLC0415 - CUDA / forced only
        from tp_lora.ops.triton.configs import num_sms  # noqa: PLC0415
        if x.shape[0] <= fp8_gemm.MAX_ROWS:
            cfg = fp8_gemm.w16_config(*w.shape, head=head, sms=num_sms(w.device.index))
            return fp8_gemm.w8a16_mm(x, w, None, None, cfg, sums=sums)
    return x @ w.t()
