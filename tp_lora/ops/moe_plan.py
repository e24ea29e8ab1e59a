"""The routing plan of one MoE layer (tp_lora.ops.moe_layout.MoEPlan): the (token, top-k) pairs a rank computes,
sorted once by (local expert, adapter slot), with everything the base grouped GEMMs and the fused MoE LoRA kernels
read. Built on the device with no host sync and no data-dependent shape, so a step that routes is capturable in a CUDA
graph. Shapes and pair order: see tp_lora.ops.moe_layout.
"""
from __future__ import annotations

import torch

from tp_lora.ops.fused import use_kernels
from tp_lora.ops.moe_layout import LORA_BLOCK, MoEPlan, codes_fit, num_lora_blocks

# pairs (N * k) up to which CUDA builds the plan with the Triton kernels (their ranking makes O(pairs^2)
# comparisons), else with torch.sort and co.
SMALL_SORT = 12288


def build_plan(topk_ids: torch.Tensor, topk_weights: torch.Tensor, token_slot: torch.Tensor | None,
               expert_start: int, num_local: int, max_loras: int = 0, lora: bool = False) -> MoEPlan:
    """topk_ids [N, k] global expert ids (-1 = padding row), topk_weights [N, k], token_slot [N] int (or None: no
    LoRA); this rank holds experts [expert_start, expert_start + num_local). lora: build the LoRA block table."""
    n, k = topk_ids.shape
    E = num_local
    L = max_loras if (lora and token_slot is not None) else 0
    slots = token_slot if L else None
    if use_kernels(topk_ids) and 0 < n * k <= SMALL_SORT and codes_fit(n * k, E, L):
        from tp_lora.ops.triton.moe_plan import plan_pairs  # noqa: PLC0415 - CUDA / forced only
        token, pos, sorted_key, ends, groups = plan_pairs(topk_ids, slots, expert_start, E, L)
    else:
        token, pos, sorted_key = sort_pairs_ref(topk_ids, slots, expert_start, E, L)
        bounds = torch.arange(L + 1, (E + 1) * (L + 1), L + 1, dtype=torch.int32, device=topk_ids.device)
        ends = torch.searchsorted(sorted_key, bounds, out_int32=True)
        groups = (lora_blocks_ref(sorted_key, E, L) if L else
                  torch.zeros(0, 4, dtype=torch.int32, device=topk_ids.device))
    return MoEPlan(token=token, pos=pos, weight=topk_weights.float(), sorted_key=sorted_key, expert_ends=ends,
                   groups=groups, keys_per_expert=L + 1)


def sort_pairs_ref(topk_ids: torch.Tensor, slots: torch.Tensor | None, expert_start: int, num_local: int,
                   max_loras: int):
    """The pairs (t, j) of topk_ids [N, k] sorted stably by key = (local expert, adapter slot) with the pairs of
    other ranks' experts last, cut to the capacity C = N * min(k, E). slots [N] (None: no LoRA, max_loras 0).
    -> token [C] int64, pos [N, k] int32 (-1: not this rank's), sorted_key [C] int32 (expert * (L + 1) + slot + 1;
    E * (L + 1) past this rank's pairs)."""
    n, k = topk_ids.shape
    E, per_expert = num_local, max_loras + 1  # keys per expert: no adapter, then slots 0..L-1
    local = topk_ids.long().reshape(-1) - expert_start
    mine = (local >= 0) & (local < E)
    slot = slots.long().reshape(n, 1).expand(n, k).reshape(-1) if max_loras else torch.full_like(local, -1)
    key = torch.where(mine, local * per_expert + slot + 1, E * per_expert).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    cap = n * min(k, E)
    sorted_key, order = sorted_key[:cap], order[:cap]
    on_rank = sorted_key < E * per_expert
    pos = torch.full((n * k + 1,), -1, dtype=torch.int32, device=key.device)  # entry n * k: off-rank pairs land
    pos.scatter_(0, torch.where(on_rank, order, n * k), torch.arange(cap, dtype=torch.int32, device=key.device))
    return order // k, pos[:n * k].view(n, k), sorted_key


def lora_blocks_ref(sorted_key: torch.Tensor, E: int, L: int) -> torch.Tensor:
    """sorted_key [C] (sort_pairs_ref's, L >= 1 slots) -> [B, 4] (expert, slot, start, count) blocks of at most
    LORA_BLOCK pairs covering every (expert, slot) group in key order, B = num_lora_blocks (unused blocks: count 0)."""
    dev, cap = sorted_key.device, sorted_key.shape[0]
    g = torch.arange(E * L, device=dev)
    key = ((g // L) * (L + 1) + g % L + 1).to(torch.int32)
    start = torch.searchsorted(sorted_key, key)
    count = torch.searchsorted(sorted_key, key, right=True) - start
    blocks = (count + LORA_BLOCK - 1) // LORA_BLOCK
    ends = torch.cumsum(blocks, 0)
    b = torch.arange(num_lora_blocks(cap, E, L), device=dev)
    gb = torch.searchsorted(ends, b, right=True).clamp_(max=E * L - 1)
    m = b - (ends[gb] - blocks[gb])  # block index inside its group
    n = (count[gb] - m * LORA_BLOCK).clamp(0, LORA_BLOCK) * (b < ends[-1])
    return torch.stack([gb // L, gb % L, start[gb] + m * LORA_BLOCK, n], 1).to(torch.int32)
