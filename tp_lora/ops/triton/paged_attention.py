"""Paged decode attention in Triton, with the signature of tp_lora.ops.paged_attention.paged_decode_ref.

One program per (sequence, KV head, context partition): the query heads sharing that KV head are one [REP, d] tile,
so each K/V position is loaded once for all of them, and only the sequence's real positions are read (its block
table, up to its context length). Long contexts at small batches are split into partitions of the context whose
partial softmax sums are merged by a second kernel, so the grid fills the GPU; the partition count depends only on
the shapes (batch, KV heads, block-table width), so a captured CUDA graph replays it for any context lengths.

An fp8 (float8_e4m3fn) cache is read as stored, one byte per element, and widened in registers to float16, not
bfloat16: e4m3 -> f16 is one packed conversion per two elements, -> bf16 adds one per element (Triton goes through
f16), conversion work that costs what the halved bytes save. Every e4m3 value is exact in f16; the queries are
multiplied by the softmax scale first (in float32) so they stay far inside f16's range, and the probabilities (in
[0, 1]) are f16 too. Half the bytes per position also means twice the partitions (the grid's target scales with the
bytes a position holds) and tiles of BLOCK_N_FP8 positions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 128  # positions per inner iteration
# ... over an fp8 cache: its widened K and V pass through shared memory as f16 too, so a 128-position tile holds
# ~100 KB of it and two programs fit an SM; 64 positions let four in (more warps to hide the conversions behind; a
# tile of 16 KB in flight per program is still several times what a share of HBM needs; sm_90 builds,
# scripts/bench_attention.py --kind fp8_kv --sweep)
BLOCK_N_FP8 = 64
# Programs the decode grid aims for where a position holds >= 256 bytes per KV head (bf16 at head_dim 128; two waves of
# SMs); 256 / bytes times that below (head_dim 64, an fp8 cache), where a program streams fewer bytes per position
# (scripts/bench_attention.py --sweep).
TARGET_PROGRAMS = 264
MIN_PART = 256  # positions per partition at least (fewer: the merge costs more than it gains)
NUM_WARPS, NUM_STAGES = 4, 2  # of the decode kernel (chosen by scripts/bench_attention.py --sweep)


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
            if KV_FP8:  # float16, as the queries (dot_queries)
                k = fp8_to_f16(k, FP8_ASM)
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
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                   scale, window, softcap, part_len,
                   s_qb, s_qh, s_kb, s_ks, s_kh, s_btb, s_ob, s_oh,
                   REP: tl.constexpr, REP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK: tl.constexpr, PARTS: tl.constexpr, F32_DOT: tl.constexpr, KV_FP8: tl.constexpr,
                   FP8_ASM: tl.constexpr):
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
    q, scale = dot_queries(q, scale, F32_DOT, KV_FP8)
    m, l_sum, acc = softmax_start(REP_PAD, D)
    m, l_sum, acc = online_softmax(m, l_sum, acc, q, r, k_ptr, v_ptr, bt_ptr + b * s_btb, g * s_kh, lo, hi, scale,
                                   window, softcap, s_kb, s_ks, REP_PAD, D, BS, BLOCK, False, F32_DOT, KV_FP8,
                                   FP8_ASM)
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


def dot_flags(q: torch.Tensor, k_cache: torch.Tensor, kernel) -> dict:
    """The attention kernels' F32_DOT / KV_FP8 / FP8_ASM for these inputs: float32 dots for float32 queries and under
    the interpreter (which has no bf16 dot); over an fp8 cache float16 dots everywhere, widened by inline PTX where
    `kernel` is compiled."""
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    return dict(F32_DOT=not fp8 and (interpreted or q.dtype == torch.float32), KV_FP8=fp8,
                FP8_ASM=fp8 and not interpreted)


def tile_positions(elem_bytes: int) -> int:
    """Positions per inner iteration of the decode kernel over a cache of elem_bytes bytes per element."""
    return BLOCK_N_FP8 if elem_bytes == 1 else BLOCK_N


def partitions(batch: int, kv_heads: int, max_context: int, head_dim: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(partition count, positions per partition) for a grid of batch x kv_heads programs over contexts of at most
    max_context positions of head_dim x elem_bytes bytes each (K or V of one KV head): split only while the grid is
    short of its target (TARGET_PROGRAMS at >= 256 bytes per position); whole tiles per partition."""
    target = TARGET_PROGRAMS * max(1, 256 // (head_dim * elem_bytes))
    parts = max(1, min(target // max(1, batch * kv_heads), triton.cdiv(max_context, MIN_PART)))
    block = tile_positions(elem_bytes)
    part_len = triton.cdiv(triton.cdiv(max_context, parts), block) * block
    return triton.cdiv(max_context, part_len), part_len


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    b, heads, d = q.shape
    _, bs, kv, _ = k_cache.shape
    if d & (d - 1) or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"paged_decode needs a power-of-two head_dim and contiguous heads, got d={d}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode needs K and V caches of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    rep = heads // kv
    parts, part_len = partitions(b, kv, block_table.shape[1] * bs, d, k_cache.element_size())
    out = torch.empty_like(q)
    if parts > 1:
        part_acc = torch.empty(b * heads * parts * d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b * heads * parts * 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _decode_kernel[(b, kv, parts)](
        q, k_cache, v_cache, block_table, context_lens, out, part_acc, part_ml, scale, int(window or 0),
        float(softcap or 0.0), part_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), D=d, BS=bs,
        BLOCK=tile_positions(k_cache.element_size()), PARTS=parts,
        **dot_flags(q, k_cache, _decode_kernel), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if parts > 1:
        _merge_kernel[(b, heads)](part_acc, part_ml, out, out.stride(0), out.stride(1), H=heads, D=d, PARTS=parts,
                                  PARTS_PAD=max(2, triton.next_power_of_2(parts)))
    return out
