"""Triton fused MoE LoRA ops: moe_lora_shrink / moe_lora_expand with the signatures and semantics of
tp_lora.ops.moe_ref (read its docstring for the pair order and shapes).

One launch per call covers every (local expert, adapter slot) group and every slice (w1 and w3 together). The grid is
(LoRA blocks of the routing plan, token blocks of the largest block, slices x output blocks [x K splits: shrink]); a
program reads its block's row of the plan's [B, 4] (expert, slot, start, count) table and walks rows start .. start +
count of the pair-ordered input, so it reads one expert's weights of one adapter only, once for the block's pairs.
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

__all__ = ["moe_lora_shrink", "moe_lora_expand"]

MAX_SLICES = 2  # w1 | w3 in one launch; more slices are split into several launches
BLOCK_M = LORA_BLOCK  # pairs per program: one LoRA block of the plan, so A / B are read once per block
# Launch settings. Both ops are bound by the A / B bytes of the (expert, adapter) groups a step touches: at decode a
# group is one or two pairs, so a program reads r x in of A for a few rows of x. The shrink splits the reduction
# (SPLIT_K programs per block, partial sums added atomically into the zeroed output) so that enough A tiles are in
# flight; the expand cuts a slice's outputs into BLOCK_N columns, one B tile each (K = r is one tile).
SHRINK = dict(BLOCK_K=128, SPLIT_K=1, num_warps=2, num_stages=4)
EXPAND = dict(BLOCK_N=256, num_warps=4, num_stages=2)


@triton.jit
def moe_shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, scale_ptr, out_ptr, groups_ptr,
    K, R, n_blocks_r,
    stride_xp, stride_xk,
    stride_al, stride_ae, stride_ar, stride_ak,
    stride_ss, stride_sl, stride_se,
    stride_os, stride_op, stride_or,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """out[s, p, :] (+)= scale[s, slot, e] * x[p] @ A_s[slot, e]^T for the pairs p of one (expert e, slot) group, over
    every SPLIT_K-th BLOCK_K run of K from the program's split (SPLIT_K > 1: added atomically into a zeroed out).
    x [P, K], A_s [L, E, R, K], scale [S, L, E] f32, out [S, P, R] f32."""
    pid_g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_x = tl.program_id(2)
    pid_k = pid_x % SPLIT_K
    s = pid_x // SPLIT_K // n_blocks_r
    pid_n = pid_x // SPLIT_K % n_blocks_r
    e = tl.load(groups_ptr + pid_g * 4).to(tl.int64)
    slot = tl.load(groups_ptr + pid_g * 4 + 1).to(tl.int64)
    start = tl.load(groups_ptr + pid_g * 4 + 2)
    count = tl.load(groups_ptr + pid_g * 4 + 3)
    if pid_m * BLOCK_M < count:
        a_ptr = a0_ptr
        if NUM_SLICES > 1:
            if s == 1:
                a_ptr = a1_ptr
        scale = tl.load(scale_ptr + s * stride_ss + slot * stride_sl + e * stride_se)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = (start + offs_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < R
        offs_k = tl.arange(0, BLOCK_K)
        k0 = pid_k * BLOCK_K
        x_blk = x_ptr + rows[:, None] * stride_xp + (k0 + offs_k[None, :]) * stride_xk
        a_blk = (a_ptr + slot * stride_al + e * stride_ae + offs_n[None, :] * stride_ar
                 + (k0 + offs_k[:, None]) * stride_ak)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
            k_left = K - kb * BLOCK_K
            xv = tl.load(x_blk, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            av = tl.load(a_blk, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
            acc += mm(xv, av, CDT, DOT, PREC)
            x_blk += BLOCK_K * SPLIT_K * stride_xk
            a_blk += BLOCK_K * SPLIT_K * stride_ak
        o_ptr = out_ptr + s * stride_os + rows[:, None] * stride_op + offs_n[None, :] * stride_or
        if SPLIT_K == 1:
            tl.store(o_ptr, acc * scale, mask=m_mask[:, None] & n_mask[None, :])
        else:
            tl.atomic_add(o_ptr, acc * scale, mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")


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
    (any float dtype; accumulated in float32)."""
    pid_g = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_x = tl.program_id(2)
    s = pid_x // n_blocks_n
    pid_n = pid_x % n_blocks_n
    e = tl.load(groups_ptr + pid_g * 4).to(tl.int64)
    slot = tl.load(groups_ptr + pid_g * 4 + 1).to(tl.int64)
    start = tl.load(groups_ptr + pid_g * 4 + 2)
    count = tl.load(groups_ptr + pid_g * 4 + 3)
    if pid_m * BLOCK_M < count:
        b_ptr = b0_ptr
        bs_ptr = bs0_ptr
        if NUM_SLICES > 1:
            if s == 1:
                b_ptr = b1_ptr
                bs_ptr = bs1_ptr
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = (start + offs_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        u_blk = buf_ptr + s * stride_us + rows[:, None] * stride_up + offs_r[None, :] * stride_ur
        b_blk = b_ptr + slot * stride_bl + e * stride_be + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for rb in range(0, tl.cdiv(R, BLOCK_R)):
            r_left = R - rb * BLOCK_R
            uv = tl.load(u_blk, mask=m_mask[:, None] & (offs_r[None, :] < r_left), other=0.0)
            bv = tl.load(b_blk, mask=(offs_r[:, None] < r_left) & n_mask[None, :], other=0.0)
            acc += mm(uv, bv, CDT, DOT, PREC)
            u_blk += BLOCK_R * stride_ur
            b_blk += BLOCK_R * stride_br
        if HAS_B_SCALES:
            ch_scale = tl.load(bs_ptr + slot * stride_bsl + e * stride_bse + offs_n * stride_bsn, mask=n_mask,
                               other=0.0)
            acc = acc * ch_scale[None, :]
        o_ptr = out_ptr + rows[:, None] * stride_op + (col0 + s * N + offs_n[None, :]) * stride_oc
        o_mask = m_mask[:, None] & n_mask[None, :]
        if ADD:
            acc += tl.load(o_ptr, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(1, n))))


def shrink_config(k: int, rank: int) -> dict:
    """The shrink's launch for x [*, k] x A^T [k, rank]: SHRINK with its tile cut to the shape."""
    cfg = dict(SHRINK, BLOCK_N=_pow2(rank, 16, 64))
    cfg["BLOCK_K"] = _pow2(k, 16, cfg["BLOCK_K"])
    cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, cfg["BLOCK_K"])))
    return cfg


def expand_config(width: int, rank: int) -> dict:
    """The expand's launch for buf [*, rank] x B^T [rank, width]: EXPAND with its tile cut to the shape."""
    return dict(EXPAND, BLOCK_N=_pow2(width, 16, EXPAND["BLOCK_N"]), BLOCK_R=_pow2(rank, 16, 64))


def _launches(weights: Sequence[torch.Tensor], scales: Sequence[torch.Tensor] | None = None):
    """Consecutive slices that share a shape and strides (and their fp8 scales' strides) go in one launch (at most
    MAX_SLICES)."""
    def key(i):
        return (weights[i].shape, weights[i].stride()) + ((scales[i].stride(),) if scales is not None else ())

    i = 0
    while i < len(weights):
        j = i + 1
        while j < len(weights) and j - i < MAX_SLICES and key(j) == key(i):
            j += 1
        yield list(range(i, j))
        i = j


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
    block_n, split = cfg.pop("BLOCK_N"), cfg["SPLIT_K"]
    n_blocks_r = triton.cdiv(rank, block_n)
    cdt, dot, prec = compute_types(lora_a[0].dtype, lora_a[0].dtype)
    for idx in _launches(lora_a):
        a = [lora_a[i] for i in idx]
        a1 = a[1] if len(a) > 1 else a[0]
        sc, o = scales[idx[0]:idx[-1] + 1], out[idx[0]:idx[-1] + 1]
        grid = (groups, triton.cdiv(LORA_BLOCK, BLOCK_M), len(idx) * n_blocks_r * split)
        moe_shrink_kernel[grid](
            x, a[0], a1, sc, o, pairs.groups,
            k, rank, n_blocks_r,
            x.stride(0), x.stride(1),
            a[0].stride(0), a[0].stride(1), a[0].stride(2), a[0].stride(3),
            sc.stride(0), sc.stride(1), sc.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            NUM_SLICES=len(idx), BLOCK_M=BLOCK_M, BLOCK_N=block_n, CDT=cdt, DOT=dot, PREC=prec, **cfg,
        )
    return out


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
    # buf (f32) is rounded to B's type for the dot; fp8 B is widened to the output's type instead.
    b_dtype = lora_b[0].dtype
    cdt, dot, prec = compute_types(out.dtype if b_dtype in FP8 else b_dtype, b_dtype)
    has_bs = b_scales is not None
    col = offset
    for idx in _launches(lora_b, b_scales):
        b = [lora_b[i] for i in idx]
        b1 = b[1] if len(b) > 1 else b[0]
        bs = [b_scales[i] for i in idx] if has_bs else [buf]  # buf: an unused placeholder
        bs1 = bs[1] if len(bs) > 1 else bs[0]
        width = b[0].shape[2]
        cfg = expand_config(width, rank)
        n_blocks_n = triton.cdiv(width, cfg["BLOCK_N"])
        u = buf[idx[0]:idx[-1] + 1]
        grid = (groups, triton.cdiv(LORA_BLOCK, BLOCK_M), len(idx) * n_blocks_n)
        moe_expand_kernel[grid](
            u, b[0], b1, bs[0], bs1, out, pairs.groups,
            rank, width, col, n_blocks_n,
            u.stride(0), u.stride(1), u.stride(2),
            b[0].stride(0), b[0].stride(1), b[0].stride(2), b[0].stride(3),
            *(bs[0].stride() if has_bs else (0, 0, 0)),
            out.stride(0), out.stride(1),
            NUM_SLICES=len(idx), ADD=bool(add), HAS_B_SCALES=has_bs, BLOCK_M=BLOCK_M, CDT=cdt, DOT=dot, PREC=prec,
            **cfg,
        )
        col += width * len(idx)
