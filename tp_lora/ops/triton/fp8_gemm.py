"""Triton FP8 GEMMs of the base layers (tp_lora.ops.fp8.fp8_linear dispatches here), with the signatures of their
references in tp_lora.ops.fp8:

    w8a16_mm(x [M, K], w [N, K] fp8, scale, block_k, cfg=None, x_scale=None, out_dtype=None) -> [M, N]
        in x's dtype, or out_dtype (decode: M <= 64)
    w8a8_mm(xq [M, K] fp8, xs, w [N, K] fp8, scale, block_k, out_dtype, cfg=None) -> [M, N]  (block scales, prefill)

scale: [N] per output channel (block_k None) or [N, ceil(K / block_k)] per block of block_k columns; xs: [M,
ceil(K / block_k)] per (token, block_k columns) (tp_lora.ops.triton.fp8_quant.quantize_per_group). w8a16_mm also
takes 16-bit weights in x's dtype with scale None (tp_lora.ops.mm16: 16-bit layers at decode, w16_config).

w8a16_mm: the decode GEMM. Few rows make the GEMM a stream of the weights, so programs own BLOCK_N output columns
and a 1 / SPLIT_K share of K, enough of them to keep every SM's loads in flight; launched early (PDL), a program
asks L2 for its first weight tiles before it waits on the kernel before it. Weight-only: the fp8 tile is widened
to x's dtype in registers (exact) and block scales multiply each K tile's float32 partial sum. SWAP computes the
transposed tile (w [BLOCK_N, BLOCK_K] @ x^T): the weight rows fill the MMA's 64-row side, so Hopper runs its
warp-group MMA with the widened weights from registers where BLOCK_M (the rows, 16 to 64) would be too few for it.
ACT8 (transposed tile, fp8 weights): each row's K tile of x is quantized to e4m3 in the kernel, scale amax / 448
(per row and BLOCK_K columns: what quantize_per_group computes), and the tile product runs on the fp8 tensor cores,
scaled per row: no widening of the weights, whose conversion bounds the weight-only form's speed.
XQ (x_scale given: x is fp8, quantized per token by its producer, x ~= x * x_scale[:, None]; per-channel weights):
the fp8 tiles go from memory straight into the fp8 tensor cores and the products accumulate there, both scales
applied once at the end. ACT8's per-tile round trip of x through registers and its per-tile scaling are what make
it slower than this form (scripts/tune_fp8_gemm.py's XQ rows). ACT8 with x_scale given (G8): x is fp8, quantized
per (row, BLOCK_K columns) by its producer as ACT8 would quantize it (decode attention, a head a group), x_scale
[M, K / BLOCK_K]: ACT8's product and its bits without its quantization in the main loop.

With SPLIT_K > 1 each program stores its partial tile in a float32 workspace [SPLIT_K, M, N] and takes a ticket on
its column block's counter; the last one to arrive sums the SPLIT_K partials in split order, REDUCE tiles in flight
at a time (the output does not depend on arrival order), applies the channel scales (loaded before the main loop),
writes the output and resets the counter to 0: one launch, no zero fill, capturable in a CUDA graph
(tp_lora.ops.triton.tickets). With sums, the programs only store their partials and the GEMM returns them as
SplitSums: the op that reads the output (the next norm) sums them while it loads it, and no program waits on a
ticket and a second round of loads at the GEMM's end.

w8a8_mm: both operands fp8 on the fp8 tensor cores, float32 accumulation, the block scales (activations per token
and block_k columns, weights per row and block) multiplying each K tile's product in the main loop. Tiles are
ordered in groups of GROUP_M row blocks so a wave of programs shares its weight tiles in L2. cuBLAS's block-scaled
GEMM beats it where torch has one (tp_lora.ops.fp8.blockwise_mm); this is the path elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.split_sums import SplitSums
from tp_lora.ops.triton.configs import DEFAULT_NUM_SMS
from tp_lora.ops.triton.dot import check_act8, compute_types, fp8_dot, mm
from tp_lora.ops.triton.pdl import pdl_args, prefetch, release_next, released, wait_prior
from tp_lora.ops.triton.tickets import tickets

SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK = 0, 1, 2  # w8a16_mm's scale layouts
MAX_ROWS = 64  # w8a16_mm takes one row block of up to this many rows
REDUCE = tl.constexpr(4)  # partial tiles the last split loads at once
PREFETCH_TILES = tl.constexpr(2)  # a program's first weight tiles asked into L2 before its PDL wait

W8A16_DEFAULT = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, SWAP=False, ACT8=False, num_warps=4, num_stages=3)
# 16-bit weights of a vocabulary shard (tens of thousands of rows): one program streams all of K for 64 rows
HEAD_CONFIG = dict(W8A16_DEFAULT, SWAP=True)
# 16-bit projections: tiles of XQ's bytes (64 rows x 128 K), K shares as XQ's (w16_config)
W16 = dict(W8A16_DEFAULT, BLOCK_K=128, num_stages=6, SWAP=True)
NARROW_BLOCKS, NARROW_SHARE = 2, 512  # w16_config's narrow layers (column blocks) and their K shares' width
# W8A8 tiles at prefill sizes (scripts/tune_fp8_gemm.py picks them)
W8A8_BLOCK = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


@triton.jit
def prefetch_weights(w_ptr, offs_n, N, s_wn, k_lo, k_hi, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Ask L2 for a program's first PREFETCH_TILES weight tiles (rows offs_n, columns from k_lo up to k_hi) before
    its PDL wait: no kernel writes the weights."""
    if PDL:
        line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements of a 128-byte line
        cols = k_lo + tl.arange(0, (PREFETCH_TILES * BLOCK_K + line - 1) // line) * line
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        prefetch(w_ptr + rows[:, None] * s_wn + tl.where(cols < k_hi, cols, k_lo)[None, :], True, PDL)


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_split, s_xm, s_wn, s_om, s_sn,
                  s_xsm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALES: tl.constexpr, SCALE_K: tl.constexpr, CDT: tl.constexpr, DOT: tl.constexpr,
                  PREC: tl.constexpr, SWAP: tl.constexpr, ACT8: tl.constexpr, DOT8: tl.constexpr, XQ: tl.constexpr,
                  G8: tl.constexpr, SUMS: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    s_row = s_ptr + offs_n.to(tl.int64) * s_sn
    if SCALES == 1:  # loaded first (before the wait: weights' scales): off the critical path of the last split
        s_n = tl.load(s_row, mask=n_mask, other=0.0)
    prefetch_weights(w_ptr, offs_n, N, s_wn, k_lo, k_hi, BLOCK_K, PDL)
    wait_prior(PDL)
    if XQ:
        s_m = tl.load(xs_ptr + rows, mask=m_mask, other=0.0)
    if SWAP:  # acc [BLOCK_N, BLOCK_M] = w [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]
        x_blk = x_ptr + rows[None, :] * s_xm + offs_k[:, None]
        w_blk = w_ptr + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:  # acc [BLOCK_M, BLOCK_N] = x [BLOCK_M, BLOCK_K] @ w^T [BLOCK_K, BLOCK_N]
        x_blk = x_ptr + rows[:, None] * s_xm + offs_k[None, :]
        w_blk = w_ptr + offs_n[None, :].to(tl.int64) * s_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k0
        if SWAP:
            wv = tl.load(w_blk + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xv = tl.load(x_blk + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            if XQ:  # fp8 rows: accumulated in place, scaled at the end
                part = tl.dot(wv.to(DOT8), xv.to(DOT8))
            elif G8:  # ACT8's product, the rows' K tiles quantized by their producer
                xs = tl.load(xs_ptr + rows * s_xsm + k0 // BLOCK_K, mask=m_mask, other=0.0)
                part = tl.dot(wv.to(DOT8), xv.to(DOT8)) * xs[None, :]
            elif ACT8:  # each row's K tile to fp8 (scale: its amax / 448), the product on the fp8 tensor cores
                xv = xv.to(tl.float32)
                xs = tl.maximum(tl.max(tl.abs(xv), axis=0) / 448.0, 1e-12)
                part = tl.dot(wv.to(DOT8), (xv / xs[None, :]).to(tl.float8e4nv).to(DOT8)) * xs[None, :]
            else:
                part = mm(wv, xv, CDT, DOT, PREC)
        else:
            xv = tl.load(x_blk + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            part = mm(xv, tl.load(w_blk + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0), CDT, DOT, PREC)
        if SCALES == 2:  # BLOCK_K divides SCALE_K: one scale per weight row of this K tile
            s_k = tl.load(s_row + k0 // SCALE_K, mask=n_mask, other=0.0)
            part *= s_k[:, None] if SWAP else s_k[None, :]
        acc += part
    release_next(PDL)
    if SWAP:
        acc = tl.trans(acc)
    o = out_ptr + rows[:, None] * s_om + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    split = tl.num_programs(1)
    tile = rows[:, None] * N + offs_n[None, :]
    if SUMS:  # the reader sums the shares (SplitSums)
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=o_mask)
    elif split > 1:
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=o_mask)
        tl.debug_barrier()  # every thread's partial stored before the ticket publishes them
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:  # the last split of this column block: sum the partials in split order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s0 in range(0, split, REDUCE):  # REDUCE loads in flight at a time
                for j in tl.static_range(REDUCE):
                    acc += tl.load(ws_ptr + (s0 + j) * M * N + tile, mask=o_mask & (tile * 0 + s0 + j < split),
                                   other=0.0, cache_modifier=".cg")
            if SCALES == 1:
                acc *= s_n[None, :]
            if XQ:
                acc *= s_m[:, None]
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
    else:
        if SCALES == 1:
            acc *= s_n[None, :]
        if XQ:
            acc *= s_m[:, None]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def w8a16_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block_k: int | None,
             cfg: dict | None = None, x_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, sums: bool = False) -> torch.Tensor | SplitSums:
    """cfg: BLOCK_N, BLOCK_K, SPLIT_K (the K shares; fewer where K has fewer tiles), SWAP, ACT8 (implies SWAP),
    num_warps, num_stages. scale None: w holds x's dtype (16-bit weights, no scales). x_scale [M] or [M, 1]
    float32: x is fp8 quantized per row (XQ; per-channel fp8 weights), the output in out_dtype (16-bit); with ACT8,
    x_scale [M, ceil(K / BLOCK_K)]: x is fp8 quantized per (row, K tile) as ACT8 does it (G8). sums:
    where K is split and the output 16-bit, the shares' partial sums (SplitSums) for a reader that adds them, instead
    of the output (a float32 reader could fuse the scaling with what follows, which rounds differently)."""
    cfg = {**W8A16_DEFAULT, **(cfg or {})}
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    g8 = x_scale is not None and cfg["ACT8"]
    xq = x_scale is not None and not g8
    out_dtype = out_dtype or x.dtype
    if xq and (x.dtype != w.dtype or w.dtype != torch.float8_e4m3fn or scale is None or block_k is not None
               or x_scale.numel() != m or out_dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"w8a16_mm: fp8 rows with their scales (x_scale of {m} values) multiply per-channel fp8 "
                         f"weights into 16-bit outputs; got {x.dtype} rows, {w.dtype} weights, block_k {block_k}, "
                         f"x_scale of {x_scale.numel()} values, out_dtype {out_dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"w8a16_mm takes up to {MAX_ROWS} rows, got {m}")
    if w.stride(-1) != 1:
        raise ValueError(f"w8a16_mm: w needs a unit stride along K, got strides {tuple(w.stride())}")
    if scale is None and w.dtype != x.dtype and not xq:
        raise ValueError(f"w8a16_mm: {w.dtype} weights need scales (without them, w must have x's {x.dtype})")
    bk = cfg["BLOCK_K"] if block_k is None else min(cfg["BLOCK_K"], block_k)
    if g8 and (x.dtype != torch.float8_e4m3fn or tuple(x_scale.shape) != (m, triton.cdiv(k, bk))
               or x_scale.stride(1) != 1 or out_dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"w8a16_mm: ACT8 of fp8 rows takes their scales [{m}, {triton.cdiv(k, bk)}] (one a row and "
                         f"{bk} columns) into 16-bit outputs; got {x.dtype} rows, x_scale {tuple(x_scale.shape)}, "
                         f"out_dtype {out_dtype}")
    if cfg["ACT8"]:
        check_act8("w8a16_mm: ACT8", w, scale)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(k, bk)
    split = max(1, min(cfg["SPLIT_K"], tiles))
    k_split = triton.cdiv(tiles, split) * bk
    split = triton.cdiv(k, k_split)
    grid_n = triton.cdiv(n, cfg["BLOCK_N"])
    cnt = tickets(x.device, grid_n)
    # one compiled kernel for every split: without splits the workspace is never touched (any float32 pointer)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else cnt.view(torch.float32)
    sums = sums and split > 1 and out_dtype in (torch.bfloat16, torch.float16)
    scales = SCALE_NONE if scale is None else SCALE_CHANNEL if block_k is None else SCALE_BLOCK
    scale = cnt.view(torch.float32) if scale is None else scale.contiguous()
    col = scale if scales == SCALE_CHANNEL else None
    cdt, dot, prec = compute_types(out_dtype, w.dtype)
    _w8a16_kernel[(grid_n, split)](
        x, x_scale.reshape(-1) if xq else x_scale if g8 else scale, w, scale, out, ws, cnt, m, n, k, k_split,
        x.stride(0), w.stride(0), out.stride(0), scale.stride(0), x_scale.stride(0) if g8 else 0,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, SCALES=scales,
        SCALE_K=block_k or 1, CDT=cdt, DOT=dot, PREC=prec, SWAP=cfg["SWAP"] or cfg["ACT8"] or xq,
        ACT8=cfg["ACT8"] and not xq and not g8, DOT8=fp8_dot(), XQ=xq, G8=g8, SUMS=sums, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(x))
    if sums:
        released(ws)
        return SplitSums(ws, col, x_scale.reshape(-1) if xq else None, out_dtype)
    released(out)
    return out


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, M, N, K, s_am, s_ask, s_bn, s_bsn, s_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SCALE_K: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * grid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_blk = a_ptr + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :]
    b_blk = b_ptr + offs_n[None, :].to(tl.int64) * s_bn + offs_k[:, None]
    as_row = as_ptr + offs_m  # token-major activation scales: the K groups s_ask apart
    bs_row = bs_ptr + offs_n.to(tl.int64) * s_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_blk + k0, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_blk + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # BLOCK_K divides SCALE_K: one scale per row of A and of B in this K tile
        sa = tl.load(as_row + (k0 // SCALE_K) * s_ask, mask=m_mask, other=0.0)
        sb = tl.load(bs_row + k0 // SCALE_K, mask=n_mask, other=0.0)
        acc += tl.dot(a.to(DOT), b.to(DOT)) * sa[:, None] * sb[None, :]
    o = out_ptr + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block_k: int,
            out_dtype: torch.dtype, cfg: dict | None = None) -> torch.Tensor:
    """cfg: BLOCK_M, BLOCK_N, BLOCK_K (at most block_k), GROUP_M, num_warps, num_stages. xs token-major (stride 1
    along M, as quantize_per_group makes it) or any other strides."""
    cfg = {**W8A8_BLOCK, **(cfg or {})}
    m, k = xq.shape
    n = w.shape[0]
    if xq.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"w8a8_mm: operands need a unit stride along K, got {tuple(xq.stride())} and "
                         f"{tuple(w.stride())}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    if xs.stride(0) != 1:
        xs = xs.t().contiguous().t()
    scale = scale.contiguous()
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_kernel[grid](
        xq, xs, w, scale, out, m, n, k, xq.stride(0), xs.stride(1), w.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=min(cfg["BLOCK_K"], block_k),
        GROUP_M=cfg["GROUP_M"], SCALE_K=block_k, DOT=fp8_dot(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def w8a16_config(m: int, n: int, k: int, act8: bool = False, xq: bool = False, g8: bool = False,
                 sms: int = DEFAULT_NUM_SMS) -> dict:
    """The launch configuration of w8a16_mm for m rows and a weight [n, k]. Weight-only: 64 columns x 128 K per
    tile, 4 warps, 3 stages, the transposed tile (SWAP) past 16 rows, and the most K shares (up to 8, each at least
    1024 wide) that keep the programs within 512 (256 past 32 rows, where each program's tile costs more); chosen
    with scripts/bench_decode_gemm.py --weights fp8. act8 (ACT8, rows up to 32): 128 x 128 tiles, 8 warps, 4
    stages, K shares by _act8_splits within 256 programs; wide layers (out >= 3 x in and >= 12288: gate_up at tp1 /
    tp2) 256 x 128 tiles, 5 stages, within 128 programs; chosen with scripts/tune_fp8_gemm.py (its ACT8 rows, at
    tp1 / tp2 / tp4's layer shapes). xq (fp8 rows, XQ): wide layers 128 x 128 tiles, 8 warps, 5 stages, K whole;
    else 64 x 256 tiles, 4 warps, 6 stages and K shares by _xq_splits for the device's sms; chosen from a sweep of
    tiles, stages and shares at the 8B layers' tp1 / tp2 / tp4 shapes (BENCHMARKS.md). g8 (ACT8 of rows quantized
    per group by their producer, G8): 64 x 128 tiles, 4 warps, 4 stages, K shares by _splits within 256 programs
    (each product is scaled per K tile: narrower tiles keep more of them in flight); chosen from 48 launch
    configurations at o_proj's and down_proj's tp1 / tp2 shapes."""
    if g8:
        return dict(W8A16_DEFAULT, num_stages=4, SWAP=True, ACT8=True,
                    SPLIT_K=_splits(triton.cdiv(n, W8A16_DEFAULT["BLOCK_N"]), k, 256))
    wide = n >= 3 * k and n >= 12288  # not tp4's o (4096 x 1024): 16 programs of 256 columns
    if xq and wide:
        return dict(W8A16_DEFAULT, BLOCK_N=128, num_warps=8, num_stages=5, SWAP=True)
    if xq:
        return dict(W8A16_DEFAULT, BLOCK_K=256, num_stages=6, SWAP=True,
                    SPLIT_K=_xq_splits(triton.cdiv(n, W8A16_DEFAULT["BLOCK_N"]), k, sms))
    if act8:
        block_n = 256 if wide else 128
        return dict(W8A16_DEFAULT, BLOCK_N=block_n, num_warps=8, num_stages=5 if wide else 4, ACT8=True,
                    SWAP=True, SPLIT_K=_act8_splits(triton.cdiv(n, block_n), k, 128 if wide else 256))
    return dict(W8A16_DEFAULT, SPLIT_K=_splits(triton.cdiv(n, W8A16_DEFAULT["BLOCK_N"]), k, 512 if m <= 32 else 256),
                SWAP=m > 16)


def w16_config(n: int, k: int, head: bool = False, sms: int = DEFAULT_NUM_SMS) -> dict:
    """w8a16_mm's launch for decode rows of 16-bit weights [n, k] (no scales): a vocabulary shard (head) HEAD_CONFIG;
    layers of at most NARROW_BLOCKS column blocks (MoE routers) K shares of NARROW_SHARE columns (up to 4), so a few
    more programs stream their few weights; else W16 with XQ's K shares (_xq_splits) for the device's sms, their
    widths counted in bytes (a 16-bit share half as many columns as an fp8 one)."""
    if head:
        return dict(HEAD_CONFIG)
    blocks = triton.cdiv(n, W16["BLOCK_N"])
    split = min(4, max(1, k // NARROW_SHARE)) if blocks <= NARROW_BLOCKS else _xq_splits(blocks, 2 * k, sms)
    return dict(W16, SPLIT_K=split)


def _splits(blocks: int, k: int, budget: int) -> int:
    """The most K shares (up to 8, each at least 1024 wide) that keep blocks x shares programs within budget."""
    split = 1
    while split < 8 and blocks * split * 2 <= budget and k // (split * 2) >= 1024:
        split *= 2
    return split


def _xq_splits(blocks: int, k: int, sms: int) -> int:
    """K shares of the XQ form (k: a weight row's bytes): doubled (up to 4, each at least 1024 bytes wide) while
    blocks x shares stay within one wave of sms programs, and only where the programs are still fewer than 64 or the
    shares stay at least 4096 bytes wide (a second wave, or short shares among enough programs, cost more than a
    share saves)."""
    split = 1
    while (split < 4 and blocks * split * 2 <= sms and k // (split * 2) >= 1024
           and (blocks * split < 64 or k // (split * 2) >= 4096)):
        split *= 2
    return split


def _act8_splits(blocks: int, k: int, budget: int) -> int:
    """The fewest K shares (up to 8, blocks x shares within budget) at most 1024 wide, halved once more (to at least
    512) where 64 programs or fewer would run: a program's ~8 K tiles cover its fixed costs, and short layers (tp4's
    qkv / o, tp2's o) need the programs to keep the loads in flight."""
    split = 1
    while split < 8 and k > split * 1024 and blocks * split * 2 <= budget:
        split *= 2
    if split < 8 and blocks * split <= 64 and k // (split * 2) >= 512 and blocks * split * 2 <= budget:
        split *= 2
    return split
