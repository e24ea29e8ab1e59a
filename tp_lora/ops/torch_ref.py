"""Plain-torch LoRA ops: the reference every other backend must match, and the CPU path.

Shapes: T tokens, S slices of a packed layer, L adapter slots, r rank (the local r/p in fully sharded column
layers), out_s the width of slice s. Tokens with no adapter (slot -1) are skipped: their shrink rows are 0 and
expand never touches their output rows.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tp_lora.ops.batch import LoRABatch


def _groups(batch: LoRABatch):
    for slot, start, count in zip(batch.host_slot_ids, batch.host_starts, batch.host_counts):
        yield slot, batch.order[start:start + count].long()


def _weight(w: torch.Tensor, slot: int, w_scales: Sequence[torch.Tensor] | None, s: int) -> torch.Tensor:
    """Slot's weight [C, K] in float32; fp8 weights carry per-row (channel) scales w_scales[s] [L, C]."""
    out = w[slot].float()
    return out if w_scales is None else out * w_scales[s][slot].float().unsqueeze(-1)


def shrink(x: torch.Tensor, lora_a: Sequence[torch.Tensor], scales: torch.Tensor, batch: LoRABatch, *,
           a_scales: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, in], lora_a S x [L, r, in], scales [S, L] float32 -> [S, T, r] float32 = scale * x @ A[slot]^T.
    a_scales: S x [L, r] float32 when lora_a is stored as fp8 (A = A_fp8 * a_scales[..., None])."""
    rank = lora_a[0].shape[1]
    out = torch.zeros(len(lora_a), x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot, idx in _groups(batch):
        xs = x[idx].float()
        for s, a in enumerate(lora_a):
            out[s, idx] = (xs @ _weight(a, slot, a_scales, s).t()) * scales[s, slot]
    return out


def expand(buf: torch.Tensor, lora_b: Sequence[torch.Tensor], batch: LoRABatch, out: torch.Tensor,
           offset: int = 0, add: bool = True, *, b_scales: Sequence[torch.Tensor] | None = None) -> None:
    """buf [S, T, r], lora_b S x [L, out_s, r], out [T, O]:
    out[:, offset + sum(out_<s) : offset + sum(out_<=s)] (+)= buf[s] @ B_s[slot]^T, for tokens with an adapter;
    add=False: those columns of every row set, 0 for tokens without one.
    b_scales: S x [L, out_s] float32 when lora_b is stored as fp8 (B = B_fp8 * b_scales[..., None])."""
    if not add:
        out[:, offset:offset + sum(b.shape[1] for b in lora_b)] = 0
    for slot, idx in _groups(batch):
        col = offset
        for s, b in enumerate(lora_b):
            width = b.shape[1]
            delta = buf[s, idx].float() @ _weight(b, slot, b_scales, s).t()
            if add:
                delta = delta + out[idx, col:col + width].float()
            out[idx, col:col + width] = delta.to(out.dtype)
            col += width


def embedding_shrink(ids: torch.Tensor, lora_a_t: torch.Tensor, scales: torch.Tensor, batch: LoRABatch,
                     vocab_start: int = 0) -> torch.Tensor:
    """ids [T], lora_a_t [L, V_local, r] (this rank's vocab rows of A^T), scales [1, L] -> [1, T, r] float32.
    Ids outside [vocab_start, vocab_start + V_local) give 0 rows (another rank holds them)."""
    vocab_local, rank = lora_a_t.shape[1], lora_a_t.shape[2]
    out = torch.zeros(1, ids.shape[0], rank, dtype=torch.float32, device=ids.device)
    for slot, idx in _groups(batch):
        local = ids[idx].long() - vocab_start
        inside = (local >= 0) & (local < vocab_local)
        rows = lora_a_t[slot][local.clamp(0, vocab_local - 1)].float() * scales[0, slot]
        out[0, idx] = rows * inside.unsqueeze(-1)
    return out
# MoE LoRA ops, pair order
from tp_lora.ops.moe_ref import moe_lora_expand, moe_lora_fused, moe_lora_shrink  # noqa: E402,F401


def lora_epilogue(out: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, batch: LoRABatch,
                  base_bias: torch.Tensor | None = None) -> None:
    """out [T, P] (a layer's partial output after expand), scale / bias [L, P] float32 (per slot: DoRA's g, 1 for
    other adapters; lora_B's bias times the LoRA scale, 0 for other adapters), base_bias [P] or None (the base
    layer's bias, already in out). For tokens with an adapter, in place:
    out = scale[slot] * (out - base_bias) + base_bias + bias[slot]."""
    for slot, idx in _groups(batch):
        y = out[idx].float()
        if base_bias is None:
            y = y * scale[slot] + bias[slot]
        else:
            bb = base_bias.float()
            y = (y - bb) * scale[slot] + bb + bias[slot]
        out[idx] = y.to(out.dtype)


def saved_embedding(ids: torch.Tensor, tables: torch.Tensor, slots: Sequence[int], batch: LoRABatch,
                    out: torch.Tensor, vocab_start: int = 0) -> None:
    """ids [T], tables [L, V_local, H] (per slot a whole embedding copy, this rank's vocab rows), out [T, H] this
    rank's base rows: for tokens of the given slots (host ints), out[t] = tables[slot][ids[t] - vocab_start], 0 for
    ids another rank holds."""
    vocab_local = tables.shape[1]
    for slot, idx in _groups(batch):
        if slot in slots:
            local = ids[idx].long() - vocab_start
            inside = ((local >= 0) & (local < vocab_local)).unsqueeze(-1)
            out[idx] = tables[slot][local.clamp(0, vocab_local - 1)] * inside.to(out.dtype)


def saved_logits(x: torch.Tensor, tables: torch.Tensor, slots: Sequence[int], batch: LoRABatch,
                 out: torch.Tensor) -> None:
    """x [T, H], tables [L, V_local, H] (per slot a whole LM-head copy, this rank's vocab rows), out [T, V_local]:
    for tokens of the given slots (host ints), out[t] = x[t] @ tables[slot]^T."""
    for slot, idx in _groups(batch):
        if slot in slots:
            out[idx] = (x[idx] @ tables[slot].t()).to(out.dtype)
