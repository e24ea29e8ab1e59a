"""The routing plan in one Triton launch, no host sync, grid from shapes only (capturable): the results of
tp_lora.ops.moe_plan's references (sort_pairs_ref, the expert ends' searchsorted, lora_blocks_ref).

- The sort: each pair gets a unique code, key << SHIFT | pair index, so its place in the stable (key, index) order is
  the count of codes below its own (an all-pairs comparison, cheap for some thousands of pairs); the program that
  ranked a pair writes its rows of the plan there.
- In the same pass each program counts, for the experts it owns (every num_programs-th), the codes below the expert's
  end: the expert ends, with no sorted keys needed.
- With adapter slots also the codes below its pairs' key and the next key: where its (expert, slot) group begins and
  ends in the sorted order, so a pair that starts a LoRA block (its distance from the group's first pair a multiple
  of LORA_BLOCK) writes the block's row of the table at its own sorted place, and every other pair a row of zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import LORA_BLOCK, code_shift, codes_fit
from tp_lora.ops.triton.fused import unit_rows
from tp_lora.ops.triton.pdl import pdl_args, release_next, released, wait_prior

# (largest pair count, BLOCK_I pairs a program ranks, NUM_WARPS, BLOCK_J codes compared at once): many small programs
# for decode plans, wider ones where each program's pass over every code costs more than its launch
SETTINGS = ((1024, 4, 8, 256), (1 << 62, 16, 4, 256))


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
def _rank_kernel(ids_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr, P, s_ids, s_slot, e0, E,
                 cap, K: tl.constexpr, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr, SHIFT: tl.constexpr,
                 BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, OWN: tl.constexpr, LORA_BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    wait_prior(PDL)
    release_next(PDL)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < P
    code, key, mine = _codes(ids_ptr, slots_ptr, i, ok, s_ids, s_slot, e0, E, K, PER_EXPERT, HAS_SLOTS, SHIFT)
    e = tl.program_id(0) + tl.num_programs(0) * tl.arange(0, OWN)  # the experts whose end this program counts
    bound = ((e + 1) * PER_EXPERT) << SHIFT  # expert e + 1's first code
    rank = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)  # per lane: summed once after the loop
    below = tl.zeros((OWN, BLOCK_J), dtype=tl.int32)
    first = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)  # codes below the pair's key, and below the next key
    last = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        cj, _, _ = _codes(ids_ptr, slots_ptr, j, j < P, s_ids, s_slot, e0, E, K, PER_EXPERT, HAS_SLOTS, SHIFT)
        rank += (cj[None, :] < code[:, None]).to(tl.int32)
        below += (cj[None, :] < bound[:, None]).to(tl.int32)
        if HAS_SLOTS:
            first += (cj[None, :] < (key << SHIFT)[:, None]).to(tl.int32)
            last += (cj[None, :] < ((key + 1) << SHIFT)[:, None]).to(tl.int32)
    rank = tl.sum(rank, 1)
    below = tl.sum(below, 1)
    tl.store(ends_ptr + e, below, mask=e < E)
    tl.store(pos_ptr + i, tl.where(mine, rank, -1), mask=ok)
    kept = ok & (rank < cap)
    tl.store(token_ptr + rank, (i // K).to(tl.int64), mask=kept)
    tl.store(skey_ptr + rank, key, mask=kept)
    if HAS_SLOTS:  # row `rank` of the block table: every sorted place < cap is some pair's rank, so all are written
        first = tl.sum(first, 1)
        start = mine & (key % PER_EXPERT != 0) & ((rank - first) % LORA_BLOCK == 0)
        out = groups_ptr + rank * 4
        tl.store(out, tl.where(start, key // PER_EXPERT, 0), mask=kept)
        tl.store(out + 1, tl.where(start, key % PER_EXPERT - 1, 0), mask=kept)
        tl.store(out + 2, tl.where(start, rank, 0), mask=kept)
        tl.store(out + 3, tl.where(start, tl.minimum(tl.sum(last, 1) - rank, LORA_BLOCK), 0), mask=kept)


def plan_pairs(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
               max_loras: int, settings: tuple[int, int, int] | None = None):
    """(token, pos, sorted_key) as sort_pairs_ref, expert_ends [E] int32 (searchsorted of each expert's end key)
    and, with max_loras, the LoRA block table [C, 4] (lora_blocks_ref's; [0, 4] without), for topk_ids [N, k] with
    N * k > 0 pairs whose codes fit (rows of unit-stride columns: the EP dispatch's unpacked views are read where they
    lie, as are the slots). settings: (BLOCK_I, NUM_WARPS, BLOCK_J)
    in place of SETTINGS' (benchmarks)."""
    n, k = topk_ids.shape
    E, p = num_local, n * k
    assert codes_fit(p, E, max_loras), (p, E, max_loras)
    cap = n * min(k, E)
    dev = topk_ids.device
    token = torch.empty(cap, dtype=torch.int64, device=dev)
    pos = torch.empty(n, k, dtype=torch.int32, device=dev)
    skey = torch.empty(cap, dtype=torch.int32, device=dev)
    ends = torch.empty(E, dtype=torch.int32, device=dev)
    groups = torch.empty(cap if max_loras else 0, 4, dtype=torch.int32, device=dev)
    ids = unit_rows(topk_ids)
    block_i, warps, block_j = settings or next(s[1:] for s in SETTINGS if p <= s[0])
    programs = triton.cdiv(p, block_i)
    _rank_kernel[(programs,)](
        ids, ids if slots is None else slots, token, pos, skey, ends, groups, p, ids.stride(0),
        0 if slots is None else slots.stride(0), expert_start, E, cap, K=k, PER_EXPERT=max_loras + 1,
        HAS_SLOTS=bool(max_loras), SHIFT=code_shift(p), BLOCK_I=block_i, BLOCK_J=block_j,
        OWN=triton.next_power_of_2(triton.cdiv(E, programs)), LORA_BLOCK=LORA_BLOCK, num_warps=warps,
        **pdl_args(ids, *(() if slots is None else (slots,))))
    released(token, pos, skey, ends, groups)
    return token, pos, skey, ends, groups
