"""The routing plan of a small batch (decode) in one Triton launch, no host sync, grid from shapes only (capturable):
the results of tp_lora.ops.moe_plan's references (sort_pairs_ref, the expert ends' searchsorted, lora_blocks_ref).

- The sort: each pair's place in the stable (key, index) order is the count of pairs before it (an all-pairs
  comparison, cheap for a few thousand pairs); the program that ranked a pair writes its rows of the plan there.
- In the same pass over the keys each program counts, for the experts it owns (every num_programs-th), the keys
  below the expert's end: the expert ends, with no sorted keys needed.
- route_plan: the router's top-k in the same launch, for a batch whose logits fit one tile: every program takes the
  top-k of every token (a few KB of logits, read from L2 after the first) and ranks its own pairs.
- With adapter slots each program then takes a ticket (tp_lora.ops.triton.tickets); the last to finish reads the
  sorted keys and writes the LoRA block table (group starts by a running max, block rows by a running sum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import LORA_BLOCK, num_lora_blocks
from tp_lora.ops.triton.fused import softmax_topk, unit_rows
from tp_lora.ops.triton.tickets import tickets

BLOCK_I, BLOCK_J = 4, 256  # pairs a program ranks (many small programs: ranking is the work), compared at once
NUM_WARPS = 8
ROUTE_TILE = 8192  # route_plan's largest tile: padded tokens x padded experts (or x ranked pairs a token)


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
def _store_plan(i, ok, K, key, mine, rank, e, below, E, cap, B, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr,
                cnt_ptr, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr, C_PAD: tl.constexpr,
                LORA_BLOCK: tl.constexpr):
    """A program's share of the plan: its pairs i (their key, whether this rank computes them, their rank in the
    stable order), the ends of its experts e (below: the keys under each end); with slots, the last program to take
    a ticket writes the LoRA block table."""
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


@triton.jit
def _plan_kernel(ids_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr, cnt_ptr, P, K, s_ids, s_slot,
                 e0, E, cap, B, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_I: tl.constexpr,
                 BLOCK_J: tl.constexpr, OWN: tl.constexpr, C_PAD: tl.constexpr, LORA_BLOCK: tl.constexpr):
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
    _store_plan(i, ok, K, key, mine, rank, e, below, E, cap, B, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr,
                cnt_ptr, PER_EXPERT, HAS_SLOTS, C_PAD, LORA_BLOCK)


@triton.jit
def _route_plan_kernel(logits_ptr, valid_ptr, slots_ptr, w_ptr, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr,
                       cnt_ptr, N, X, s_l, s_slot, first, e0, E, cap, B, K: tl.constexpr, K_PAD: tl.constexpr,
                       N_PAD: tl.constexpr, X_PAD: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
                       HAS_VALID: tl.constexpr, PER_EXPERT: tl.constexpr, HAS_SLOTS: tl.constexpr,
                       BLOCK_I: tl.constexpr, OWN: tl.constexpr, C_PAD: tl.constexpr, LORA_BLOCK: tl.constexpr):
    t = tl.arange(0, N_PAD)[:, None]
    c = tl.arange(0, X_PAD)
    x = tl.load(logits_ptr + t.to(tl.int64) * s_l + c[None, :], mask=(t < N) & (c[None, :] < X),
                other=-float("inf")).to(tl.float32)
    x = tl.where((t < N) | (c[None, :] >= X), x, 0.0)  # rows past the batch: no NaN
    ids, w = softmax_topk(x, c, K, K_PAD, RENORM, ROUND, logits_ptr.dtype.element_ty)  # [N_PAD, K_PAD]
    if HAS_VALID:  # a graph's padding rows route nowhere
        ids = tl.where(first + t >= tl.load(valid_ptr), -1, ids)
    s = tl.arange(0, K_PAD)[None, :]
    pair = t * K + s
    real = (t < N) & (s < K)
    local = ids - e0
    owned = real & (local >= 0) & (local < E)
    slot = -1
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + t * s_slot, mask=t < N, other=-1).to(tl.int32)
    key = tl.where(owned, local * PER_EXPERT + slot + 1, E * PER_EXPERT)
    key = tl.where(real, key, E * PER_EXPERT + 1)  # as _keys gives them
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = i < N * K
    at = (pair[None, :, :] == i[:, None, None]) & real[None, :, :]  # [BLOCK_I, N_PAD, K_PAD]: this program's pairs
    key_i = tl.sum(tl.sum(tl.where(at, key[None, :, :], 0), 2), 1)
    mine = tl.sum(tl.sum((at & owned[None, :, :]).to(tl.int32), 2), 1) > 0
    tl.store(w_ptr + i, tl.sum(tl.sum(tl.where(at, w[None, :, :], 0.0), 2), 1), mask=ok)
    before = (key[None, :, :] < key_i[:, None, None]) | (
        (key[None, :, :] == key_i[:, None, None]) & (pair[None, :, :] < i[:, None, None]))
    rank = tl.sum(tl.sum((before & real[None, :, :]).to(tl.int32), 2), 1)
    e = tl.program_id(0) + tl.num_programs(0) * tl.arange(0, OWN)  # the experts whose end this program counts
    below = tl.sum(tl.sum((key[None, :, :] < ((e + 1) * PER_EXPERT)[:, None, None]).to(tl.int32), 2), 1)
    _store_plan(i, ok, K, key_i, mine, rank, e, below, E, cap, B, token_ptr, pos_ptr, skey_ptr, ends_ptr, groups_ptr,
                cnt_ptr, PER_EXPERT, HAS_SLOTS, C_PAD, LORA_BLOCK)


def _plan_outputs(n: int, k: int, E: int, max_loras: int, dev: torch.device):
    """(capacity C, LoRA blocks B, the plan's tensors token [C], pos [N, k], sorted_key [C], expert_ends [E],
    groups [B, 4]) for N tokens of k pairs over E local experts, unwritten."""
    cap = n * min(k, E)
    blocks = num_lora_blocks(cap, E, max_loras) if max_loras else 0
    i32 = dict(dtype=torch.int32, device=dev)
    return cap, blocks, (torch.empty(cap, dtype=torch.int64, device=dev), torch.empty(n, k, **i32),
                         torch.empty(cap, **i32), torch.empty(E, **i32), torch.empty(blocks, 4, **i32))


def plan_pairs(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
               max_loras: int):
    """(token, pos, sorted_key) as sort_pairs_ref, expert_ends [E] int32 (searchsorted of each expert's end key)
    and, with max_loras, the LoRA block table [B, 4] (lora_blocks_ref's used rows first, then rows of 0; [0, 4]
    without), for topk_ids [N, k] with N * k > 0 (rows of unit-stride columns: the EP dispatch's unpacked views are
    read where they lie, as are the slots)."""
    n, k = topk_ids.shape
    E, p, dev = num_local, n * k, topk_ids.device
    cap, blocks, (token, pos, skey, ends, groups) = _plan_outputs(n, k, E, max_loras, dev)
    ids = unit_rows(topk_ids)
    programs = triton.cdiv(p, BLOCK_I)
    _plan_kernel[(programs,)](
        ids, ids if slots is None else slots, token, pos, skey, ends, groups, tickets(dev, 1) if max_loras else ends,
        p, k, ids.stride(0), 0 if slots is None else slots.stride(0), expert_start, E, cap, blocks,
        PER_EXPERT=max_loras + 1, HAS_SLOTS=bool(max_loras), BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J,
        OWN=triton.next_power_of_2(triton.cdiv(E, programs)), C_PAD=triton.next_power_of_2(max(cap, 16)),
        LORA_BLOCK=LORA_BLOCK, num_warps=NUM_WARPS)
    return token, pos, skey, ends, groups


def route_fits(tokens: int, experts: int, k: int) -> bool:
    """Whether route_plan takes a batch of `tokens` rows of `experts` router logits (every program holds them all)."""
    widest = max(triton.next_power_of_2(experts), BLOCK_I * triton.next_power_of_2(k))
    return tokens > 0 and triton.next_power_of_2(tokens) * widest <= ROUTE_TILE


def route_plan(logits: torch.Tensor, k: int, renormalize: bool, round_weights: bool, valid: torch.Tensor | None,
               first: int, slots: torch.Tensor | None, expert_start: int, num_local: int, max_loras: int):
    """moe_topk's top-k of logits [N, X] (route_fits), then plan_pairs of it, in one launch -> (token, pos,
    sorted_key, expert_ends, groups) as plan_pairs and the top-k weights [N, k] float32 (the ids stay inside)."""
    logits = unit_rows(logits)
    n, x = logits.shape
    if not 1 <= k <= x:
        raise ValueError(f"route_plan: k={k} outside 1..{x} (the number of experts)")
    E, p, dev = num_local, n * k, logits.device
    cap, blocks, (token, pos, skey, ends, groups) = _plan_outputs(n, k, E, max_loras, dev)
    w = torch.empty(n, k, dtype=torch.float32, device=dev)
    programs = triton.cdiv(p, BLOCK_I)
    _route_plan_kernel[(programs,)](
        logits, ends if valid is None else valid, ends if slots is None else slots, w, token, pos, skey, ends, groups,
        tickets(dev, 1) if max_loras else ends, n, x, logits.stride(0), 0 if slots is None else slots.stride(0),
        first, expert_start, E, cap, blocks, K=k, K_PAD=triton.next_power_of_2(k), N_PAD=triton.next_power_of_2(n),
        X_PAD=triton.next_power_of_2(x), RENORM=renormalize, ROUND=round_weights, HAS_VALID=valid is not None,
        PER_EXPERT=max_loras + 1, HAS_SLOTS=bool(max_loras), BLOCK_I=BLOCK_I,
        OWN=triton.next_power_of_2(triton.cdiv(E, programs)), C_PAD=triton.next_power_of_2(max(cap, 16)),
        LORA_BLOCK=LORA_BLOCK, num_warps=NUM_WARPS)
    return token, pos, skey, ends, groups, w
