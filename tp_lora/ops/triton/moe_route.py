"""An MoE router over a decode batch in one Triton launch, no host sync, grid from shapes only (capturable): the
logits x @ w^T rounded to x's dtype (F.linear's), softmax in float32 and top-k (tp_lora.ops.fused.moe_topk_ref's
rules) and, where the experts follow the router on the same rank (no EP dispatch between them), the routing plan of
the pairs (tp_lora.ops.moe_plan.build_plan's).

Programs split the experts (BLOCK_E each) and the hidden dim (SPLIT_H ways) and store float32 partial logits; the
last program to take a ticket (tp_lora.ops.triton.tickets) sums them in a fixed order, picks every row's top k, then
ranks the pairs and closes the plan (tp_lora.ops.triton.moe_plan's helpers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.dot import compute_types, mm
from tp_lora.ops.triton.moe_plan import BLOCK_J, finish_plan, plan_buffers, plan_constants, rank_pairs
from tp_lora.ops.triton.tickets import tickets

LOGITS = 8192  # padded rows x padded experts up to which routing takes this kernel: the last program holds them all
BLOCK_E, BLOCK_H = 16, 128
TARGET_PROGRAMS = 32  # programs reading the router weight (experts x hidden splits)
RANK_BLOCK = 64  # pairs the last program ranks at once


@triton.jit
def _top_k(part_ptr, x_ptr, ids_ptr, wt_ptr, valid_ptr, N, E, first, K: tl.constexpr,
           K_PAD: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr, SPLIT_H: tl.constexpr,
           RENORM: tl.constexpr, ROUND: tl.constexpr, HAS_VALID: tl.constexpr):
    """The partial logits [SPLIT_H, N_PAD, E_PAD] summed in order and rounded to x's dtype, then each row's top k of
    their softmax: ids [N, K] int64 (the lowest index among equals; -1 for rows first + t >= valid[0]), weights
    [N, K] float32."""
    n = tl.arange(0, N_PAD)
    e = tl.arange(0, E_PAD)
    s = tl.zeros((N_PAD, E_PAD), dtype=tl.float32)
    for g in tl.static_range(SPLIT_H):
        s += tl.load(part_ptr + (g * N_PAD + n[:, None]) * E_PAD + e[None, :], cache_modifier=".cg")
    x = tl.where(e[None, :] < E, s.to(x_ptr.dtype.element_ty).to(tl.float32), -float("inf"))
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    j = tl.arange(0, K_PAD)
    ids = tl.zeros((N_PAD, K_PAD), dtype=tl.int32)
    w = tl.zeros((N_PAD, K_PAD), dtype=tl.float32)
    for r in tl.static_range(K):
        m = tl.max(p, 1)
        i = tl.min(tl.where(p == m[:, None], e[None, :], E_PAD), 1)
        ids = tl.where(j[None, :] == r, i[:, None], ids)
        w = tl.where(j[None, :] == r, m[:, None], w)
        p = tl.where(e[None, :] == i[:, None], -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 1)[:, None]
    if ROUND:
        w = w.to(x_ptr.dtype.element_ty).to(tl.float32)
    if HAS_VALID:  # a graph's padding rows route nowhere
        ids = tl.where(first + n[:, None] >= tl.load(valid_ptr), -1, ids)
    out = n[:, None] * K + j[None, :]
    ok = (n[:, None] < N) & (j[None, :] < K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=ok)
    tl.store(wt_ptr + out, w, mask=ok)


@triton.jit
def _route_kernel(x_ptr, w_ptr, part_ptr, ids_ptr, wt_ptr, valid_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr,
                  ends_ptr, groups_ptr, cnt_ptr, N, H, E, first, s_x, s_w, h_split, e0, E_LOC, cap, B,
                  CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                  N_PAD: tl.constexpr, EL_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                  SPLIT_H: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr, HAS_VALID: tl.constexpr,
                  PLAN: tl.constexpr, RANK_BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, PER_EXPERT: tl.constexpr,
                  HAS_SLOTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_C: tl.constexpr, C_PAD: tl.constexpr,
                  LORA_BLOCK: tl.constexpr):
    ge, gh = tl.program_id(0), tl.program_id(1)
    n = tl.arange(0, N_PAD)
    e = ge * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros((N_PAD, BLOCK_E), dtype=tl.float32)
    h0 = gh * h_split
    for hb in range(h0, tl.minimum(h0 + h_split, H), BLOCK_H):
        h = hb + tl.arange(0, BLOCK_H)
        xt = tl.load(x_ptr + n[:, None] * s_x + h[None, :], mask=(n[:, None] < N) & (h[None, :] < H), other=0.0)
        wt = tl.load(w_ptr + e[None, :] * s_w + h[:, None], mask=(e[None, :] < E) & (h[:, None] < H), other=0.0)
        acc += mm(xt, wt, CDT, DOT, PREC)
    tl.store(part_ptr + (gh * N_PAD + n[:, None]) * EL_PAD + e[None, :], acc)
    tl.debug_barrier()  # every thread's partials stored before the ticket publishes them
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(1) - 1:
        _top_k(part_ptr, x_ptr, ids_ptr, wt_ptr, valid_ptr, N, E, first, K, K_PAD, N_PAD, EL_PAD, SPLIT_H, RENORM,
               ROUND, HAS_VALID)
        if PLAN:
            tl.debug_barrier()  # the ids stored before they are read back as pairs
            for i0 in range(0, N * K, RANK_BLOCK):
                rank_pairs(ids_ptr, slots_ptr, token_ptr, pos_ptr, skey_ptr, i0 + tl.arange(0, RANK_BLOCK), N * K,
                           K, e0, E_LOC, cap, PER_EXPERT, HAS_SLOTS, BLOCK_J)
            tl.debug_barrier()  # every pair ranked before the plan's closing reads the sorted keys
            finish_plan(ids_ptr, slots_ptr, skey_ptr, ends_ptr, groups_ptr, N * K, K, e0, E_LOC, cap, B, PER_EXPERT,
                        HAS_SLOTS, E_PAD, BLOCK_C, C_PAD, LORA_BLOCK)
        tl.atomic_xchg(cnt_ptr, 0)


def takes(rows: int, experts: int) -> bool:
    """Whether route() takes a batch of `rows` tokens over `experts` experts (decode sizes)."""
    return 1 <= rows and _pad(rows, 16) * _pad(experts, BLOCK_E) <= LOGITS


def _pad(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(n))


def route(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, round_weights: bool,
          valid: torch.Tensor | None = None, first: int = 0, slots: torch.Tensor | None = None,
          plan: tuple[int, int, int] | None = None):
    """x [n, H] (takes(n, E)), router weight [E, H] -> topk ids [n, k] int64, weights [n, k] float32 and, with
    plan = (expert_start, num_local, max_loras), the plan's tensors as tp_lora.ops.triton.moe_plan.plan_pairs returns
    them (slots [n] int32 when max_loras), else None."""
    n, hidden = x.shape
    experts = weight.shape[0]
    if not takes(n, experts) or weight.shape[1] != hidden or not 1 <= k <= experts:
        raise ValueError(f"route: x {tuple(x.shape)}, weight {tuple(weight.shape)}, k={k}: expected at most "
                         f"{LOGITS} padded rows x experts, the weight's columns = x's and k in 1..{experts}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("route: x and the router weight need contiguous rows")
    dev = x.device
    ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    w = torch.empty(n, k, dtype=torch.float32, device=dev)
    e_pad, n_pad = _pad(experts, BLOCK_E), _pad(n, 16)
    e_blocks = e_pad // BLOCK_E
    split = max(1, min(TARGET_PROGRAMS // e_blocks, triton.cdiv(hidden, BLOCK_H)))
    h_split = triton.cdiv(triton.cdiv(hidden, split), BLOCK_H) * BLOCK_H
    split = triton.cdiv(hidden, h_split)
    part = torch.empty(split * n_pad * e_pad, dtype=torch.float32, device=dev)
    e0, num_local, max_loras = plan if plan is not None else (0, 1, 0)
    bufs = plan_buffers(n, k, num_local, max_loras, dev) if plan is not None else (ids,) * 5
    token, pos, skey, ends, groups = bufs
    cdt, dot, prec = compute_types(x.dtype, weight.dtype)
    _route_kernel[(e_blocks, split)](
        x, weight, part, ids, w, ids if valid is None else valid, ids if slots is None else slots.contiguous(), token,
        pos, skey, ends, groups, tickets(dev, 1), n, hidden, experts, first, x.stride(0), weight.stride(0), h_split,
        e0, num_local, token.shape[0], groups.shape[0], CDT=cdt, DOT=dot, PREC=prec, K=k,
        K_PAD=triton.next_power_of_2(k), N_PAD=n_pad, EL_PAD=e_pad, BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, SPLIT_H=split,
        RENORM=renormalize, ROUND=round_weights, HAS_VALID=valid is not None, PLAN=plan is not None,
        RANK_BLOCK=RANK_BLOCK, BLOCK_J=BLOCK_J, **plan_constants(token.shape[0], num_local, max_loras))
    return ids, w, (bufs if plan is not None else None)
