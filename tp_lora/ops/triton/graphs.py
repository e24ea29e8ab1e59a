"""Replaying a captured decode step with a new batch: the kernels read only `order`, `token_slot` and the step's
work table, all of fixed size for a given T and max_loras, so refreshing those buffers in place is enough."""
from __future__ import annotations

from tp_lora.lora.batch import LoRABatch
from tp_lora.ops.triton.schedule import prepare


def refresh_static_batch(static: LoRABatch, new: LoRABatch) -> None:
    """Copy `new`'s metadata into the buffers that a graph captured with `static` reads (same T and max_loras).
    Called with new=static before capture, it builds the work table the graph will own."""
    table = prepare(static).table
    if new is static:
        return
    if new.num_tokens != static.num_tokens or new.max_loras != static.max_loras:
        raise ValueError(f"a graph captured for {static.num_tokens} tokens / {static.max_loras} slots cannot replay "
                         f"{new.num_tokens} tokens / {new.max_loras} slots")
    static.token_slot.copy_(new.token_slot, non_blocking=True)
    static.order.copy_(new.order, non_blocking=True)
    table.copy_(prepare(new).table, non_blocking=True)
