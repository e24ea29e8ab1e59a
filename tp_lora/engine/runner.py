"""Executes one model step from a host-side description: builds the step's metadata once (attention layout, LoRA
batches for the tokens and for the sampled rows) and runs the forward pass and the LM head.

Decode steps on CUDA can replay a captured CUDA graph: one per padded batch size and per "any LoRA" flag. The
step's inputs and metadata (token ids, positions, block tables) are copied into the graph's static buffers, so a new
batch of the same padded size, with any mix of adapters and context lengths, replays without capture or host syncs;
the paged decode kernel reads each sequence's real context only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tp_lora.hostcopy import to_device
from tp_lora.lora.batch import LoRABatch, build_lora_batch
from tp_lora.models.attention import AttnGroup, AttnMeta, KVCache, build_attn_meta

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class StepBatch:
    """Sequence n contributes lens[n] tokens at positions starts[n].. into the KV-cache blocks blocks[n] (its block
    table), with adapter slot slots[n] (-1 none). all_logits: logits for every token (scoring), else for each
    sequence's last token."""
    ids: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    all_logits: bool = False

    def add(self, tokens: list[int], blocks: list[int], start: int, slot: int) -> None:
        self.ids.extend(tokens)
        self.blocks.append(blocks)
        self.starts.append(start)
        self.lens.append(len(tokens))
        self.slots.append(slot)

    @property
    def is_decode(self) -> bool:
        return not self.all_logits and all(n == 1 for n in self.lens)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B] static inputs, refreshed before each replay
    positions: torch.Tensor
    block_table: torch.Tensor  # [B, W] int32
    lora: LoRABatch | None
    logits: torch.Tensor  # [B, V] static output


class ModelRunner:
    def __init__(self, model, rt, device, cuda_graphs: bool = False):
        self.model, self.rt, self.device = model, rt, torch.device(device)
        # Graphs need device-side metadata end to end: the torch reference backend loops on the host.
        self.use_graphs = (cuda_graphs and self.device.type == "cuda" and
                           (rt is None or hasattr(rt.ops, "refresh_static_batch")))
        self.graphs: dict[tuple, _Graph] = {}
        self.cache: KVCache | None = None
        self.max_len = 0  # the longest sequence the cache serves (graphs' block tables are this wide)
        self.pool = None
        self.replayed = False  # whether the last execute() replayed a graph

    def kv_cache(self, blocks: int, block_size: int, max_len: int) -> KVCache:
        """A cache of at least `blocks` blocks for sequences of up to `max_len` positions (the width of the graphs'
        block tables). Kept across calls so captured graphs stay valid; replaced (and graphs dropped) only when too
        small."""
        c = self.cache
        if c is None or c.num_blocks < blocks or c.block_size != block_size or self.max_len < max_len:
            self.release_graphs()
            self.cache = None  # free the old one before allocating the new
            self.cache = self.model.new_cache(blocks, block_size)
            self.max_len = max_len
        return self.cache

    def _set_lora(self, slots: list[int]) -> None:
        if self.rt is not None:
            self.rt.batch = build_lora_batch(slots, self.rt.max_loras, self.device)

    @torch.no_grad()
    def execute(self, step: StepBatch, cache: KVCache) -> torch.Tensor:
        """-> float32 logits [N, V] (or [T, V] with all_logits), gathered over the TP group."""
        self.replayed = self.use_graphs and step.is_decode and len(step.lens) <= GRAPH_BATCH_SIZES[-1] and \
            cache is self.cache
        if self.replayed:
            return self._replay(step)
        meta = build_attn_meta(step.blocks, step.starts, step.lens, cache.block_size, self.device,
                               self.model.sliding_window)
        token_slots = [s for s, n in zip(step.slots, step.lens) for _ in range(n)]
        self._set_lora(token_slots)
        ids, = to_device([torch.tensor(step.ids, dtype=torch.long)], self.device)
        hidden = self.model(ids, cache, meta)
        if step.all_logits:
            return self.model.logits(hidden)
        self._set_lora(step.slots)
        return self.model.logits(hidden[meta.last_token])

    @torch.no_grad()
    def warm_up(self, sizes: list[int], block_size: int) -> None:
        """One eager step of each size (tokens of one sequence, LoRA on through slot 0, whatever it holds) in a
        scratch cache, outputs dropped: kernels compile here instead of inside the first steps that need them."""
        bs = block_size
        cache = self.model.new_cache(-(-max(sizes) // bs), bs)
        for t in sizes:
            step = StepBatch()
            step.add([0] * t, list(range(-(-t // bs))), 0, 0 if self.rt is not None else -1)
            self.execute(step, cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- CUDA graphs ----------------------------------------------------------------------------------------
    def _decode_meta(self, table: torch.Tensor, g_pos: torch.Tensor) -> AttnMeta:
        """Decode layout computed on the device from the static inputs (inside the graph)."""
        bs = self.cache.block_size
        slots = table.gather(1, (g_pos // bs)[:, None])[:, 0].long() * bs + g_pos % bs
        group = AttnGroup(tokens=None, block_table=table, context_lens=(g_pos + 1).to(torch.int32))
        return AttnMeta(slots=slots, positions=g_pos, groups=[group],
                        last_token=torch.arange(table.shape[0], device=self.device),
                        window=self.model.sliding_window or 0)

    def _replay(self, step: StepBatch) -> torch.Tensor:
        n = len(step.lens)
        size = next(s for s in GRAPH_BATCH_SIZES if s >= n)
        pad = size - n
        slots = step.slots + [-1] * pad
        lora = self.rt is not None and any(s >= 0 for s in step.slots)
        key = (size, lora)
        g = self.graphs.get(key) or self._capture(size, slots, lora)
        host = torch.tensor([step.ids + [0] * pad, step.starts + [0] * pad], dtype=torch.long)
        width = g.block_table.shape[1]
        scratch = [self.cache.scratch] * width
        table = torch.tensor([(b + scratch)[:width] for b in step.blocks] + [scratch] * pad, dtype=torch.int32)
        dev, dev_table = to_device([host, table], self.device)
        g.ids.copy_(dev[0])
        g.positions.copy_(dev[1])
        g.block_table.copy_(dev_table)
        if g.lora is not None:
            self.rt.ops.refresh_static_batch(g.lora, build_lora_batch(slots, self.rt.max_loras, self.device))
        g.graph.replay()
        return g.logits[:n]

    def _capture(self, size: int, slots: list[int], lora: bool) -> _Graph:
        dev = self.device
        ids = torch.zeros(size, dtype=torch.long, device=dev)
        positions = torch.zeros(size, dtype=torch.long, device=dev)
        width = -(-self.max_len // self.cache.block_size)
        table = torch.full((size, width), self.cache.scratch, dtype=torch.int32, device=dev)
        static_lora = None
        if self.rt is not None:
            static_lora = build_lora_batch(slots if lora else [-1] * size, self.rt.max_loras, dev)
            if lora:
                self.rt.ops.refresh_static_batch(static_lora, static_lora)  # builds the per-step tables once
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def forward():
            if self.rt is not None:
                self.rt.batch = static_lora
            meta = self._decode_meta(table, positions)
            return self.model.logits(self.model(ids, self.cache, meta))

        # Warm up on a side stream (allocator and Triton autotuning settle before capture), then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter reader's page-locked allocations (host work on another thread, which polls CUDA
        # events) would otherwise invalidate a capture that happens while it runs.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = forward()
        g = _Graph(graph, ids, positions, table, static_lora if lora else None, logits)
        self.graphs[(size, lora)] = g
        return g

    def release_graphs(self) -> None:
        """Drop captured graphs (before the process group goes away: a live captured NCCL graph can hang teardown)."""
        self.graphs.clear()
        # The memory pool died with its last graph: reusing its handle for a new capture trips an allocator assert.
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
