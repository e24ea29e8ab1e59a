"""Dynamic fp8 activation quantization in one launch, with the signatures of the references in tp_lora.ops.fp8:

    quantize_per_token(x [T, K]) -> (x_fp8 [T, K] float8_e4m3fn, scales [T, 1] float32)   (also quantize_row8,
        which the norms and act_mul of tp_lora.ops.triton.fused call to emit their rows quantized this way or per
        group)
    quantize_per_group(x [T, K], group, rows_to=1) -> (x_fp8 [T', K], scales [T', ceil(K / group)] float32)

Each row (per token) or each group of `group` columns of a row (per group, the activations of block-scaled GEMMs) is
divided by max(amax / 448, 1e-12), clamped and rounded to e4m3, as the references compute it. Per token: one program
per row (reading it once up to WHOLE_ROW columns, twice past them); per group: a program per GROUPS groups of a row.
Per group, T' is T rounded up to a multiple of rows_to (the extra rows zeros with scale 1) and the scales are
token-major (stride 1 along T'), the layout cuBLAS's block-scaled GEMM takes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn  # the e4m3 of tp_lora.ops.fp8 (which dispatches here: no import back)
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
E4M3_MAX = tl.constexpr(FP8_MAX)  # the same, where a kernel reads it
BLOCK = 1024  # columns per iteration of the per-token kernel over rows wider than WHOLE_ROW
WHOLE_ROW = 16384  # rows up to this wide: the per-token kernel holds the row in registers and reads it once


@triton.jit
def row_scale(amax, FMAX: tl.constexpr):
    """The per-token scale of a row whose largest magnitude is amax (float32)."""
    return tl.maximum(amax / FMAX, 1e-12)


@triton.jit
def to_e4m3(v, scale, q_row, i, ok, FMAX: tl.constexpr):
    """v (float32) / scale, clamped to e4m3's range, stored at q_row's columns i (mask ok)."""
    q = tl.minimum(tl.maximum(v / scale, -FMAX), FMAX)
    tl.store(q_row + i, q.to(q_row.dtype.element_ty), mask=ok)


@triton.jit
def quantize_row(v, q_row, s_row, i, ok):
    """A row v [BLOCK] float32 (0 where masked) quantized per token: its scale to s_row, v / scale to q_row."""
    scale = row_scale(tl.max(tl.abs(v), 0), E4M3_MAX)
    tl.store(s_row, scale)
    to_e4m3(v, scale, q_row, i, ok, E4M3_MAX)


@triton.jit
def quantize_row8(v, q_row, s_row, i, ok, Q8: tl.constexpr):
    """A row's tile v [BLOCK] float32 at columns i (0 where masked by ok) quantized per token (Q8 1: the whole row,
    its scale to s_row) or per Q8 columns (Q8 > 1, dividing BLOCK; i's first column a multiple of it: each group's
    scale to s_row at its index, as ACT8 quantizes a K tile of that width); v / scale to q_row + i."""
    if Q8 == 1:
        quantize_row(v, q_row, s_row, i, ok)
    else:
        groups: tl.constexpr = v.shape[0] // Q8
        scale = row_scale(tl.max(tl.reshape(tl.abs(v), (groups, Q8)), 1), E4M3_MAX)
        first = tl.min(tl.reshape(i, (groups, Q8)), 1)
        tl.store(s_row + first // Q8, scale, mask=tl.max(tl.reshape(ok.to(tl.int32), (groups, Q8)), 1) > 0)
        to_e4m3(v, tl.reshape(tl.broadcast_to(scale[:, None], (groups, Q8)), v.shape), q_row, i, ok, E4M3_MAX)


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, s_ptr, K, s_xm, s_qm, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                      WHOLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if WHOLE:  # the row in one tile: read once
        v = tl.load(x_ptr + row * s_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        quantize_row(v, q_ptr + row * s_qm, s_ptr + row, offs, offs < K)
        return
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * s_xm + k0 + offs, mask=offs < K - k0, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = row_scale(tl.max(amax, axis=0), FMAX)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = offs < K - k0
        v = tl.load(x_ptr + row * s_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        to_e4m3(v, scale, q_ptr + row * s_qm + k0, offs, mask, FMAX)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    q = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    whole = triton.next_power_of_2(k) <= WHOLE_ROW
    block = triton.next_power_of_2(k) if whole else BLOCK
    if t:
        _per_token_kernel[(t,)](x, q, scales, k, x.stride(0), q.stride(0), BLOCK=block, FMAX=FP8_MAX, WHOLE=whole,
                                num_warps=max(4, min(16, block // 512)) if whole else 4)
    return q, scales


GROUPS = 32  # groups of one row per program of the per-group kernel, at most


@triton.jit
def _per_group_kernel(x_ptr, q_ptr, s_ptr, K, G, s_xm, s_qm, s_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                      FMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g[:, None] < G) & (cols < K)
    v = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=1) / FMAX, 1e-12)
    tl.store(s_ptr + row + g * s_sg, scale, mask=g < G)
    q = tl.minimum(tl.maximum(v / scale[:, None], -FMAX), FMAX)
    tl.store(q_ptr + row * s_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_group(x: torch.Tensor, group: int, rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    if group < 16 or group & (group - 1):
        raise ValueError(f"quantize_per_group: group={group}: expected a power of two of at least 16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    g = -(-k // group)
    padded = -(-t // rows_to) * rows_to
    q = torch.empty(padded, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(g, padded, dtype=torch.float32, device=x.device).t()  # token-major [padded, g]
    if padded > t:  # rows past x: zeros (scale 1), exact in any GEMM
        q[t:].zero_()
        scales[t:].fill_(1.0)
    groups = min(GROUPS, triton.next_power_of_2(g))
    if t:
        _per_group_kernel[(t, triton.cdiv(g, groups))](x, q, scales, k, g, x.stride(0), q.stride(0),
                                                       scales.stride(1), GROUP=group, GROUPS=groups, FMAX=FP8_MAX,
                                                       num_warps=max(4, min(16, groups * group // 512)))
    return q, scales
