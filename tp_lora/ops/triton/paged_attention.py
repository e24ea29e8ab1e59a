"""Paged decode attention in Triton, with the signature of tp_lora.ops.paged_attention.paged_decode_ref.

One program per (sequence, KV head, context partition): the query heads sharing that KV head are one [REP, d] tile,
so each K/V position is loaded once for all of them, and only the sequence's real positions are read (its block
table, up to its context length). Long contexts at small batches are split into partitions whose partial softmax
sums are merged at the end, so the grid fills the GPU. The partition count depends only on the shapes (batch, KV
heads, block-table width), so a captured CUDA graph replays it for any context lengths; each sequence splits its own
context over them (at least MIN_PART positions each), so a short one runs whole in its first partition, which writes
its output. Where a sequence uses several, each stores its partial and takes a ticket on the (sequence, KV head)
counter; the last to arrive merges them (one launch, no merge kernel).

An fp8 (float8_e4m3fn) cache is read as stored, one byte per element, and widened in registers to float16 (exact for
every e4m3 value): the queries are multiplied by the softmax scale first (in float32) so they stay far inside f16's
range, and the probabilities (in [0, 1]) are f16 too. K, the Q @ K^T operand whose reduction runs along its rows,
keeps its bytes through shared memory and widens in the dot's operand layout; V (reduced across its rows) widens
before shared memory, so ldmatrix transposes it as f16 (see fp8_to_f16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.split_sums import SplitSums
from tp_lora.ops.triton.dot import interpreting
from tp_lora.ops.triton.fp8_quant import E4M3_MAX, row_scale, to_e4m3
from tp_lora.ops.triton.fused import load_shares, rope_apply, rope_inputs
from tp_lora.ops.triton.pdl import pdl_args, prefetch, release_next, released, wait_prior
from tp_lora.ops.triton.tickets import tickets

BLOCK_N = 128  # positions per inner iteration over a 16-bit cache
BLOCK_N_FP8 = 64  # ... over an fp8 cache (its widened V passes through shared memory as f16)
# Programs the decode grid aims for where a position holds >= 256 bytes per KV head (bf16 at head_dim 128; two waves of
# SMs); 256 / bytes times that below (head_dim 64, an fp8 cache), where a program streams fewer bytes per position.
TARGET_PROGRAMS = 264
MIN_PART = 128  # positions per partition at least (fewer: the merge costs more than it gains)
MERGE = tl.constexpr(4)  # partials the merging program loads at once
NUM_WARPS, NUM_STAGES = 8, 2  # of the decode kernel
NUM_WARPS_FP8 = 4  # ... over an fp8 cache
# Registers a thread at most over an fp8 cache (RoPE and the qkv shares in the kernel take more): four programs an SM
MAX_REGS_FP8 = 128


@triton.jit
def softmax_start(ROWS: tl.constexpr, D: tl.constexpr):
    """The empty state of online_softmax: (row max -inf, row sum 0, output 0)."""
    return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, D], tl.float32)


@triton.jit
def dot_queries(q, scale, F32_DOT: tl.constexpr, KV_FP8: tl.constexpr):
    """(queries, score scale) as online_softmax takes them: float32 (F32_DOT); over an fp8 cache float16 with the
    scale applied (the keys widen to f16, the scores then need no scale: 1.0); else as loaded."""
    if F32_DOT:
        q = q.to(tl.float32)
    elif KV_FP8:
        q = (q.to(tl.float32) * scale).to(tl.float16)
        scale = 1.0
    return q, scale


@triton.jit
def fp8_to_f16(x, ASM: tl.constexpr):
    """float8_e4m3fn -> float16, exact. ASM: the packed conversion in inline PTX marked impure, which Triton does not
    move past the tile's trip through shared memory: V, the P @ V operand whose reduction runs across its rows, is
    then transposed as f16 by ldmatrix; Triton's own cast is moved after it, and the transpose gathers single bytes.
    Else (the interpreter runs no PTX) the cast."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float16)


@triton.jit
def online_softmax(m, l_sum, acc, q, q_pos, k_ptr, v_ptr, table_ptr, head_off, lo, hi, scale, window, softcap, s_kb,
                   s_ks, ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr,
                   CAUSAL: tl.constexpr, F32_DOT: tl.constexpr, KV_FP8: tl.constexpr, FP8_ASM: tl.constexpr):
    """State (row max, row sum, unnormalized output [ROWS, D], float32) carried on over the positions lo..hi-1 of one
    sequence's paged K/V for q [ROWS, D] (table_ptr: its block table, head_off: its KV head's offset in a cache row),
    BLOCK positions per iteration. CAUSAL: row i sees positions <= q_pos[i] (and > q_pos[i] - window if window > 0);
    else every position in range. F32_DOT / KV_FP8 / FP8_ASM: as dot_flags (q from dot_queries)."""
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
        else:
            if KV_FP8:  # float16, as the queries (dot_queries); K by Triton's cast, moved past its smem trip
                k = k.to(tl.float16)
                v = fp8_to_f16(v, FP8_ASM)
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
def partition(lo, hi, part, min_part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """(lo, hi, used) of partition `part` of positions lo..hi-1 split over at most PARTS partitions of whole BLOCK
    tiles of >= min_part positions (the last may be shorter): it covers lo..hi-1 of its own; `used` are non-empty."""
    base = lo - lo % BLOCK
    span = hi - base
    part_len = tl.cdiv(tl.maximum(tl.cdiv(span, PARTS), min_part), BLOCK) * BLOCK
    used = tl.maximum(tl.cdiv(span, part_len), 1)
    return tl.maximum(lo, base + part * part_len), tl.minimum(hi, base + (part + 1) * part_len), used


@triton.jit
def sequence_split(ctx_ptr, cu_q_ptr, b, part, window, min_part, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                   CU_Q: tl.constexpr):
    """(lo, hi, partitions used, query row, runs) of partition `part` of sequence b: its context from its window's
    first position on, split by partition(); the partition covers positions lo..hi-1. CU_Q: b's query row is cu_q[b]
    and only a sequence of exactly one query runs; else row b, and every sequence runs. `runs` is False past the
    partitions used."""
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    row = b
    runs = part >= 0
    if CU_Q:
        row = tl.load(cu_q_ptr + b)
        runs = tl.load(cu_q_ptr + b + 1) - row == 1
    start = 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    lo, hi, used = partition(start, ctx, part, min_part, PARTS, BLOCK)
    return lo, hi, used, row, runs & (part < used)


@triton.jit
def merge_partials(acc, m, l_sum, part, used, prow, ok, cnt_ptr, part_acc_ptr, part_ml_ptr, ROWS: tl.constexpr,
                   D: tl.constexpr, PARTS: tl.constexpr):
    """Partition `part` of `used` stores its partial state of rows prow [ROWS] (where ok: partials [rows, PARTS, D]
    and (max, sum) [rows, PARTS, 2]) and takes a ticket on cnt_ptr -> (whether it came last, and then the merged
    unnormalized output and sums of all `used` partials; else its own). The last resets the counter."""
    d = tl.arange(0, D)
    at = prow * PARTS
    tl.store(part_acc_ptr + (at + part)[:, None] * D + d[None, :], acc, mask=ok[:, None])
    tl.store(part_ml_ptr + (at + part) * 2, m, mask=ok)
    tl.store(part_ml_ptr + (at + part) * 2 + 1, l_sum, mask=ok)
    tl.debug_barrier()  # every thread's partial stored before the ticket publishes them
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == used - 1
    num, den = acc, l_sum
    if last:  # merge them all in partition order, rescaled to the running max: one pass, MERGE loads in flight
        m_run = tl.full([ROWS], float("-inf"), tl.float32)
        num = tl.zeros([ROWS, D], tl.float32)
        den = tl.zeros([ROWS], tl.float32)
        for p0 in range(0, used, MERGE):
            for j in tl.static_range(MERGE):
                pr = at + p0 + j
                live = ok & (prow * 0 + p0 + j < used)
                m_p = tl.load(part_ml_ptr + pr * 2, mask=live, other=float("-inf"), cache_modifier=".cg")
                l_p = tl.load(part_ml_ptr + pr * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
                a_p = tl.load(part_acc_ptr + pr[:, None] * D + d[None, :], mask=live[:, None], other=0.0,
                              cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_p)
                base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay at 0
                keep, w = tl.exp(m_run - base), tl.exp(m_p - base)
                den = den * keep + w * l_p
                num = num * keep[:, None] + w[:, None] * a_p
                m_run = m_new
        tl.atomic_xchg(cnt_ptr, 0)
    return last, num, den


@triton.jit
def store_rows(out_ptr, row, heads, row_ok, acc, l_sum, s_ob, s_oh, q8_ptr, qs_ptr, s_q8, s_qs, D: tl.constexpr,
               OUT8: tl.constexpr):
    """The normalized output of query row `row`'s heads (acc / l_sum), rows where row_ok; OUT8: also quantized per
    (row, head) to e4m3 (q8 row `row` [H * D], its scales at qs_ptr's row [H]), as the ACT8 GEMM quantizes."""
    d = tl.arange(0, D)
    y = (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_ob + heads[:, None] * s_oh + d[None, :], y, mask=row_ok[:, None])
    if OUT8:
        v = y.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), 1), E4M3_MAX)
        tl.store(qs_ptr + row * s_qs + heads, scale, mask=row_ok)
        to_e4m3(v, scale[:, None], q8_ptr + row * s_q8, heads[:, None] * D + d[None, :], row_ok[:, None], E4M3_MAX)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, cu_q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr,
                   scale, window, softcap, min_part,
                   s_qb, s_qh, s_kb, s_ks, s_kh, s_btb, s_ob, s_oh,
                   kn_ptr, vn_ptr, cos_ptr, sin_ptr, slots_ptr, qw_ptr, kw_ptr, eps, k_inv, v_inv,
                   s_knb, s_knh, s_vnb, s_vnh, s_cos, s_sin, col_ptr, rs_ptr, dl_ptr, s_share, k_col, v_col,
                   q8_ptr, qs8_ptr, s_q8, s_qs8,
                   REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK: tl.constexpr, PARTS: tl.constexpr, CU_Q: tl.constexpr, F32_DOT: tl.constexpr,
                   KV_FP8: tl.constexpr, FP8_ASM: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                   NORM: tl.constexpr, OFFSET: tl.constexpr, SCALED: tl.constexpr, SHARES: tl.constexpr,
                   COL: tl.constexpr, ROW: tl.constexpr, DELTA: tl.constexpr, OUT8: tl.constexpr,
                   PDL: tl.constexpr):
    wait_prior(PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    part = tl.program_id(2)
    d = tl.arange(0, D)
    if ROPE:  # q, k, v of the new token as projected (SHARES: the qkv GEMM's SplitSums), RoPE'd (after the optional
        # per-head norm) here. Their loads (query row b: no cu_q with RoPE) go out with the context length's, and
        # the block table's first entries are asked into L1: one round trip to memory before the K / V tiles.
        tl.static_assert(not CU_Q, "paged_decode's RoPE takes no cu_q")
        dt = out_ptr.dtype.element_ty
        cos_row, sin_row = cos_ptr + b * s_cos, sin_ptr + b * s_sin
        rs = tl.load(rs_ptr + b) if ROW else 1.0
        two = tl.arange(0, 2)[:, None]  # k's rows: the head in row 0, row 1 masked
        q_at = b * s_qb + g * REP * s_qh  # the delta (DELTA) at the shares' element offsets
        q_in = rope_inputs(q_ptr + q_at, REP, s_qh, cos_row, sin_row, qw_ptr, col_ptr + g * REP * s_qh,
                           dl_ptr + q_at, rs, s_share, REP_PAD, D, D, R, NORM, dt, SHARES, COL, DELTA)
        k_at = b * s_knb + g * s_knh
        k_in = rope_inputs(kn_ptr + k_at, 1, s_knh, cos_row, sin_row, kw_ptr, col_ptr + k_col + g * s_knh,
                           dl_ptr + k_col + k_at, rs, s_share, 2, D, D, R, NORM, dt, SHARES, COL, DELTA)
        v_at = g * s_vnh + two * 0 + d[None, :]
        v = load_shares(vn_ptr + b * s_vnb + v_at, col_ptr + v_col + v_at, dl_ptr + v_col + b * s_vnb + v_at, two < 1,
                        rs, s_share, SHARES, COL, DELTA, dt)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        prefetch(bt_ptr + b * s_btb, False, PDL)
    lo, hi, used, row, runs = sequence_split(ctx_ptr, cu_q_ptr, b, part, window, min_part, PARTS, BLOCK, CU_Q)
    if not runs:
        return
    r = tl.arange(0, REP_PAD)
    heads = g * REP + r
    if ROPE:
        q = rope_apply(*q_in, eps, D, D, R, NORM, OFFSET, dt)
        if part == used - 1:  # the last partition used holds the new position: it writes its K and V first
            k = rope_apply(*k_in, eps, D, D, R, NORM, OFFSET, dt)
            if SCALED:  # an fp8 cache holds k / k_scale and v / v_scale
                k = k.to(tl.float32) * k_inv
                v = v.to(tl.float32) * v_inv
            at = (slot // BS) * s_kb + (slot % BS) * s_ks + g * s_kh + two * 0 + d[None, :]
            tl.store(k_ptr + at, k, mask=two < 1)
            tl.store(v_ptr + at, v, mask=two < 1)
            tl.debug_barrier()  # stored before any thread of the program reads the position back
    else:
        q = tl.load(q_ptr + row * s_qb + heads[:, None] * s_qh + d[None, :], mask=(r < REP)[:, None], other=0.0)
    q, scale = dot_queries(q, scale, F32_DOT, KV_FP8)
    m, l_sum, acc = softmax_start(REP_PAD, D)
    m, l_sum, acc = online_softmax(m, l_sum, acc, q, r, k_ptr, v_ptr, bt_ptr + b * s_btb, g * s_kh, lo, hi, scale,
                                   window, softcap, s_kb, s_ks, REP_PAD, D, BS, BLOCK, False, F32_DOT, KV_FP8,
                                   FP8_ASM)
    release_next(PDL)
    if PARTS == 1:
        store_rows(out_ptr, row, heads, r < REP, acc, l_sum, s_ob, s_oh, q8_ptr, qs8_ptr, s_q8, s_qs8, D, OUT8)
    elif used == 1:  # the whole context in this partition: no merge
        store_rows(out_ptr, row, heads, r < REP, acc, l_sum, s_ob, s_oh, q8_ptr, qs8_ptr, s_q8, s_qs8, D, OUT8)
    else:
        kv = tl.num_programs(1)
        merged, num, den = merge_partials(acc, m, l_sum, part, used, b * kv * REP + heads, r < REP,
                                          cnt_ptr + b * kv + g, part_acc_ptr, part_ml_ptr, REP_PAD, D, PARTS)
        if merged:
            store_rows(out_ptr, row, heads, r < REP, num, den, s_ob, s_oh, q8_ptr, qs8_ptr, s_q8, s_qs8, D, OUT8)


def dot_flags(q: torch.Tensor, k_cache: torch.Tensor, kernel) -> dict:
    """The attention kernels' F32_DOT / KV_FP8 / FP8_ASM for these inputs: float32 dots for float32 queries and under
    the interpreter (which has no bf16 dot); over an fp8 cache float16 dots everywhere, V widened by inline PTX where
    `kernel` is compiled."""
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    return dict(F32_DOT=not fp8 and (interpreted or q.dtype == torch.float32), KV_FP8=fp8,
                FP8_ASM=fp8 and not interpreted)


def launch_options(fp8: bool) -> dict:
    """The decode kernel's warps and stages; over an fp8 cache also its register cap (compiled kernels only)."""
    if not fp8:
        return {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    cap = {} if interpreting() else {"maxnreg": MAX_REGS_FP8}
    return {"num_warps": NUM_WARPS_FP8, "num_stages": NUM_STAGES, **cap}


def tile_positions(elem_bytes: int) -> int:
    """Positions per inner iteration of the decode kernel over a cache of elem_bytes bytes per element."""
    return BLOCK_N_FP8 if elem_bytes == 1 else BLOCK_N


def partitions(batch: int, kv_heads: int, max_context: int, head_dim: int, elem_bytes: int = 2,
               programs: int | None = None) -> int:
    """Partition count of a grid of batch x kv_heads programs over contexts of at most max_context positions of
    head_dim x elem_bytes bytes each (K or V of one KV head): split only while the grid is short of its target
    (`programs`, default TARGET_PROGRAMS, at >= 256 bytes per position)."""
    target = (programs or TARGET_PROGRAMS) * max(1, 256 // (head_dim * elem_bytes))
    return max(1, min(target // max(1, batch * kv_heads), triton.cdiv(max_context, MIN_PART)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                 cu_q: torch.Tensor | None = None, out: torch.Tensor | None = None, rope: tuple | None = None,
                 sums: SplitSums | None = None, out8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """paged_decode_ref's attention; with cu_q (paged_varlen's), only the sequences of exactly one query, each
    reading q row cu_q[s] and writing that row of `out` (its other rows left as they are). rope: (k, v, cos, sin,
    slots, q_weight, k_weight, eps, offset, kv_scales) as rope_write_kv takes them, q as projected: paged_decode_rope's
    RoPE and K / V write in the same launch (without cu_q). sums (with rope): q, k and v are views of the first share
    of the qkv GEMM's SplitSums (q from its column 0), whose output they stand for: the kernel sums the shares
    (and adds their delta).
    out8 (q [B, H * d] e4m3, scales [B, H] float32, both row-major): the output also quantized per (row, head) there,
    as the ACT8 decode GEMM quantizes a K tile of d columns (o_proj's rows; tp_lora.ops.fp8.takes_rows8's group)."""
    _, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    if d & (d - 1) or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"paged_decode needs a power-of-two head_dim and contiguous heads, got d={d}")
    if sums is not None and (rope is None or q.data_ptr() != sums.parts.data_ptr()):
        raise ValueError("paged_decode: SplitSums come with rope, q a view of their first share from column 0")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode needs K and V caches of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    seqs = context_lens.shape[0]
    rep = heads // kv
    block = tile_positions(k_cache.element_size())
    parts = partitions(seqs, kv, block_table.shape[1] * bs, d, k_cache.element_size())
    out = torch.empty(q.shape, dtype=q.dtype if sums is None else sums.dtype, device=q.device) if out is None else out
    if parts > 1:
        part_acc = torch.empty(seqs * heads * parts * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(seqs * heads * parts * 2, dtype=torch.float32, device=q.device)
        cnt = tickets(q.device, seqs * kv)
    else:
        part_acc = part_ml = out
        cnt = context_lens  # (unread with one partition)
    cu = context_lens if cu_q is None else cu_q  # (unread without cu_q)
    if rope is None:
        kn = vn = cos = sin = slots = qw = kw = q  # (unread without rope)
        eps, offset, kv_scales, r, norm = 0.0, False, (1.0, 1.0), 2, False
    else:
        kn, vn, cos, sin, slots, qw, kw, eps, offset, kv_scales = rope
        r, norm = cos.shape[-1], qw is not None
        qw, kw = (qw, kw) if norm else (q, q)
    if out8 is not None and (cu_q is not None or out8[0].shape != (q.shape[0], heads * d) or out8[0].stride(1) != 1
                             or out8[1].shape != (q.shape[0], heads) or out8[1].stride(1) != 1):
        raise ValueError(f"paged_decode: out8 needs q [{q.shape[0]}, {heads * d}] and scales [{q.shape[0]}, {heads}] "
                         f"(unit column strides, without cu_q), got {tuple(out8[0].shape)} and {tuple(out8[1].shape)}")
    q8, qs8 = out8 if out8 is not None else (out, out)
    col = None if sums is None else sums.col
    row = None if sums is None else sums.row
    _decode_kernel[(seqs, kv, parts)](
        q, k_cache, v_cache, block_table, context_lens, cu, out, part_acc, part_ml, cnt, scale, int(window or 0),
        float(softcap or 0.0), MIN_PART,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        kn, vn, cos, sin, slots, qw, kw, float(eps), 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos.stride(0), sin.stride(0),
        q if col is None else col, q if row is None else row, q if sums is None or sums.delta is None else sums.delta,
        0 if sums is None else sums.parts.stride(0),
        (kn.data_ptr() - q.data_ptr()) // q.element_size(), (vn.data_ptr() - q.data_ptr()) // q.element_size(),
        q8, qs8, q8.stride(0), qs8.stride(0),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BS=bs, BLOCK=block, PARTS=parts,
        CU_Q=cu_q is not None, **dot_flags(out, k_cache, _decode_kernel), ROPE=rope is not None, R=r, NORM=norm,
        OFFSET=bool(offset), SCALED=k_cache.dtype == torch.float8_e4m3fn and tuple(kv_scales) != (1.0, 1.0),
        SHARES=0 if sums is None else sums.parts.shape[0], COL=col is not None, ROW=row is not None,
        DELTA=sums is not None and sums.delta is not None, OUT8=out8 is not None,
        **launch_options(k_cache.element_size() == 1), **pdl_args(q))
    released(out, q8)
    return out
