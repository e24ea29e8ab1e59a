"""Executes one model step from a host-side description: builds the step's metadata once (attention layout, LoRA
batches for the tokens and for the sampled rows) and runs the forward pass and the LM head."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tp_lora.lora.batch import build_lora_batch
from tp_lora.models.attention import KVCache, build_attn_meta


@dataclass
class StepBatch:
    """Sequence n contributes lens[n] tokens at positions starts[n].. into KV-cache row rows[n], with adapter slot
    slots[n] (-1 none). all_logits: logits for every token (scoring), else for each sequence's last token."""
    ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    all_logits: bool = False

    def add(self, tokens: list[int], row: int, start: int, slot: int) -> None:
        self.ids.extend(tokens)
        self.rows.append(row)
        self.starts.append(start)
        self.lens.append(len(tokens))
        self.slots.append(slot)

    @property
    def is_decode(self) -> bool:
        return not self.all_logits and all(n == 1 for n in self.lens)


class ModelRunner:
    def __init__(self, model, rt, device):
        self.model, self.rt, self.device = model, rt, torch.device(device)

    def _set_lora(self, slots: list[int]) -> None:
        if self.rt is not None:
            self.rt.batch = build_lora_batch(slots, self.rt.max_loras, self.device)

    @torch.no_grad()
    def execute(self, step: StepBatch, cache: KVCache) -> torch.Tensor:
        """-> float32 logits [N, V] (or [T, V] with all_logits), gathered over the TP group."""
        meta = build_attn_meta(step.rows, step.starts, step.lens, self.device, self.model.sliding_window)
        token_slots = [s for s, n in zip(step.slots, step.lens) for _ in range(n)]
        self._set_lora(token_slots)
        hidden = self.model(torch.tensor(step.ids, dtype=torch.long).to(self.device), cache, meta)
        if step.all_logits:
            return self.model.logits(hidden)
        self._set_lora(step.slots)
        return self.model.logits(hidden[meta.last_token])
