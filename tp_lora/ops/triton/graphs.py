"""Replaying a captured step with a new batch: the kernels read only `order`, `token_slot` and the step's work table,
all of fixed size for a given T and max_loras, so refreshing those buffers in place is enough. A graph binds them to
buffers of its own (views of its input staging buffer, bind_graph_buffers), and each step writes the new batch's
host-side copies of them (step_buffers) there, sent with the step's other inputs."""
from __future__ import annotations

import dataclasses

import torch

from tp_lora.ops.batch import LoRABatch, build_lora_batch
from tp_lora.ops.triton.schedule import prepare, resolve


def graph_buffers(batch: LoRABatch) -> list[torch.Tensor]:
    """The buffers of `batch` a captured step reads: token_slot [T], order [T] and the work table [3, entries] (built
    here on first use: call it outside capture)."""
    return [batch.token_slot, batch.order, prepare(batch).table]


def bind_graph_buffers(static: LoRABatch, buffers: list[torch.Tensor]) -> None:
    """Make `static` read `buffers` (shaped like graph_buffers(static), on its device) instead of its own, holding
    the same values."""
    own = graph_buffers(static)
    if [b.shape for b in buffers] != [b.shape for b in own] or [b.dtype for b in buffers] != [b.dtype for b in own]:
        raise ValueError(f"buffers {[(tuple(b.shape), b.dtype) for b in buffers]} for a batch whose graph buffers are "
                         f"{[(tuple(b.shape), b.dtype) for b in own]}")
    for dst, src in zip(buffers, own):
        dst.copy_(src)
    key = resolve(static)  # prepare's cache key
    static.token_slot, static.order = buffers[0], buffers[1]
    static.derived[key] = dataclasses.replace(static.derived[key], table=buffers[2])


def step_buffers(token_slot: list[int], static: LoRABatch) -> list[torch.Tensor]:
    """Host tensors (shaped like graph_buffers(static)) that, copied into a graph's buffers bound to `static`, make
    it run a batch of these per-row adapter slots."""
    new = build_lora_batch(token_slot, static.max_loras, "cpu")
    if new.num_tokens != static.num_tokens:
        raise ValueError(f"a graph captured for {static.num_tokens} tokens / {static.max_loras} slots cannot replay "
                         f"{new.num_tokens} tokens")
    return graph_buffers(new)
