"""Triton fused MoE LoRA ops: moe_lora_shrink / moe_lora_expand with the signatures and semantics of
tp_lora.ops.moe_ref (read its docstring for the pair order and shapes).

One launch per call covers every (local expert, adapter slot) group and every slice (w1 and w3 together). The grid is
(LoRA blocks of the routing plan, token blocks of the largest block, slices x output blocks [x K splits: shrink]); a
program reads its block's row of the plan's (expert, slot, start, count) table (count 0: no block) and walks rows
start .. start + count of the pair-ordered input, so it reads one expert's weights of one adapter only, once for the
block's pairs.
Pairs of tokens without an adapter belong to no block: shrink leaves their rows 0 and expand never touches them.

FP8 B (lora.dtype=fp8): float8_e4m3fn with per-output-channel float32 scales b_scales S x [L, E, out_s]
(tp_lora.ops.fp8), dequantised in the expand kernel: B is widened to the output's type for the dot and the
accumulator scaled per column, as in the dense expand kernel.

Grids come from the plan's static sizes (block count, block size): no device value is read here, so the calls are
capturable in a CUDA graph. Runs natively on CUDA and, under TRITON_INTERPRET=1, on the CPU.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import LORA_BLOCK, MoEPlan
from tp_lora.ops.triton.dot import FP8, compute_types, mm
from tp_lora.ops.triton.kernels import pick
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior

__all__ = ["moe_lora_shrink", "moe_lora_expand", "moe_lora_fused"]

MAX_SLICES = 2  # w1 | w3 in one launch; more slices are split into several launches
BLOCK_M = LORA_BLOCK  # pairs per program: one LoRA block of the plan, so A / B are read once per block
# Launch settings. All three ops are bound by the A / B bytes of the (expert, adapter) groups a step touches; at
# decode a group is one or two pairs, so a program streams r x in of A (or out x r of B) for a few rows. The expand
# and the fused op cut a slice's outputs into runs of columns, one B tile of BLOCK_N columns at a time; the fused op
# gives each program N_PER_PROGRAM columns of a slice (each program of a block recomputes the block's shrink, its A
# read again from L2); its blocks of one pair (ONE_ROW) read A in ROW_K-wide and B in ROW_N-column tiles.
SHRINK = dict(BLOCK_K=128, num_warps=2, num_stages=4)
EXPAND = dict(BLOCK_N=128, num_warps=2, num_stages=2)
FUSED = dict(BLOCK_K=256, BLOCK_N=256, N_PER_PROGRAM=1024, num_warps=2, num_stages=3, ONE_ROW=True, ROW_K=512,
             ROW_N=512)


@triton.jit
def _block_rows(groups_ptr, pid_g, pid_m, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """(expert, slot, whether it has pairs, m_mask, pair rows, offs_r, r_mask) of token block pid_m of LoRA block
    pid_g."""
    e = tl.load(groups_ptr + pid_g * 4).to(tl.int64)
    slot = tl.load(groups_ptr + pid_g * 4 + 1).to(tl.int64)
    start = tl.load(groups_ptr + pid_g * 4 + 2)
    count = tl.load(groups_ptr + pid_g * 4 + 3)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    return (e, slot, pid_m * BLOCK_M < count, offs_m < count, (start + offs_m).to(tl.int64), offs_r,
            offs_r < R)


@triton.jit
def _shrink_tile(x_ptr, a_ptr, rows, m_mask, offs_r, r_mask, K, stride_xp, stride_xk, stride_ar, stride_ak,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, CDT: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr):
    """x[rows] @ A^T over all of K -> [BLOCK_M, BLOCK_R] float32; a_ptr: this (slot, expert)'s A [R, K]; rows: the
    block's rows of x (its pairs, or their tokens where x is not in pair order)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_blk = x_ptr + rows[:, None] * stride_xp + offs_k[None, :] * stride_xk
    a_blk = a_ptr + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        xv = tl.load(x_blk, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        av = tl.load(a_blk, mask=(offs_k[:, None] < k_left) & r_mask[None, :], other=0.0)
        acc += mm(xv, av, CDT, DOT, PREC)
        x_blk += BLOCK_K * stride_xk
        a_blk += BLOCK_K * stride_ak
    return acc


@triton.jit
def _expand_tile(u, b_ptr, bs_ptr, out_ptr, rows, m_mask, offs_r, r_mask, offs_n, n_mask, col, stride_bn, stride_br,
                 stride_bsn, stride_op, stride_oc, ADD: tl.constexpr, HAS_B_SCALES: tl.constexpr,
                 CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """out[rows, col + offs_n] (+)= u @ B[offs_n]^T (times B's channel scales): u [BLOCK_M, BLOCK_R] float32 (the
    whole rank), b_ptr / bs_ptr: this (slot, expert)'s B [N, R] / scales [N]."""
    bv = tl.load(b_ptr + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    acc = mm(u, bv, CDT, DOT, PREC)
    if HAS_B_SCALES:
        acc = acc * tl.load(bs_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)[None, :]
    o_ptr = out_ptr + rows[:, None] * stride_op + (col + offs_n[None, :]) * stride_oc
    o_mask = m_mask[:, None] & n_mask[None, :]
    if ADD:
        acc += tl.load(o_ptr, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _shrink_row(x_row, a_ptr, offs_r, r_mask, K, stride_xk, stride_ar, stride_ak, BLOCK_R: tl.constexpr,
                ROW_K: tl.constexpr, CDT: tl.constexpr):
    """One row's x @ A^T over all of K on the CUDA cores -> [BLOCK_R] float32 (operands rounded to CDT, as the dot
    path rounds them); x_row: the row's start, a_ptr: this (slot, expert)'s A [R, K]. No shared memory: A's tiles
    go straight to registers."""
    offs_k = tl.arange(0, ROW_K)
    acc = tl.zeros((BLOCK_R, ROW_K), dtype=tl.float32)
    for k0 in range(0, K, ROW_K):
        kk = k0 + offs_k
        k_mask = kk < K
        av = tl.load(a_ptr + offs_r[:, None] * stride_ar + kk[None, :] * stride_ak,
                     mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        xv = tl.load(x_row + kk * stride_xk, mask=k_mask, other=0.0)
        acc += av.to(CDT).to(tl.float32) * xv.to(CDT).to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _expand_row(u, b_ptr, bs_ptr, o_row, offs_r, r_mask, n_lo, n_hi, stride_bn, stride_br, stride_bsn, stride_oc,
                HAS_B_SCALES: tl.constexpr, ROW_N: tl.constexpr, CDT: tl.constexpr):
    """o_row[n] += u @ B[n]^T for n in [n_lo, n_hi) on the CUDA cores (u rounded to CDT first, as the dot path
    rounds it; B widened to float32, exact for fp8 and 16-bit B): u [BLOCK_R] float32, o_row the row's start."""
    u = u.to(CDT).to(tl.float32)
    for n0 in range(n_lo, n_hi, ROW_N):
        offs_n = n0 + tl.arange(0, ROW_N)
        n_mask = offs_n < n_hi
        bv = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        d = tl.sum(bv.to(tl.float32) * u[None, :], axis=1)
        if HAS_B_SCALES:
            d = d * tl.load(bs_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)
        o = o_row + offs_n * stride_oc
        d += tl.load(o, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(o, d.to(o_row.dtype.element_ty), mask=n_mask)


@triton.jit
def moe_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, scale_ptr, out_ptr, groups_ptr,
    K, R,
    stride_xp, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_ss, stride_sl, stride_se,
    stride_os, stride_op, stride_or,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """out[s, p, :] = scale[s, slot, e] * x[p] @ A_s[slot, e]^T for the pairs p of one (expert e, slot) group.
    x [P, K], A_s [L, E, R, K], scale [S, L, E] f32, out [S, P, R] f32. Grid: (blocks, token blocks, slices)."""
    s = tl.program_id(2)
    e, slot, live, m_mask, rows, offs_r, r_mask = _block_rows(groups_ptr, tl.program_id(0), tl.program_id(1), R,
                                                              BLOCK_M, BLOCK_R)
    if live:
        a_ptr = pick(s, a0_ptr, a1_ptr, a1_ptr, NUM_SLICES)
        acc = _shrink_tile(x_ptr, a_ptr + slot * stride_al + e * stride_ae, rows, m_mask, offs_r, r_mask, K,
                           stride_xp, stride_xk, stride_ar, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, CDT, DOT, PREC)
        acc *= tl.load(scale_ptr + s * stride_ss + slot * stride_sl + e * stride_se)
        o_ptr = out_ptr + s * stride_os + rows[:, None] * stride_op + offs_r[None, :] * stride_or
        tl.store(o_ptr, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def moe_expand_kernel(
    buf_ptr, b0_ptr, b1_ptr, bs0_ptr, bs1_ptr, out_ptr, groups_ptr,
    R, N, col0, n_blocks_n,
    stride_us, stride_up, stride_ur,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_bsl, stride_bse, stride_bsn,
    stride_op, stride_oc,
    NUM_SLICES: tl.constexpr, ADD: tl.constexpr, HAS_B_SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """out[p, col0 + s*N + n] (+)= buf[s, p] @ B_s[slot, e, n]^T for the pairs p of one (expert e, slot) group.
    buf [S, P, R] f32, B_s [L, E, N, R] (fp8 with bs_s [L, E, N] per output channel, or 16/32-bit), out [P, O]
    (any float dtype; accumulated in float32). Grid: (blocks, token blocks, slices x column blocks)."""
    pid_x = tl.program_id(2)
    s = pid_x // n_blocks_n
    pid_n = pid_x % n_blocks_n
    e, slot, live, m_mask, rows, offs_r, r_mask = _block_rows(groups_ptr, tl.program_id(0), tl.program_id(1), R,
                                                              BLOCK_M, BLOCK_R)
    if live:
        b_ptr = pick(s, b0_ptr, b1_ptr, b1_ptr, NUM_SLICES)
        bs_ptr = pick(s, bs0_ptr, bs1_ptr, bs1_ptr, NUM_SLICES)
        u = tl.load(buf_ptr + s * stride_us + rows[:, None] * stride_up + offs_r[None, :] * stride_ur,
                    mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _expand_tile(u, b_ptr + slot * stride_bl + e * stride_be, bs_ptr + slot * stride_bsl + e * stride_bse,
                     out_ptr, rows, m_mask, offs_r, r_mask, offs_n, offs_n < N, col0 + s * N, stride_bn, stride_br,
                     stride_bsn, stride_op, stride_oc, ADD, HAS_B_SCALES, CDT, DOT, PREC)


@triton.jit
def moe_fused_kernel(
    x_ptr, idx_ptr, a0_ptr, a1_ptr, scale_ptr, b0_ptr, b1_ptr, bs0_ptr, bs1_ptr, out_ptr, groups_ptr,
    K, R, N, col0, n_per_program, n_programs,
    stride_xp, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_ss, stride_sl, stride_se,
    stride_bl, stride_be, stride_bn, stride_br,
    stride_bsl, stride_bse, stride_bsn,
    stride_op, stride_oc,
    NUM_SLICES: tl.constexpr, HAS_B_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, CDT_A: tl.constexpr, DOT_A: tl.constexpr, PREC_A: tl.constexpr,
    CDT_B: tl.constexpr, DOT_B: tl.constexpr, PREC_B: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr,
    ONE_ROW: tl.constexpr, ROW_K: tl.constexpr, ROW_N: tl.constexpr,
):
    """The shrink's u = scale * x[p] @ A_s^T kept in registers, then out[p, col0 + s*N + n] += u @ B_s[n]^T over the
    program's n_per_program columns, for the pairs p of one (expert, slot) group. Shapes as the two kernels above;
    GATHER: pair p's row of x is x[idx[p]]. Grid: (blocks, token blocks, slices x n_programs).
    ONE_ROW: a block of one pair (a decode step's groups, mostly) takes the rows path, its shrink and expand on the
    CUDA cores with A's and B's tiles straight in registers (the tensor cores' 16-row tiles would be padding staged
    through shared memory); larger blocks take the tiles.
    PDL: the shrink reads nothing the kernel before it (the base GEMM writing out) writes, so it runs before the wait
    (tp_lora.ops.triton.pdl), beside that GEMM's last programs; the expand's read-modify-write of out after it."""
    pid_x = tl.program_id(2)
    s = pid_x // n_programs
    pid_n = pid_x % n_programs
    e, slot, live, m_mask, rows, offs_r, r_mask = _block_rows(groups_ptr, tl.program_id(0), tl.program_id(1), R,
                                                              BLOCK_M, BLOCK_R)
    one = ONE_ROW and tl.sum(m_mask.to(tl.int32), axis=0) == 1
    row = tl.min(rows, axis=0)  # the block's first pair (rows are consecutive)
    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    u_row = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if live:
        src = rows
        if GATHER:
            src = tl.load(idx_ptr + rows, mask=m_mask, other=0).to(tl.int64)
        a_ptr = pick(s, a0_ptr, a1_ptr, a1_ptr, NUM_SLICES) + slot * stride_al + e * stride_ae
        scale = tl.load(scale_ptr + s * stride_ss + slot * stride_sl + e * stride_se)
        if one:
            x_row = x_ptr + tl.sum(tl.where(m_mask, src, 0), axis=0) * stride_xp
            u_row = scale * _shrink_row(x_row, a_ptr, offs_r, r_mask, K, stride_xk, stride_ar, stride_ak, BLOCK_R,
                                        ROW_K, CDT_A)
        else:
            u = scale * _shrink_tile(x_ptr, a_ptr, src, m_mask, offs_r, r_mask, K, stride_xp, stride_xk, stride_ar,
                                     stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, CDT_A, DOT_A, PREC_A)
    wait_prior(PDL)
    release_next(PDL)
    if live:
        b_ptr = pick(s, b0_ptr, b1_ptr, b1_ptr, NUM_SLICES)
        bs_ptr = pick(s, bs0_ptr, bs1_ptr, bs1_ptr, NUM_SLICES)
        n_lo = pid_n * n_per_program
        n_hi = tl.minimum(N, n_lo + n_per_program)
        b_ptr += slot * stride_bl + e * stride_be
        bs_ptr += slot * stride_bsl + e * stride_bse
        if one:
            _expand_row(u_row, b_ptr, bs_ptr, out_ptr + row * stride_op + (col0 + s * N) * stride_oc, offs_r, r_mask,
                        n_lo, n_hi, stride_bn, stride_br, stride_bsn, stride_oc, HAS_B_SCALES, ROW_N, CDT_B)
        else:
            for n0 in range(n_lo, n_hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                _expand_tile(u, b_ptr, bs_ptr, out_ptr, rows, m_mask, offs_r, r_mask, offs_n, offs_n < n_hi,
                             col0 + s * N, stride_bn, stride_br, stride_bsn, stride_op, stride_oc, True, HAS_B_SCALES,
                             CDT_B, DOT_B, PREC_B)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def shrink_config(k: int, rank: int) -> dict:
    """The shrink's launch for x [*, k] x A^T [k, rank]: SHRINK with its tile cut to the shape."""
    return dict(SHRINK, BLOCK_K=_pow2(k, 16, SHRINK["BLOCK_K"]), BLOCK_R=_pow2(rank, 16, 1 << 30))


def expand_config(width: int, rank: int) -> dict:
    """The expand's launch for buf [*, rank] x B^T [rank, width]: EXPAND with its tile cut to the shape."""
    return dict(EXPAND, BLOCK_N=_pow2(width, 16, EXPAND["BLOCK_N"]), BLOCK_R=_pow2(rank, 16, 1 << 30))


def fused_config(k: int, rank: int, width: int) -> dict:
    """The fused op's launch for x [*, k] x A^T [k, rank] x B^T [rank, width] (one slice)."""
    cfg = dict(FUSED, BLOCK_K=_pow2(k, 16, FUSED["BLOCK_K"]), BLOCK_N=_pow2(width, 16, FUSED["BLOCK_N"]),
               BLOCK_R=_pow2(rank, 16, 1 << 30), ROW_K=_pow2(k, 16, FUSED["ROW_K"]),
               ROW_N=_pow2(width, 16, FUSED["ROW_N"]))
    per = triton.cdiv(min(cfg.pop("N_PER_PROGRAM"), width), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    cfg["n_per_program"], cfg["n_programs"] = per, triton.cdiv(width, per)
    return cfg


def _launches(*stacks: Sequence[torch.Tensor] | None):
    """Consecutive slices whose stacks share shapes and strides go in one launch (at most MAX_SLICES)."""
    stacks = [st for st in stacks if st is not None]

    def key(i):
        return tuple((st[i].shape, st[i].stride()) for st in stacks)

    i, n = 0, len(stacks[0])
    while i < n:
        j = i + 1
        while j < n and j - i < MAX_SLICES and key(j) == key(i):
            j += 1
        yield list(range(i, j))
        i = j


def _pair(stack: Sequence[torch.Tensor], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch's slice 0 and 1 tensors (slice 0 twice for a one-slice launch)."""
    return stack[idx[0]], stack[idx[-1]]


def moe_lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor,
                    pairs: MoEPlan) -> torch.Tensor:
    """x [P, in] in pair order, lora_a S x [L, E, r, in], scales [S, L, E] float32 -> [S, P, r] float32;
    rows of pairs without an adapter are 0."""
    rank = lora_a[0].shape[2]
    k = x.shape[1]
    out = torch.zeros(len(lora_a), x.shape[0], rank, dtype=torch.float32, device=x.device)
    groups = pairs.groups.shape[0]
    if groups == 0 or x.shape[0] == 0:
        return out
    cfg = shrink_config(k, rank)
    cdt, dot, prec = compute_types(lora_a[0].dtype, lora_a[0].dtype)
    for idx in _launches(lora_a):
        a0, a1 = _pair(lora_a, idx)
        sc, o = scales[idx[0]:idx[-1] + 1], out[idx[0]:idx[-1] + 1]
        moe_shrink_kernel[(groups, triton.cdiv(LORA_BLOCK, BLOCK_M), len(idx))](
            x, a0, a1, sc, o, pairs.groups,
            k, rank,
            x.stride(0), x.stride(1),
            *a0.stride(),
            *sc.stride(),
            *o.stride(),
            NUM_SLICES=len(idx), BLOCK_M=BLOCK_M, CDT=cdt, DOT=dot, PREC=prec, **cfg,
        )
    return out


def _b_types(out: torch.Tensor, lora_b: Sequence[torch.Tensor]):
    # u (f32) is rounded to B's type for the dot; fp8 B is widened to the output's type instead.
    b_dtype = lora_b[0].dtype
    return compute_types(out.dtype if b_dtype in FP8 else b_dtype, b_dtype)


def moe_lora_expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], pairs: MoEPlan, out: torch.Tensor,
                    offset: int = 0, add: bool = True, *, b_scales: Sequence[torch.Tensor] | None = None) -> None:
    """buf [S, P, r], lora_b S x [L, E, out_s, r], out [P, O] in pair order:
    out[p, offset + sum(out_<s) : offset + sum(out_<=s)] (+)= buf[s, p] @ B_s[slot_p, e_p]^T for pairs with an
    adapter; other rows are not touched. Computed in float32, stored in out.dtype. b_scales: S x [L, E, out_s]
    float32 when lora_b is fp8 (per output channel)."""
    groups = pairs.groups.shape[0]
    if groups == 0 or out.shape[0] == 0:
        return
    rank = buf.shape[2]
    cdt, dot, prec = _b_types(out, lora_b)
    has_bs = b_scales is not None
    col = offset
    for idx in _launches(lora_b, b_scales):
        b0, b1 = _pair(lora_b, idx)
        bs0, bs1 = _pair(b_scales, idx) if has_bs else (buf, buf)  # buf: an unused placeholder
        width = b0.shape[2]
        cfg = expand_config(width, rank)
        n_blocks_n = triton.cdiv(width, cfg["BLOCK_N"])
        u = buf[idx[0]:idx[-1] + 1]
        moe_expand_kernel[(groups, triton.cdiv(LORA_BLOCK, BLOCK_M), len(idx) * n_blocks_n)](
            u, b0, b1, bs0, bs1, out, pairs.groups,
            rank, width, col, n_blocks_n,
            *u.stride(),
            *b0.stride(),
            *(bs0.stride() if has_bs else (0, 0, 0)),
            *out.stride(),
            NUM_SLICES=len(idx), ADD=bool(add), HAS_B_SCALES=has_bs, BLOCK_M=BLOCK_M, CDT=cdt, DOT=dot, PREC=prec,
            **cfg,
        )
        col += width * len(idx)


def moe_lora_fused(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor,
                   lora_b: Sequence[torch.Tensor], pairs: MoEPlan, out: torch.Tensor, offset: int = 0, *,
                   b_scales: Sequence[torch.Tensor] | None = None, rows: torch.Tensor | None = None) -> None:
    """moe_lora_expand(moe_lora_shrink(x[rows], lora_a, scales, pairs), lora_b, pairs, out, offset, add=True,
    b_scales=...) in one launch per slice pair, u never leaving registers (no collective between the two: the default
    LoRA mode). x [P, in] in pair order (rows None) or [N, in] read at rows [P] (the pairs' tokens), lora_a
    S x [L, E, r, in], scales [S, L, E] float32, lora_b S x [L, E, out_s, r], out [P, O]."""
    groups = pairs.groups.shape[0]
    if groups == 0 or out.shape[0] == 0:
        return
    if len(lora_a) != len(lora_b):
        raise ValueError(f"moe_lora_fused: {len(lora_a)} A stacks for {len(lora_b)} B stacks: expected one per slice")
    rank, k = lora_a[0].shape[2], x.shape[1]
    cdt_a, dot_a, prec_a = compute_types(lora_a[0].dtype, lora_a[0].dtype)
    cdt_b, dot_b, prec_b = _b_types(out, lora_b)
    has_bs = b_scales is not None
    col = offset
    for idx in _launches(lora_a, lora_b, b_scales):
        a0, a1 = _pair(lora_a, idx)
        b0, b1 = _pair(lora_b, idx)
        bs0, bs1 = _pair(b_scales, idx) if has_bs else (x, x)  # x: an unused placeholder
        width = b0.shape[2]
        cfg = fused_config(k, rank, width)
        per, n_programs = cfg.pop("n_per_program"), cfg.pop("n_programs")
        sc = scales[idx[0]:idx[-1] + 1]
        moe_fused_kernel[(groups, triton.cdiv(LORA_BLOCK, BLOCK_M), len(idx) * n_programs)](
            x, x if rows is None else rows, a0, a1, sc, b0, b1, bs0, bs1, out, pairs.groups,
            k, rank, width, col, per, n_programs,
            *x.stride(),
            *a0.stride(),
            *sc.stride(),
            *b0.stride(),
            *(bs0.stride() if has_bs else (0, 0, 0)),
            *out.stride(),
            NUM_SLICES=len(idx), HAS_B_SCALES=has_bs, BLOCK_M=BLOCK_M, CDT_A=cdt_a, DOT_A=dot_a, PREC_A=prec_a,
            CDT_B=cdt_b, DOT_B=dot_b, PREC_B=prec_b, GATHER=rows is not None, **cfg, **pdl_args(out),
        )
        released(out)
        col += width * len(idx)
