"""Triton grouped expert GEMM for few rows per expert (decode), with the signature of tp_lora.ops.grouped_mm:

    grouped_mm(x [C, K], w [E, N, K], ends [E] int32) -> [C, N],  rows ends[e-1]:ends[e] = x[rows] @ w[e]^T

A program owns one (expert, BLOCK_N columns) tile of the weights and walks that expert's rows in blocks of BLOCK_M,
so each weight byte is read once per row block and experts without rows read nothing: a memory-bound pass over the
routed experts. Rows past ends[-1] are left unwritten. The grid depends on shapes only (capturable in a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.dot import compute_types, mm

BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 128
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, ends_ptr, out_ptr, N, K, s_xm, s_we, s_wn, s_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    e = tl.program_id(0)
    start = tl.where(e > 0, tl.load(ends_ptr + tl.maximum(e - 1, 0)), 0)
    end = tl.load(ends_ptr + e)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_blk = w_ptr + e.to(tl.int64) * s_we + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        m_mask = rows < end
        x_blk = x_ptr + rows[:, None].to(tl.int64) * s_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            xv = tl.load(x_blk + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wv = tl.load(w_blk + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc += mm(xv, wv, CDT, DOT, PREC)
        o = out_ptr + rows[:, None].to(tl.int64) * s_om + offs_n[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError(f"grouped_mm: w needs a unit stride along K, got strides {tuple(w.stride())}")
    c, k = x.shape
    e, n, _ = w.shape
    out = torch.empty(c, n, dtype=x.dtype, device=x.device)
    if c == 0 or e == 0:
        return out
    cdt, dot, prec = compute_types(w.dtype, w.dtype)
    _grouped_mm_kernel[(e, triton.cdiv(n, BLOCK_N))](
        x, w, ends, out, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, CDT=cdt, DOT=dot, PREC=prec,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
