"""The routing plan in two Triton launches at most, no host sync, grid from shapes only (capturable): the results of
tp_lora.ops.moe_plan's references (sort_pairs_ref, the expert ends' searchsorted, lora_blocks_ref).

- The sort: each pair gets a unique code, key << SHIFT | pair index, so its place in the stable (key, index) order is
  the count of codes below its own (an all-pairs comparison, cheap for some thousands of pairs); the program that
  ranked a pair writes its rows of the plan there.
- In the same pass each program counts, for the experts it owns (every num_programs-th), the codes below the expert's
  end: the expert ends, with no sorted keys needed.
- With adapter slots the LoRA block table, one row per program of the LoRA kernels. Where a row per sorted pair is
  no more rows than the compact table's num_lora_blocks (decode steps with many slots), the same pass also counts
  the codes below each pair's key and below the next key, where its (expert, slot) group begins and ends in the
  sorted order, so a pair that starts a LoRA block (its distance from the group's first pair a multiple of
  LORA_BLOCK) writes the block's row at its own sorted place and every other pair a row of zeros. Else the compact
  table from the sorted keys, used rows first: a block's row is the count of block starts before it. Up to CHUNK
  sorted pairs the last ranking program to finish writes it (a ticket, tp_lora.ops.triton.tickets: decode stays one
  launch); past that a second launch, each program counting the block starts before its own chunk of pairs, then
  running a cumulative sum over its chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import LORA_BLOCK, code_shift, codes_fit, num_lora_blocks
from tp_lora.ops.triton.fused import unit_rows
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior
from tp_lora.ops.triton.tickets import tickets

# (largest pair count, BLOCK_I pairs a program ranks, NUM_WARPS, BLOCK_J codes compared at once): many small programs
# for decode plans, wider ones where each program's pass over every code costs more than its launch
SETTINGS = ((1024, 4, 8, 256), (1 << 62, 16, 4, 256))
CHUNK = 512  # sorted pairs a program of the compact block table takes


@triton.jit
def _codes(ids_ptr, slots_ptr, i, ok, s_ids, s_slot, e0, E, K: tl.constexpr, PER_EXPERT: tl.constexpr,
           HAS_SLOTS: tl.constexpr, SHIFT: tl.constexpr):
    """(code, key, mine) of flat pairs i (token i // K's (i % K)-th expert; rows s_ids apart, slots s_slot apart):
    key = local expert * PER_EXPERT + slot + 1, E * PER_EXPERT for pairs of other ranks; code = key << SHIFT | i, the
    largest int32 past the last pair (masked)."""
    local = tl.load(ids_ptr + (i // K) * s_ids + i % K, mask=ok, other=-1).to(tl.int32) - e0
    mine = (local >= 0) & (local < E)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + (i // K) * s_slot, mask=ok, other=-1).to(tl.int32)
    else:
        slot = tl.full(i.shape, -1, tl.int32)
    key = tl.where(mine, local * PER_EXPERT + slot + 1, E * PER_EXPERT)
    return tl.where(ok, (key << SHIFT) | i, 0x7FFFFFFF), key, mine & ok


@triton.jit
def _rank_kernel(ids_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr, cnt_ptr, P, s_ids,
                 s_slot, e0, E, cap, B, K: tl.constexpr, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr,
                 SHIFT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, OWN: tl.constexpr,
                 TABLE: tl.constexpr, CHUNK: tl.constexpr, LORA_BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < P
    code, key, mine = _codes(ids_ptr, slots_ptr, i, ok, s_ids, s_slot, e0, E, K, PER_EXPERT, HAS_SLOTS, SHIFT)
    e = tl.program_id(0) + tl.num_programs(0) * tl.arange(0, OWN)  # the experts whose end this program counts
    bound = ((e + 1) * PER_EXPERT) << SHIFT  # expert e + 1's first code
    rank = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)  # per lane: summed once after the loop
    below = tl.zeros((OWN, BLOCK_J), dtype=tl.int32)
    first = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)  # TABLE 1: codes below the pair's key, below the next key
    last = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        cj, _, _ = _codes(ids_ptr, slots_ptr, j, j < P, s_ids, s_slot, e0, E, K, PER_EXPERT, HAS_SLOTS, SHIFT)
        rank += (cj[None, :] < code[:, None]).to(tl.int32)
        below += (cj[None, :] < bound[:, None]).to(tl.int32)
        if TABLE == 1:
            first += (cj[None, :] < (key << SHIFT)[:, None]).to(tl.int32)
            last += (cj[None, :] < ((key + 1) << SHIFT)[:, None]).to(tl.int32)
    rank = tl.sum(rank, 1)
    below = tl.sum(below, 1)
    tl.store(ends_ptr + e, below, mask=e < E)
    tl.store(pos_ptr + i, tl.where(mine, rank, -1), mask=ok)
    kept = ok & (rank < cap)
    tl.store(token_ptr + rank, (i // K).to(tl.int64), mask=kept)
    tl.store(skey_ptr + rank, key, mask=kept)
    if TABLE == 1:  # row `rank` of the block table: every sorted place < cap is some pair's rank, so all are written
        start = mine & (key % PER_EXPERT != 0) & ((rank - tl.sum(first, 1)) % LORA_BLOCK == 0)
        out = groups_ptr + rank * 4
        tl.store(out, tl.where(start, key // PER_EXPERT, 0), mask=kept)
        tl.store(out + 1, tl.where(start, key % PER_EXPERT - 1, 0), mask=kept)
        tl.store(out + 2, tl.where(start, rank, 0), mask=kept)
        tl.store(out + 3, tl.where(start, tl.minimum(tl.sum(last, 1) - rank, LORA_BLOCK), 0), mask=kept)
    if TABLE == 2:  # the last program to finish writes the compact block table
        tl.debug_barrier()  # every thread's keys stored before the ticket publishes them
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            _block_rows(skey_ptr, groups_ptr, cap, B, E * PER_EXPERT, 0, 1, PER_EXPERT, CHUNK, LORA_BLOCK)
            tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _block_rows(skey_ptr, groups_ptr, C, B, LIMIT, pid, programs, PER_EXPERT: tl.constexpr, CHUNK: tl.constexpr,
                LORA_BLOCK: tl.constexpr):
    """Program pid of `programs`' part of the LoRA block table [B, 4] of the C sorted keys (used rows first, in key
    order; the rest all 0): the block rows of its CHUNK sorted pairs and its stripe of the unused rows. A block starts
    at each pair with an adapter whose distance from its group's first pair (a running max of the key changes,
    carried over the chunks in order) is a multiple of LORA_BLOCK."""
    q0 = pid * CHUNK
    lanes = tl.arange(0, CHUNK)
    used = q0 * 0  # block starts before the chunk in hand
    group = q0 * 0  # the first pair of the group that runs into the chunk in hand
    for t0 in range(0, C, CHUNK):
        q = t0 + lanes
        ok = q < C
        key = tl.load(skey_ptr + q, mask=ok, other=LIMIT, cache_modifier=".cg")  # L2: other programs' rows
        prev = tl.load(skey_ptr + q - 1, mask=ok & (q > 0), other=-1, cache_modifier=".cg")
        gs = tl.maximum(tl.associative_scan(tl.where(key != prev, q, 0), 0, _max), group)
        s = ok & (key < LIMIT) & (key % PER_EXPERT != 0) & ((q - gs) % LORA_BLOCK == 0)
        if t0 == q0:
            row = used + tl.cumsum(s.to(tl.int32), 0) - 1
            count = tl.zeros((CHUNK,), dtype=tl.int32)
            for d in tl.static_range(LORA_BLOCK):
                count += (tl.load(skey_ptr + q + d, mask=s & (q + d < C), other=-1, cache_modifier=".cg") == key
                          ).to(tl.int32)
            out = groups_ptr + row * 4
            tl.store(out, key // PER_EXPERT, mask=s)
            tl.store(out + 1, key % PER_EXPERT - 1, mask=s)
            tl.store(out + 2, q, mask=s)
            tl.store(out + 3, count, mask=s)
        used += tl.sum(s.to(tl.int32), 0)
        group = tl.max(gs, 0)
    for b0 in range(used + q0, B, programs * CHUNK):  # this program's stripe of the rows no block took
        b = b0 + lanes
        for c in tl.static_range(4):
            tl.store(groups_ptr + b * 4 + c, 0, mask=b < B)


@triton.jit
def _blocks_kernel(skey_ptr, groups_ptr, C, B, LIMIT, PER_EXPERT: tl.constexpr, CHUNK: tl.constexpr,
                   LORA_BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    _block_rows(skey_ptr, groups_ptr, C, B, LIMIT, tl.program_id(0), tl.num_programs(0), PER_EXPERT, CHUNK,
                LORA_BLOCK)


def plan_pairs(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
               max_loras: int, settings: tuple[int, int, int] | None = None):
    """(token, pos, sorted_key) as sort_pairs_ref, expert_ends [E] int32 (searchsorted of each expert's end key)
    and, with max_loras, the LoRA block table: lora_blocks_ref's used rows, each at its start pair's row of a [C, 4]
    table where C <= min(B, CHUNK), else first in a [B, 4] one; rows of 0 elsewhere ([0, 4] without), for topk_ids
    [N, k] with N * k > 0 pairs whose codes fit (rows of unit-stride columns: the EP dispatch's unpacked views are read
    where they lie, as are the slots). settings: (BLOCK_I, NUM_WARPS, BLOCK_J) in place of SETTINGS' (benchmarks)."""
    n, k = topk_ids.shape
    E, p = num_local, n * k
    assert codes_fit(p, E, max_loras), (p, E, max_loras)
    cap = n * min(k, E)
    dev = topk_ids.device
    token = torch.empty(cap, dtype=torch.int64, device=dev)
    pos = torch.empty(n, k, dtype=torch.int32, device=dev)
    skey = torch.empty(cap, dtype=torch.int32, device=dev)
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    blocks = num_lora_blocks(cap, E, max_loras) if max_loras else 0
    # the table: 0 none, 1 a row per sorted pair (ranked pairs write it), 2 compact by the ranking's last program,
    # 3 compact by a second launch
    table_chunk = max(16, triton.next_power_of_2(cap))
    table = 0 if not max_loras else 1 if cap <= min(blocks, CHUNK) else 2 if table_chunk <= CHUNK else 3
    groups = torch.empty(cap if table == 1 else blocks, 4, dtype=torch.int32, device=dev)
    ids = unit_rows(topk_ids)
    block_i, warps, block_j = settings or next(s[1:] for s in SETTINGS if p <= s[0])
    programs = triton.cdiv(p, block_i)
    _rank_kernel[(programs,)](
        ids, ids if slots is None else slots, token, pos, skey, ends, groups, tickets(dev, 1) if table == 2 else ends,
        p, ids.stride(0), 0 if slots is None else slots.stride(0), expert_start, E, cap, blocks, K=k,
        PER_EXPERT=max_loras + 1, HAS_SLOTS=bool(max_loras), SHIFT=code_shift(p), BLOCK_I=block_i, BLOCK_J=block_j,
        OWN=triton.next_power_of_2(triton.cdiv(E, programs)), TABLE=table, CHUNK=min(table_chunk, CHUNK),
        LORA_BLOCK=LORA_BLOCK, num_warps=warps, **pdl_args(ids, *(() if slots is None else (slots,))))
    released(token, pos, skey, ends, groups)
    if table == 3:
        _blocks_kernel[(triton.cdiv(cap, CHUNK),)](
            skey, groups, cap, blocks, E * (max_loras + 1), PER_EXPERT=max_loras + 1, CHUNK=CHUNK,
            LORA_BLOCK=LORA_BLOCK, num_warps=4, **pdl_args(skey))
        released(groups, token, pos, skey, ends)
    return token, pos, skey, ends, groups
