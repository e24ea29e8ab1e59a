"""The LM head's GEMM, x [T, K] @ w [N, K]^T over 16-bit weights (a vocabulary shard), with its decode dispatch.

Up to tp_lora.ops.triton.fp8_gemm.MAX_ROWS rows of 16-bit activations, weights of at least HEAD_MIN_ROWS rows in
the activations' dtype and the Triton kernels on: the split-K GEMM w8a16_mm over the 16-bit weights (no scales,
HEAD_CONFIG), which streams such weights faster than cuBLAS (scripts/bench_decode_gemm.py). Elsewhere (the CPU,
float32, more rows, smaller shards) x @ w^T; tp_lora.ops.fp8.w8a16_mm_ref is the kernel's reference."""
from __future__ import annotations

import torch

from tp_lora.ops.fused import use_kernels

HEAD_MIN_ROWS = 16384  # weight rows from which the kernel runs: a vocabulary shard, not a projection


def head_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] and w.shape[0] >= HEAD_MIN_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and w.stride(-1) == 1 and use_kernels(x)):
        from tp_lora.ops.triton import fp8_gemm  # noqa: PLC0415 - CUDA / forced only
        if x.shape[0] <= fp8_gemm.MAX_ROWS:
            return fp8_gemm.w8a16_mm(x, w, None, None, fp8_gemm.HEAD_CONFIG)
    return x @ w.t()
