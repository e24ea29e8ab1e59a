"""Executes one model step from a host-side description: builds the step's metadata once (attention layout, LoRA
batches for the tokens and for the sampled rows) and runs the forward pass and the LM head.

Steps on CUDA can replay a captured CUDA graph, per "any LoRA" flag: decode-only steps one per padded batch size
(the paged decode kernel), other steps one per padded token count (the varlen paged kernel over every token, so any
mix of prefill chunks and decodes). The step's inputs and metadata (token ids, positions, KV slots, block tables,
query offsets, LoRA batches) are built on the host into the graph's page-locked staging buffer and sent to its static
buffers in one copy, so a new step of the same padded size, with any mix of adapters and context lengths, replays
without capture or host syncs; the kernels read each sequence's real queries and context only. Scoring steps (logits
of every token) and steps past the largest bucket run eagerly.
The step that captures a graph takes its result from the warm-up forward before the capture (a capture runs
nothing), so every step runs the model's collectives exactly once, captured or not: what lets EP-over-DP peers step
eagerly, replay or capture in the same step.

A model stepping in lockstep with peers (needs_lockstep: MoE with EP over DP replicas, see tp_lora.models.moe) sizes
its graphs itself: every step, decode or mixed, pads to the rows its EP group agreed on: pad_to_graph_sizes(sizes)
the row counts of the graphs (decode batch sizes and mixed token buckets in one list), graph_batch(tokens, lora) ->
(rows, lora) of the step's graph, graph_rows(valid) a context for forwards over padded rows (valid: the real count,
on the device).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from tp_lora import distributed as comm
from tp_lora.engine.graph_inputs import DecodeInputs, MixedInputs, pad_decode_step, pad_mixed_step
from tp_lora.hostcopy import Staging, to_device
from tp_lora.models.attention import KVCache, build_attn_meta
from tp_lora.ops.batch import LoRABatch, build_lora_batch
from tp_lora.ops.paged_attention import kernel_takes

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Every 128 from 512 to 1024 (the GEMMs' row tile, so padding within a bucket costs no tile): steps there are
# GEMM-bound, and a prefill chunk of 512 plus the running decodes lands just past 512.
# Graphs share one memory pool, so a bucket adds little more than its static logits ([seqs, V] float32).
MIXED_TOKEN_SIZES = (64, 128, 256, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096)


def pending(row: int) -> int:
    """The placeholder id of a token still on the device: row `row` of the last step's sampled tokens (keep_sampled);
    a step fed it reads the token there."""
    return -1 - row


@dataclass
class StepBatch:
    """Sequence n contributes lens[n] tokens at positions starts[n].. into the KV-cache blocks blocks[n] (its block
    table), with adapter slot slots[n] (-1 none); its last token's id is the one the previous step sampled in row
    feeds[n] (added as a pending() placeholder: on the device, its id here 0) or its own (feeds[n] -1).
    all_logits: logits for every token (scoring), else for each sequence's last token."""
    ids: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    feeds: list[int] = field(default_factory=list)
    all_logits: bool = False

    def add(self, tokens: list[int], blocks: list[int], start: int, slot: int) -> None:
        feed = -1 - tokens[-1]  # >= 0 for a pending() last token
        if feed >= 0:
            tokens = tokens[:-1] + [0]
        self.ids.extend(tokens)
        self.blocks.append(blocks)
        self.starts.append(start)
        self.lens.append(len(tokens))
        self.slots.append(slot)
        self.feeds.append(max(feed, -1))

    @property
    def fed(self) -> list[int] | None:
        """feeds, or None when no token is fed."""
        return self.feeds if any(f >= 0 for f in self.feeds) else None

    @property
    def is_decode(self) -> bool:
        return not self.all_logits and all(n == 1 for n in self.lens)


@dataclass
class _Graph:
    inputs: Staging  # static inputs (its device views: DecodeInputs / MixedInputs fields, then each LoRA batch's graph
    # buffers), refreshed before each replay
    loras: list[LoRABatch]  # static LoRA batches (of the tokens, then of the logits' rows if they differ); [] for none
    forward: Callable[[], torch.Tensor]  # the step over the static buffers -> logits [rows, V]
    graph: torch.cuda.CUDAGraph | None = None  # once captured
    logits: torch.Tensor | None = None  # [rows, V] static output, once captured
    fields: int = 0  # the inputs' views that are step fields (the rest: the LoRA batches' graph buffers)
    lora_slots: list[list[int]] | None = None  # the adapter slots `loras` hold (unchanged: no refresh)


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
                           (rt is None or hasattr(rt.ops, "graph_buffers")))
        self.mixed_sizes: list[tuple[int, int]] = []  # (tokens, sequences) of the mixed-step graphs
        self.lockstep = False  # whether every step replays a graph of the rows the model's EP group agreed on
        self.graphs: dict[tuple, _Graph] = {}
        self.layout = 0  # the LoRA runtime's layout the graphs were captured with
        self.allocations = 0  # KV caches allocated so far: a new count means new (empty) memory
        # The last sampled tokens, row by row ([max_seqs], then one spare element that a feed of -1 indexes).
        self.sampled = torch.zeros(max_seqs + 1, dtype=torch.int64, device=self.device)
        self.cache: KVCache | None = None
        self.max_len = 0  # the longest sequence the cache serves (graphs' block tables are this wide)
        self.pool = None
        self.replayed = False  # whether the last execute() replayed a graph
        self.captured = False  # whether that graph was captured by it (its first use)
        # (first token, TP group) where execute() leaves each rank its vocabulary shard of the logits (the caller
        # draws from the shards or gathers them: set before any step, from model.vocab_shard()); None: gathered
        self.vocab_shard = None
        if self.use_graphs:
            self.plan_graphs(max_tokens, max_seqs)

    def plan_graphs(self, max_tokens: int, max_seqs: int) -> None:
        """Sizes of the graphs steps replay. Mixed steps need the varlen kernel (the reference gathers every table's
        positions for every token). A model stepping in lockstep pads every step to one of the decode batch sizes
        and mixed token buckets together (each also a mixed graph, so a rank of any mix replays the group's size)."""
        self.mixed_sizes = mixed_sizes(max_tokens, max_seqs) if kernel_takes(self.model.head_dim) else []
        self.lockstep = getattr(self.model, "needs_lockstep", False)
        if self.lockstep:
            sizes = sorted(set(GRAPH_BATCH_SIZES) | {t for t, _ in self.mixed_sizes})
            if self.mixed_sizes:
                self.mixed_sizes = [(t, min(max_seqs, t)) for t in sizes]
            self.model.pad_to_graph_sizes(tuple(sizes))

    def kv_cache(self, blocks: int, block_size: int, max_len: int) -> KVCache:
        """A cache of at least `blocks` blocks for sequences of up to `max_len` positions (the width of the graphs'
        block tables). Kept across calls so captured graphs stay valid; replaced (and graphs dropped) only when too
        small, graphs dropped alone when sequences grow longer."""
        c = self.cache
        if c is None or c.num_blocks < blocks or c.block_size != block_size:
            self.release_graphs()
            self.cache = None  # free the old one before allocating the new
            self.cache = self.model.new_cache(blocks, block_size)
            self.allocations += 1
            self.max_len = max_len
        elif self.max_len < max_len:  # wider block tables: new graphs over the same cache
            self.release_graphs()
            self.max_len = max_len
        return self.cache

    def _set_lora(self, slots: list[int]) -> None:
        if self.rt is not None:
            self.rt.batch = build_lora_batch(slots, self.rt.max_loras, self.device)

    @torch.no_grad()
    def execute(self, step: StepBatch, cache: KVCache) -> torch.Tensor:
        """-> float32 logits [N, V] (or [T, V] with all_logits), gathered over the TP group."""
        if self.rt is not None and self.rt.layout != self.layout:  # graphs captured before lack new LoRA work
            self.release_graphs()
            self.layout = self.rt.layout
        graphed = self.use_graphs and not step.all_logits and cache is self.cache
        self.captured = False
        lora = self.rt is not None and any(s >= 0 for s in step.slots)
        size, lora = self._graph_size(step, lora) if graphed else (None, lora)
        self.replayed = size is not None
        if size is not None:
            kind, *dims = size
            replay = self._replay_decode if kind == "decode" else self._replay_mixed
            return replay(step, *dims, lora)
        meta = build_attn_meta(step.blocks, step.starts, step.lens, cache.block_size, self.device,
                               self.model.sliding_window)
        token_slots = [s for s, n in zip(step.slots, step.lens) for _ in range(n)]
        self._set_lora(token_slots)
        fed = step.fed
        if fed is None:
            ids, = to_device([torch.tensor(step.ids, dtype=torch.long)], self.device)
        else:
            feed = torch.full((len(step.ids),), -1, dtype=torch.long)
            feed[torch.tensor(step.lens).cumsum(0) - 1] = torch.tensor(fed)
            ids, feed = to_device([torch.tensor(step.ids, dtype=torch.long), feed], self.device)
            ids = self._fed(ids, feed)
        hidden = self.model(ids, cache, meta)
        if step.all_logits:
            return self.model.logits(hidden)
        self._set_lora(step.slots)
        return self.model.logits(hidden[meta.last_token], self.vocab_shard is None)

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
        comm.wait_device(self.device)  # with a deadline: warm-up steps run the model's collectives

    def copy_blocks(self, cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy KV block src into block dst, for each (src, dst) of `pairs`, in every layer of `cache` (on the
        device, after the work queued so far: n / best_of siblings' copies of their prompt's partial last block)."""
        src, dst = to_device([torch.tensor(x) for x in zip(*pairs)], self.device)  # (not made there: a host sync)
        for t in cache.k + cache.v:
            t = t.view(torch.uint8) if t.element_size() == 1 else t  # fp8 KV: copied as bytes
            t[dst] = t[src]

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """tokens [N] (any number type, on the device): this step's sampled tokens, which the next step's fed ids
        read."""
        self.sampled[:tokens.shape[0]].copy_(tokens)

    def _fed(self, ids: torch.Tensor, feed: torch.Tensor) -> torch.Tensor:
        """ids with each token whose feed >= 0 replaced by the sampled token of that row (on the device)."""
        return torch.where(feed < 0, ids, self.sampled[feed])

    # ---- CUDA graphs ----------------------------------------------------------------------------------------
    def _graph_size(self, step: StepBatch, lora: bool) -> tuple[tuple | None, bool]:
        """(the graph `step` replays: ("decode", rows) or ("mixed", tokens, sequences), None to run it eagerly; the
        graph's LoRA flag). Decode steps take the smallest decode graph holding them, other steps (and decode steps
        past the largest) the smallest mixed one. In lockstep a step replays a graph of exactly the rows its EP group
        agreed on (graph_batch), whatever its own mix, or none where no graph has that many: past the largest size,
        where every peer steps eagerly too."""
        n, tokens = len(step.lens), len(step.ids)
        if self.lockstep:
            rows, lora = self.model.graph_batch(tokens, lora)
            if step.is_decode and rows <= GRAPH_BATCH_SIZES[-1]:
                return ("decode", rows), lora
            return next((("mixed", t, s) for t, s in self.mixed_sizes if t == rows and s >= n), None), lora
        if step.is_decode and n <= GRAPH_BATCH_SIZES[-1]:
            return ("decode", next(s for s in GRAPH_BATCH_SIZES if s >= n)), lora
        return next((("mixed", t, s) for t, s in self.mixed_sizes if t >= tokens and s >= n), None), lora

    def _replay_decode(self, step: StepBatch, size: int, lora: bool) -> torch.Tensor:
        """The step through the decode graph of `size` rows (its own or more)."""
        n = len(step.lens)
        key = ("decode", size, lora)
        g = self.graphs.get(key) or self._decode_graph(size, lora)
        pad_decode_step(step.ids, step.blocks, step.starts, size, self._table_width(), self.cache.block_size,
                        self.cache.scratch, DecodeInputs.of(g.inputs.fill()[:g.fields]), step.fed)
        return self._replay(key, g, [step.slots + [-1] * (size - n)], n,
                            DecodeInputs.of(g.inputs.device[:g.fields]).valid)

    def _replay_mixed(self, step: StepBatch, tokens: int, seqs: int, lora: bool) -> torch.Tensor:
        n = len(step.lens)
        lora_slots = []  # per token, then per logits row (read only by a graph with LoRA)
        if lora:
            token_slots = [s for s, k in zip(step.slots, step.lens) for _ in range(k)]
            lora_slots = [token_slots + [-1] * (tokens - len(token_slots)), step.slots + [-1] * (seqs - n)]
        key = ("mixed", tokens, lora)
        g = self.graphs.get(key) or self._mixed_graph(tokens, seqs, lora)
        pad_mixed_step(step.ids, step.blocks, step.starts, step.lens, tokens, seqs, self._table_width(),
                       self.cache.block_size, self.cache.scratch, MixedInputs.of(g.inputs.fill()[:g.fields]), step.fed)
        return self._replay(key, g, lora_slots, n, MixedInputs.of(g.inputs.device[:g.fields]).cu_q[-1:])

    def _replay(self, key: tuple, g: _Graph, lora_slots: list[list[int]], n: int, valid: torch.Tensor
                ) -> torch.Tensor:
        """Stage the step's adapter slots (per token, then per logits row) as g's LoRA batches' buffers, send g's
        staged inputs (its own filled by the caller) to its static ones in one host->device copy, replay (or run and
        capture g on first use, as `key`); -> the first n rows of the logits. valid: g's count of real token rows
        ([1] on the device), for models with graph_rows."""
        rows = getattr(self.model, "graph_rows", None)
        with rows(valid) if rows is not None else nullcontext():
            if g.loras and lora_slots != g.lora_slots:  # decode steps mostly repeat the last step's (staged)
                host = g.inputs.fill()
                per = (len(host) - g.fields) // len(g.loras)
                for i, (static, slots) in enumerate(zip(g.loras, lora_slots)):
                    views = host[g.fields + i * per:g.fields + (i + 1) * per]
                    for view, new in zip(views, self.rt.ops.step_buffers(slots, static)):
                        view.copy_(new)
                g.lora_slots = lora_slots
            g.inputs.send()
            if g.graph is None:
                self.captured = True
                g.graph, g.logits, out = self._record(g.forward)
                self.graphs[key] = g
                return out[:n]
            g.graph.replay()
            return g.logits[:n]

    def _table_width(self) -> int:
        return -(-self.max_len // self.cache.block_size)

    def _static_lora(self, rows: int, lora: bool) -> LoRABatch | None:
        """A LoRA batch of `rows` rows whose buffers a graph reads (None without a LoRA runtime). With lora every row
        starts on slot 0, so the LoRA layers run in the capture whatever the capturing step's adapters (each replay
        refreshes the buffers with the step's); without, they skip their work (decided on the host at capture)."""
        if self.rt is None:
            return None
        return build_lora_batch([0 if lora else -1] * rows, self.rt.max_loras, self.device)

    def _staging(self, fields: list[torch.Tensor], loras: list[LoRABatch]) -> Staging:
        """A graph's static inputs in one staging buffer: tensors shaped like `fields`, then the graph buffers of each
        of `loras`, which are bound to them."""
        buffers = [self.rt.ops.graph_buffers(b) for b in loras]
        staging = Staging(fields + [t for bs in buffers for t in bs], self.device)
        at = len(fields)
        for batch, bs in zip(loras, buffers):
            self.rt.ops.bind_graph_buffers(batch, staging.device[at:at + len(bs)])
            at += len(bs)
        return staging

    def _decode_graph(self, size: int, lora: bool) -> _Graph:
        """Static buffers of a decode graph of `size` rows (not captured yet): ids, positions, block tables, and the
        count of real rows ([1], read by models with graph_rows)."""
        fields = DecodeInputs.zeros(size, self._table_width(), "cpu").tensors()
        static_lora = self._static_lora(size, lora)
        loras = [static_lora] if lora else []
        staging = self._staging(fields, loras)
        inputs = DecodeInputs.of(staging.device[:len(fields)])

        def forward():
            if self.rt is not None:
                self.rt.batch = static_lora
            meta = inputs.meta(self.model.sliding_window)
            return self.model.logits(self.model(self._fed(inputs.ids, inputs.feed), self.cache, meta),
                                     self.vocab_shard is None)

        return _Graph(staging, loras, forward, fields=len(fields))

    def _mixed_graph(self, tokens: int, seqs: int, lora: bool) -> _Graph:
        fields = MixedInputs.zeros(tokens, seqs, self._table_width(), "cpu").tensors()
        token_lora, row_lora = self._static_lora(tokens, lora), self._static_lora(seqs, lora)
        loras = [token_lora, row_lora] if lora else []
        staging = self._staging(fields, loras)
        inputs = MixedInputs.of(staging.device[:len(fields)])

        def forward():
            if self.rt is not None:
                self.rt.batch = token_lora
            hidden = self.model(self._fed(inputs.ids, inputs.feed), self.cache, inputs.meta(self.model.sliding_window))
            if self.rt is not None:
                self.rt.batch = row_lora
            return self.model.logits(hidden[inputs.last_token], self.vocab_shard is None)

        return _Graph(staging, loras, forward, fields=len(fields))

    def _record(self, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """forward() run once (the warm-up: allocator and Triton settle; its output is this step's result), then
        captured in a graph of the runner's memory pool -> (graph, its static output, the warm-up's output)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = forward()
        torch.cuda.current_stream().wait_stream(side)
        out.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter reader's page-locked allocations (host work on another thread, which polls CUDA
        # events) would otherwise invalidate a capture that happens while it runs.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = forward()
        return graph, logits, out

    def release_graphs(self) -> None:
        """Drop captured graphs (before the process group goes away: a live captured NCCL graph can hang teardown)."""
        if self.device.type == "cuda" and self.graphs:
            torch.cuda.synchronize(self.device)  # no replay still running or reading their pool
        self.graphs.clear()
        # The memory pool died with its last graph: reusing its handle for a new capture trips an allocator assert.
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
