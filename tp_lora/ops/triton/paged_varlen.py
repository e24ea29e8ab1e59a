"""Varlen paged attention in Triton, with the signature of tp_lora.ops.paged_attention.paged_varlen_ref.

One program per (query block, KV head, key partition): a query block is up to BLOCK_Q consecutive new tokens of one
sequence, and its tile holds those tokens times the REP query heads of the KV head ([BLOCK_Q * REP, d] rows), so each
K/V position is loaded once for all of them. Where the grid is short of programs (steps of few tokens: a chat turn
over a long cached prefix beside a few decodes), each block splits the keys it attends over up to PARTS partitions
as the decode kernel does (tp_lora.ops.triton.paged_attention), and the last partition to finish merges them.
Sequence s's blocks are numbered from cu_q[s] // BLOCK_Q + s on, which leaves it room for cdiv(q_len, BLOCK_Q)
blocks; so T // BLOCK_Q + S programs cover any split of T tokens between S sequences, and a program finds its
sequence with a binary search over cu_q on the device. The grid depends on the shapes only
(T, S, KV heads): a captured CUDA graph replays it for any mix of prefill chunks and decodes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton import paged_attention
from tp_lora.ops.triton.paged_attention import (dot_flags, dot_queries, merge_partials, online_softmax,
                                                partition, partitions, softmax_start)
from tp_lora.ops.triton.tickets import tickets

BLOCK_N = 64  # key positions per inner iteration
MIN_ROWS = 16  # tile rows (query tokens x query heads of a KV head) at least: what tl.dot takes
CHUNK_ROWS = 64  # tile rows when the step's shapes leave room for chunks (16+ query tokens per sequence on average)
CHUNK_MAX_D = 128  # ... and the head is small enough for [CHUNK_ROWS, d] float32 accumulators in registers
NUM_WARPS, NUM_STAGES = 4, 3  # of the kernel (Triton's defaults; scripts/bench_attention.py --sweep --kind varlen)
TARGET_PROGRAMS = 264  # (query block, KV head) programs the grid aims for before splitting keys (at 256 B / position)
# Over an fp8 cache, sequences of one query run in the decode kernel (tiles of one token's heads, context partitions)
# instead of this one's rows; a 16-bit cache keeps them here (its chunk programs then fill the decode programs' tail).
DECODES_APART_FP8 = True


@triton.jit
def _find_sequence(cu_q_ptr, prog, num_seqs, BLOCK_Q: tl.constexpr, STEPS: tl.constexpr):
    """The last s in [0, num_seqs) whose first query block cu_q[s] // BLOCK_Q + s is <= prog (a fixed number of
    halvings: STEPS >= bit length of num_seqs)."""
    lo = prog * 0
    hi = lo + num_seqs
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        active = lo < hi
        new_lo = tl.where(active & (start <= prog), mid + 1, lo)
        hi = tl.where(active & (start > prog), mid, hi)
        lo = new_lo
    return lo - 1


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr,
                   num_seqs, scale, window, softcap, min_part,
                   s_qt, s_qh, s_kb, s_ks, s_kh, s_btb, s_ot, s_oh,
                   REP: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK: tl.constexpr, STEPS: tl.constexpr, SKIP_DECODES: tl.constexpr, F32_DOT: tl.constexpr,
                   KV_FP8: tl.constexpr, FP8_ASM: tl.constexpr, PARTS: tl.constexpr):
    # Grid (KV heads, query blocks, key partitions), blocks taken last to first: a chunk's late blocks attend the most
    # keys (causal), so they start first instead of forming the grid's tail.
    g = tl.program_id(0)
    prog = tl.num_programs(1) - 1 - tl.program_id(1)
    part = tl.program_id(2)
    seq = _find_sequence(cu_q_ptr, prog, num_seqs, BLOCK_Q, STEPS)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_begin
    first = (prog - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # the block's first query, counted in the sequence
    if first >= q_len:  # past the sequence's queries (padding sequences have none)
        return
    if SKIP_DECODES and q_len == 1:  # the decode kernel's
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    r = tl.arange(0, ROWS)
    qi = first + r // REP  # query of each row, in the sequence
    heads = g * REP + r % REP
    row_ok = (r // REP < BLOCK_Q) & (qi < q_len)
    q_pos = ctx - q_len + qi  # position of each row's query
    last = ctx - q_len + tl.minimum(first + BLOCK_Q, q_len) - 1  # the block's last query position
    lo = 0
    if window > 0:
        lo = tl.maximum(ctx - q_len + first - window + 1, 0)
    hi = last + 1
    # Without a window, the whole tiles before the block's first query are visible to every row: no causal mask.
    split = lo
    if window == 0:
        split = tl.maximum(lo, (ctx - q_len + first) // BLOCK * BLOCK)
    lo, hi, used = partition(lo, hi, part, min_part, PARTS, BLOCK)
    if part >= used:
        return
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q_begin + qi)[:, None] * s_qt + heads[:, None] * s_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    q, scale = dot_queries(q, scale, F32_DOT, KV_FP8)
    m, l_sum, acc = softmax_start(ROWS, D)
    m, l_sum, acc = online_softmax(m, l_sum, acc, q, q_pos, k_ptr, v_ptr, bt_ptr + seq * s_btb, g * s_kh, lo,
                                   tl.minimum(split, hi), scale, window, softcap, s_kb, s_ks, ROWS, D, BS, BLOCK, False,
                                   F32_DOT, KV_FP8, FP8_ASM)
    m, l_sum, acc = online_softmax(m, l_sum, acc, q, q_pos, k_ptr, v_ptr, bt_ptr + seq * s_btb, g * s_kh,
                                   tl.maximum(split, lo), hi, scale, window, softcap, s_kb, s_ks, ROWS, D, BS, BLOCK,
                                   True, F32_DOT, KV_FP8, FP8_ASM)
    at = out_ptr + (q_begin + qi)[:, None] * s_ot + heads[:, None] * s_oh + d[None, :]
    if PARTS == 1:
        tl.store(at, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    elif used == 1:  # every key of the block in this partition: no merge
        tl.store(at, (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        kv = tl.num_programs(0)
        merged, num, den = merge_partials(acc, m, l_sum, part, used, (q_begin + qi) * kv * REP + heads, row_ok,
                                          cnt_ptr + prog * kv + g, part_acc_ptr, part_ml_ptr, ROWS, D, PARTS)
        if merged:
            tl.store(at, (num / den[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def tile(rep: int, tokens: int, seqs: int, head_dim: int) -> tuple[int, int]:
    """(query tokens per block, tile rows) for `rep` query heads per KV head, in a step of `tokens` query rows over
    `seqs` sequences: small tiles where most sequences may be decodes (a decode fills `rep` rows of its tile, and
    streams its whole context through them), larger ones where chunks must be there (fewer re-reads of their keys,
    fuller dots)."""
    chunky = tokens >= 16 * seqs and head_dim <= CHUNK_MAX_D
    rows = max(CHUNK_ROWS if chunky else MIN_ROWS, triton.next_power_of_2(rep))
    return rows // rep, rows


def paged_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, cu_q: torch.Tensor, scale: float, window: int = 0,
                 softcap: float = 0.0) -> torch.Tensor:
    t, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    if d & (d - 1) or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"paged_varlen needs a power-of-two head_dim and contiguous heads, got d={d}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_varlen needs K and V caches of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if cu_q.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(f"cu_q has {cu_q.shape[0]} entries for {context_lens.shape[0]} sequences, expected "
                         f"{context_lens.shape[0] + 1}")
    rep = heads // kv
    seqs = context_lens.shape[0]
    out = torch.empty_like(q)
    if t == 0 or seqs == 0:
        return out
    block_q, rows = tile(rep, t, seqs, d)
    apart = DECODES_APART_FP8 and k_cache.element_size() == 1
    if apart:
        paged_attention.paged_decode(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap, cu_q, out)
    blocks = triton.cdiv(t, block_q) + seqs
    # Partitions from the shapes (a graph replays them): enough for the step's tokens alone to fill the grid.
    parts = partitions(triton.cdiv(t, block_q), kv, block_table.shape[1] * bs, d, k_cache.element_size(),
                       TARGET_PROGRAMS)
    if parts > 1:
        part_acc = torch.empty(t * heads * parts * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(t * heads * parts * 2, dtype=torch.float32, device=q.device)
        cnt = tickets(q.device, blocks * kv)
    else:
        part_acc = part_ml = cnt = out  # (unread with one partition)
    _varlen_kernel[(kv, blocks, parts)](
        q, k_cache, v_cache, block_table, context_lens, cu_q, out, part_acc, part_ml, cnt, seqs, scale,
        int(window or 0), float(softcap or 0.0), paged_attention.MIN_PART,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, BLOCK_Q=block_q, ROWS=rows, D=d, BS=bs, BLOCK=BLOCK_N, STEPS=seqs.bit_length(),
        SKIP_DECODES=apart, **dot_flags(q, k_cache, _varlen_kernel), PARTS=parts, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out
