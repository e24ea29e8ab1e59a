"""Launchers of the Triton LoRA kernels (kernels.py): shrink, expand, embedding_shrink with the signatures and
semantics of tp_lora.ops.torch_ref.

Scheme selection (the project's ``lora.kernel=sorted|chunked``): ``set_scheme("sorted")`` or
``set_scheme("chunked", segment_size=None)`` for the process, or ``scheme=`` on a single call. schedule.py explains
both. Default: "chunked" (its grid is bounded by the tokens, not by max_loras x tokens; see BENCHMARKS.md).

No call here reads a device value on the host: launch grids come from T, max_loras, the weight shapes and the
batch's host-side tuples, so a decode step can be captured in a CUDA graph (call ``prepare(batch)`` right after
building the batch, so that its one host->device copy of the work table happens outside the captured region).

FP8 weights: A and/or B may be torch.float8_e4m3fn with per-channel float32 scales (``a_scales`` S x [L, r],
``b_scales`` S x [L, out_s]; see tp_lora.ops.fp8.quantize_fp8_per_channel); the kernels dequantise on the fly.

Under TRITON_INTERPRET=1 (CPU) the same kernels run in the interpreter (see dot.py for its one difference).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch
import triton

from tp_lora.ops.batch import LoRABatch
from tp_lora.ops.triton import configs
from tp_lora.ops.triton.dot import FP8, compute_types
from tp_lora.ops.triton.kernels import (embedding_shrink_kernel, expand_kernel, expand_rows_kernel,
                                        lora_epilogue_kernel, shrink_kernel, shrink_rows_kernel)
from tp_lora.ops.triton.pdl import forget, pdl_args, released
from tp_lora.ops.triton.schedule import Schedule, prepare

MAX_SLICES_PER_LAUNCH = 3


def _launch_groups(n: int, key, solo):
    """Split slices 0..n-1 into launches of <= 3 consecutive slices with equal key(i) (what the kernel takes once
    for all of them: dtype, inner strides). solo(i): slice i must launch alone (a selected value is 1, see the
    note above shrink_kernel). Yields (first slice index, slice indices)."""
    i = 0
    while i < n:
        j = i + 1
        if not solo(i):
            while j < n and j - i < MAX_SLICES_PER_LAUNCH and key(j) == key(i) and not solo(j):
                j += 1
        yield i, list(range(i, j))
        i = j


def _three(seq, idx, attr=None):
    vals = [seq[i] if attr is None else attr(seq[i]) for i in idx]
    return vals + [vals[0]] * (MAX_SLICES_PER_LAUNCH - len(vals))


def _m_programs(sched: Schedule, t: int, block_m: int, other_programs: int, device: torch.device) -> int:
    """Programs per table entry along the token axis. chunked: 1 (a segment fits one block). sorted: enough for one
    adapter's tokens to spread over every SM, never more than the token blocks of the whole step."""
    if sched.scheme == "chunked":
        return 1
    sms = configs.num_sms((device.index or 0) if device.type == "cuda" else None)
    want = -(-configs.SORTED_PROGRAMS_PER_SM * sms // max(1, other_programs))
    return max(1, min(-(-t // block_m), want))


def _new_buffer(shape: tuple[int, ...], zero: bool, device: torch.device) -> torch.Tensor:
    """The shrink output. Zeroed only where the kernel accumulates (split-K); else it writes every row."""
    return (torch.zeros if zero else torch.empty)(shape, dtype=torch.float32, device=device)


def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor, batch: LoRABatch, *,
           a_scales: Sequence[torch.Tensor] | None = None, scheme: str | None = None) -> torch.Tensor:
    """x [T, in], lora_a S x [L, r, in], scales [S, L] float32 -> [S, T, r] float32 = scale * x @ A[slot]^T,
    zero rows for tokens without an adapter. a_scales: S x [L, r] float32 when lora_a is fp8 (per-row scales).
    scheme: "sorted" | "chunked" | None (the module setting)."""
    n_slices = len(lora_a)
    _, rank, k = lora_a[0].shape
    t = x.shape[0]
    rows = configs.shrink_rows_config(t, rank, k)
    if rows is None or t == 0:
        forget(x.device)  # shrink_kernel does not release the next launch early; shrink_rows_kernel does (its expand)
    if t == 0:
        return torch.zeros(n_slices, 0, rank, dtype=torch.float32, device=x.device)

    def key(i):
        a = lora_a[i]
        return (a.dtype, a.stride(1), a.stride(2)) + ((a_scales[i].stride(1),) if a_scales is not None else ())

    def solo(i):
        return 1 in (lora_a[i].stride(0),) + ((a_scales[i].stride(0),) if a_scales is not None else ())

    if rows is None:
        sched = prepare(batch, scheme)
        cfg = configs.shrink_config(t, rank, k, sched.scheme)
        block_m = sched.segment_size or cfg["BLOCK_M"]
    else:
        cfg = rows
    split_k = cfg["SPLIT_K"]
    out = _new_buffer((n_slices, t, rank), split_k > 1, x.device)
    n_blocks_r = triton.cdiv(rank, cfg["BLOCK_N"])
    for base, idx in _launch_groups(n_slices, key, solo):
        a3 = _three(lora_a, idx)
        as3 = _three(a_scales, idx) if a_scales is not None else [scales] * 3  # unused placeholders
        strides = (x.stride(0), x.stride(1),
                   *(a.stride(0) for a in a3), a3[0].stride(1), a3[0].stride(2),
                   as3[0].stride(0) if a_scales is not None else 0, as3[0].stride(1) if a_scales is not None else 0,
                   scales.stride(0), scales.stride(1),
                   out.stride(0), out.stride(1), out.stride(2))
        meta = dict(NUM_SLICES=len(idx), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split_k,
                    EVEN_K=k % (cfg["BLOCK_K"] * split_k) == 0, HAS_A_SCALES=a_scales is not None,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if rows is not None:
            shrink_rows_kernel[(t, len(idx) * split_k)](x, *a3, *as3, scales, out, batch.token_slot, k, rank, base,
                                                        *strides, **meta, **pdl_args(x))
            released(out)
            continue
        cdt, dot, prec = compute_types(x.dtype, lora_a[idx[0]].dtype)
        other = len(idx) * n_blocks_r * split_k
        grid = (sched.entries, other, _m_programs(sched, t, block_m, other, x.device))
        shrink_kernel[grid](x, *a3, *as3, scales, out, batch.order, sched.table, k, rank, sched.entries, base,
                            n_blocks_r, *strides, grid[2], BLOCK_M=block_m, CDT=cdt, DOT=dot, PREC=prec, **meta)
    return out


def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], batch: LoRABatch, out: torch.Tensor,
           offset: int = 0, add: bool = True, *, b_scales: Sequence[torch.Tensor] | None = None,
           scheme: str | None = None) -> None:
    """buf [S, T, r], lora_b S x [L, out_s, r], out [T, O]:
    out[:, offset + sum(out_<s) : offset + sum(out_<=s)] (+)= buf[s] @ B_s[slot]^T for tokens with an adapter;
    other rows are not touched (add=False: set to 0). Computed in float32, stored in out.dtype. b_scales: S x [L, out_s]
    float32 when lora_b is fp8 (per output channel). scheme: "sorted" | "chunked" | None (the module setting)."""
    t = out.shape[0]
    rank = buf.shape[2]
    widths = [b.shape[1] for b in lora_b]
    rows = configs.expand_rows_config(t, rank, max(widths, default=0))
    if rows is None or t == 0 or not widths:
        # expand_kernel writes into out, which the base layer's releasing kernel may have written before: it starts in
        # full (expand_rows_kernel waits for it, launched early after its shrink)
        forget(out.device)
    if t == 0 or not widths:
        return
    cols = list(itertools.accumulate([offset] + widths))  # first output column of each slice
    if rows is None:
        sched = prepare(batch, scheme)
        cfg = configs.expand_config(t, rank, max(widths), sched.scheme)
        block_m, block_n = sched.segment_size or cfg["BLOCK_M"], cfg["BLOCK_N"]
        if not add:  # expand_kernel visits the tokens with an adapter only
            out[:, cols[0]:cols[-1]].zero_()
    else:
        cfg, block_n = rows, rows["BLOCK_N"]

    def key(i):
        b = lora_b[i]
        return (b.dtype, b.stride(1), b.stride(2)) + ((b_scales[i].stride(1),) if b_scales is not None else ())

    def solo(i):
        picked = (lora_b[i].stride(0), widths[i], cols[i]) + ((b_scales[i].stride(0),) if b_scales is not None else ())
        return 1 in picked

    for base, idx in _launch_groups(len(lora_b), key, solo):
        b3 = _three(lora_b, idx)
        bs3 = _three(b_scales, idx) if b_scales is not None else [buf] * 3  # unused placeholders
        w3 = _three(widths, idx)
        nb_ends = list(itertools.accumulate(triton.cdiv(w, block_n) for w in w3[:len(idx)]))
        nb_ends += [nb_ends[-1]] * (MAX_SLICES_PER_LAUNCH - len(nb_ends))
        # buf (f32) is rounded to B's type for the dot; fp8 B is widened to the output's type instead.
        b_dtype = lora_b[idx[0]].dtype
        cdt, dot, prec = compute_types(out.dtype if b_dtype in FP8 else b_dtype, b_dtype)
        has_bs = b_scales is not None
        tail = (base, cols[base], *w3, nb_ends[0], nb_ends[1],
                buf.stride(0), buf.stride(1), buf.stride(2),
                *(b.stride(0) for b in b3), b3[0].stride(1), b3[0].stride(2),
                *((s.stride(0) for s in bs3) if has_bs else (0, 0, 0)), bs3[0].stride(1) if has_bs else 0,
                out.stride(0), out.stride(1))
        meta = dict(NUM_SLICES=len(idx), BLOCK_N=block_n, BLOCK_K=cfg["BLOCK_K"], ADD=bool(add), HAS_B_SCALES=has_bs,
                    CDT=cdt, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if rows is not None:
            expand_rows_kernel[(t, nb_ends[len(idx) - 1])](buf, *b3, *bs3, out, batch.token_slot, rank, *tail, **meta,
                                                           **pdl_args(buf, out))
            continue
        grid = (sched.entries, nb_ends[len(idx) - 1], _m_programs(sched, t, block_m, nb_ends[len(idx) - 1],
                                                                    out.device))
        expand_kernel[grid](buf, *b3, *bs3, out, batch.order, sched.table, rank, sched.entries, *tail, grid[2],
                            BLOCK_M=block_m, DOT=dot, PREC=prec, **meta)


def embedding_shrink(ids: torch.Tensor, lora_a_t: torch.Tensor, scales: torch.Tensor, batch: LoRABatch,
                     vocab_start: int = 0) -> torch.Tensor:
    """ids [T], lora_a_t [L, V_local, r] (this rank's vocab rows of A^T), scales [1, L] -> [1, T, r] float32.
    Ids outside [vocab_start, vocab_start + V_local) and tokens without an adapter give 0 rows."""
    t, (_, vocab_local, rank) = ids.shape[0], lora_a_t.shape
    out = torch.empty(1, t, rank, dtype=torch.float32, device=ids.device)  # the kernel writes every row
    if t == 0:
        return out
    cfg = configs.embedding_config(t, rank)
    embedding_shrink_kernel[(triton.cdiv(t, cfg["BLOCK_M"]),)](
        ids, batch.token_slot, lora_a_t, scales, out,
        t, rank, vocab_start, vocab_local,
        lora_a_t.stride(0), lora_a_t.stride(1), lora_a_t.stride(2), scales.stride(1), out.stride(1), out.stride(2),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
    )
    return out


def lora_epilogue(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, batch: LoRABatch,
                  base_bias: torch.Tensor | None = None) -> None:
    """torch_ref.lora_epilogue: one program per (token, column block), the token's slot read on the device (no
    host data: graph-safe)."""
    t, p = out.shape
    if t == 0 or not batch.any_lora:
        return
    if out.stride(1) != 1 or scale.stride(1) != 1 or bias.stride() != scale.stride():
        raise ValueError(f"lora_epilogue: expected unit column strides and scale / bias of one layout, got out "
                         f"{out.stride()}, scale {scale.stride()}, bias {bias.stride()}")
    block = min(1024, triton.next_power_of_2(p))
    lora_epilogue_kernel[(t, triton.cdiv(p, block))](
        out, scale, bias, base_bias if base_bias is not None else scale, batch.token_slot, p, out.stride(0),
        scale.stride(0), HAS_BASE_BIAS=base_bias is not None, BLOCK_N=block, num_warps=4)


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Step sizes (tokens) that between them use every per-size variant of the kernels up to max_tokens, so each
    variant is compiled at start (Triton compiles at first use) rather than inside a step."""
    return sorted({min(edge, max_tokens) for edge in configs.T_EDGES[:-1]} | {max_tokens})
