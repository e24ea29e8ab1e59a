"""Triton kernels of the LoRA ops. Their launchers live in tp_lora/ops/triton/lora_launch.py.

Notation: T tokens, L adapter slots, r rank, S slices of a packed layer (at most 3 per launch: q/k/v).
Every program reads one row of a work table (slot, start, count) built by schedule.py, and walks the token ids
``order[start : start + count]`` in blocks of BLOCK_M: tokens of one adapter, so it reads that adapter's
weights only. Per-slice weight pointers are passed as separate arguments (w0, w1, w2) and picked by a scalar
branch on the program's slice index: no pointer tables to build, cache or copy per call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tp_lora.ops.triton.dot import mm
from tp_lora.ops.triton.pdl import release_next, wait_prior


@triton.jit
def pick(s, v0, v1, v2, NUM_SLICES: tl.constexpr):
    """v_s for a scalar slice index s (pointers or ints)."""
    v = v0
    if NUM_SLICES > 1:
        if s == 1:
            v = v1
    if NUM_SLICES > 2:
        if s == 2:
            v = v2
    return v


@triton.jit
def _n_block(pid_x, col0, width0, width1, width2, nb_end0, nb_end1, NUM_SLICES: tl.constexpr):
    """(slice, n block within it, first output column, width) of n block pid_x of the slices' concatenated blocks
    (nb_end_s: cumulative block ends)."""
    s = pid_x * 0  # a runtime int32, like the values the branches below assign
    nb = pid_x
    col = col0
    width = width0
    if NUM_SLICES > 1:
        if pid_x >= nb_end0:
            s = 1
            nb = pid_x - nb_end0
            col = col0 + width0
            width = width1
    if NUM_SLICES > 2:
        if pid_x >= nb_end1:
            s = 2
            nb = pid_x - nb_end1
            col = col0 + width0 + width1
            width = width2
    return s, nb, col, width


# Triton specialises integer arguments: multiples of 16 get an alignment hint (what lets loads and stores of a row
# use 16-byte vectors: keep it for strides, widths and offsets) and the value 1 becomes a constant. A constant
# cannot be replaced by another slice's value in a runtime branch, so the launcher never packs a slice whose
# selected values include a 1 with other slices (see _solo in __init__.py). Arguments that only count or index
# scalars are not specialised: that would only multiply compiled variants.
@triton.jit(do_not_specialize=["table_stride", "slice_base", "n_blocks_r", "M_PROGRAMS"])
def shrink_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, as0_ptr, as1_ptr, as2_ptr, scale_ptr, out_ptr, order_ptr, table_ptr,
    K, R, table_stride, slice_base, n_blocks_r,
    stride_xt, stride_xk,
    stride_al0, stride_al1, stride_al2, stride_ar, stride_ak,
    stride_asl, stride_asr,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or,
    M_PROGRAMS,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_A_SCALES: tl.constexpr,
    CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """out[slice_base + s, t, :] (+)= scale[s, slot] * x[t] @ A_s[slot]^T for the tokens t of one table entry.

    x [T, K], A_s [L, R, K] (fp8 with a_scales [L, R] per row, or x's dtype), scale [S, L] f32, out [S, T, R] f32.
    Grid: (table entries, S x n_blocks_r x SPLIT_K, M_PROGRAMS). SPLIT_K == 1: every row is written, entries of
    tokens without an adapter (slot -1) write zeros, so out may start uninitialised. SPLIT_K > 1: each program
    reduces every SPLIT_K-th K block and atomically adds its partial sum into out, which must start zeroed.
    EVEN_K: K is a multiple of BLOCK_K * SPLIT_K (no K mask).
    """
    pid_g = tl.program_id(0)
    pid_x = tl.program_id(1)
    pid_m = tl.program_id(2)
    pid_k = pid_x % SPLIT_K
    pid_n = (pid_x // SPLIT_K) % n_blocks_r
    s = pid_x // (SPLIT_K * n_blocks_r)

    slot = tl.load(table_ptr + pid_g)
    start = tl.load(table_ptr + table_stride + pid_g)
    count = tl.load(table_ptr + 2 * table_stride + pid_g)
    # slot -1: tokens without an adapter (or padding, count 0). They read nothing: no K iterations, zero scales.
    is_lora = slot >= 0
    if SPLIT_K > 1:
        count = tl.where(is_lora, count, 0)  # their rows are already zero
    k_iters = tl.where(is_lora, tl.cdiv(K, BLOCK_K * SPLIT_K), 0)
    slot = tl.maximum(slot, 0).to(tl.int64)  # no address is formed from -1

    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr, NUM_SLICES)
    stride_al = pick(s, stride_al0, stride_al1, stride_al2, NUM_SLICES)
    scale = tl.load(scale_ptr + (slice_base + s) * stride_ss + slot * stride_sl, mask=is_lora, other=0.0)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    if HAS_A_SCALES:
        as_ptr = pick(s, as0_ptr, as1_ptr, as2_ptr, NUM_SLICES)
        row_scale = tl.load(as_ptr + slot * stride_asl + offs_n * stride_asr, mask=n_mask, other=0.0)
        row_scale = tl.where(is_lora, row_scale, 0.0)

    for mb in range(pid_m, tl.cdiv(count, BLOCK_M), M_PROGRAMS):
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        x_blk = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk
        a_blk = a_ptr + slot * stride_al + offs_n[None, :] * stride_ar + offs_k[:, None] * stride_ak
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_iters):
            if EVEN_K:
                xv = tl.load(x_blk, mask=m_mask[:, None], other=0.0)
                av = tl.load(a_blk, mask=n_mask[None, :], other=0.0)
            else:
                k_left = K - kb * BLOCK_K * SPLIT_K
                xv = tl.load(x_blk, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                av = tl.load(a_blk, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
            acc += mm(xv, av, CDT, DOT, PREC)
            x_blk += BLOCK_K * SPLIT_K * stride_xk
            a_blk += BLOCK_K * SPLIT_K * stride_ak
        if HAS_A_SCALES:
            acc = acc * row_scale[None, :]
        acc = acc * scale
        o_ptr = out_ptr + (slice_base + s) * stride_os + tok[:, None] * stride_ot + offs_n[None, :] * stride_or
        o_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(o_ptr, acc, mask=o_mask)
        else:
            tl.atomic_add(o_ptr, acc, mask=o_mask, sem="relaxed")


@triton.jit(do_not_specialize=["table_stride", "slice_base", "nb_end0", "nb_end1", "M_PROGRAMS"])
def expand_kernel(
    buf_ptr, b0_ptr, b1_ptr, b2_ptr, bs0_ptr, bs1_ptr, bs2_ptr, out_ptr, order_ptr, table_ptr,
    R, table_stride, slice_base, col0, width0, width1, width2, nb_end0, nb_end1,
    stride_us, stride_ut, stride_ur,
    stride_bl0, stride_bl1, stride_bl2, stride_bn, stride_bk,
    stride_bsl0, stride_bsl1, stride_bsl2, stride_bsn,
    stride_ot, stride_on,
    M_PROGRAMS,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ADD: tl.constexpr, HAS_B_SCALES: tl.constexpr,
    CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
):
    """out[t, col_s + n] (+)= buf[slice_base + s, t] @ B_s[slot]^T for the tokens t of one table entry.

    buf [S, T, R] (f32), B_s [L, width_s, R] (fp8 with b_scales [L, width_s] per output channel, or 16/32-bit),
    out [T, O]; col_s = col0 + sum of earlier widths. Grid: (table entries, n blocks of all slices, M_PROGRAMS);
    the n-block axis is the concatenation of each slice's cdiv(width_s, BLOCK_N) blocks (nb_end_s: cumulative
    ends), so narrow k/v slices of a GQA layer get only the programs they need.
    """
    pid_g = tl.program_id(0)
    pid_x = tl.program_id(1)
    pid_m = tl.program_id(2)

    s, nb, col, width = _n_block(pid_x, col0, width0, width1, width2, nb_end0, nb_end1, NUM_SLICES)

    slot = tl.load(table_ptr + pid_g)
    start = tl.load(table_ptr + table_stride + pid_g)
    count = tl.load(table_ptr + 2 * table_stride + pid_g)
    count = tl.where(slot >= 0, count, 0)  # tokens without an adapter: their rows are not touched
    slot = tl.maximum(slot, 0).to(tl.int64)

    b_ptr = pick(s, b0_ptr, b1_ptr, b2_ptr, NUM_SLICES)
    stride_bl = pick(s, stride_bl0, stride_bl1, stride_bl2, NUM_SLICES)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_B_SCALES:
        bs_ptr = pick(s, bs0_ptr, bs1_ptr, bs2_ptr, NUM_SLICES)
        stride_bsl = pick(s, stride_bsl0, stride_bsl1, stride_bsl2, NUM_SLICES)
        ch_scale = tl.load(bs_ptr + slot * stride_bsl + offs_n * stride_bsn, mask=n_mask, other=0.0)

    for mb in range(pid_m, tl.cdiv(count, BLOCK_M), M_PROGRAMS):
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tok = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        o_ptr = out_ptr + tok[:, None] * stride_ot + (col + offs_n)[None, :] * stride_on
        o_mask = m_mask[:, None] & n_mask[None, :]
        if ADD:  # issued before the dot: the output tile is the bulk of the bytes, let it be in flight early
            prev = tl.load(o_ptr, mask=o_mask, other=0.0)
        u_blk = buf_ptr + (slice_base + s) * stride_us + tok[:, None] * stride_ut + offs_k[None, :] * stride_ur
        b_blk = b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(R, BLOCK_K)):
            k_left = R - kb * BLOCK_K
            uv = tl.load(u_blk, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            bv = tl.load(b_blk, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
            acc += mm(uv, bv, CDT, DOT, PREC)
            u_blk += BLOCK_K * stride_ur
            b_blk += BLOCK_K * stride_bk
        if HAS_B_SCALES:
            acc = acc * ch_scale[None, :]
        if ADD:
            acc += prev.to(tl.float32)
        tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def embedding_shrink_kernel(
    ids_ptr, slot_ptr, a_ptr, scale_ptr, out_ptr,
    T, R, vocab_start, vocab_local,
    stride_al, stride_av, stride_ar, stride_sl, stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t] = scale[slot_t] * A^T[slot_t, ids[t] - vocab_start] for tokens with an adapter whose id is in this
    rank's vocab range, else 0. ids [T], A^T [L, V_local, R], scale [L] f32 (row 0 of [1, L]), out [T, R] f32,
    every row written. A plain gather: token order does not matter, so no work table. Grid: (cdiv(T, BLOCK_M),)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)
    local = tl.load(ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64) - vocab_start
    hit = m_mask & (slot >= 0) & (local >= 0) & (local < vocab_local)
    slot = tl.maximum(slot, 0).to(tl.int64)
    local = tl.where(hit, local, 0)
    scale = tl.load(scale_ptr + slot * stride_sl, mask=hit, other=0.0)
    rows = tl.load(a_ptr + slot[:, None] * stride_al + local[:, None] * stride_av + offs_n[None, :] * stride_ar,
                   mask=hit[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_or, rows * scale[:, None],
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["slice_base"])
def shrink_rows_kernel(
    x_ptr, a0_ptr, a1_ptr, a2_ptr, as0_ptr, as1_ptr, as2_ptr, scale_ptr, out_ptr, slot_ptr,
    K, R, slice_base,
    stride_xt, stride_xk,
    stride_al0, stride_al1, stride_al2, stride_ar, stride_ak,
    stride_asl, stride_asr,
    stride_ss, stride_sl,
    stride_os, stride_ot, stride_or,
    NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_A_SCALES: tl.constexpr, PDL: tl.constexpr,
):
    """shrink_kernel's result for few tokens, one token per program: out[slice_base + s, t, :] (+)= scale[s, slot_t]
    * x[t] @ A_s[slot_t]^T, a [BLOCK_N, BLOCK_K] tile of A times x's run of K per iteration, reduced on the CUDA
    cores in float32 (no token block padded to a tensor-core tile, no work table). Grid: (T, S x SPLIT_K).
    SPLIT_K == 1 writes every row (zeros for slot -1); SPLIT_K > 1 adds atomically into a zeroed out.
    PDL (tp_lora.ops.triton.pdl): its expand launches once A's loads are done."""
    wait_prior(PDL)
    t = tl.program_id(0)
    pid_x = tl.program_id(1)
    pid_k = pid_x % SPLIT_K
    s = pid_x // SPLIT_K
    slot = tl.load(slot_ptr + t)
    is_lora = slot >= 0
    k_iters = tl.where(is_lora, tl.cdiv(K, BLOCK_K * SPLIT_K), 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    t = t.to(tl.int64)

    a_ptr = pick(s, a0_ptr, a1_ptr, a2_ptr, NUM_SLICES)
    stride_al = pick(s, stride_al0, stride_al1, stride_al2, NUM_SLICES)
    scale = tl.load(scale_ptr + (slice_base + s) * stride_ss + slot * stride_sl, mask=is_lora, other=0.0)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_blk = x_ptr + t * stride_xt + offs_k * stride_xk
    a_blk = a_ptr + slot * stride_al + offs_n[:, None] * stride_ar + offs_k[None, :] * stride_ak
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kb in range(0, k_iters):
        if EVEN_K:
            xv = tl.load(x_blk)
            av = tl.load(a_blk, mask=n_mask[:, None], other=0.0)
        else:
            k_left = K - kb * BLOCK_K * SPLIT_K
            xv = tl.load(x_blk, mask=offs_k < k_left, other=0.0)
            av = tl.load(a_blk, mask=n_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        acc += av.to(tl.float32) * xv.to(tl.float32)[None, :]
        x_blk += BLOCK_K * SPLIT_K * stride_xk
        a_blk += BLOCK_K * SPLIT_K * stride_ak
    release_next(PDL)
    res = tl.sum(acc, 1) * scale
    if HAS_A_SCALES:
        as_ptr = pick(s, as0_ptr, as1_ptr, as2_ptr, NUM_SLICES)
        res = res * tl.load(as_ptr + slot * stride_asl + offs_n * stride_asr, mask=n_mask, other=0.0)
    o_ptr = out_ptr + (slice_base + s) * stride_os + t * stride_ot + offs_n * stride_or
    if SPLIT_K == 1:
        tl.store(o_ptr, res, mask=n_mask)
    else:
        tl.atomic_add(o_ptr, res, mask=offs_n < tl.where(is_lora, R, 0), sem="relaxed")


@triton.jit(do_not_specialize=["slice_base", "nb_end0", "nb_end1"])
def expand_rows_kernel(
    buf_ptr, b0_ptr, b1_ptr, b2_ptr, bs0_ptr, bs1_ptr, bs2_ptr, out_ptr, slot_ptr,
    R, slice_base, col0, width0, width1, width2, nb_end0, nb_end1,
    stride_us, stride_ut, stride_ur,
    stride_bl0, stride_bl1, stride_bl2, stride_bn, stride_bk,
    stride_bsl0, stride_bsl1, stride_bsl2, stride_bsn,
    stride_ot, stride_on,
    NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ADD: tl.constexpr, HAS_B_SCALES: tl.constexpr, CDT: tl.constexpr, PDL: tl.constexpr,
):
    """expand_kernel's result for few tokens, one token per program: out[t, col_s + n] (+)= buf[slice_base + s, t]
    @ B_s[slot_t]^T over one BLOCK_N run of the slices' concatenated columns (as expand_kernel's n-block axis), on
    the CUDA cores in float32 (buf rounded to CDT first, as the dot's operand). Rows of slot -1 are not touched (not
    ADD: set to 0). Grid: (T, n blocks of all slices). PDL: B's tile (written by no kernel) loads before the wait
    for buf's shrink."""
    t = tl.program_id(0).to(tl.int64)
    pid_x = tl.program_id(1)
    s, nb, col, width = _n_block(pid_x, col0, width0, width1, width2, nb_end0, nb_end1, NUM_SLICES)
    slot = tl.load(slot_ptr + t)
    is_lora = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    b_ptr = pick(s, b0_ptr, b1_ptr, b2_ptr, NUM_SLICES)
    stride_bl = pick(s, stride_bl0, stride_bl1, stride_bl2, NUM_SLICES)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < tl.where(is_lora, width, 0)  # (a mask `& is_lora` trips the interpreter)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < tl.where(is_lora, R, 0)
    o_ptr = out_ptr + t * stride_ot + (col + offs_n) * stride_on
    bv = tl.load(b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                 mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    wait_prior(PDL)
    if ADD:
        prev = tl.load(o_ptr, mask=n_mask, other=0.0)
    u = tl.load(buf_ptr + (slice_base + s) * stride_us + t * stride_ut + offs_k * stride_ur, mask=k_mask, other=0.0)
    acc = tl.sum(bv.to(tl.float32) * u.to(CDT).to(tl.float32)[None, :], 1)
    if HAS_B_SCALES:
        bs_ptr = pick(s, bs0_ptr, bs1_ptr, bs2_ptr, NUM_SLICES)
        stride_bsl = pick(s, stride_bsl0, stride_bsl1, stride_bsl2, NUM_SLICES)
        acc = acc * tl.load(bs_ptr + slot * stride_bsl + offs_n * stride_bsn, mask=n_mask, other=0.0)
    if ADD:
        acc += prev.to(tl.float32)
    else:  # every row: 0 where slot -1 (its B and buf loads masked to 0)
        n_mask = offs_n < width
    tl.store(o_ptr, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def lora_epilogue_kernel(out_ptr, scale_ptr, bias_ptr, base_bias_ptr, token_slot_ptr, P, out_stride, w_stride,
                         HAS_BASE_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (token, BLOCK_N columns): out = scale[slot] * (out - base_bias) + base_bias + bias[slot] for
    a token with an adapter (slot >= 0); tokens without one exit at once."""
    t = tl.program_id(0)
    slot = tl.load(token_slot_ptr + t)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < P
    ptrs = out_ptr + t.to(tl.int64) * out_stride + cols
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(scale_ptr + slot.to(tl.int64) * w_stride + cols, mask=mask, other=1.0)
    b = tl.load(bias_ptr + slot.to(tl.int64) * w_stride + cols, mask=mask, other=0.0)
    if HAS_BASE_BIAS:
        bb = tl.load(base_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y - bb) * g + bb + b
    else:
        y = y * g + b
    tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
