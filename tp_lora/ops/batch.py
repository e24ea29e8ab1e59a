"""Per-step LoRA batch metadata (the role of Punica's wrapper): built once per step, read by every LoRA layer.

Tokens are grouped by adapter slot with a stable sort, so a kernel can walk one adapter's tokens contiguously:
``order[starts[i] : starts[i] + counts[i]]`` are the indices of the tokens that use slot ``slot_ids[i]``.
Tokens with no adapter (slot -1) sort first and belong to no group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tp_lora.hostcopy import to_device


@dataclass
class LoRABatch:
    token_slot: torch.Tensor  # [T] int32, -1 = no adapter
    order: torch.Tensor  # [T] int32, token indices sorted (stably) by slot
    slot_ids: torch.Tensor  # [n_active] int32, active slots in ascending order
    counts: torch.Tensor  # [n_active] int32, tokens per active slot
    starts: torch.Tensor  # [n_active] int32, offset of each slot's group in `order`
    host_slot_ids: tuple[int, ...]  # the same, on the host: the torch backend loops over them without a sync
    host_counts: tuple[int, ...]
    host_starts: tuple[int, ...]
    max_loras: int
    # Backends derive their own per-step metadata (e.g. chunked segments) once and keep it here, keyed by name.
    derived: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.token_slot.shape[0]

    @property
    def any_lora(self) -> bool:
        """Decided on the host: no device->host copy on the hot path."""
        return len(self.host_slot_ids) > 0


def build_lora_batch(token_slot: list[int] | torch.Tensor, max_loras: int, device: torch.device | str) -> LoRABatch:
    """token_slot: per token the adapter slot in [0, max_loras) or -1. Host-side work (numpy), one copy to the
    device."""
    if isinstance(token_slot, torch.Tensor):
        slots = token_slot.detach().cpu().numpy().astype(np.int64).reshape(-1)
    else:
        slots = np.array(token_slot, dtype=np.int64).reshape(-1)
    if slots.size and (slots.min() < -1 or slots.max() >= max_loras):
        raise ValueError(f"token slot out of range: got values in [{slots.min()}, {slots.max()}], "
                         f"expected -1 or [0, {max_loras})")
    order = np.argsort(slots, kind="stable")
    per_slot = np.bincount(slots + 1, minlength=max_loras + 1)  # [0]: tokens without an adapter
    active = np.flatnonzero(per_slot[1:])
    counts = per_slot[1:][active]
    starts = per_slot[0] + np.cumsum(counts) - counts
    packed, = to_device([torch.from_numpy(np.concatenate([slots, order, active, counts, starts]).astype(np.int32))],
                        device)
    t, n = slots.size, active.size
    return LoRABatch(
        token_slot=packed[:t], order=packed[t:2 * t],
        slot_ids=packed[2 * t:2 * t + n], counts=packed[2 * t + n:2 * t + 2 * n], starts=packed[2 * t + 2 * n:],
        host_slot_ids=tuple(active.tolist()), host_counts=tuple(counts.tolist()), host_starts=tuple(starts.tolist()),
        max_loras=max_loras,
    )
