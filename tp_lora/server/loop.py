"""The server's engine loop, on every rank of the TP group: between steps the ranks agree on one control message
(new requests, cancellations, adapter loads and unloads from rank 0's HTTP front end, and the stop level from
signals), then every rank applies it and steps alike. Rank 0 hands each request's tokens and result back to the
front end through the callback it submitted with.

The control exchange is one all_gather_object over the TP group: each idle iteration (rank 0 waits up to IDLE_WAIT_S
for work first, so an idle server exchanges ~100 times a second) and every ARRIVAL_CHECK_STEPS steps while busy (the
exchange syncs the host with the devices). With one rank nothing is exchanged.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from tp_lora import distributed as comm
from tp_lora.engine.engine import ABORT, ARRIVAL_CHECK_STEPS, DRAIN, RUN, Engine
from tp_lora.engine.requests import Request, Result

IDLE_WAIT_S = 0.01
SHUTTING_DOWN = "the server is shutting down"


@dataclass
class Delta:
    """What a request's front end gets after a step: its new tokens, and its result once it ended."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    final: Optional[Result] = None


class ServingLoop:
    def __init__(self, engine: Engine, tp: comm.Group, on_step: Callable[["ServingLoop"], None] = lambda s: None):
        self.engine, self.tp = engine, tp
        self.driver = tp.rank == 0
        self.context = engine.open_for_serving()  # prompt + max_new_tokens bound (a collective: every rank)
        self.level = RUN
        self.on_step = on_step  # rank 0, after each control round (metrics)
        # rank 0: what the HTTP thread sent, and where each request's deltas go
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._deliver: dict[int, tuple[Callable[[Delta], None], bool]] = {}  # index -> (callback, wants deltas)
        self._sent: dict[int, int] = {}  # index -> tokens delivered
        self._replies: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.in_flight = 0  # rank 0: submitted requests not yet ended
        self.cancelled = 0  # requests dropped from the engine because their client went away

    # ---- rank 0's front end (any thread) ------------------------------------------------------------------------
    def submit(self, req: Request, deliver: Callable[[Delta], None], stream: bool) -> None:
        with self._lock:
            self._deliver[req.index] = (deliver, stream)
            self.in_flight += 1
        self._inbox.put(("add", req, time.perf_counter()))

    def cancel(self, index: int) -> None:
        self._inbox.put(("cancel", index))

    def call(self, op: str, *args) -> Future:
        """load / unload an adapter on every rank; the Future resolves to None or the error."""
        fut: Future = Future()
        mid = next(self._ids)
        self._replies[mid] = fut
        self._inbox.put((op, mid) + args)
        return fut

    # ---- every rank: the loop ---------------------------------------------------------------------------------
    def run(self, stop: Callable[[], int], stop_grace_s: float) -> None:
        """Serve until a stop signal (agreed by the ranks) has drained the run: requests in flight finish within
        stop_grace_s, then the rest end with an error."""
        engine = self.engine
        it, deadline = 0, None
        try:
            while True:
                busy = engine.sched.has_work
                if not busy or it % ARRIVAL_CHECK_STEPS == 0 or self.tp.size == 1:
                    local = stop()
                    if deadline is not None and time.perf_counter() >= deadline:
                        local = ABORT
                    level, msgs = self._exchange(local, self._take(wait=not busy) if self.driver else None)
                    if level > self.level:
                        self._raise_level(level)
                        if deadline is None:
                            deadline = time.perf_counter() + stop_grace_s
                    self._apply(msgs)
                    if self.driver:
                        self.on_step(self)
                it += 1
                if not engine.sched.has_work:
                    if self.level >= DRAIN:
                        break
                    continue
                out = engine.step()
                if self.driver:
                    self._send(out.advanced, out.finished)
        finally:
            if self.driver:  # every request still open ends, with an error (e.g. the ranks were lost)
                self.level = max(self.level, ABORT)
                for index in list(self._deliver):
                    self._end(Result(Request(index, id=index), error=SHUTTING_DOWN))
                while True:
                    try:
                        self._reject(self._inbox.get_nowait())
                    except queue.Empty:
                        break

    def _take(self, wait: bool) -> list:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=IDLE_WAIT_S) if wait else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _exchange(self, level: int, msgs: Optional[list]) -> tuple[int, list]:
        if self.tp.size == 1:
            return max(level, self.level), msgs
        views = comm.all_gather_object((max(level, self.level), msgs), self.tp)
        return max(v[0] for v in views), views[0][1]

    def _raise_level(self, level: int) -> None:
        sched = self.engine.sched
        if self.level < DRAIN <= level:
            for req in sched.stop_admitting():
                self._end(Result(req, error=SHUTTING_DOWN))
        if level >= ABORT:
            for seq in sched.abort():
                self._end(Result(seq.request, error=SHUTTING_DOWN + f" (scheduler.stop_grace_s passed)"))
        self.level = level

    def _apply(self, msgs: list) -> None:
        engine = self.engine
        for msg in msgs:
            op = msg[0]
            if op == "add":
                _, req, arrival = msg
                err = SHUTTING_DOWN if self.level >= DRAIN else engine.check_request(req, self.context)
                if err:
                    self._end(Result(req, error=err))
                else:
                    engine.add(req, arrival)
            elif op == "cancel":
                if engine.cancel(msg[1]) is not None:
                    self.cancelled += 1
                    self._end(None, msg[1])
            elif op in ("load", "unload"):
                err = engine.load_adapter(*msg[2:]) if op == "load" else engine.unload_adapter(*msg[2:])
                if self.driver:
                    self._replies.pop(msg[1]).set_result(err)

    def _reject(self, msg) -> None:
        if msg[0] == "add":
            self._end(Result(msg[1], error=SHUTTING_DOWN))
        elif msg[0] in ("load", "unload"):
            self._replies.pop(msg[1]).set_result(SHUTTING_DOWN)

    # ---- rank 0: results back to the front end -------------------------------------------------------------------
    def _send(self, advanced: list[Result], finished: list[Result]) -> None:
        ended = {id(r) for r in finished}
        for res in advanced:
            index = res.request.index
            deliver, stream = self._deliver.get(index, (None, False))
            if stream and id(res) not in ended:  # an ending stream gets its last tokens with its result
                n = self._sent.get(index, 0)
                self._sent[index] = len(res.output_token_ids)
                deliver(Delta(res.output_token_ids[n:], res.logprobs[n:], res.top_logprobs[n:]))
        for res in finished:
            self._end(res)

    def _end(self, res: Optional[Result], index: Optional[int] = None) -> None:
        """Request ended: deliver its result (None: cancelled, nothing to deliver), with the tokens its stream has
        not had yet, and forget it."""
        if not self.driver:
            return
        index = res.request.index if res is not None else index
        with self._lock:
            entry = self._deliver.pop(index, None)
            if entry is not None:
                self.in_flight -= 1
        n = self._sent.pop(index, 0)
        if entry is not None and res is not None:
            entry[0](Delta(res.output_token_ids[n:], res.logprobs[n:], res.top_logprobs[n:], final=res))
