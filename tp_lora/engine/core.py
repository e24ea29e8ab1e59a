"""The step core: a run of requests over one KV cache, stepped by a front end's control loop (tp_lora.engine.control).
One step admits waiting requests, copies their adapters into slots, runs the model over the batch, samples, and
hands back the results that advanced or ended.

Every rank of a TP group makes the same calls on the same requests, so they agree on every batch without exchanging
control messages; only the model's collectives cross ranks, plus two small agreements where a rank's local view could
differ: a lazy adapter read (the file may be corrupt on one read and not another) and the KV blocks that fit (free
memory differs per GPU).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig
from tp_lora.engine.adapters import AdapterRegistry
from tp_lora.engine.choices import fork
from tp_lora.engine.kv_pool import BlockPool, misfit, plan_kv
from tp_lora.engine.requests import Request, Result, request_error
from tp_lora.engine.runner import ModelRunner, StepBatch, pending
from tp_lora.engine.sampler import Sampler, top_logprobs
from tp_lora.engine.scheduler import Scheduler, Sequence
from tp_lora.engine.stats import Gauges, StepOutput, StepStats
from tp_lora.hostcopy import to_device


@dataclass
class InFlight:
    """A launched step whose sampled tokens have not reached the host yet."""
    sampled: list[tuple[Sequence, int]]  # (sequence, where its pending token is in seq.tokens), in row order
    host: Optional[torch.Tensor]  # [2, rows] float64 token ids and log-probabilities, copied in once `done`
    tops: Optional[list]  # the top log-probabilities of each sampled row (when a request asked; read already)
    done: Optional[torch.cuda.Event]  # recorded after the step's work (None off CUDA: everything ran already)
    started: float  # perf_counter() at launch
    decode: bool  # one new token per sequence
    replayed: bool  # from a CUDA graph
    captured: bool  # its graph captured by it
    read_first: bool  # the host needs its tokens before the next step: top log-probabilities were taken (a host
    # sync already)


class EngineCore:
    """The model's runner, the adapter registry and the sampler, stepped over one run at a time (open() ..
    close_run()). `lockstep`: for EP over DP replicas, the model's call that steps with the peers."""

    def __init__(self, cfg: RunConfig, ps: comm.ParallelState, runner: ModelRunner, registry: AdapterRegistry,
                 sampler: Sampler, vocab_size: int, max_positions: int, lockstep: Optional[Callable] = None):
        self.cfg, self.ps, self.runner, self.registry, self.sampler = cfg, ps, runner, registry, sampler
        self.vocab_size, self.max_positions, self.lockstep = vocab_size, max_positions, lockstep
        self.stats = StepStats()
        self.sched: Optional[Scheduler] = None  # the open run's
        # On CUDA a step's tokens are read after the next step is launched (where it can be: see step()), so the GPU
        # does not wait for the host between steps (EP over DP replicas too: lockstep exchanges on the host).
        self.run_ahead = ps.device.type == "cuda"
        self.inflight: Optional[InFlight] = None
        self._last_read = 0.0
        self._arrival: dict[int, float] = {}
        self._pool: Optional[BlockPool] = None  # the last run's KV blocks and prefix cache
        self._pool_cache = 0  # the runner's cache allocation it indexes

    # ---- requests -----------------------------------------------------------------------------------------------
    def check_request(self, req: Request, max_len: int) -> Optional[str]:
        """Why this request cannot run, or None."""
        if req.adapter is not None and not req.error and (why := self.registry.unknown(req.adapter)):
            return why
        return (request_error(req, max_len, self.vocab_size, self.sampler.tokenizer is not None)
                or self.sampler.check(req, self.vocab_size))

    # ---- a run ------------------------------------------------------------------------------------------------------
    def plan_kv(self, needs: list[int]) -> tuple[int, int]:
        """(blocks, longest fitting need) for requests needing `needs` positions each (kv_pool.plan_kv)."""
        return plan_kv(self.runner, self.ps, self.cfg.scheduler, needs)

    def misfit(self, need: int, fit: int) -> str:
        return misfit(need, fit, self.cfg.scheduler.kv_memory_fraction, self.cfg.scheduler.kv_cache_mb)

    def open(self, blocks: int, max_len: int) -> None:
        """Start a run: a KV cache of `blocks` blocks (from plan_kv) for sequences of up to `max_len` positions, and
        a scheduler over it."""
        sc = self.cfg.scheduler
        self.kv = self.runner.kv_cache(blocks, sc.kv_block_size, max_len)
        pool = self._pool  # the last run's blocks keep their cached prefixes while they index the same cache
        if (pool is None or pool.blocks != blocks or self._pool_cache != self.runner.allocations
                or not sc.prefix_caching):
            pool = BlockPool(blocks, sc.kv_block_size, sc.prefix_caching)
        self._pool, self._pool_cache = pool, self.runner.allocations
        self.sched = Scheduler(self.registry.state, pool, sc.max_batch_size, sc.max_tokens_per_step,
                               sc.max_overtakes, admit_batch=sc.admit_batch, identity=self.registry.identity,
                               max_prefix_overtakes=sc.max_prefix_overtakes)
        self._arrival.clear()
        self.sampler.reset()

    def open_for_serving(self) -> int:
        """Open a run for requests that come and go (a server): KV blocks for scheduler.max_batch_size sequences of
        the whole context, or as many as fit. Returns the longest request (prompt + max_new_tokens) it can hold."""
        max_len = self.cfg.model.max_seq_len or self.max_positions
        blocks, fit = self.plan_kv([max_len] * self.cfg.scheduler.max_batch_size)
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
        """Drop request `index` from the run (its client went away), freeing its slot and KV blocks; its result so
        far, or None when the run does not hold it."""
        out = self.sched.remove(index)
        if out is None:
            return None
        self._arrival.pop(index, None)
        self.sampler.forget(index)
        res = out.result if isinstance(out, Sequence) else Result(out)
        res.finish_reason = "cancelled"
        return res

    def stop_admitting(self) -> list[Request]:
        """Admit nothing more; the requests still waiting (they will not run)."""
        return self.sched.stop_admitting()

    def abort(self) -> list[Request]:
        """Drop every running sequence; their requests."""
        return [seq.request for seq in self.sched.abort()]

    def close_run(self) -> None:
        """End the run, after an error too: what it holds is freed, the slots are usable by the next run."""
        if self.inflight is not None:  # its tokens are dropped with the run
            if self.inflight.done is not None:
                self.inflight.done.synchronize()
            self.inflight = None
        self.sched.abort()
        self.kv = None  # the runner keeps the cache for the next run
        st = self.registry.state
        for slot in range(len(st)):
            if not st.ready[slot]:
                st.clear(slot)  # assigned but never copied in
        self.sched = None

    def load_adapter(self, name: str, path: str) -> Optional[str]:
        """Register adapter `name` from `path` at run time (every rank, between steps). None, or why not."""
        return self.registry.register(name, path)

    def unload_adapter(self, name: str) -> Optional[str]:
        """Unload adapter `name` (every rank, between steps): None, or why it cannot be. From now on no new request
        may name it; it is forgotten at once when no request of the open run uses it, else it stays in `unloading`
        until finish_unloads() finds its last running or queued request ended."""
        why = self.registry.unregister(name)
        if why is None:
            self.finish_unloads()
        return why

    @property
    def unloading(self) -> set[str]:
        """Adapters being unloaded, waiting for their requests to end."""
        return self.registry.unloading

    def finish_unloads(self) -> list[str]:
        """Forget the adapters being unloaded that no running or queued request uses any more; their names (sorted:
        the same order on every rank)."""
        if not self.unloading:
            return []
        sched = self.sched
        used = set() if sched is None else ({s.request.adapter for s in sched.running}
                                            | {r.adapter for r in sched.waiting})
        done = sorted(self.unloading - used)
        for name in done:
            self.registry.remove(name)
        return done

    @property
    def busy(self) -> bool:
        """Whether the run has work: sequences to step, requests to admit, or a launched step to read."""
        return self.sched.has_work or self.inflight is not None

    def idle(self, wait_s: float) -> None:
        """Nothing to step: take part in the EP peers' steps (lockstep), else sleep up to wait_s (at most 10 ms)."""
        if self.lockstep is not None:
            self.lockstep(0)
        else:
            time.sleep(min(0.01, max(0.0, wait_s)))

    def gauges(self) -> Gauges:
        sched, s = self.sched, self.stats
        queued = (len(sched.waiting), len(sched.running)) if sched is not None else (0, 0)
        pool = sched.blocks if sched is not None else None
        kv = (pool.blocks - pool.available, pool.cached, pool.available - pool.cached) if pool else (0, 0, 0)
        return Gauges(*queued, s.slot_hit_rate, self.registry.cache.stats.host_misses, s.adapter_loads, *kv)

    # ---- one step ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepOutput:
        """One step of the run: admit waiting requests, copy their adapters into slots, run the model over the
        batch, sample, and return which results advanced and which ended. The same on every rank of the TP group.

        With run_ahead the sampled tokens stay on the device until the next call, which first launches the
        following step of the running sequences (their new tokens fed on the device; sequences that end by length
        left out) and then reads them: the host prepares a step while the GPU runs the last one. A sequence found
        finished then has a row in that step, whose token is dropped. That step admits waiting requests too (a new
        request's prefill starts one step sooner than after a read), unless an admission would copy an adapter into
        a slot (the copy stream could overwrite a slot the step in flight reads): then, as when the last step's rows
        must be read first (InFlight.read_first), it reads first and steps as usual. The results of a call are those
        of the step before."""
        sched, reg, out = self.sched, self.registry, StepOutput()
        prev, self.inflight = self.inflight, None
        if prev is not None:
            copies = bool(reg.wanted(sched))  # a waiting request's adapter would be copied into a slot
            if not prev.read_first and not (copies and sched.may_admit()):
                ending = [seq for seq, _ in prev.sampled if seq.generated >= seq.request.max_new_tokens]
                plan = self._schedule(set(), admit=not copies, ending=ending)
                self._admitted(plan.admitted)
                if plan.work:
                    self._lockstep(plan.work)
                    self._launch(plan.work)
                    self.stats.ahead_steps += 1
            self._read(prev, out)
            if self.inflight is not None or not sched.has_work:
                return out
        loadable, unread = reg.loadable(sched)
        plan = self._schedule(loadable)
        self._admitted(plan.admitted)
        failed = set()
        for slot, name in plan.loads:  # copied in before the step that prefills their requests
            image = reg.fetch(name)  # read already (overlap_reads), else read here; and the ranks' verdict
            if image is None:
                failed.add(name)
                for req in sched.fail_adapter(name):
                    self.sampler.forget(req.index)
                    out.finished.append(Result(req, error=reg.failure(name)))
            else:
                reg.copy_into_slot(slot, image)
                self.stats.adapter_loads += 1
                sched.loaded(slot)
        work = [(seq, n) for seq, n in plan.work if seq.request.adapter not in failed]
        self._lockstep(work)
        if work:
            self._launch(work)
        reg.cache.prefetch(reg.wanted(sched))  # disk reads for what the queue asks next run beside the steps
        if not work:
            if unread and not plan.loads:  # nothing to run until an adapter is read: help read one
                reg.cache.wait_any(unread)
            elif not plan.loads:
                raise RuntimeError(f"scheduler made no progress: {len(sched.running)} running, "
                                   f"{len(sched.waiting)} waiting, slots {reg.state.names} users "
                                   f"{reg.state.users}, {sched.blocks.available} free KV blocks")
            return out
        if not self.run_ahead:
            launched, self.inflight = self.inflight, None
            self._read(launched, out)
        return out

    def _lockstep(self, work: list[tuple[Sequence, int]]) -> None:
        """EP over DP replicas: announce the forward about to launch (its tokens, any adapter) to the EP peers, as
        every rank does before each of its forwards (an idle rank's part in theirs: idle())."""
        if self.lockstep is not None:
            self.lockstep(sum(n for _, n in work), any(seq.slot >= 0 for seq, _ in work))

    def _admitted(self, seqs: list[Sequence]) -> None:
        """Sequences a plan admitted: their arrival and admission times, their prompt tokens counted."""
        now = time.perf_counter()
        for seq in seqs:
            seq.result.metrics.update(arrival=self._arrival.pop(seq.request.index), admitted=now)
            self.stats.prompt_tokens += seq.prompt_len

    def _schedule(self, loadable, **kw):
        """The scheduler's plan (Scheduler.schedule), its slot hits, misses and preemptions counted."""
        sched = self.sched
        hits0, misses0, pre0, cached0 = sched.slot_hits, sched.slot_misses, sched.preemptions, sched.prefix_hits
        plan = sched.schedule(loadable, **kw)
        self.stats.prefix_hit_tokens += sched.prefix_hits - cached0
        self.stats.slot_hits += sched.slot_hits - hits0
        self.stats.slot_misses += sched.slot_misses - misses0
        self.stats.preemptions += sched.preemptions - pre0
        return plan

    def _launch(self, work: list[tuple[Sequence, int]]) -> None:
        """Run the model over `work` ((sequence, its new tokens)) and sample each finished sequence's next token on
        the device; the tokens travel to the host in the background (self.inflight, read by _read) and stand as
        runner.pending() placeholders meanwhile."""
        started = time.perf_counter()
        step = StepBatch()
        for seq, n in work:
            step.add(seq.tokens[seq.computed:seq.computed + n], seq.blocks, seq.computed, seq.slot)
        self.registry.sync()
        logits = self.runner.execute(step, self.kv)  # [sequences, V] (or a vocabulary shard): each one's last token
        for seq, n in work:
            seq.computed += n
            self.sched.cache_blocks(seq)
        self.stats.steps += 1
        sampled = [(seq, i) for i, (seq, _) in enumerate(work) if seq.computed == len(seq.tokens)]
        sampled += self._fork(sampled)
        host = tops = None
        if sampled:
            reqs = [s.request for s, _ in sampled]
            idx = [i for _, i in sampled]
            rows = logits  # the rows to sample (an index from a list would sync the host with the device)
            if idx != list(range(logits.shape[0])):
                rows = logits[to_device([torch.tensor(idx)], logits.device)[0]]
            shard = self.runner.vocab_shard
            if shard is not None and self.sampler.plain(reqs):
                drawn = self.sampler.sample_shard(rows, *shard, reqs)
            else:
                if shard is not None:
                    rows = comm.all_gather(rows, shard[1], dim=-1)
                drawn = self.sampler.sample(rows, reqs, self.stats)
            self.runner.keep_sampled(drawn[0])
            k = max(r.logprobs for r in reqs)
            tops = top_logprobs(rows, k) if k else None
            cuda = drawn.device.type == "cuda"
            host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=cuda).copy_(drawn, non_blocking=cuda)
        done = None
        if self.ps.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        if sampled:  # grammar rows: their tokens go to their matchers once on the host (_read's hand_on)
            self.sampler.follow(host, done)
        for j, (seq, _) in enumerate(sampled):
            seq.tokens.append(pending(j))
        read_first = tops is not None
        self.inflight = InFlight([(seq, len(seq.tokens) - 1) for seq, _ in sampled], host, tops, done, started,
                                 all(n == 1 for _, n in work), self.runner.replayed, self.runner.captured,
                                 read_first)

    def _fork(self, sampled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """n / best_of siblings joining the batch as their first one's prompt ends in this step (choices.fork), each
        with its first one's logits row; their copies of its partial last block queued after the step."""
        if not self.sched.waiting:
            return []
        pairs, copies = fork(self.sched, [seq for seq, _ in sampled])
        if copies:
            self.runner.copy_blocks(self.kv, copies)
        row, now = {id(seq): i for seq, i in sampled}, time.perf_counter()
        for seq, _ in pairs:
            seq.result.metrics.update(arrival=self._arrival.pop(seq.request.index), admitted=now)
            self.stats.prompt_tokens += seq.prompt_len
            self.stats.prefix_hit_tokens += seq.prompt_len
        return [(seq, row[id(lead)]) for seq, lead in pairs]

    def _read(self, f: InFlight, out: StepOutput) -> None:
        """A launched step's tokens onto the host: each sampled sequence that still runs takes its token (and its
        log-probabilities), and ends when it finished."""
        if f.done is not None:
            comm.wait_event(f.done, self.ps.device)  # a peer that never joins a collective: an error, not a hang
            self.sampler.hand_on()
        now = time.perf_counter()
        seconds = now - max(f.started, self._last_read)  # the step's share of the wall time (steps overlap)
        self._last_read = now
        s = self.stats
        if f.replayed:
            s.graph_steps += 1
            s.graph_captures += f.captured
            s.graph_seconds += seconds
        else:
            s.eager_seconds += seconds
        if f.decode:
            by = s.decode_by_rows.setdefault(len(f.sampled), [0, 0.0])
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
            s.generated_tokens += 1
            out.advanced.append(res)
            if self.sampler.finished(res, tok, at + 1 - seq.prompt_len):
                self.sched.remove(seq.request.index)  # running, or preempted by the step launched since
                res.metrics["finished"] = now
                self.sampler.final_text(res)
                out.finished.append(res)
