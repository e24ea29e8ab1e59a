"""The generation engine: a model with its LoRA slots, adapter cache and KV cache, a scheduler over the requests,
the step loop.

Every rank of a TP group runs this same deterministic loop on the same requests, so they agree on every batch
without exchanging control messages; only the model's collectives cross ranks, plus three small agreements where a
rank's local view could differ: a lazy adapter read (the file may be corrupt on one read and not another), the KV
blocks that fit (free memory differs per GPU), and -- every few steps, or each step while requests are still arriving
by wall clock -- how many requests have arrived and whether a stop signal came.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence as Seq

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, resolve_device, resolve_dtype, validate_for_model
from tp_lora.engine.kv_pool import BlockPool, blocks_for, kv_budget_bytes, kv_bytes_per_token, plan_blocks
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.runner import ModelRunner, StepBatch, pending
from tp_lora.engine.sampler import draw, top_logprobs
from tp_lora.engine.tokenizer import Detokenizer, load_tokenizer
from tp_lora.engine.scheduler import LOOKAHEAD, Scheduler, Sequence, SlotState
from tp_lora.lora.adapter import AdapterError, discover_adapters
from tp_lora.lora.cache import PREFETCH_DEPTH, AdapterCache, AdapterInfo
from tp_lora.lora.layers import LoRARuntime, module_shapes
from tp_lora.lora.slots import SlotTable
from tp_lora.models.checkpoint import CheckpointReader, load_hf_config
from tp_lora.models.loader import load_weights
from tp_lora.models.registry import MOE_TYPES
from tp_lora.ops import get_backend

RUN, DRAIN, ABORT = 0, 1, 2  # stop levels: keep going / admit nothing more, finish in-flight / drop in-flight too
# The longest the step loop waits for the reads of the next admission group's adapters before admitting without
# them: waiting keeps the batch full when reads take a normal few ms (a decode step costs about the same with a
# partly empty batch), the bound keeps one slow file from stalling everyone.
READ_WAIT_S = 0.1
ARRIVAL_CHECK_STEPS = 4  # TP ranks busy with work agree on newly arrived requests every this many steps
INTERRUPTED = "not run: the run was stopped before this request finished (resume=true runs it)"

__all__ = ["Engine", "Sequence", "StepOutput", "StepStats", "RUN", "DRAIN", "ABORT"]


@dataclass
class StepStats:
    steps: int = 0
    graph_steps: int = 0  # steps replayed from a CUDA graph (the others ran eagerly)
    graph_captures: int = 0  # of those, the steps that captured their graph (its first use; slow)
    graph_seconds: float = 0.0  # wall time of those steps: to the sampled tokens on the host, from the launch or from
    # the previous step's tokens, whichever is later (steps launched ahead overlap)
    eager_seconds: float = 0.0  # the same for the eager steps
    # decode steps (one new token per sequence: what a decode benchmark times) by their number of sequences ->
    # [steps, wall seconds (as graph_seconds)]
    decode_by_rows: dict = field(default_factory=dict)
    ahead_steps: int = 0  # steps launched before the previous step's tokens were read (run_ahead)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    adapter_loads: int = 0  # copies into device slots
    slot_hits: int = 0  # admissions that found their adapter in a slot
    slot_misses: int = 0
    interrupted: int = 0  # requests a stop left unfinished
    preemptions: int = 0  # running sequences sent back to the queue for want of KV blocks (recomputed later)
    extra: dict = field(default_factory=dict)

    @property
    def decode_steps(self) -> int:
        return sum(n for n, _ in self.decode_by_rows.values())

    @property
    def decode_seconds(self) -> float:
        return sum(t for _, t in self.decode_by_rows.values())

    @property
    def slot_hit_rate(self) -> float:
        n = self.slot_hits + self.slot_misses
        return self.slot_hits / n if n else 1.0


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""
    sampled: list[tuple[Sequence, int]]  # (sequence, where its pending token is in seq.tokens), in row order
    host: Optional[torch.Tensor]  # [2, rows] float64 token ids and log-probabilities, copied in once `done`
    tops: Optional[list]  # the top log-probabilities of each sampled row (when a request asked; read already)
    done: Optional[torch.cuda.Event]  # recorded after the step's work (None off CUDA: everything ran already)
    started: float  # perf_counter() at launch
    decode: bool  # one new token per sequence
    replayed: bool  # from a CUDA graph
    captured: bool  # its graph captured by it


@dataclass
class StepOutput:
    """What one Engine.step() did: the results that got a token (streams read their new tokens) and those that
    ended (finished, or failed: their adapter could not be loaded)."""
    advanced: list[Result] = field(default_factory=list)
    finished: list[Result] = field(default_factory=list)


def build_model(hf: dict, tp: comm.Group, dtype, device, rt: Optional[LoRARuntime], targets: Optional[set]):
    """The model class for a config.json: MoE configs go to tp_lora.models.moe, the rest are Llama-family."""
    from tp_lora.models import registry
    return registry.build(hf, tp, dtype, device, rt, targets)


def host_threads(requested: int, device_type: str) -> Optional[int]:
    """torch's host threads for one process (parallel.host_threads): `requested`, or for 0 one on CUDA and None
    (keep torch's default) on CPU, where the model's compute runs on them. On CUDA the host only prepares steps and
    reads adapters: on two H200 hosts one thread served 11-16% more tokens/s at one adapter than torch's 16, and as
    many at 1000 (BENCHMARKS.md); the reads are slower on one thread, the steps faster."""
    if requested:
        return requested
    return 1 if device_type == "cuda" else None


def _usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, as under a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# Beyond ~8 threads a read's copies gain little more (host memory bandwidth) and take cores from the other ranks.
MAX_READ_THREADS = 8


def read_threads(requested: int, device_type: str, cores: int, local_ranks: int) -> Optional[int]:
    """Threads for an adapter read the step loop waits on (parallel.read_threads): `requested`, or for 0 on CUDA the
    rank's share of the host's `cores` less one (at most MAX_READ_THREADS), and None (the thread's own) on CPU, where
    reads share the cores with the model's compute."""
    if requested:
        return requested
    if device_type != "cuda":
        return None
    return max(1, min(MAX_READ_THREADS, cores // max(1, local_ranks) - 1))


class Engine:
    def __init__(self, cfg: RunConfig, ps: comm.ParallelState, model_dir: str, adapter_dir: Optional[str]):
        self.cfg, self.ps = cfg, ps
        self.device = str(ps.device)
        dev_kind = resolve_device(cfg.device) if cfg.device != "auto" else ps.device.type
        self.dtype = resolve_dtype(cfg.dtype, dev_kind)
        self.hf = load_hf_config(model_dir)
        validate_for_model(self.hf, ps.tp.size)
        lo = cfg.lora
        self.adapter_paths = discover_adapters(adapter_dir) if adapter_dir else {}
        # The dtype of adapters read whole (a read by plan keeps the file's dtype and the slot image casts): fp8
        # quantizes B from the float32 original, others take the slots' dtype.
        host_dtype = torch.float32 if lo.dtype == "fp8" else self.dtype
        self.cache = AdapterCache(self.adapter_paths, lo.max_cpu_loras, host_dtype, ps.tp)
        self.cache.read_threads = read_threads(cfg.parallel.read_threads, ps.device.type,
                                               _usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        # Admission waits (boundedly) for reads where they overlap GPU steps. On CPU reads and steps share the cores,
        # and the step loop reading what it admits keeps each run's batches, and so its rounding, the same.
        self.overlap_reads = ps.device.type == "cuda"
        self.rt = None
        if self.cache.infos:
            ops = get_backend(lo.backend, self.device)
            if hasattr(ops, "set_scheme"):
                ops.set_scheme(lo.kernel, lo.segment_size)
            self.rt = LoRARuntime(lo.max_loras, lo.max_rank, lo.fully_sharded, ops, fp8=lo.dtype == "fp8")
        targets = set().union(*(i.targets for i in self.cache.infos.values()))
        if not lo.lora_embeddings:
            targets -= {"embed_tokens", "lm_head"}
        p = cfg.parallel
        if p.ep_size > 1 and self.hf.get("model_type") not in MOE_TYPES:
            raise ConfigError(f"parallel.ep_size={p.ep_size} splits experts, but model_type="
                              f"{self.hf.get('model_type')!r} has none (MoE types: {MOE_TYPES})")
        comm.init_expert_parallel(ps, p.ep_size, p.ep_attention, p.timeout_s)  # before the MoE blocks are built
        self.model = build_model(self.hf, ps.tp, self.dtype, ps.device, self.rt, targets)
        load_weights(self.model, CheckpointReader(model_dir))
        self.slot_state = SlotState(lo.max_loras)
        self.copy_stream = torch.cuda.Stream(ps.device) if ps.device.type == "cuda" else None
        self._copies_pending = False
        if self.rt is not None:
            # Images alive at once: the host tier, the reads ahead, one being fetched.
            self.slots = SlotTable(self.rt, host_images=lo.max_cpu_loras + PREFETCH_DEPTH + 1)
            self.cache.attach_model(module_shapes(self.rt), lo.max_rank, self.slots)
            if getattr(self.model, "needs_lockstep", False):
                self._pin_adapters()
        self.tokenizer = load_tokenizer(model_dir)
        self.sched: Optional[Scheduler] = None  # the open run's (open() .. close_run())
        # EP over DP replicas steps in lockstep with its peers (every rank of the EP group steps until all idle).
        self.lockstep = self.model.lockstep if getattr(self.model, "needs_lockstep", False) else None
        # On CUDA a step's tokens are read after the next step is launched (where it can be: see step()), so the GPU
        # does not wait for the host between steps. EP over DP replicas steps in lockstep and reads every step.
        self.run_ahead = ps.device.type == "cuda" and self.lockstep is None
        self._inflight: Optional[_InFlight] = None
        self._last_read = 0.0
        eos = self.hf.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_positions = self.hf.get("max_position_embeddings", 4096)
        # MoE models say whether their decode step is free of host syncs (capturable) in their layout and dtype.
        graphs = cfg.cuda_graphs and getattr(self.model, "cuda_graph_safe", True)
        self.runner = ModelRunner(self.model, self.rt, ps.device, graphs, cfg.scheduler.max_tokens_per_step,
                                  cfg.scheduler.max_batch_size)
        self.generator = torch.Generator().manual_seed(cfg.generation.seed)
        self.stats = StepStats()
        self.decode_outputs = True  # finished results carry their text (a server's front end decodes on its own)
        sizes = getattr(self.rt.ops, "warm_up_sizes", None) if self.rt is not None else None
        # EP over DP replicas steps in lockstep with its peers: no solo steps there.
        if sizes is not None and ps.device.type == "cuda" and not getattr(self.model, "needs_lockstep", False):
            self.runner.warm_up([min(n, self.max_positions) for n in sizes(cfg.scheduler.max_tokens_per_step)],
                                cfg.scheduler.kv_block_size)
        # Set for serving, after the start-up's big host copies (weights, the image pool), which gain from threads.
        threads = host_threads(cfg.parallel.host_threads, ps.device.type)
        if threads is not None:
            torch.set_num_threads(threads)

    # ---- adapters -------------------------------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, AdapterInfo]:
        """Usable adapters as registered (names, shapes); weights are read on first use."""
        return self.cache.infos

    @property
    def bad_adapters(self) -> dict[str, str]:
        """name -> why it cannot be used (found at start, or at its first read)."""
        return self.cache.bad

    def _pin_adapters(self) -> None:
        """Expert parallelism over DP replicas sends a token's adapter slot to the rank owning its expert, so every
        rank must hold every adapter in the same slot: load them all once, in name order."""
        names = sorted(self.cache.infos)
        if len(names) > self.cfg.lora.max_loras:
            raise ConfigError(f"parallel.ep_attention=dp with ep_size={self.cfg.parallel.ep_size} pins every adapter "
                              f"in a slot, but there are {len(names)} adapters for lora.max_loras="
                              f"{self.cfg.lora.max_loras}: raise lora.max_loras")
        slot = 0
        for name in names:
            try:
                image = self.cache.fetch(name)
            except AdapterError:
                continue  # now in bad_adapters, on every rank alike
            self.cache.load_slot(self.slots, slot, image)
            self.slot_state.names[slot] = name
            slot += 1
        self.slot_state.pinned = True

    def reset_adapter_cache(self) -> None:
        """Forget which adapters are in host memory and in the slots (benchmarks: start a measured run cold)."""
        if self.slot_state.pinned:
            return
        if any(self.slot_state.users):
            raise RuntimeError("reset_adapter_cache during generate()")
        self.cache.forget()
        for slot in range(len(self.slot_state)):
            self.slot_state.clear(slot)
        if self.rt is not None:
            self.slots.names = [None] * len(self.slots.names)

    def load_adapter(self, name: str, path: str) -> Optional[str]:
        """Register adapter `name` from `path` at run time (every rank, between steps). None, or why not."""
        if name in self.adapters:
            return f"adapter {name!r} is already loaded (unload it first)"
        if self.rt is None:
            return ("the model has no LoRA layers: this process started without adapters (lora.adapter_dir with at "
                    "least one adapter makes them, for the modules its adapters target)")
        if self.slot_state.pinned:
            return "adapters are pinned in slots here (parallel.ep_attention=dp with ep_size > 1): none can be added"
        return self.cache.register(name, path)

    def unload_adapter(self, name: str) -> Optional[str]:
        """Forget adapter `name` (every rank, between steps); refused while requests of the open run use it."""
        if name not in self.adapters and name not in self.bad_adapters:
            return f"adapter {name!r} is not loaded"
        if self.slot_state.pinned:
            return "adapters are pinned in slots here (parallel.ep_attention=dp with ep_size > 1): none can be removed"
        sched = self.sched
        users = 0 if sched is None else (sum(s.request.adapter == name for s in sched.running)
                                         + sum(r.adapter == name for r in sched.waiting))
        if users:
            return f"adapter {name!r} is in use by {users} requests; unload it when they have finished"
        slot = self.slot_state.slot_of(name)
        if slot is not None:
            self.slot_state.clear(slot)
            self.slots.names[slot] = None
        self.cache.remove(name)
        return None

    def check_request(self, req: Request, max_len: int) -> Optional[str]:
        """Why this request cannot run, or None."""
        if req.error:
            return req.error
        if req.adapter is not None:
            if req.adapter in self.bad_adapters:
                return self._adapter_failure(req.adapter)
            if req.adapter not in self.adapters:
                known = sorted(self.adapters)
                shown = (f"{known[:10]} and {len(known) - 10} more" if len(known) > 10 else known) if known \
                    else "none (set lora.adapter_dir)"
                return f"unknown adapter {req.adapter!r}; known adapters: {shown}"
        if not req.prompt_token_ids:
            return "empty prompt"
        if req.stop and self.tokenizer is None:
            return "'stop' strings need a tokenizer (tokenizer.json in the model dir)"
        if req.top_p is not None and not 0 < req.top_p <= 1:
            return f"top_p={req.top_p}: expected in (0, 1]"
        if not 0 <= req.logprobs <= self.hf["vocab_size"]:
            return f"logprobs={req.logprobs}: expected in [0, {self.hf['vocab_size']}]"
        vocab = self.hf["vocab_size"]
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
        total = len(req.prompt_token_ids) + req.max_new_tokens
        if total > max_len:
            return (f"prompt ({len(req.prompt_token_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                    f"exceeds the context of {max_len} tokens")
        return None

    def _adapter_failure(self, name: str) -> str:
        why = self.bad_adapters[name]
        return f"adapter {name!r} failed to load: {why.removeprefix(f'adapter {name!r}: ')}"

    def _fetch(self, name: str) -> Optional[object]:
        """An adapter's host form (its slot image), or None when it cannot be used (the same verdict on every rank)."""
        try:
            return self.cache.fetch(name)
        except AdapterError:
            return None

    def _loadable(self, sched: Scheduler) -> tuple[Optional[set[str]], list[str]]:
        """(adapters the next step may copy into slots, those still being read) over the waiting requests the
        scheduler may admit next; (None, []) without overlap_reads: any, read when admitted. Waits up to
        READ_WAIT_S for the reads of the first group's adapters. The ranks of a TP group agree on which reads are
        done and on when the wait ends (times differ per rank)."""
        if not self.overlap_reads:
            return None, []
        if not sched.may_admit():
            return set(), []
        wanted = self._wanted(sched)
        if not wanted:
            return set(), []
        self.cache.prefetch(wanted)
        first = {r.adapter for r in sched.waiting[:sched.group_size]}
        deadline = time.perf_counter() + READ_WAIT_S
        while True:
            flags = comm.all_true([self.cache.ready(n) for n in wanted] + [time.perf_counter() < deadline],
                                  self.ps.tp)
            unread = [n for n, ok in zip(wanted, flags) if not ok]
            due = [n for n in unread if n in first]
            if not due or not flags[-1]:
                return {n for n, ok in zip(wanted, flags) if ok}, unread
            self.cache.wait_any(due)

    def _wanted(self, sched: Scheduler) -> list[str]:
        """Adapters of the next waiting requests that are not in a slot, in queue order."""
        return list(dict.fromkeys(r.adapter for r in sched.waiting[:LOOKAHEAD]
                                  if r.adapter is not None and self.slot_state.slot_of(r.adapter) is None))

    def _copy_into_slot(self, slot: int, image) -> None:
        self.cache.load_slot(self.slots, slot, image, self.copy_stream)
        self._copies_pending = self.copy_stream is not None
        self.stats.adapter_loads += 1

    def _step(self, work: list[tuple[Sequence, int]], cache) -> torch.Tensor:
        """work: (sequence, number of its new tokens). Returns logits [N, V] of each sequence's last new token (a
        pending last token is read on the device)."""
        step = StepBatch()
        for seq, n in work:
            step.add(seq.tokens[seq.computed:seq.computed + n], seq.blocks, seq.computed, seq.slot)
        if self._copies_pending:  # adapter copies issued on the side stream land before any slot is read
            torch.cuda.current_stream(self.ps.device).wait_stream(self.copy_stream)
            self._copies_pending = False
        logits = self.runner.execute(step, cache)
        for seq, n in work:
            seq.computed += n
        return logits

    @torch.no_grad()
    def prompt_logits(self, requests: list[Request]) -> list[torch.Tensor]:
        """Logits [len(prompt), V] at every prompt position of each request, each with its adapter, in one step
        (evaluation and scoring; all requests must fit in the slots at once)."""
        for req in requests:
            err = self.check_request(req, self.max_positions)
            if err:
                raise ValueError(err)
        names = list(dict.fromkeys(r.adapter for r in requests if r.adapter is not None))
        st = self.slot_state
        slot_of = {}
        for name in names:
            slot = st.slot_of(name)
            if slot is None:
                slot = st.victim(set(names))
                if slot is None:
                    for s in slot_of.values():
                        st.release(s)
                    raise ValueError(f"{len(names)} adapters do not fit in lora.max_loras={self.cfg.lora.max_loras} "
                                     f"slots")
                image = self._fetch(name)
                if image is None:
                    for s in slot_of.values():
                        st.release(s)
                    raise ValueError(self._adapter_failure(name))
                st.assign(slot, name)
                self._copy_into_slot(slot, image)
                st.loaded(slot)
            st.acquire(slot)  # held until all are placed, so no later name evicts it
            slot_of[name] = slot
        for s in slot_of.values():
            st.release(s)
        bs = self.cfg.scheduler.kv_block_size
        seqs, used = [], 0
        for req in requests:
            n = blocks_for(len(req.prompt_token_ids), bs)
            seqs.append(Sequence(req, list(range(used, used + n)), slot_of.get(req.adapter, -1),
                                 list(req.prompt_token_ids), len(req.prompt_token_ids)))
            used += n
        cache = self.model.new_cache(used, bs)
        step = StepBatch(all_logits=True)
        for s in seqs:
            step.add(s.tokens, s.blocks, 0, s.slot)
        if self._copies_pending:
            torch.cuda.current_stream(self.ps.device).wait_stream(self.copy_stream)
            self._copies_pending = False
        return list(self.runner.execute(step, cache).split([s.prompt_len for s in seqs]))

    # ---- KV blocks --------------------------------------------------------------------------------------------
    def _kv_plan(self, needs: list[int]) -> tuple[int, int]:
        """(blocks, longest fitting need) for requests needing `needs` positions each: as many blocks as the
        max_batch_size largest requests use at once, or as the memory this rank has left holds; the TP ranks take
        the smallest plan so they schedule alike."""
        s = self.cfg.scheduler
        m = self.model
        bs = s.kv_block_size
        bpt = kv_bytes_per_token(len(m.layers), m.kv_heads, m.head_dim, m.dtype)
        old = self.runner.cache
        reusable = 0 if old is None else (old.num_blocks + 1) * old.block_size * bpt
        budget = kv_budget_bytes(self.ps.device, s.kv_memory_fraction, s.kv_cache_mb, reusable)
        wanted = sum(sorted(blocks_for(n + 1, bs) for n in needs)[-s.max_batch_size:])  # +1: the admission's
        blocks = plan_blocks(budget, bs, bpt, wanted)
        if self.ps.tp.size > 1:
            blocks = min(comm.all_gather_object(blocks, self.ps.tp))
        return blocks, max(0, blocks * bs - 1)

    # ---- a run: the scheduler over one KV cache, stepped by a front end's loop ---------------------------------
    def open(self, blocks: int, max_len: int) -> None:
        """Start a run: a KV cache of `blocks` blocks (from _kv_plan) for sequences of up to `max_len` positions, and
        a scheduler over it."""
        sc = self.cfg.scheduler
        self.kv = self.runner.kv_cache(blocks, sc.kv_block_size, max_len)
        self.sched = Scheduler(self.slot_state, BlockPool(blocks, sc.kv_block_size), sc.max_batch_size,
                               sc.max_tokens_per_step, sc.max_overtakes, admit_batch=sc.admit_batch)
        self._arrival: dict[int, float] = {}
        self._text: dict[int, Detokenizer] = {}  # requests with stop strings: their text so far
        self._seeded: dict[int, torch.Generator] = {}  # requests with their own seed: their generator

    def open_for_serving(self) -> int:
        """Open a run for requests that come and go (a server): KV blocks for scheduler.max_batch_size sequences of
        the whole context, or as many as fit. Returns the longest request (prompt + max_new_tokens) it can hold."""
        max_len = self.cfg.model.max_seq_len or self.max_positions
        blocks, fit = self._kv_plan([max_len] * self.cfg.scheduler.max_batch_size)
        if not blocks:
            raise ConfigError(f"no KV cache block fits (scheduler.kv_cache_mb={self.cfg.scheduler.kv_cache_mb}, "
                              f"scheduler.kv_memory_fraction={self.cfg.scheduler.kv_memory_fraction})")
        fit = min(fit, max_len)
        self.open(blocks, fit)
        return fit

    def add(self, req: Request, arrival: float) -> None:
        """Queue a request that passed check_request and fits the run's KV cache; arrival: its perf_counter time."""
        self._arrival[req.index] = arrival
        self.sched.add(req)

    def cancel(self, index: int) -> Optional[Result]:
        """Drop request `index` from the run (its client went away), freeing its slot and KV row; its result so far,
        or None when the run does not hold it."""
        out = self.sched.remove(index)
        if out is None:
            return None
        self._arrival.pop(index, None)
        self._text.pop(index, None)
        self._seeded.pop(index, None)
        res = out.result if isinstance(out, Sequence) else Result(out)
        res.finish_reason = "cancelled"
        return res

    def close_run(self) -> None:
        """End the run, after an error too: what it holds is freed, the slots are usable by the next run."""
        if self._inflight is not None:  # its tokens are dropped with the run
            if self._inflight.done is not None:
                self._inflight.done.synchronize()
            self._inflight = None
        self.sched.abort()
        st = self.slot_state
        for slot in range(len(st)):
            if not st.ready[slot]:
                st.clear(slot)  # assigned but never copied in
        self.sched = None

    def idle(self, wait_s: float) -> None:
        """Nothing to step: take part in the EP peers' steps (lockstep), else sleep up to wait_s (at most 10 ms)."""
        if self.lockstep is not None:
            self.lockstep(0)
        else:
            time.sleep(min(0.01, max(0.0, wait_s)))

    @property
    def busy(self) -> bool:
        """Whether the run has work: sequences to step, requests to admit, or a launched step to read."""
        return self.sched.has_work or self._inflight is not None

    @torch.no_grad()
    def step(self) -> StepOutput:
        """One step of the run: admit waiting requests, copy their adapters into slots, run the model over the
        batch, sample, and return which results advanced and which ended. The same on every rank of the TP group.

        With run_ahead the sampled tokens stay on the device until the next call, which first launches the
        following step of the running sequences (their new tokens fed on the device; sequences that end by length
        left out) and then reads them: the host prepares a step while the GPU runs the last one. A sequence found
        finished then has a row in that step, whose token is dropped. That call admits nothing (it reads first and
        steps as usual when requests could be admitted, or when a request asked for top log-probabilities), so the
        results of a call are those of the step before."""
        sched, out = self.sched, StepOutput()
        prev, self._inflight = self._inflight, None
        if prev is not None:
            if prev.tops is None and not sched.may_admit():
                ending = [seq for seq, _ in prev.sampled if seq.generated >= seq.request.max_new_tokens]
                work = self._schedule(set(), admit=False, ending=ending).work
                if work:
                    self._launch(work)
                    self.stats.ahead_steps += 1
            self._read(prev, out)
            if self._inflight is not None or not sched.has_work:
                return out
        now = time.perf_counter()
        loadable, unread = self._loadable(sched)
        plan = self._schedule(loadable)
        for seq in plan.admitted:
            seq.result.metrics.update(arrival=self._arrival.pop(seq.request.index), admitted=now)
            self.stats.prompt_tokens += seq.prompt_len
        failed = set()
        for slot, name in plan.loads:  # copied in before the step that prefills their requests
            image = self._fetch(name)  # read already (overlap_reads), else read here; and the ranks' verdict
            if image is None:
                failed.add(name)
                for req in sched.fail_adapter(name):
                    self._text.pop(req.index, None)
                    out.finished.append(Result(req, error=self._adapter_failure(name)))
            else:
                self._copy_into_slot(slot, image)
                sched.loaded(slot)
        work = [(seq, n) for seq, n in plan.work if seq.request.adapter not in failed]
        if self.lockstep is not None:
            self.lockstep(sum(n for _, n in work), any(seq.slot >= 0 for seq, _ in work))
        if work:
            self._launch(work)
        self.cache.prefetch(self._wanted(sched))  # disk reads for what the queue asks next run beside the steps
        if not work:
            if unread and not plan.loads:  # nothing to run until an adapter is read: help read one
                self.cache.wait_any(unread)
            elif not plan.loads:
                raise RuntimeError(f"scheduler made no progress: {len(sched.running)} running, "
                                   f"{len(sched.waiting)} waiting, slots {self.slot_state.names} users "
                                   f"{self.slot_state.users}, {sched.blocks.available} free KV blocks")
            return out
        if not self.run_ahead:
            launched, self._inflight = self._inflight, None
            self._read(launched, out)
        return out

    def _schedule(self, loadable, **kw):
        """The scheduler's plan (Scheduler.schedule), its slot hits, misses and preemptions counted."""
        sched = self.sched
        hits0, misses0, pre0 = sched.slot_hits, sched.slot_misses, sched.preemptions
        plan = sched.schedule(loadable, **kw)
        self.stats.slot_hits += sched.slot_hits - hits0
        self.stats.slot_misses += sched.slot_misses - misses0
        self.stats.preemptions += sched.preemptions - pre0
        return plan

    def _launch(self, work: list[tuple[Sequence, int]]) -> None:
        """Run the model over `work` and sample each finished sequence's next token on the device; the tokens
        travel to the host in the background (self._inflight, read by _read) and stand as runner.pending()
        placeholders meanwhile."""
        started = time.perf_counter()
        logits = self._step(work, self.kv)
        self.stats.steps += 1
        sampled = [(seq, i) for i, (seq, _) in enumerate(work) if seq.computed == len(seq.tokens)]
        host = tops = None
        if sampled:
            reqs = [s.request for s, _ in sampled]
            idx = [i for _, i in sampled]  # increasing: all of them is every row, in order
            rows = logits if len(idx) == logits.shape[0] else logits[idx]
            drawn = draw(rows, [self._temperature(r) for r in reqs], self._top_ps(reqs), self._generators(reqs))
            self.runner.keep_sampled(drawn[0])
            k = max(r.logprobs for r in reqs)
            tops = top_logprobs(rows, k) if k else None
            cuda = drawn.device.type == "cuda"
            host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=cuda).copy_(drawn, non_blocking=cuda)
        done = None
        if self.ps.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        for j, (seq, _) in enumerate(sampled):
            seq.tokens.append(pending(j))
        self._inflight = _InFlight([(seq, len(seq.tokens) - 1) for seq, _ in sampled], host, tops, done, started,
                                   all(n == 1 for _, n in work), self.runner.replayed, self.runner.captured)

    def _read(self, f: _InFlight, out: StepOutput) -> None:
        """A launched step's tokens onto the host: each sampled sequence that still runs takes its token (and its
        log-probabilities), and ends when it finished."""
        if f.done is not None:
            comm.wait_event(f.done, self.ps.device)  # a peer that never joins a collective: an error, not a hang
        now = time.perf_counter()
        seconds = now - max(f.started, self._last_read)  # the step's share of the wall time (steps overlap)
        self._last_read = now
        if f.replayed:
            self.stats.graph_steps += 1
            self.stats.graph_captures += f.captured
            self.stats.graph_seconds += seconds
        else:
            self.stats.eager_seconds += seconds
        if f.decode:
            by = self.stats.decode_by_rows.setdefault(len(f.sampled), [0, 0.0])
            by[0] += 1
            by[1] += seconds
        if not f.sampled:
            return
        toks, lps = f.host.tolist()
        for j, ((seq, at), tok, lp) in enumerate(zip(f.sampled, toks, lps)):
            tok = int(tok)
            seq.tokens[at] = tok
            if seq.stopped:  # finished, cancelled or dropped after this step was launched
                continue
            res = seq.result
            res.output_token_ids.append(tok)
            res.logprobs.append(lp)
            if seq.request.logprobs:
                res.top_logprobs.append(f.tops[j][:seq.request.logprobs])
            res.metrics.setdefault("first_token", now)
            self.stats.generated_tokens += 1
            out.advanced.append(res)
            if self._finished(seq, tok, at + 1 - seq.prompt_len):
                self.sched.remove(seq.request.index)  # running, or preempted by the step launched since
                res.metrics["finished"] = now
                self._final_text(res)
                out.finished.append(res)

    # ---- generate(): the offline front end ---------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[Request], on_result: Callable[[Result], None] = lambda r: None,
                 progress: Callable[[int, int], None] = lambda done, total: None, *,
                 arrival_times: Optional[Seq[float]] = None,
                 stop: Optional[Callable[[], int]] = None) -> list[Result]:
        """Continuous batching over `requests` (see tp_lora.engine.scheduler for the policy). Results come back in
        request order; on_result gets each one as it completes (finished or failed).

        arrival_times: seconds after the call at which each request arrives; it is not admitted before (serving
        benchmarks). stop: polled each step, returns RUN, DRAIN (admit nothing more, finish what runs, within
        scheduler.stop_grace_s) or ABORT (drop what runs); requests a stop leaves unfinished come back with
        `interrupted` set and are not passed to on_result.
        """
        cfg, sc = self.cfg, self.cfg.scheduler
        t0 = time.perf_counter()
        if arrival_times is not None and len(arrival_times) != len(requests):
            raise ValueError(f"arrival_times has {len(arrival_times)} entries for {len(requests)} requests")
        results: dict[int, Result] = {}
        total = len(requests)

        def emit(res: Result) -> None:
            res.metrics.setdefault("finished", time.perf_counter())
            results[res.request.index] = res
            on_result(res)
            progress(len(results), total)

        max_len = cfg.model.max_seq_len or self.max_positions
        valid = []
        for req in requests:
            err = self.check_request(req, max_len)
            if err:
                emit(Result(req, error=err))
            else:
                valid.append(req)
        blocks, fit = self._kv_plan([len(r.prompt_token_ids) + r.max_new_tokens for r in valid]) \
            if valid else (0, 0)
        arrival = {r.index: float(t) for r, t in zip(requests, arrival_times)} if arrival_times is not None else {}
        pending = []  # (arrival, request) not yet handed to the scheduler
        for req in valid:
            need = len(req.prompt_token_ids) + req.max_new_tokens
            if need > fit:
                emit(Result(req, error=self.kv_misfit(need, fit)))
            else:
                pending.append((arrival.get(req.index, 0.0), req))
        pending.sort(key=lambda x: x[0])  # stable: equal times keep request order

        interrupted: list[Request] = []
        if pending:
            self.open(blocks, max(len(r.prompt_token_ids) + r.max_new_tokens for _, r in pending))
            try:
                self._loop(pending, t0, emit, interrupted, stop)
            finally:  # after an error too: the slots this run held are free for the next call
                self.close_run()
        # EP over DP replicas: every rank of the EP group steps until all are idle (a rank out of work still serves
        # the others' tokens routed to its experts).
        while self.lockstep is not None and self.lockstep(0):
            pass
        self.stats.seconds += time.perf_counter() - t0
        self.stats.interrupted += len(interrupted)
        out = []
        for r in requests:
            res = results.get(r.index)
            out.append(res if res is not None else Result(r, error=INTERRUPTED, interrupted=True))
        return out

    def kv_misfit(self, need: int, fit: int) -> str:
        sc = self.cfg.scheduler
        return (f"prompt + max_new_tokens = {need} positions of KV cache do not fit the {fit} this rank can hold "
                f"(scheduler.kv_memory_fraction={sc.kv_memory_fraction}, scheduler.kv_cache_mb={sc.kv_cache_mb})")

    def agree(self, arrived: int, level: int) -> tuple[int, int]:
        """Agree over the TP group: requests arrived on every rank's clock (min) and the stop level (max)."""
        if self.ps.tp.size == 1:
            return arrived, level
        views = comm.all_gather_object((arrived, level), self.ps.tp)
        return min(v[0] for v in views), max(v[1] for v in views)

    def _loop(self, pending: list[tuple[float, Request]], t0: float, emit, interrupted: list[Request],
              stop) -> None:
        """generate()'s control plane around step(): requests enter as they arrive and the stop level rises on
        signals, both agreed by the TP ranks (each idle iteration and every few busy steps while requests are still
        to arrive: the exchange syncs the host; every stop_check_steps for stopping; one rank: every iteration)."""
        sc, sched = self.cfg.scheduler, self.sched
        timed = any(at > 0 for at, _ in pending)
        fed = 0  # pending[:fed] handed to the scheduler
        level, drain_deadline = RUN, None
        it = 0
        while True:
            now = time.perf_counter()
            local = stop() if stop is not None else RUN
            if drain_deadline is not None and now >= drain_deadline:
                local = max(local, ABORT)
            arrivals_due = timed and fed < len(pending) and (not self.busy or it % ARRIVAL_CHECK_STEPS == 0)
            if arrivals_due or it % sc.stop_check_steps == 0 or self.ps.tp.size == 1:
                due = fed
                while due < len(pending) and t0 + pending[due][0] <= now:
                    due += 1
                due, agreed = self.agree(due if timed else len(pending), max(local, level))
                for at, req in pending[fed:due]:
                    self.add(req, t0 + at)
                fed = max(fed, due)
                if agreed > level:
                    level = agreed
                    if level >= DRAIN and drain_deadline is None:
                        drain_deadline = now + sc.stop_grace_s
                        interrupted += sched.stop_admitting() + [r for _, r in pending[fed:]]
                        fed = len(pending)
                    if level >= ABORT:
                        interrupted += [s.request for s in sched.abort()]
            it += 1
            if not self.busy:
                if fed >= len(pending):
                    break
                self.idle(t0 + pending[fed][0] - time.perf_counter())
                continue
            for res in self.step().finished:
                emit(res)

    def close(self) -> None:
        """Release CUDA graphs (call before the process group is destroyed) and the adapter reader."""
        self.runner.release_graphs()
        self.cache.close()

    def _temperature(self, req: Request) -> float:
        return req.temperature if req.temperature is not None else self.cfg.generation.temperature

    def _top_ps(self, reqs: list[Request]) -> list[float]:
        return [r.top_p if r.top_p is not None else self.cfg.generation.top_p for r in reqs]

    def _generators(self, reqs: list[Request]):
        """The run's generator, or per request where one has its own seed (made at its first sample)."""
        if all(r.seed is None for r in reqs):
            return self.generator
        return [self.generator if r.seed is None else
                self._seeded.setdefault(r.index, torch.Generator().manual_seed(r.seed)) for r in reqs]

    def _finished(self, seq: Sequence, tok: int, generated: int) -> bool:
        """Whether seq ends with its `generated`-th new token `tok` (a later step may have one pending already)."""
        req = seq.request
        ignore = req.ignore_eos if req.ignore_eos is not None else self.cfg.generation.ignore_eos
        if not ignore and tok in self.eos:
            seq.result.finish_reason = "stop"
            return True
        if req.stop and self._stop_string(seq.result, tok):
            seq.result.finish_reason = "stop"
            return True
        return generated >= req.max_new_tokens

    def _stop_string(self, res: Result, tok: int) -> bool:
        """Whether the text now holds one of the request's stop strings; the result's text then ends before it."""
        text = self._text.setdefault(res.request.index, Detokenizer(self.tokenizer))
        before = len(text.text)
        if not text.add([tok]):
            return False
        longest = max(len(s) for s in res.request.stop)
        window = max(0, before - longest + 1)  # a match must end in the new text
        hits = [i for i in (text.text.find(s, window) for s in res.request.stop) if i >= 0]
        if not hits:
            return False
        res.text = text.text[:min(hits)]
        return True

    def _final_text(self, res: Result) -> None:
        """A finished result's decoded text (with a tokenizer, and decode_outputs), unless a stop string set it
        already."""
        self._text.pop(res.request.index, None)
        self._seeded.pop(res.request.index, None)
        if self.decode_outputs and self.tokenizer is not None and res.text is None:
            res.text = self.tokenizer.decode(res.output_token_ids)
