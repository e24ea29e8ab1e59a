"""The plain-torch fused MoE LoRA ops (the reference for tp_lora.ops.triton.moe_lora), over the pair order of a
routing plan (tp_lora.ops.moe_plan): pairs sorted by (local expert, adapter slot), so one LoRA block of the plan is
one expert of one adapter over consecutive pairs. Shapes: P pairs (the plan's capacity), E local experts, L adapter
slots, S slices in one launch (2 for w1/w3, 1 for w2), r the (local) LoRA rank.

    moe_lora_shrink: u[s, p] = scale[s, slot_p, e_p] * x[p] @ A_s[slot_p, e_p]^T        (pairs with an adapter)
    moe_lora_expand: out[p, offset + s*out_s : ...] (+)= u[s, p] @ B_s[slot_p, e_p]^T

One launch per call covers every slice, expert and slot. The math fixes the number of calls per MoE layer at 4:
shrink(w1, w3) -> [all-gather] -> expand(w1, w3) -> activation -> shrink(w2) -> [all-reduce] -> expand(w2); without
the collectives (the default LoRA mode) moe_lora_fused does each shrink + expand in one call.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tp_lora.ops.moe_layout import MoEPlan


def moe_lora_shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor,
                    plan: MoEPlan) -> torch.Tensor:
    """x [P, in] in pair order, lora_a S x [L, E, r, in], scales [S, L, E] float32 -> [S, P, r] float32;
    rows of pairs without an adapter are 0."""
    rank = lora_a[0].shape[2]
    out = torch.zeros(len(lora_a), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for e, slot, start, count in _blocks(plan):
        xs = x[start:start + count].float()
        for s, a in enumerate(lora_a):
            out[s, start:start + count] = (xs @ a[slot, e].float().t()) * scales[s, slot, e]
    return out


def moe_lora_expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], plan: MoEPlan, out: torch.Tensor,
                    offset: int = 0, add: bool = True, *, b_scales: Sequence[torch.Tensor] | None = None) -> None:
    """buf [S, P, r], lora_b S x [L, E, out_s, r], out [P, O] in pair order:
    out[p, offset + sum(out_<s) : offset + sum(out_<=s)] (+)= buf[s, p] @ B_s[slot_p, e_p]^T for pairs with an
    adapter; other rows are not touched. Computed in float32, stored in out.dtype. b_scales: S x [L, E, out_s]
    float32 when lora_b is stored as fp8 (B = B_fp8 * b_scales[..., None], tp_lora.ops.fp8)."""
    for e, slot, start, count in _blocks(plan):
        col = offset
        for s, b in enumerate(lora_b):
            width = b.shape[2]
            w = b[slot, e].float()
            if b_scales is not None:
                w = w * b_scales[s][slot, e].float().unsqueeze(-1)
            delta = buf[s, start:start + count].float() @ w.t()
            if add:
                delta = delta + out[start:start + count, col:col + width].float()
            out[start:start + count, col:col + width] = delta.to(out.dtype)
            col += width


def moe_lora_fused(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor,
                   lora_b: Sequence[torch.Tensor], plan: MoEPlan, out: torch.Tensor, offset: int = 0, *,
                   b_scales: Sequence[torch.Tensor] | None = None, rows: torch.Tensor | None = None) -> None:
    """shrink then expand (add=True) where no collective sits between them (the default LoRA mode): one launch on
    Triton. x [P, in] in pair order, or [N, in] read at rows [P] (the pairs' tokens); lora_a S x [L, E, r, in],
    scales [S, L, E], lora_b S x [L, E, out_s, r], out [P, O]."""
    x = x if rows is None else x[rows]
    moe_lora_expand(moe_lora_shrink(x, lora_a, scales, plan), lora_b, plan, out, offset, b_scales=b_scales)


def _blocks(plan: MoEPlan) -> list[list[int]]:
    """The plan's LoRA blocks that hold pairs (read on the host: this reference loops in Python)."""
    return [b for b in plan.groups.tolist() if b[3] > 0]
