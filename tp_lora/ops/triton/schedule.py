"""How token blocks are handed to programs: the two scheduling schemes and their per-step work tables.

Both schemes walk the tokens in ``batch.order`` (stably sorted by adapter slot) and give each program work that
belongs to one adapter, so a program reads one adapter's weights. They differ in the work table and grid:

- "sorted" (vLLM lora_shrink / lora_expand style): one table entry per adapter group, padded to ``max_loras + 1``
  entries. Grid (max_loras, n-blocks [x split-K] x slices, m_programs); each program strides over its group's token
  blocks (block, block + m_programs, ...). Groups past the active ones, and programs past a group's blocks, exit.
- "chunked" (SGLang chunked SGMV style): every group is cut into segments of <= segment_size tokens, one table entry
  per segment, padded to the bound cdiv(T, seg) + min(max_loras + 1, T). Grid (entries, n-blocks x slices, 1);
  each program does exactly one segment.

A table is int32 [3, entries]: rows (slot, start in ``order``, token count). The tokens without an adapter form a
group too, with slot -1 (they sort first, so it starts at 0): shrink writes their zero rows itself instead of
a separate memset, expand skips them. Padding entries are (-1, 0, 0).
Its size, and so every grid, depends only on T, max_loras and segment_size, never on how tokens split between
adapters: a step can be captured in a CUDA graph and replayed with another split, provided the table (and the
batch's ``order``) are copied into the captured buffers first (see ``prepare``).

Tables are built on the host from the batch's host_* tuples with one host->device copy, once per step: they are
cached in ``batch.derived`` under ("sorted",) or ("chunked", segment_size), so every layer of the step reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tp_lora.hostcopy import to_device
from tp_lora.ops.batch import LoRABatch
from tp_lora.ops.triton import configs

SCHEMES = ("sorted", "chunked")

_state = {"scheme": "chunked", "segment_size": None}


def set_scheme(name: str, segment_size: int | None = None) -> None:
    """Select the scheduling scheme for every later shrink / expand that does not name one (the project's
    ``lora.kernel`` config key). segment_size (chunked only): tokens per segment, a power of two >= 16;
    None picks it per step from T (configs.segment_size)."""
    if name not in SCHEMES:
        raise ValueError(f"lora.kernel={name!r}: expected one of {SCHEMES}")
    if segment_size is not None and (segment_size < 16 or segment_size & (segment_size - 1)):
        raise ValueError(f"segment_size must be a power of two >= 16, got {segment_size}")
    _state.update(scheme=name, segment_size=segment_size)


@dataclass(frozen=True)
class Schedule:
    """One step's work table on the device plus the host-side numbers that shape the grid."""
    scheme: str
    table: torch.Tensor  # int32 [3, entries]: slot, start (into batch.order), count
    entries: int  # table width: max_loras + 1 (sorted) or the segment bound (chunked)
    segment_size: int | None  # chunked: tokens per segment, the kernels' BLOCK_M


def _groups(batch: LoRABatch) -> tuple[list[int], list[int], list[int]]:
    """(slots, starts, counts) of the step's groups, the no-adapter group (slot -1) first when it has tokens."""
    n_none = batch.num_tokens - sum(batch.host_counts)
    head = ([-1], [0], [n_none]) if n_none else ([], [], [])
    return (head[0] + list(batch.host_slot_ids), head[1] + list(batch.host_starts),
            head[2] + list(batch.host_counts))


def _sorted_table(batch: LoRABatch) -> np.ndarray:
    table = np.zeros((3, batch.max_loras + 1), dtype=np.int32)
    table[0] = -1
    groups = _groups(batch)
    table[:, :len(groups[0])] = groups
    return table


def chunked_entries(num_tokens: int, max_loras: int, segment_size: int) -> int:
    """Upper bound on the segments of any split of num_tokens tokens between max_loras adapters (+ the no-adapter
    group): sum_g cdiv(c_g, seg) <= sum_g (c_g / seg + 1) <= T / seg + groups."""
    return -(-num_tokens // segment_size) + min(max_loras + 1, num_tokens)


def _chunked_table(batch: LoRABatch, seg: int) -> np.ndarray:
    entries = chunked_entries(batch.num_tokens, batch.max_loras, seg)
    table = np.zeros((3, entries), dtype=np.int32)
    table[0] = -1
    slots, starts, counts = (np.array(g, dtype=np.int64) for g in _groups(batch))
    per_group = (counts + seg - 1) // seg
    group = np.repeat(np.arange(slots.size), per_group)
    within = np.arange(group.size) - (np.cumsum(per_group) - per_group)[group]  # segment index inside its group
    n = group.size
    table[0, :n] = slots[group]
    table[1, :n] = starts[group] + within * seg
    table[2, :n] = np.minimum(counts[group] - within * seg, seg)
    return table


def resolve(batch: LoRABatch, scheme: str | None = None, segment_size: int | None = None) -> tuple[str, int | None]:
    scheme = scheme or _state["scheme"]
    if scheme not in SCHEMES:
        raise ValueError(f"lora.kernel={scheme!r}: expected one of {SCHEMES}")
    if scheme == "sorted":
        return scheme, None
    return scheme, segment_size or _state["segment_size"] or configs.segment_size(batch.num_tokens)


def prepare(batch: LoRABatch, scheme: str | None = None, segment_size: int | None = None) -> Schedule:
    """The step's schedule for `scheme` (default: the one set by set_scheme), built on first use and cached in
    batch.derived. Call it right after building the batch (outside CUDA-graph capture) to keep the one copy out of
    the model's forward; every shrink / expand of the step then finds it cached."""
    key = scheme, seg = resolve(batch, scheme, segment_size)  # (scheme, segment size or None): the cache key
    cached = batch.derived.get(key)
    if cached is not None:
        return cached
    table = _sorted_table(batch) if scheme == "sorted" else _chunked_table(batch, seg)
    sched = Schedule(scheme, to_device([torch.from_numpy(table)], batch.order.device)[0], table.shape[1], seg)
    batch.derived[key] = sched
    return sched
