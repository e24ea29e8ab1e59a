"""The control plane every front end shares: the loop that takes a front end's requests, cancellations and adapter
loads (a Source), agrees them and the stop level across the ranks of the TP group, applies them to the engine, drives
step(), and hands what happened to the front end (a Sink). The offline job and LLM.generate (generate() below) and
the server (tp_lora.server.loop) differ only in their source and sink.

The agreement is one all_gather_object over the agreeing group, carrying each rank's stop level, its source's view and
whether it is busy; the next exchange and the loop's end follow from the gathered flags, alike on every rank. While any
rank steps: every ARRIVAL_CHECK_STEPS iterations while requests may still come (the exchange syncs the host with the
devices), else every scheduler.stop_check_steps; when all are idle, every iteration; with one rank, every iteration
(free). The loop ends once no rank is busy and nothing more will come (or a stop has drained it).

The agreeing group is the TP group, whose ranks step alike (an idle rank knows its peers are idle, so it exchanges
and may end at once), or, for a server over data-parallel replicas, the world group (`group`): the replicas step apart,
an idle rank passes the iterations to the next exchange and waits there for the busy ones (a source spanning replicas
takes requests until stopped: `more` stays True). Between exchanges each rank steps or idles once per iteration, so EP
over DP replicas keeps its lockstep.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Sequence as Seq

import torch

from tp_lora import distributed as comm
from tp_lora.engine.choices import Choices
from tp_lora.engine.core import EngineCore
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.stats import StepOutput

RUN, DRAIN, ABORT = 0, 1, 2  # stop levels: keep going / admit nothing more, finish in-flight / drop in-flight too
ARRIVAL_CHECK_STEPS = 4
INTERRUPTED = "not run: the run was stopped before this request finished (resume=true runs it)"

# What a source hands the loop, applied alike on every rank:
#   ("add", request, arrival perf_counter time, front end's tag)   ("cancel", request index)
#   ("load", tag, name, path)   ("unload", tag, name)
Op = tuple


class Source(Protocol):
    """A front end's requests, on every rank of the TP group."""

    more: bool  # requests may still come
    lost: bool  # the front end is gone: stop now (ABORT)

    def take(self, wait: bool) -> object:
        """This rank's view of what came since the last take (wait: nothing to step, it may block briefly)."""

    def merge(self, views: list) -> list[Op]:
        """The ops every rank applies, from every rank's view (the same on every rank)."""

    def close(self) -> list[Request]:
        """No more requests will be taken (a stop): those that came but were never handed over."""

    def wait_s(self) -> float:
        """How long an idle loop may sleep before the next request can come."""


class Sink(Protocol):
    """Where a front end's results go (the ranks that report; the others may ignore them)."""

    def accepted(self, req: Request, tag) -> None: ...

    def ended(self, res: Result) -> None:
        """The request finished or failed (refused, adapter unusable)."""

    def stepped(self, out: StepOutput) -> None: ...

    def cancelled(self, index: int) -> None: ...

    def replied(self, tag, error: Optional[str]) -> None: ...

    def stopped(self, requests: list[Request], level: int) -> None:
        """The stop level rose to `level`: these requests will not finish."""

    def flush(self) -> None:
        """End of an iteration."""


def control_loop(engine: EngineCore, source: Source, sink: Sink, stop: Callable[[], int], context: int,
                 group: Optional[comm.Group] = None) -> None:
    """Run the open run until the source has no more requests and the engine no work, or a stop has drained it:
    requests in flight finish within scheduler.stop_grace_s, then the rest are dropped. context: the longest
    request (prompt + max_new_tokens) the run holds. group: the ranks that agree (default the TP group; a group
    spanning several replicas agrees its exchanges and its end, see the module's doc)."""
    sc = engine.cfg.scheduler
    group = group or engine.ps.tp
    alike = group.size == engine.ps.tp.size  # one TP group: its ranks step alike, so each knows the others are idle
    level, deadline, it, due, quiet = RUN, None, 0, 0, False
    unloads: dict[str, list] = {}  # adapter being unloaded -> the tags of the unload calls waiting for its requests
    while True:
        busy = engine.busy
        if it >= due or (alike and not busy):
            local = ABORT if source.lost or (deadline is not None and time.perf_counter() >= deadline) else stop()
            view = source.take(wait=not busy)
            if group.size == 1:
                gathered = [(max(local, level), view, busy)]
            else:
                gathered = comm.all_gather_object((max(local, level), view, busy), group)
            agreed, views = max(v[0] for v in gathered), [v[1] for v in gathered]
            ops = source.merge(views)
            if agreed > level:
                if level < DRAIN <= agreed:
                    deadline = time.perf_counter() + sc.stop_grace_s
                    sink.stopped(engine.stop_admitting() + source.close(), DRAIN)
                if agreed >= ABORT:
                    sink.stopped(engine.abort(), ABORT)
                level = agreed
            _apply(engine, ops, sink, level, context, unloads)
            quiet = not any(v[2] for v in gathered)  # every rank idle (past a drain, ops make none busy)
            # Exchanges sync the host with the devices: while any rank steps, every few steps (sooner while requests
            # may still come); each iteration when all are idle, or with one rank (free).
            due = it + (1 if quiet or group.size == 1 else
                        min(ARRIVAL_CHECK_STEPS, sc.stop_check_steps) if source.more else sc.stop_check_steps)
        it += 1
        if engine.busy:
            sink.stepped(engine.step())
        elif (quiet or alike) and (level >= DRAIN or not source.more):
            _unloaded(engine, unloads, sink)
            sink.flush()
            return
        else:
            engine.idle(source.wait_s())
        _unloaded(engine, unloads, sink)
        sink.flush()


def _unloaded(engine: EngineCore, unloads: dict[str, list], sink: Sink) -> None:
    """Forget the adapters being unloaded whose last request ended, and answer the calls that waited for them."""
    for name in engine.finish_unloads():
        for tag in unloads.pop(name, ()):
            sink.replied(tag, None)


def _apply(engine: EngineCore, ops: list[Op], sink: Sink, level: int, context: int,
           unloads: dict[str, list]) -> None:
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, req, arrival, tag = op
            if level >= DRAIN:
                sink.stopped([req], level)
            elif err := engine.check_request(req, context):
                sink.ended(Result(req, error=err))
            else:
                engine.add(req, arrival)
                sink.accepted(req, tag)
        elif kind == "cancel":
            if engine.cancel(op[1]) is not None:
                sink.cancelled(op[1])
        elif kind == "load":
            sink.replied(op[1], engine.load_adapter(*op[2:]))
        elif kind == "unload":  # answered now, or once the adapter's last running or queued request ends
            _, tag, name = op
            err = engine.unload_adapter(name)
            if err is None and name in engine.unloading:
                unloads.setdefault(name, []).append(tag)
            else:
                sink.replied(tag, err)
        else:
            raise ValueError(f"unknown control op {kind!r}")


class ListSource:
    """Requests known up front, each arriving `at` seconds after t0 (0: at once). The ranks agree on the arrivals
    by the slowest clock."""

    lost = False

    def __init__(self, pending: list[tuple[float, Request]], t0: float):
        self.pending, self.t0, self.fed = pending, t0, 0  # pending sorted by arrival; pending[:fed] handed over
        self.timed = any(at > 0 for at, _ in pending)

    @property
    def more(self) -> bool:
        return self.fed < len(self.pending)

    def take(self, wait: bool) -> int:
        if not self.timed:
            return len(self.pending)
        now, due = time.perf_counter(), self.fed
        while due < len(self.pending) and self.t0 + self.pending[due][0] <= now:
            due += 1
        return due

    def merge(self, views: list) -> list[Op]:
        due = min(views)
        ops = [("add", req, self.t0 + at, None) for at, req in self.pending[self.fed:due]]
        self.fed = max(self.fed, due)
        return ops

    def close(self) -> list[Request]:
        out = [r for _, r in self.pending[self.fed:]]
        self.fed = len(self.pending)
        return out

    def wait_s(self) -> float:
        return self.t0 + self.pending[self.fed][0] - time.perf_counter() if self.more else 0.0


class ListSink:
    """Results of a list of requests by request index; `interrupted` holds those a stop left unfinished."""

    def __init__(self, on_result: Callable[[Result], None], progress: Callable[[int, int], None], total: int):
        self.results: dict[int, Result] = {}
        self.interrupted: list[Request] = []
        self.on_result, self.progress, self.total = on_result, progress, total

    def ended(self, res: Result) -> None:
        res.metrics.setdefault("finished", time.perf_counter())
        self.results[res.request.index] = res
        self.on_result(res)
        self.progress(len(self.results), self.total)

    def stepped(self, out: StepOutput) -> None:
        for res in out.finished:
            self.ended(res)

    def stopped(self, requests: list[Request], level: int) -> None:
        self.interrupted += requests

    def accepted(self, req: Request, tag) -> None:
        pass

    def cancelled(self, index: int) -> None:
        pass

    def replied(self, tag, error: Optional[str]) -> None:
        pass

    def flush(self) -> None:
        pass


@torch.no_grad()
def generate(engine: EngineCore, requests: list[Request], on_result: Callable[[Result], None] = lambda r: None,
             progress: Callable[[int, int], None] = lambda done, total: None, *,
             arrival_times: Optional[Seq[float]] = None, stop: Optional[Callable[[], int]] = None) -> list[Result]:
    """Continuous batching over `requests` (see tp_lora.engine.scheduler for the policy). Results come back in
    request order; on_result gets each one as it completes (finished or failed). A request of several sequences
    (n / best_of) runs as that many and comes back as one Result with `choices` (tp_lora.engine.choices).

    arrival_times: seconds after the call at which each request arrives; it is not admitted before (serving
    benchmarks). stop: polled, returns RUN, DRAIN (admit nothing more, finish what runs, within
    scheduler.stop_grace_s) or ABORT (drop what runs); requests a stop leaves unfinished come back with
    `interrupted` set and are not passed to on_result.
    """
    t0 = time.perf_counter()
    if arrival_times is not None and len(arrival_times) != len(requests):
        raise ValueError(f"arrival_times has {len(arrival_times)} entries for {len(requests)} requests")
    choices = Choices(requests)  # n / best_of: siblings beside their first request, folded back as they end

    def report(result: Result) -> None:
        folded = choices.fold(result)
        if folded is not None:
            on_result(folded)
    sink = ListSink(report, progress, len(choices.expanded))
    max_len = engine.cfg.model.max_seq_len or engine.max_positions
    valid = []
    for req in choices.expanded:
        err = engine.check_request(req, max_len)
        if err:
            sink.ended(Result(req, error=err))
        else:
            valid.append(req)
    blocks, fit = engine.plan_kv([len(r.prompt_token_ids) + r.max_new_tokens for r in valid]) if valid else (0, 0)
    arrival = {r.index: float(t) for r, t in zip(requests, arrival_times)} if arrival_times is not None else {}
    arrival.update({i: arrival[f] for i, f in choices.first.items() if f in arrival})
    pending = []  # (arrival, request) not yet handed to the scheduler
    for req in valid:
        need = len(req.prompt_token_ids) + req.max_new_tokens
        if need > fit:
            sink.ended(Result(req, error=engine.misfit(need, fit)))
        else:
            pending.append((arrival.get(req.index, 0.0), req))
    pending.sort(key=lambda x: x[0])  # stable: equal times keep request order
    if pending:
        context = max(len(r.prompt_token_ids) + r.max_new_tokens for _, r in pending)
        engine.open(blocks, context)
        try:
            control_loop(engine, ListSource(pending, t0), sink, stop or (lambda: RUN), context)
        finally:  # after an error too: the slots this run held are free for the next call
            engine.close_run()
    # EP over DP replicas: every rank of the EP group steps until all are idle (a rank out of work still serves the
    # others' tokens routed to its experts).
    while engine.lockstep is not None and engine.lockstep(0):
        pass
    engine.stats.seconds += time.perf_counter() - t0
    engine.stats.interrupted += len(sink.interrupted)
    return choices.collect([sink.results.get(r.index) or Result(r, error=INTERRUPTED, interrupted=True)
                            for r in choices.expanded])
