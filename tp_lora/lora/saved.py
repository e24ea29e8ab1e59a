"""modules_to_save for the vocabulary-parallel layers (embed_tokens, lm_head): each slot may hold an adapter's whole
trained copy of the table, split by vocabulary like the base ([L, V/p, H] per rank), and a token of an adapter with a
copy reads its rows / its logits from the copy instead of the base table (ops.saved_embedding / ops.saved_logits).
The copies live beside the slots and are allocated with them, so their memory counts against the device's before the
KV cache takes the rest."""
from __future__ import annotations

from typing import Callable

import torch

from tp_lora.ops.batch import LoRABatch
from tp_lora.sharding import take


class SavedCopies:
    """Per-slot whole copies of a vocab-parallel table `base` (.weight [V/p, H], .vocab_start / .vocab_end).
    saved_table [L, V/p, H], saved_on [L] (1 where the slot holds a copy), saved_slots: the same on the host, kept by
    the slot table as adapters come and go (the ops loop over them without a device read)."""

    def init_saved(self, base, max_loras: int, enabled: bool) -> None:
        self.saved_slots: set[int] = set()
        self.saved_table = self.saved_on = None
        if not enabled:
            return
        rows, hidden = base.weight.shape
        dtype = getattr(base, "dtype", base.weight.dtype)
        try:
            self.saved_table = torch.zeros(max_loras, rows, hidden, dtype=dtype, device=base.weight.device)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            need = max_loras * rows * hidden * dtype.itemsize
            raise RuntimeError(f"modules_to_save copies of a [{base.vocab}, {hidden}] table need {need / 2**30:.2f} "
                               f"GiB per rank for lora.max_loras={max_loras} slots ({rows} vocabulary rows each), "
                               f"which does not fit: lower lora.max_loras, or raise tp_size ({e})") from e
        self.saved_on = torch.zeros(max_loras, dtype=torch.float32, device=base.weight.device)

    def saved_views(self, slot: int) -> list[torch.Tensor]:
        return [] if self.saved_table is None else [self.saved_table[slot], self.saved_on[slot:slot + 1]]

    def write_saved(self, views: list[torch.Tensor], at: int, table: torch.Tensor, copy: Callable) -> None:
        """An adapter's whole table [V, H] into the saved views found at views[at:at + 2]: this rank's rows."""
        if self.saved_table is None:
            raise ValueError("this layer was built without room for modules_to_save copies (no adapter registered "
                             "at start saved this module)")
        copy(views[at], take(table, (self.base.vocab_start, self.base.vocab_end), 0))
        views[at + 1][0] = 1.0

    def saved_active(self, batch: LoRABatch) -> tuple[int, ...]:
        """The step's slots whose adapter brought a copy (host data)."""
        return tuple(s for s in batch.host_slot_ids if s in self.saved_slots) if self.saved_slots else ()
