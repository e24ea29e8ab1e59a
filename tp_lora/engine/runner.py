"""Executes one model step from a host-side description: builds the step's metadata once (attention layout, LoRA
batches for the tokens and for the sampled rows) and runs the forward pass and the LM head.

Decode steps on CUDA can replay a captured CUDA graph: one per padded batch size and per "any LoRA" flag. The
step's inputs and metadata (token ids, positions, block tables) are copied into the graph's static buffers, so a new
batch of the same padded size, with any mix of adapters and context lengths, replays without capture or host syncs;
the paged decode kernel reads each sequence's real context only. The step that captures a graph computes its result
in the warm-up forward before the capture (a capture runs nothing), so every step runs the model's collectives
exactly once, captured or not: what lets EP-over-DP peers step eagerly, replay or capture in the same step.

A model may size its graphs itself (MoE with EP over DP replicas: the EP group's agreed batch, see
tp_lora.models.moe): graph_batch(tokens, lora) -> (tokens, lora) the graph must cover, graph_rows(valid) a context
for forwards over padded rows (valid: the real count, on the device), pad_to_graph_sizes(sizes) the sizes in use.
"""
from __future__ import annotations

from contextlib import nullcontext
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
    valid: torch.Tensor  # [1] int64: how many of the B rows are real tokens (models with graph_rows read it)
    batch: LoRABatch | None  # the LoRA batch the graph reads (None without a LoRA runtime)
    lora: bool  # whether the LoRA layers run in it (then `batch` is refreshed before each replay)
    logits: torch.Tensor | None = None  # [B, V] static output, once captured


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
        if self.use_graphs and hasattr(model, "pad_to_graph_sizes"):
            model.pad_to_graph_sizes(GRAPH_BATCH_SIZES)

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
        if self.use_graphs and step.is_decode and cache is self.cache:
            lora = self.rt is not None and any(s >= 0 for s in step.slots)
            graph_batch = getattr(self.model, "graph_batch", None)
            need, lora = graph_batch(len(step.lens), lora) if graph_batch is not None else (len(step.lens), lora)
            self.replayed = need <= GRAPH_BATCH_SIZES[-1]
            if self.replayed:
                return self._replay(step, need, lora)
        self.replayed = False
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

    def _replay(self, step: StepBatch, need: int, lora: bool) -> torch.Tensor:
        """The step through the graph of the smallest size holding `need` tokens (its own or more) with LoRA flag
        `lora`, captured on first use."""
        n = len(step.lens)
        size = next(s for s in GRAPH_BATCH_SIZES if s >= need)
        pad = size - n
        slots = step.slots + [-1] * pad
        g = self.graphs.get((size, lora))
        fresh = g is None
        if fresh:
            g = self._new_graph(size, lora)
        host = torch.tensor([step.ids + [0] * pad, step.starts + [0] * pad, [n] * size], dtype=torch.long)
        width = g.block_table.shape[1]
        scratch = [self.cache.scratch] * width
        table = torch.tensor([(b + scratch)[:width] for b in step.blocks] + [scratch] * pad, dtype=torch.int32)
        dev, dev_table = to_device([host, table], self.device)
        g.ids.copy_(dev[0])
        g.positions.copy_(dev[1])
        g.valid.copy_(dev[2, :1])
        g.block_table.copy_(dev_table)
        if g.lora:
            self.rt.ops.refresh_static_batch(g.batch, build_lora_batch(slots, self.rt.max_loras, self.device))
        rows = getattr(self.model, "graph_rows", None)
        with rows(g.valid) if rows is not None else nullcontext():
            if fresh:
                return self._capture(g)[:n]
            g.graph.replay()
        return g.logits[:n]

    def _new_graph(self, size: int, lora: bool) -> _Graph:
        """Static buffers of a graph of `size` rows, not captured yet. With LoRA its batch starts with every row on
        slot 0, so the LoRA layers are on in the capture whatever the capturing step's adapters (each replay
        refreshes it with the step's)."""
        dev = self.device
        width = -(-self.max_len // self.cache.block_size)
        batch = None
        if self.rt is not None:
            batch = build_lora_batch([0 if lora else -1] * size, self.rt.max_loras, dev)
            if lora:
                self.rt.ops.refresh_static_batch(batch, batch)  # builds the per-step tables once
        return _Graph(None, torch.zeros(size, dtype=torch.long, device=dev),
                      torch.zeros(size, dtype=torch.long, device=dev),
                      torch.full((size, width), self.cache.scratch, dtype=torch.int32, device=dev),
                      torch.zeros(1, dtype=torch.long, device=dev), batch, lora)

    def _capture(self, g: _Graph) -> torch.Tensor:
        """Run the step already in g's buffers once (the warm-up: the allocator and Triton settle), then capture it
        into g. Returns the warm-up's logits [B, V]: this step's result (the capture itself runs nothing)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def forward():
            if self.rt is not None:
                self.rt.batch = g.batch
            meta = self._decode_meta(g.block_table, g.positions)
            return self.model.logits(self.model(g.ids, self.cache, meta))

        # Warm up on a side stream, then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = forward()
        torch.cuda.current_stream().wait_stream(side)
        logits.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter reader's page-locked allocations (host work on another thread, which polls CUDA
        # events) would otherwise invalidate a capture that happens while it runs.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            g.logits = forward()
        g.graph = graph
        self.graphs[(g.ids.shape[0], g.lora)] = g
        return logits

    def release_graphs(self) -> None:
        """Drop captured graphs (before the process group goes away: a live captured NCCL graph can hang teardown)."""
        self.graphs.clear()
        # The memory pool died with its last graph: reusing its handle for a new capture trips an allocator assert.
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
