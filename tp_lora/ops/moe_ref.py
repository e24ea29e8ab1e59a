"""MoE routing metadata and the plain-torch fused MoE LoRA ops (the reference for tp_lora.ops.triton.moe_lora).

After routing, the (token, expert) pairs this rank computes are laid out in *pair order*: sorted by (local expert,
adapter slot), stably. The base expert GEMMs walk one expert's pairs contiguously; the LoRA ops walk one
(expert, slot) group contiguously. Shapes: N dispatched tokens, k top-k, P pairs, E local experts, L adapter
slots, S slices in one launch (2 for w1/w3, 1 for w2), r the (local) LoRA rank.

    moe_lora_shrink: u[s, p] = scale[s, slot_p, e_p] * x[p] @ A_s[slot_p, e_p]^T        (pairs with an adapter)
    moe_lora_expand: out[p, offset + s*out_s : ...] (+)= u[s, p] @ B_s[slot_p, e_p]^T

One launch per call covers every slice, expert and slot. The math fixes the number of calls per MoE layer at 4:
shrink(w1, w3) -> [all-gather] -> expand(w1, w3) -> activation -> shrink(w2) -> [all-reduce] -> expand(w2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tp_lora.hostcopy import to_device


@dataclass
class MoEPairs:
    """The (token, expert) pairs routed to this rank's experts, in pair order."""
    token: torch.Tensor  # [P] int64, row of the pair's token in the dispatched batch
    weight: torch.Tensor  # [P] float32, router weight of the pair
    expert: torch.Tensor  # [P] int32, local expert
    slot: torch.Tensor  # [P] int32, adapter slot of the token (-1 none)
    groups: torch.Tensor  # [G, 4] int32 (local expert, slot, start, count) of every group with slot >= 0
    host_groups: tuple[tuple[int, int, int, int], ...]  # the same on the host
    host_expert_counts: tuple[int, ...]  # [E] pairs per local expert (contiguous, expert order)
    num_experts: int  # local experts

    @property
    def num_pairs(self) -> int:
        return self.token.shape[0]

    @property
    def any_lora(self) -> bool:
        """Decided on the host, identically on every rank that dispatched the same tokens."""
        return len(self.host_groups) > 0

    @property
    def max_group(self) -> int:
        return max((g[3] for g in self.host_groups), default=0)


def build_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, token_slot: torch.Tensor | None,
                expert_start: int, num_local: int, max_loras: int = 0) -> MoEPairs:
    """topk_ids [N, k] global expert ids (-1 = padding), topk_weights [N, k], token_slot [N] (or None: no LoRA);
    this rank holds experts [expert_start, expert_start + num_local). One device->host copy (the group counts)."""
    n, k = topk_ids.shape
    dev = topk_ids.device
    local = topk_ids.long().reshape(-1) - expert_start
    flat = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    token = flat // k
    expert = local[flat]
    if token_slot is None or max_loras == 0:
        slot = torch.full_like(expert, -1)
    else:
        slot = token_slot.long()[token]
    keys_per_expert = max_loras + 1
    key = expert * keys_per_expert + slot + 1
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_local * keys_per_expert).cpu().view(num_local, keys_per_expert)
    host_groups, start = [], 0
    for e in range(num_local):
        for j, c in enumerate(counts[e].tolist()):
            if c and j > 0:
                host_groups.append((e, j - 1, start, c))
            start += c
    groups, = to_device([torch.tensor(host_groups, dtype=torch.int32).reshape(-1, 4)], dev)
    return MoEPairs(token=token[order], weight=topk_weights.reshape(-1)[flat][order].float(),
                    expert=expert[order].to(torch.int32), slot=slot[order].to(torch.int32), groups=groups,
                    host_groups=tuple(host_groups), host_expert_counts=tuple(counts.sum(1).tolist()),
                    num_experts=num_local)


def moe_lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor,
                    pairs: MoEPairs) -> torch.Tensor:
    """x [P, in] in pair order, lora_a S x [L, E, r, in], scales [S, L, E] float32 -> [S, P, r] float32;
    rows of pairs without an adapter are 0."""
    rank = lora_a[0].shape[2]
    out = torch.zeros(len(lora_a), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for e, slot, start, count in pairs.host_groups:
        xs = x[start:start + count].float()
        for s, a in enumerate(lora_a):
            out[s, start:start + count] = (xs @ a[slot, e].float().t()) * scales[s, slot, e]
    return out


def moe_lora_expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], pairs: MoEPairs, out: torch.Tensor,
                    offset: int = 0, add: bool = True) -> None:
    """buf [S, P, r], lora_b S x [L, E, out_s, r], out [P, O] in pair order:
    out[p, offset + sum(out_<s) : offset + sum(out_<=s)] (+)= buf[s, p] @ B_s[slot_p, e_p]^T for pairs with an
    adapter; other rows are not touched. Computed in float32, stored in out.dtype."""
    for e, slot, start, count in pairs.host_groups:
        col = offset
        for s, b in enumerate(lora_b):
            width = b.shape[2]
            delta = buf[s, start:start + count].float() @ b[slot, e].float().t()
            if add:
                delta = delta + out[start:start + count, col:col + width].float()
            out[start:start + count, col:col + width] = delta.to(out.dtype)
            col += width
