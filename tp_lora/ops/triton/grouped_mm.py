"""Triton grouped expert GEMM for few rows per expert (decode), with the signature of tp_lora.ops.grouped_mm:

    grouped_mm(x [C, K], w [E, N, K], ends [E] int32, scale=None, block_k=None, rows=None, gated=False) -> [C, N],
        rows ends[e-1]:ends[e] = x[rows] @ w[e]^T
    (gated, 16-bit weights or fp8 with act8: w's rows are [gate | up] and the result silu(gate) * up [C, N / 2],
    act_mul in the epilogue)
    (ends None: one expert, w [1, N, K], taking every row: a dense GEMM)
    rows [C] int (the pairs' tokens): row i reads x[rows[i]] (the dispatch's gather in the GEMM's loads).

w in x's dtype, or float8_e4m3fn with scale [E, N] per output channel or [E, N, ceil(K / block_k)] per block of
block_k columns: the fp8 tile is widened to x's dtype in registers (exact) and the scales applied to the float32
partial sums, so only the fp8 bytes leave memory (weight-only fp8: the activations are not quantized); with act8 the
rows are quantized to e4m3 per (row, K tile) and multiplied on the fp8 tensor cores, the product transposed (the
weight tile on the MMA's M side, as Hopper's warp-group MMA takes it). With E = 1 and no ends it is a dense GEMM (what
fp8_linear ran before tp_lora.ops.triton.fp8_gemm's split-K kernel; the baseline scripts/tune_fp8_gemm.py times).

A program owns one (expert, BLOCK_N columns) tile of the weights and walks that expert's rows in blocks of BLOCK_M,
so each weight byte is read once per row block and experts without rows read nothing: a memory-bound pass over the
routed experts. Rows past ends[-1] are left unwritten. The grid depends on shapes only (capturable in a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.configs import num_sms
from tp_lora.ops.triton.dot import check_act8, compute_types, fp8_dot, mm
from tp_lora.ops.triton.fused import act_mul_of
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior

BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 128
NUM_WARPS, NUM_STAGES = 4, 4
ACT8_STAGES = 3  # the pipeline's depth with act8 (scripts/tune_fp8_gemm.py --experts)
F32_STAGES = 3  # float32 tiles: 4 stages of 32+ rows exceed an sm90 program's 227 KB of shared memory
MAX_BLOCK_M = 64  # one row block of up to this many rows (a dense GEMM's decode batch reads its weights once)
# 16-bit experts (BENCHMARKS.md, "the grouped GEMM's 16-bit tiles"): gated takes (BLOCK_N, stages) = (64, 2), so its
# two weight tiles a stage leave room for several programs an SM; else STAGES_16 stages, K tiles of 64 where 128
# leaves a part-empty last tile.
GATED_BLOCK_N, GATED_STAGES, STAGES_16 = 64, 2, 3
# fp8 experts gated with act8 (a gate and an up tile a stage, 3 stages): (BLOCK_N, warps, column blocks a program).
# Narrow where the programs fit one wave of three an SM (what 64-column tiles leave room for), else wide.
GATED8_NARROW, GATED8_WIDE = (64, 4, 2), (128, 8, 1)
SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2


@triton.jit
def _w_part(xv, w_tile, s_row, k0, k_mask, n_mask, SCALES: tl.constexpr, SCALE_K: tl.constexpr, CDT: tl.constexpr,
            DOT: tl.constexpr, PREC: tl.constexpr):
    """One K tile's float32 product of the rows xv [BLOCK_M, BLOCK_K] with the weight tile at w_tile + k0
    [BLOCK_K, BLOCK_N], its per-block scales applied (SCALES 2)."""
    wv = tl.load(w_tile + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    part = mm(xv, wv, CDT, DOT, PREC)
    if SCALES == 2:  # one scale per (row, SCALE_K columns); BLOCK_K divides SCALE_K
        part *= tl.load(s_row + k0 // SCALE_K, mask=n_mask, other=0.0)[None, :]
    return part


@triton.jit
def _act8_rows(xv, DOT8: tl.constexpr):
    """ACT8's rows xv^T [BLOCK_K, BLOCK_M], each quantized to e4m3 (scale: its amax / 448) -> (fp8 rows as DOT8,
    scales [BLOCK_M])."""
    xf = xv.to(tl.float32)
    xs = tl.maximum(tl.max(tl.abs(xf), axis=0) / 448.0, 1e-12)
    return (xf / xs[None, :]).to(tl.float8e4nv).to(DOT8), xs


@triton.jit
def _act8_part(xq, xs, w_tile, s_row, k0, k_mask, n_mask, SCALES: tl.constexpr, SCALE_K: tl.constexpr,
               DOT8: tl.constexpr, XQ: tl.constexpr):
    """ACT8's K tile, transposed: the fp8 weight tile at w_tile + k0 [BLOCK_N, BLOCK_K] times the quantized rows xq
    [BLOCK_K, BLOCK_M] (_act8_rows) -> float32 [BLOCK_N, BLOCK_M], scaled back by xs (and by the per-block weight
    scales, SCALES 2). The weights on the MMA's M side: Hopper's warp-group MMA. XQ: rows quantized per token
    before the kernel, whose scales the epilogue applies: the product unscaled (it accumulates in the MMA)."""
    wv = tl.load(w_tile + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    part = tl.dot(wv.to(DOT8), xq)
    if not XQ:
        part = part * xs[None, :]
    if SCALES == 2:
        part *= tl.load(s_row + k0 // SCALE_K, mask=n_mask, other=0.0)[:, None]
    return part


@triton.jit
def _act8_row_block(x_ptr, xs_ptr, src, rows, m_mask, w_e, s_e, out_ptr, n0, N, K, s_xm, s_wn, s_om, s_sn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COL_BLOCKS: tl.constexpr,
                    SCALES: tl.constexpr, SCALE_K: tl.constexpr, DOT8: tl.constexpr, GATED: tl.constexpr,
                    XQ: tl.constexpr):
    """ACT8 over one row block (rows, read at src): the COL_BLOCKS column blocks of BLOCK_N from n0, their K tiles
    walked as one loop, so the pipeline keeps the next block's loads in flight through a block's epilogue. XQ: x
    holds fp8 rows, xs_ptr their scales (one a row)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_blk = x_ptr + src[None, :].to(tl.int64) * s_xm + offs_k[:, None]
    kt = tl.cdiv(K, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    if XQ:
        xs = tl.load(xs_ptr + src, mask=m_mask, other=0.0)
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, tl.minimum(COL_BLOCKS, tl.cdiv(N - n0, BLOCK_N)) * kt):
        j = i // kt
        k0 = (i - j * kt) * BLOCK_K
        offs_n = n0 + j * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns (GATED: gate rows n, up rows N + n)
        n_mask = offs_n < N
        w_blk = w_e + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
        s_row = s_e + offs_n.to(tl.int64) * s_sn
        k_mask = offs_k < K - k0
        xv = tl.load(x_blk + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if XQ:
            xq = xv.to(DOT8)
        else:
            xq, xs = _act8_rows(xv, DOT8)
        acc_t += _act8_part(xq, xs, w_blk, s_row, k0, k_mask, n_mask, SCALES, SCALE_K, DOT8, XQ)
        if GATED:  # the up tile takes the same quantized rows
            up_t += _act8_part(xq, xs, w_blk + N * s_wn, s_row + N * s_sn, k0, k_mask, n_mask, SCALES, SCALE_K, DOT8,
                               XQ)
        if k0 + BLOCK_K >= K:  # this column block's last K tile: its epilogue
            if SCALES == 1:
                acc_t *= tl.load(s_row, mask=n_mask, other=0.0)[:, None]
                if GATED:
                    up_t *= tl.load(s_row + N * s_sn, mask=n_mask, other=0.0)[:, None]
            if XQ:
                acc_t *= xs[None, :]
                if GATED:
                    up_t *= xs[None, :]
            if GATED:
                acc_t = act_mul_of(acc_t, up_t, dt, False).to(tl.float32)
            o = out_ptr + rows[:, None].to(tl.int64) * s_om + offs_n[None, :]
            tl.store(o, tl.trans(acc_t).to(dt), mask=m_mask[:, None] & n_mask[None, :])
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


@triton.jit
def _grouped_mm_kernel(x_ptr, xs_ptr, w_ptr, ends_ptr, out_ptr, s_ptr, idx_ptr, C, N, K, s_xm, s_we, s_wn, s_om,
                       s_se, s_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       COL_BLOCKS: tl.constexpr, SCALES: tl.constexpr, SCALE_K: tl.constexpr, ENDS: tl.constexpr,
                       CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ACT8: tl.constexpr,
                       DOT8: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr, XQ: tl.constexpr,
                       PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)  # at once: the next kernel (the fused MoE LoRA's shrink) starts beside this one's last programs
    e = tl.program_id(0)
    if ENDS:
        start = tl.where(e > 0, tl.load(ends_ptr + tl.maximum(e - 1, 0)), 0)
        end = tl.load(ends_ptr + e)
    else:  # one expert, every row
        start = 0
        end = C
    n0 = tl.program_id(1) * COL_BLOCKS * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)  # output columns (GATED: gate rows n, up rows N + n)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * s_we
    s_e = s_ptr + e.to(tl.int64) * s_se
    w_blk = w_e + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] (16-bit / weight-only)
    s_row = s_e + offs_n.to(tl.int64) * s_sn
    w_up = w_blk + N * s_wn  # GATED: the up rows' tiles
    dt = out_ptr.dtype.element_ty
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        m_mask = rows < end
        src = rows
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=m_mask, other=0)
        if ACT8:
            _act8_row_block(x_ptr, xs_ptr, src, rows, m_mask, w_e, s_e, out_ptr, n0, N, K, s_xm, s_wn, s_om, s_sn,
                            BLOCK_M, BLOCK_N, BLOCK_K, COL_BLOCKS, SCALES, SCALE_K, DOT8, GATED, XQ)
        else:  # one column block (COL_BLOCKS 1)
            x_blk = x_ptr + src[:, None].to(tl.int64) * s_xm + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_mask = offs_k < K - k0
                xv = tl.load(x_blk + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                acc += _w_part(xv, w_blk, s_row, k0, k_mask, n_mask, SCALES, SCALE_K, CDT, DOT, PREC)
                if GATED:
                    acc_up += _w_part(xv, w_up, s_row, k0, k_mask, n_mask, SCALES, SCALE_K, CDT, DOT, PREC)
            if SCALES == 1:
                acc *= tl.load(s_row, mask=n_mask, other=0.0)[None, :]
            if GATED:
                acc = act_mul_of(acc, acc_up, dt, False).to(tl.float32)
            o = out_ptr + rows[:, None].to(tl.int64) * s_om + offs_n[None, :]
            tl.store(o, acc.to(dt), mask=m_mask[:, None] & n_mask[None, :])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor | None, scale: torch.Tensor | None = None,
               block_k: int | None = None, rows_per_expert: int = BLOCK_M, act8: bool = False,
               rows: torch.Tensor | None = None, gated: bool = False, x_scale: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """rows_per_expert: the most rows one expert is expected to get (a dense GEMM: all of them), which sets the
    row block (at most MAX_BLOCK_M); a dense GEMM (no ends) takes narrow column blocks. act8 (fp8 weights): x
    quantized per (row, K tile of min(BLOCK_K, block_k) columns) in the kernel, the product on fp8 tensor cores.
    rows: as the module's docstring (x read where it lies when its columns have a unit stride). gated (16-bit
    weights, or fp8 with act8): w's N rows are [gate | up] and the result is silu(gate) * up [C, N / 2] (act_mul's,
    in the epilogue). x_scale [rows of x] (with act8, per-channel weights): x holds fp8 rows quantized per token,
    these their scales (XQ: the tiles straight into the MMA, the scales at the end); the output in out_dtype."""
    xq = x_scale is not None
    if xq and (not act8 or x.dtype != torch.float8_e4m3fn or block_k is not None
               or x_scale.numel() != x.shape[0] or out_dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"grouped_mm: fp8 rows with their scales (x_scale) take act8 with per-channel weights and "
                         f"a 16-bit out_dtype, got {x.dtype} rows, act8 {act8}, block_k {block_k}, "
                         f"{x_scale.numel()} scales for {x.shape[0]} rows, out_dtype {out_dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError(f"grouped_mm: w needs a unit stride along K, got strides {tuple(w.stride())}")
    if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"grouped_mm: block_k={block_k}: expected a power of two of at least 16")
    c, k = x.shape[0] if rows is None else rows.shape[0], x.shape[1]
    e, n, _ = w.shape
    if gated and (n % 2 or (scale is not None or w.element_size() != 2) and not act8):
        raise ValueError(f"grouped_mm: gated takes 16-bit weights, or fp8 ones with act8, of an even number of rows "
                         f"[gate | up], got {n} of {w.dtype}{' with act8' if act8 else ''}")
    n = n // 2 if gated else n
    if ends is None and e != 1:
        raise ValueError(f"grouped_mm without ends takes one expert (a dense GEMM), got w of {e}")
    out = torch.empty(c, n, dtype=out_dtype or x.dtype, device=x.device)
    if c == 0 or e == 0:
        return out
    if act8:
        check_act8("grouped_mm: act8", w, scale)
    if scale is None:
        mode, scale, s_se, s_sn, bk = SCALE_NONE, out, 0, 0, BLOCK_K  # scale_ptr unused
    else:
        scale = scale.contiguous()
        mode = SCALE_CHANNEL if block_k is None else SCALE_BLOCK
        s_se, s_sn = scale.stride(0), scale.stride(1)
        bk = BLOCK_K if block_k is None else min(BLOCK_K, block_k)
    block_m = min(MAX_BLOCK_M, max(BLOCK_M, triton.next_power_of_2(rows_per_expert)))
    # a dense GEMM in narrow column tiles: enough programs to stream its weights over every SM
    block_n = 32 if ends is None else BLOCK_N
    cdt, dot, prec = compute_types(out.dtype, w.dtype)
    stages = ACT8_STAGES if act8 else F32_STAGES if max(x.element_size(), w.element_size()) == 4 else NUM_STAGES
    warps, col_blocks = NUM_WARPS, 1
    if act8 and gated:
        narrow = e * triton.cdiv(n, GATED8_WIDE[0]) <= 3 * num_sms(x.device.index if x.is_cuda else None)
        block_n, warps, col_blocks = GATED8_NARROW if narrow else GATED8_WIDE
    if ends is not None and mode == SCALE_NONE and x.element_size() == w.element_size() == 2:
        block_n, stages = (GATED_BLOCK_N, GATED_STAGES) if gated else (BLOCK_N, STAGES_16)
        bk = BLOCK_K if gated or k % BLOCK_K == 0 else BLOCK_K // 2
    _grouped_mm_kernel[(e, triton.cdiv(n, block_n * col_blocks))](
        x, x_scale.reshape(-1) if xq else out, w, x if ends is None else ends, out, scale, x if rows is None else rows,
        c, n, k, x.stride(0), w.stride(0),
        w.stride(1), out.stride(0), s_se, s_sn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, COL_BLOCKS=col_blocks,
        SCALES=mode, SCALE_K=block_k or 1, ENDS=ends is not None, CDT=cdt, DOT=dot, PREC=prec, ACT8=act8,
        DOT8=fp8_dot(), GATHER=rows is not None, GATED=gated, XQ=xq, num_warps=warps, num_stages=stages,
        **pdl_args(x, *(t for t in (ends, rows) if t is not None)))
    released(out)
    return out
