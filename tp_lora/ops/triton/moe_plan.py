"""Triton sort of a routing plan's pairs for small batches (decode), with the signature and results of
tp_lora.ops.moe_plan.sort_pairs_ref: each pair's place in the stable (key, index) order is the count of pairs before
it (an all-pairs comparison, cheap for a few thousand pairs), and the program that ranked a pair writes its rows of
the plan there. One launch; no host sync; grid from shapes only (capturable in a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_I, BLOCK_J = 64, 256


@triton.jit
def _keys(ids_ptr, slots_ptr, i, ok, K, e0, E, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr):
    """(key, slot, mine) of flat pairs i: key = local expert * PER_EXPERT + slot + 1, E * PER_EXPERT for pairs of
    other ranks, and past the last pair (masked) larger still."""
    local = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32) - e0
    mine = (local >= 0) & (local < E)
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + i // K, mask=ok, other=-1).to(tl.int32)
    else:
        slot = tl.full(i.shape, -1, tl.int32)
    key = tl.where(mine, local * PER_EXPERT + slot + 1, E * PER_EXPERT)
    return tl.where(ok, key, E * PER_EXPERT + 1), slot, mine & ok


@triton.jit
def _sort_pairs_kernel(ids_ptr, slots_ptr, token_ptr, pos_ptr, expert_ptr, slot_ptr, skey_ptr, P, K, e0, E, cap,
                       PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_J: tl.constexpr):
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < P
    key, slot, mine = _keys(ids_ptr, slots_ptr, i, ok, K, e0, E, PER_EXPERT, HAS_SLOTS)
    rank = tl.zeros((BLOCK_I,), dtype=tl.int32)
    for j0 in range(0, P, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        kj, _, _ = _keys(ids_ptr, slots_ptr, j, j < P, K, e0, E, PER_EXPERT, HAS_SLOTS)
        before = (kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(pos_ptr + i, tl.where(mine, rank, -1), mask=ok)
    kept = ok & (rank < cap)
    tl.store(token_ptr + rank, (i // K).to(tl.int64), mask=kept)
    tl.store(expert_ptr + rank, tl.where(mine, key // PER_EXPERT, E), mask=kept)
    tl.store(slot_ptr + rank, tl.where(mine, slot, -1), mask=kept)
    tl.store(skey_ptr + rank, key, mask=kept)


def sort_pairs(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
               max_loras: int):
    n, k = topk_ids.shape
    E, p = num_local, n * k
    cap = n * min(k, E)
    dev = topk_ids.device
    token = torch.empty(cap, dtype=torch.int64, device=dev)
    pos = torch.empty(n, k, dtype=torch.int32, device=dev)
    expert, slot, skey = (torch.empty(cap, dtype=torch.int32, device=dev) for _ in range(3))
    if p:
        ids = topk_ids.contiguous()
        _sort_pairs_kernel[(triton.cdiv(p, BLOCK_I),)](
            ids, ids if slots is None else slots.contiguous(), token, pos, expert, slot, skey, p, k, expert_start,
            E, cap, PER_EXPERT=max_loras + 1, HAS_SLOTS=bool(max_loras), BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J)
    return token, pos, expert, slot, skey
