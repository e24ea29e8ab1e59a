"""The tp all-reduce (or the EP reduce-scatter) fused with the residual add and RMSNorm that follow it, in one
Triton kernel over peer memory: the signature of tp_lora.ops.fused.reduce_add_rms_norm_ref with the group's staging
buffer in place of the group.

Program p pushes its rows of x into every rank's buffer and takes every rank's as they arrive (the exchange of
tp_lora.distributed.peer), sums each row over the ranks in rank order (float32, rounded to x's dtype as the
all-reduce's result is: every rank gets the same bits), then adds the residual and norms as add_rms_norm does, at its
warps (the same bits). One launch instead of all-reduce + add_rms_norm, one one-way trip over NVLink; out8: the normed
rows quantized per token too (tp_lora.ops.fused's out8). x may be a GEMM's SplitSums (its K shares, a LoRA delta):
summed into this rank's rows before they go. scatter: x holds a chunk of rows per rank and each rank pushes rank r's
chunk to rank r only, which norms its own rows (reduce_scatter + add_rms_norm).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.distributed.peer import PeerBuffer
from tp_lora.distributed.peer_kernels import ASM, done_call, exchange, next_call, push_row, push_to, take_row
from tp_lora.ops.split_sums import SplitSums
from tp_lora.ops.triton.fused import add_norm_row, as_rows, check_rows8, load_shares, norm_warps


@triton.jit
def _reduce_add_rms_norm_kernel(x_ptr, col_ptr, row_ptr, d_ptr, res_ptr, w_ptr, xw_ptr, out_ptr, res_out_ptr, q_ptr,
                                qs_ptr, ptrs, pads, epochs, report, limit, rows, keep, s_x, s_part, s_r, s_o, s_ro,
                                s_q, n, eps, slot, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                                HAS_RES: tl.constexpr, NORM_X: tl.constexpr, OFFSET: tl.constexpr, ASM: tl.constexpr,
                                POLL: tl.constexpr, SCATTER: tl.constexpr, Q8: tl.constexpr, PARTS: tl.constexpr,
                                COL: tl.constexpr, ROW: tl.constexpr, DELTA: tl.constexpr):
    p = tl.program_id(0)
    step = tl.num_programs(0)
    i = tl.arange(0, BLOCK)
    ok = i < n
    dt = out_ptr.dtype.element_ty
    e, half = next_call(epochs, p, slot, WORLD)
    for row in range(p, rows, step):
        t = tl.cast(row, tl.int64)
        if SCATTER:  # row t of rank r's chunk (rows apart) to rank r
            for r in tl.static_range(WORLD):
                push_to(ptrs, r, half + RANK * slot + t * n + i, tl.load(x_ptr + (r * rows + t) * s_x + i, mask=ok),
                        ok)
        elif PARTS:  # a GEMM's SplitSums: summed, scaled, its delta added, rounded as the GEMM and expand would
            rs = tl.load(row_ptr + t) if ROW else 1.0
            v = load_shares(x_ptr + t * s_x + i, col_ptr + i, d_ptr + t * s_x + i, ok, rs, s_part, PARTS, COL, DELTA,
                            dt)
            push_row(ptrs, half, slot, t * n, i, v.to(dt), ok, RANK, WORLD)
        else:
            push_row(ptrs, half, slot, t * n, i, tl.load(x_ptr + t * s_x + i, mask=ok), ok, RANK, WORLD)
    exchange(pads, p, e, report, limit, RANK, WORLD, ASM, POLL)
    for row in range(p, rows, step):
        t = tl.cast(row, tl.int64)
        h = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            h += take_row(ptrs, half, slot, t * n, i, ok, r, report, limit, e, p, RANK, dt, POLL, ASM).to(tl.float32)
        h = h.to(dt)
        if row < keep:  # every rank exchanges every row of its chunk; a rank's own rows may be fewer
            if not HAS_RES:  # the stream is the reduced x itself
                tl.store(res_out_ptr + t * s_ro + i, h, mask=ok)
            add_norm_row(h.to(tl.float32), res_ptr + t * s_r, w_ptr, xw_ptr, out_ptr + t * s_o,
                         res_out_ptr + t * s_ro, q_ptr + t * s_q, qs_ptr + t, i, ok, n, eps, HAS_RES, NORM_X, OFFSET,
                         Q8)
    done_call(epochs, p, e)


def reduce_add_rms_norm(x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        offset: bool, x_weight: torch.Tensor | None, buf: PeerBuffer, scatter: bool = False,
                        out8: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., N] this rank's partial sums -> (RMSNorm(sum of x over the ranks + residual), that stream), as
    add_rms_norm of the all-reduced x. buf: the group's staging buffer of x's dtype (PeerAllReduce.buffer). scatter:
    x [world * C, N] holds rank r's rows at r * C.., of which this rank sums and norms its own first rows (the
    residual's, else all C), as add_rms_norm of reduce_scatter(x)[:rows]. x may be a GEMM's SplitSums (not with
    scatter): this rank's rows are their sum (and delta), rounded as the GEMM would have, before the exchange."""
    sums = x if isinstance(x, SplitSums) else None
    if sums is not None and (scatter or sums.parts.stride(-1) != 1 or sums.parts.stride(0) != sums.parts[0].numel()):
        raise ValueError(f"reduce_add_rms_norm: SplitSums need contiguous parts and no scatter, got strides "
                         f"{tuple(sums.parts.stride())}, scatter={scatter}")
    rows = as_rows(x if sums is None else sums.parts[0], "reduce_add_rms_norm's x")
    shape, dtype = (x.shape, x.dtype) if sums is None else (rows.shape, sums.dtype)
    t, n = rows.shape
    keep = t
    if scatter:
        if t % buf.world:
            raise ValueError(f"reduce_add_rms_norm: {t} rows do not split into {buf.world} equal chunks")
        t //= buf.world
        keep = t if residual is None else residual.shape[0]
        if keep > t:
            raise ValueError(f"reduce_add_rms_norm: a residual of {keep} rows against chunks of {t}")
    if not buf.fits(rows[:t]):
        raise ValueError(f"reduce_add_rms_norm: {t} x {n} elements exceed the peer buffer's slot of {buf.slot}")
    out = torch.empty((keep, n) if scatter else shape, dtype=dtype, device=rows.device)
    res_out = torch.empty_like(out)
    res = rows[:keep] if residual is None else as_rows(residual, "reduce_add_rms_norm's residual")
    q, qs, q8 = check_rows8("reduce_add_rms_norm", out8, keep, n, out)
    if q8 > 1:
        raise ValueError(f"reduce_add_rms_norm: out8 quantizes per token over peer memory, got scales per {q8} "
                         f"columns")
    col, row = (None, None) if sums is None else (sums.col, sums.row)
    if t:
        buf.launch("reduce-scatter + norm" if scatter else "all_reduce + norm", rows)
        _reduce_add_rms_norm_kernel[(buf.programs,)](
            rows if sums is None else sums.parts, weight if col is None else col,
            weight if row is None else row.reshape(-1), rows if sums is None or sums.delta is None else sums.delta,
            res, weight, weight if x_weight is None else x_weight, out, res_out, q, qs, buf.ptrs, buf.pads,
            buf.epochs, buf.report.address, buf.limit, t, keep, rows.stride(0), rows.numel(), res.stride(0), n, n,
            q.stride(0), n, float(eps), buf.slot, RANK=buf.rank, WORLD=buf.world, BLOCK=triton.next_power_of_2(n),
            HAS_RES=residual is not None, NORM_X=x_weight is not None, OFFSET=bool(offset), ASM=ASM,
            POLL=buf.polls(t * n * dtype.itemsize * buf.world), SCATTER=scatter, Q8=q8,
            PARTS=0 if sums is None else sums.parts.shape[0], COL=col is not None, ROW=row is not None,
            DELTA=sums is not None and sums.delta is not None, num_warps=norm_warps(keep, n))
    return out, res_out
