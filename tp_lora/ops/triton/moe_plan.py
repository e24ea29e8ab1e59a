"""The routing plan of a small batch (decode) in one Triton launch, no host sync, grid from shapes only (capturable):
the results of tp_lora.ops.moe_plan's references (sort_pairs_ref, the expert ends' searchsorted, lora_blocks_ref).

- The sort: each pair's place in the stable (key, index) order is the count of pairs before it (an all-pairs
  comparison, cheap for a few thousand pairs); the program that ranked a pair writes its rows of the plan there.
- In the same pass over the keys each program counts, for the experts it owns (every num_programs-th), the keys
  below the expert's end: the expert ends, with no sorted keys needed.
- With adapter slots each program then takes a ticket (tp_lora.ops.triton.tickets); the last to finish reads the
  sorted keys and writes the LoRA block table (group starts by a running max, block rows by a running sum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import LORA_BLOCK, num_lora_blocks
from tp_lora.ops.triton.fused import unit_rows
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior
from tp_lora.ops.triton.tickets import tickets

BLOCK_I, BLOCK_J = 4, 256  # pairs a program ranks (many small programs: ranking is the work), compared at once
NUM_WARPS = 8


@triton.jit
def _keys(ids_ptr, slots_ptr, i, ok, K, s_ids, s_slot, e0, E, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """(key, mine) of flat pairs i (token i // K's (i % K)-th expert; rows s_ids apart, slots s_slot apart): key =
    local expert * PER_EXPERT + slot + 1, E * PER_EXPERT for pairs of other ranks, and past the last pair (masked)
    larger still."""
    local = tl.load(ids_ptr + (i // K) * s_ids + i % K, mask=ok, other=-1).to(tl.int32) - e0
    mine = (local >= 0) & (local < E)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + (i // K) * s_slot, mask=ok, other=-1).to(tl.int32)
    else:
        slot = tl.full(i.shape, -1, tl.int32)
    key = tl.where(mine, local * PER_EXPERT + slot + 1, E * PER_EXPERT)
    return tl.where(ok, key, E * PER_EXPERT + 1), mine & ok


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _lora_block_rows(skey_ptr, groups_ptr, C, B, LIMIT, PER_EXPERT: tl.constexpr, C_PAD: tl.constexpr,
                     LORA_BLOCK: tl.constexpr):
    """The LoRA block table [B, 4] of the C sorted keys: used rows first, the rest all 0."""
    p = tl.arange(0, C_PAD)
    ok = p < C
    key = tl.load(skey_ptr + p, mask=ok, other=LIMIT, cache_modifier=".cg")
    prev = tl.load(skey_ptr + tl.maximum(p - 1, 0), mask=ok & (p > 0), other=-1, cache_modifier=".cg")
    group_start = tl.associative_scan(tl.where(key != prev, p, 0), 0, _max)
    lora = ok & (key < LIMIT) & (key % PER_EXPERT != 0)  # this rank's pairs that have an adapter
    first = lora & ((p - group_start) % LORA_BLOCK == 0)
    row = tl.cumsum(first.to(tl.int32), 0) - 1
    count = tl.zeros((C_PAD,), dtype=tl.int32)
    for d in tl.static_range(LORA_BLOCK):
        count += (tl.load(skey_ptr + p + d, mask=first & (p + d < C), other=-1, cache_modifier=".cg") == key
                  ).to(tl.int32)
    out = groups_ptr + row * 4
    tl.store(out, key // PER_EXPERT, mask=first)
    tl.store(out + 1, key % PER_EXPERT - 1, mask=first)
    tl.store(out + 2, p, mask=first)
    tl.store(out + 3, count, mask=first)
    used = tl.sum(first.to(tl.int32), 0)
    for b0 in range(0, B, C_PAD):  # the rows no block took: count 0
        b = b0 + p
        for c in tl.static_range(4):
            tl.store(groups_ptr + b * 4 + c, 0, mask=(b >= used) & (b < B))


@triton.jit
def _plan_kernel(ids_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr, cnt_ptr, P, K, s_ids, s_slot,
                 e0, E, cap, B, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_I: tl.constexpr,
                 BLOCK_J: tl.constexpr, OWN: tl.constexpr, C_PAD: tl.constexpr, LORA_BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < P
    key, mine = _keys(ids_ptr, slots_ptr, i, ok, K, s_ids, s_slot, e0, E, PER_EXPERT, HAS_SLOTS)
    e = tl.program_id(0) + tl.num_programs(0) * tl.arange(0, OWN)  # the experts whose end this program counts
    bound = (e + 1) * PER_EXPERT  # expert e + 1's first key
    rank = tl.zeros((BLOCK_I,), dtype=tl.int32)
    below = tl.zeros((OWN,), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        kj, _ = _keys(ids_ptr, slots_ptr, j, j < P, K, s_ids, s_slot, e0, E, PER_EXPERT, HAS_SLOTS)
        before = (kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
        below += tl.sum((kj[None, :] < bound[:, None]).to(tl.int32), 1)
    tl.store(ends_ptr + e, below, mask=e < E)
    tl.store(pos_ptr + i, tl.where(mine, rank, -1), mask=ok)
    kept = ok & (rank < cap)
    tl.store(token_ptr + rank, (i // K).to(tl.int64), mask=kept)
    tl.store(skey_ptr + rank, key, mask=kept)
    if HAS_SLOTS:
        tl.debug_barrier()  # every thread's keys stored before the ticket publishes them
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            _lora_block_rows(skey_ptr, groups_ptr, cap, B, E * PER_EXPERT, PER_EXPERT, C_PAD, LORA_BLOCK)
            tl.atomic_xchg(cnt_ptr, 0)


def plan_pairs(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
               max_loras: int):
    """(token, pos, sorted_key) as sort_pairs_ref, expert_ends [E] int32 (searchsorted of each expert's end key)
    and, with max_loras, the LoRA block table [B, 4] (lora_blocks_ref's used rows first, then rows of 0; [0, 4]
    without), for topk_ids [N, k] with N * k > 0 (rows of unit-stride columns: the EP dispatch's unpacked views are
    read where they lie, as are the slots)."""
    n, k = topk_ids.shape
    E, p = num_local, n * k
    cap = n * min(k, E)
    dev = topk_ids.device
    token = torch.empty(cap, dtype=torch.int64, device=dev)
    pos = torch.empty(n, k, dtype=torch.int32, device=dev)
    skey = torch.empty(cap, dtype=torch.int32, device=dev)
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    blocks = num_lora_blocks(cap, E, max_loras) if max_loras else 0
    groups = torch.empty(blocks, 4, dtype=torch.int32, device=dev)
    ids = unit_rows(topk_ids)
    programs = triton.cdiv(p, BLOCK_I)
    _plan_kernel[(programs,)](
        ids, ids if slots is None else slots, token, pos, skey, ends, groups, tickets(dev, 1) if max_loras else ends,
        p, k, ids.stride(0), 0 if slots is None else slots.stride(0), expert_start, E, cap, blocks,
        PER_EXPERT=max_loras + 1, HAS_SLOTS=bool(max_loras), BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J,
        OWN=triton.next_power_of_2(triton.cdiv(E, programs)), C_PAD=triton.next_power_of_2(max(cap, 16)),
        LORA_BLOCK=LORA_BLOCK, num_warps=NUM_WARPS, **pdl_args(ids, *(() if slots is None else (slots,))))
    released(token, pos, skey, ends, groups)
    return token, pos, skey, ends, groups
