"""Paged decode attention in Triton, with the signature of tp_lora.ops.paged_attention.paged_decode_ref.

One program per (sequence, KV head, context partition): the query heads sharing that KV head are one [REP, d] tile,
so each K/V position is loaded once for all of them, and only the sequence's real positions are read (its block
table, up to its context length). Long contexts at small batches are split into partitions of the context whose
partial softmax sums are merged by a second kernel, so the grid fills the GPU; the partition count depends only on
the shapes (batch, KV heads, block-table width), so a captured CUDA graph replays it for any context lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # positions per inner iteration
# Programs the decode grid aims for at head_dim >= 128 (two waves of SMs); 128 / head_dim times that below, where a
# program streams fewer bytes per position (scripts/bench_attention.py --sweep).
TARGET_PROGRAMS = 264
MIN_PART = 256  # positions per partition at least (fewer: the merge costs more than it gains)
NUM_WARPS, NUM_STAGES = 4, 2  # of the decode kernel (chosen by scripts/bench_attention.py --sweep)


@triton.jit
def softmax_start(ROWS: tl.constexpr, D: tl.constexpr):
    """The empty state of online_softmax: (row max -inf, row sum 0, output 0)."""
    return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32)


@triton.jit
def online_softmax(m, l_sum, acc, q, q_pos, k_ptr, v_ptr, table_ptr, head_off, lo, hi, scale, window, softcap, s_kb,
                   s_ks, ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr,
                   CAUSAL: tl.constexpr, F32_DOT: tl.constexpr):
    """State (row max, row sum, unnormalized output [ROWS, D], float32) carried on over the positions lo..hi-1 of one
    sequence's paged K/V for q [ROWS, D] (table_ptr: its block table, head_off: its KV head's offset in a cache row),
    BLOCK positions per iteration. CAUSAL: row i sees positions <= q_pos[i] (and > q_pos[i] - window if window > 0);
    else every position in range."""
    d = tl.arange(0, D)
    for t0 in range(lo - lo % BLOCK, hi, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        valid = (t >= lo) & (t < hi)
        blk = tl.load(table_ptr + t // BS, mask=valid, other=0).to(tl.int64)
        place = blk * s_kb + (t % BS) * s_ks + head_off
        k = tl.load(k_ptr + place[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + place[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if F32_DOT:  # float32 operands: full precision (tl.dot takes tf32 by default)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:  # an fp8 cache widens to the queries' type
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * scale
        if softcap > 0:
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)  # softcap * tanh(s / softcap)
        allowed = valid[None, :]
        if CAUSAL:
            allowed = allowed & (t[None, :] <= q_pos[:, None])
            if window > 0:
                allowed = allowed & (t[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row whose keys all lie in later tiles (its window starts there) still has m = -inf: keep it at 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l_sum, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   scale, window, softcap, part_len,
                   s_qb, s_qh, s_kb, s_ks, s_kh, s_btb, s_ob, s_oh,
                   REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK: tl.constexpr, PARTS: tl.constexpr, F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    start = 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    lo = tl.maximum(start, part * part_len)
    hi = tl.minimum(ctx, (part + 1) * part_len)
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + (g * REP + r)[:, None] * s_qh + d[None, :], mask=(r < REP)[:, None], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    m, l_sum, acc = softmax_start(REP_PAD, D)
    m, l_sum, acc = online_softmax(m, l_sum, acc, q, r, k_ptr, v_ptr, bt_ptr + b * s_btb, g * s_kh, lo, hi, scale,
                                   window, softcap, s_kb, s_ks, REP_PAD, D, BS, BLOCK, False, F32_DOT)
    heads = g * REP + r
    if PARTS == 1:
        out = acc / l_sum[:, None]
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(r < REP)[:, None])
    else:
        # Partials [B, H, PARTS, D] and (max, sum) [B, H, PARTS, 2]; an empty partition leaves (-inf, 0, 0).
        n_heads = tl.num_programs(1) * REP
        row = (b * n_heads + heads) * PARTS + part
        tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc, mask=(r < REP)[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=r < REP)
        tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=r < REP)


@triton.jit
def _merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, s_ob, s_oh, H: tl.constexpr, D: tl.constexpr,
                  PARTS: tl.constexpr, PARTS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, D)
    row = (b * H + h) * PARTS + p
    ok = p < PARTS
    m = tl.load(part_ml_ptr + row * 2, mask=ok, other=float("-inf"))
    l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=ok, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(ok, tl.exp(m - m_all), 0.0)  # an empty partition has m = -inf: weight 0
    acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(out_ptr + b * s_ob + h * s_oh + d, out.to(out_ptr.dtype.element_ty))


def partitions(batch: int, kv_heads: int, max_context: int, head_dim: int) -> tuple[int, int]:
    """(partition count, positions per partition) for a grid of batch x kv_heads programs over contexts of at most
    max_context positions: split only while the grid is short of its target (TARGET_PROGRAMS at head_dim >= 128)."""
    target = TARGET_PROGRAMS * max(1, 128 // head_dim)
    parts = max(1, min(target // max(1, batch * kv_heads), triton.cdiv(max_context, MIN_PART)))
    part_len = triton.cdiv(triton.cdiv(max_context, parts), BLOCK_N) * BLOCK_N
    return triton.cdiv(max_context, part_len), part_len


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    b, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    if d & (d - 1) or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"paged_decode needs a power-of-two head_dim and contiguous heads, got d={d}")
    rep = heads // kv
    parts, part_len = partitions(b, kv, block_table.shape[1] * bs, d)
    out = torch.empty_like(q)
    if parts > 1:
        part_acc = torch.empty(b * heads * parts * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * heads * parts * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    f32 = type(_decode_kernel).__name__ == "InterpretedFunction" or q.dtype == torch.float32
    _decode_kernel[(b, kv, parts)](
        q, k_cache, v_cache, block_table, context_lens, out, part_acc, part_ml, scale, int(window or 0),
        float(softcap or 0.0), part_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BS=bs, BLOCK=BLOCK_N, PARTS=parts, F32_DOT=f32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if parts > 1:
        _merge_kernel[(b, heads)](part_acc, part_ml, out, out.stride(0), out.stride(1), H=heads, D=d, PARTS=parts,
                                  PARTS_PAD=max(2, triton.next_power_of_2(parts)))
    return out
