"""Executes one model step from a host-side description: builds the step's metadata once (attention layout, LoRA
batches for the tokens and for the sampled rows) and runs the forward pass and the LM head.

Steps on CUDA can replay a captured CUDA graph, per "any LoRA" flag: decode-only steps one per padded batch size
(the paged decode kernel), other steps one per padded token count (the varlen paged kernel over every token, so any
mix of prefill chunks and decodes). The step's inputs and metadata (token ids, positions, KV slots, block tables,
query offsets, LoRA batches) are copied into the graph's static buffers, so a new step of the same padded size, with
any mix of adapters and context lengths, replays without capture or host syncs; the kernels read each sequence's
real queries and context only. Scoring steps (logits of every token) and steps past the largest bucket run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tp_lora.engine.graph_inputs import MixedInputs, pad_mixed_step
from tp_lora.hostcopy import to_device
from tp_lora.lora.batch import LoRABatch, build_lora_batch
from tp_lora.models.attention import AttnGroup, AttnMeta, KVCache, build_attn_meta
from tp_lora.ops.paged_attention import kernel_takes

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIXED_TOKEN_SIZES = (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)


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
    inputs: list[torch.Tensor]  # static inputs, refreshed (in this order) before each replay
    loras: list[LoRABatch]  # static LoRA batches (of the tokens, then of the logits' rows if they differ); [] for none
    logits: torch.Tensor  # [rows, V] static output


def mixed_sizes(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) of the mixed-step graphs for a scheduler of these limits: the token buckets up to
    max_tokens (itself the last one, unless past the largest bucket), each for up to min(max_seqs, tokens)
    sequences."""
    sizes = {t for t in MIXED_TOKEN_SIZES if t < max_tokens} | {min(max_tokens, MIXED_TOKEN_SIZES[-1])}
    return [(t, min(max_seqs, t)) for t in sorted(sizes)]


class ModelRunner:
    def __init__(self, model, rt, device, cuda_graphs: bool = False, max_tokens: int = 4096, max_seqs: int = 256):
        """max_tokens / max_seqs: the most tokens / sequences of a step (the scheduler's limits), which size the
        mixed-step graphs."""
        self.model, self.rt, self.device = model, rt, torch.device(device)
        # Graphs need device-side metadata end to end: the torch reference backend loops on the host.
        self.use_graphs = (cuda_graphs and self.device.type == "cuda" and
                           (rt is None or hasattr(rt.ops, "refresh_static_batch")))
        # Mixed steps need the varlen kernel (the reference gathers every table's positions for every token), and a
        # model whose forward over any tokens has no host sync.
        mixed = self.use_graphs and kernel_takes(model.head_dim) and getattr(model, "mixed_graph_safe", True)
        self.mixed_sizes = mixed_sizes(max_tokens, max_seqs) if mixed else []
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
        n = len(step.lens)
        graphed = self.use_graphs and not step.all_logits and cache is self.cache
        if graphed and step.is_decode and n <= GRAPH_BATCH_SIZES[-1]:
            self.replayed = True
            return self._replay_decode(step)
        size = next((sz for sz in self.mixed_sizes if sz[0] >= len(step.ids) and sz[1] >= n), None) \
            if graphed else None
        self.replayed = size is not None
        if size is not None:
            return self._replay_mixed(step, *size)
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

    def _replay_decode(self, step: StepBatch) -> torch.Tensor:
        n = len(step.lens)
        size = next(s for s in GRAPH_BATCH_SIZES if s >= n)
        pad = size - n
        slots = step.slots + [-1] * pad
        lora = self.rt is not None and any(s >= 0 for s in step.slots)
        g = self.graphs.get(("decode", size, lora)) or self._capture_decode(size, slots, lora)
        width = g.inputs[2].shape[1]
        scratch = [self.cache.scratch] * width
        host = [torch.tensor(step.ids + [0] * pad), torch.tensor(step.starts + [0] * pad),
                torch.tensor([(b + scratch)[:width] for b in step.blocks] + [scratch] * pad, dtype=torch.int32)]
        return self._replay(g, host, [slots], n)

    def _replay_mixed(self, step: StepBatch, tokens: int, seqs: int) -> torch.Tensor:
        n = len(step.lens)
        token_slots = [s for s, k in zip(step.slots, step.lens) for _ in range(k)]
        lora_slots = [token_slots + [-1] * (tokens - len(token_slots)), step.slots + [-1] * (seqs - n)]
        lora = self.rt is not None and any(s >= 0 for s in step.slots)
        g = self.graphs.get(("mixed", tokens, lora)) or self._capture_mixed(tokens, seqs, lora_slots, lora)
        host = pad_mixed_step(step.ids, step.blocks, step.starts, step.lens, tokens, seqs, self._table_width(),
                              self.cache.block_size, self.cache.scratch)
        return self._replay(g, host.tensors(), lora_slots, n)

    def _replay(self, g: _Graph, host: list[torch.Tensor], lora_slots: list[list[int]], n: int) -> torch.Tensor:
        """Copy the step's host tensors into g's static inputs (one host->device copy per dtype), its adapter slots
        (per token, then per logits row) into g's LoRA batches, replay; -> the first n rows of the logits."""
        for static, new in zip(g.inputs, to_device(host, self.device)):
            static.copy_(new)
        for static, slots in zip(g.loras, lora_slots):
            self.rt.ops.refresh_static_batch(static, build_lora_batch(slots, self.rt.max_loras, self.device))
        g.graph.replay()
        return g.logits[:n]

    def _table_width(self) -> int:
        return -(-self.max_len // self.cache.block_size)

    def _static_lora(self, slots: list[int], lora: bool) -> LoRABatch | None:
        """A LoRA batch whose buffers a graph reads (None without a LoRA runtime): of `slots` when lora, else of
        none (the LoRA layers then skip their work, decided on the host at capture)."""
        if self.rt is None:
            return None
        batch = build_lora_batch(slots if lora else [-1] * len(slots), self.rt.max_loras, self.device)
        if lora:
            self.rt.ops.refresh_static_batch(batch, batch)  # builds the per-step tables once
        return batch

    def _capture_decode(self, size: int, slots: list[int], lora: bool) -> _Graph:
        dev = self.device
        ids = torch.zeros(size, dtype=torch.long, device=dev)
        positions = torch.zeros(size, dtype=torch.long, device=dev)
        table = torch.full((size, self._table_width()), self.cache.scratch, dtype=torch.int32, device=dev)
        static_lora = self._static_lora(slots, lora)

        def forward():
            if self.rt is not None:
                self.rt.batch = static_lora
            meta = self._decode_meta(table, positions)
            return self.model.logits(self.model(ids, self.cache, meta))

        graph, logits = self._record(forward)
        g = _Graph(graph, [ids, positions, table], [static_lora] if lora else [], logits)
        self.graphs[("decode", size, lora)] = g
        return g

    def _capture_mixed(self, tokens: int, seqs: int, lora_slots: list[list[int]], lora: bool) -> _Graph:
        inputs = MixedInputs.zeros(tokens, seqs, self._table_width(), self.device)
        inputs.kv_slots.fill_(-1)  # until the first refresh, every row is padding
        inputs.block_table.fill_(self.cache.scratch)
        token_lora, row_lora = (self._static_lora(s, lora) for s in lora_slots)

        def forward():
            if self.rt is not None:
                self.rt.batch = token_lora
            hidden = self.model(inputs.ids, self.cache, inputs.meta(self.model.sliding_window))
            if self.rt is not None:
                self.rt.batch = row_lora
            return self.model.logits(hidden[inputs.last_token])

        graph, logits = self._record(forward)
        g = _Graph(graph, inputs.tensors(), [token_lora, row_lora] if lora else [], logits)
        self.graphs[("mixed", tokens, lora)] = g
        return g

    def _record(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """forward() captured in a graph of the runner's memory pool -> (graph, its output)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
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
        return graph, logits

    def release_graphs(self) -> None:
        """Drop captured graphs (before the process group goes away: a live captured NCCL graph can hang teardown)."""
        self.graphs.clear()
        # The memory pool died with its last graph: reusing its handle for a new capture trips an allocator assert.
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
