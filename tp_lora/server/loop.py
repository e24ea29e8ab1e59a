"""The server's engine loop, on every rank of the TP group: between steps the ranks agree on one control message
(new requests, cancellations, adapter loads and unloads from the HTTP front end, and the stop level from signals),
then every rank applies it and steps alike. Rank 0 holds the channel to the front-end process
(tp_lora.server.channel): it reads the front end's ops without waiting and sends one frame per step with every
sequence's new token ids (no text: the front end detokenizes).

The control exchange is one all_gather_object over the TP group: each idle iteration (rank 0 waits up to IDLE_WAIT_S
for work first, so an idle server exchanges ~100 times a second) and every ARRIVAL_CHECK_STEPS steps while busy (the
exchange syncs the host with the devices). With one rank nothing is exchanged.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from tp_lora import distributed as comm
from tp_lora.engine.engine import ABORT, ARRIVAL_CHECK_STEPS, DRAIN, RUN, Engine
from tp_lora.engine.requests import Result
from tp_lora.server.channel import SHUTTING_DOWN, STEP_FIELDS, EngineEnd

IDLE_WAIT_S = 0.01


class ServingLoop:
    def __init__(self, engine: Engine, tp: comm.Group):
        self.engine, self.tp = engine, tp
        self.driver = tp.rank == 0
        self.context = engine.open_for_serving()  # prompt + max_new_tokens bound (a collective: every rank)
        engine.decode_outputs = False  # results carry token ids; the front end makes the text
        self.level = RUN
        self.link: Optional[EngineEnd] = None  # rank 0: the channel to the front end (set before run)
        self.frontend_lost = False  # rank 0: the front end went away while serving
        self._streams: dict[int, int] = {}  # rank 0: streamed request index -> tokens sent so far
        self._msg: dict = {}  # rank 0: this step's frame to the front end, being built
        self._gauges = None
        self._steps = -1  # rank 0: the step count the front end was last sent stats of
        self._registry = None

    def adapter_registry(self) -> dict[str, str]:
        """The usable adapters' names and directories (the front end's /v1/models and model check)."""
        return {name: info.path for name, info in self.engine.adapters.items()}

    # ---- every rank: the loop ---------------------------------------------------------------------------------
    def run(self, stop: Callable[[], int], stop_grace_s: float) -> None:
        """Serve until a stop signal (agreed by the ranks) has drained the run: requests in flight finish within
        stop_grace_s, then the rest end with an error. Rank 0 also stops (ABORT) when the front end goes away."""
        engine = self.engine
        it, deadline = 0, None
        if self.driver:
            self._registry = (len(engine.adapters), len(engine.bad_adapters))
        while True:
            busy = engine.busy
            if not busy or it % ARRIVAL_CHECK_STEPS == 0 or self.tp.size == 1:
                local = stop()
                if deadline is not None and time.perf_counter() >= deadline:
                    local = ABORT
                msgs = self._take(wait=not busy) if self.driver else None
                if self.driver and self.link.closed:
                    self.frontend_lost = True
                    local = ABORT
                level, msgs = self._exchange(local, msgs)
                if level > self.level:
                    self._raise_level(level)
                    if deadline is None:
                        deadline = time.perf_counter() + stop_grace_s
                self._apply(msgs)
            it += 1
            if engine.busy:
                out = engine.step()
                if self.driver:
                    self._send(out.advanced, out.finished)
            if self.driver:
                self._flush()
            if not engine.busy and self.level >= DRAIN:
                break

    def _take(self, wait: bool) -> list:
        return [op for frame in self.link.receive(IDLE_WAIT_S if wait else 0.0) for op in frame]

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
            self._put("draining", True)
        if level >= ABORT:
            for seq in sched.abort():
                self._end(Result(seq.request, error=SHUTTING_DOWN + " (scheduler.stop_grace_s passed)"))
        self.level = level

    def _apply(self, msgs: list) -> None:
        engine = self.engine
        for msg in msgs:
            op = msg[0]
            if op == "add":
                _, req, arrival, stream = msg
                err = SHUTTING_DOWN if self.level >= DRAIN else engine.check_request(req, self.context)
                if err:
                    self._end(Result(req, error=err))
                else:
                    engine.add(req, arrival)
                    if stream and self.driver:
                        self._streams[req.index] = 0
            elif op == "cancel":
                if engine.cancel(msg[1]) is not None and self.driver:
                    self._streams.pop(msg[1], None)
                    self._msg.setdefault("cancelled", []).append(msg[1])
            elif op in ("load", "unload"):
                err = engine.load_adapter(*msg[2:]) if op == "load" else engine.unload_adapter(*msg[2:])
                if self.driver:
                    self._msg.setdefault("replies", []).append((msg[1], err))
                    self._registry = None  # sent again at the flush

    # ---- rank 0: the step's frame to the front end ---------------------------------------------------------------
    def _put(self, key: str, value) -> None:
        if self.driver:
            self._msg[key] = value

    def _send(self, advanced: list[Result], finished: list[Result]) -> None:
        ended = {id(r) for r in finished}
        deltas = []
        for res in advanced:
            index = res.request.index
            n = self._streams.get(index)
            if n is not None and id(res) not in ended:  # an ending stream gets its last tokens with its result
                self._streams[index] = len(res.output_token_ids)
                deltas.append((index, res.output_token_ids[n:], res.logprobs[n:], res.top_logprobs[n:]))
        if deltas:
            self._msg.setdefault("deltas", []).extend(deltas)
        for res in finished:
            self._end(res)

    def _end(self, res: Result) -> None:
        """The request ended (finished or failed): its result, with the tokens its stream has not had yet."""
        if not self.driver:
            return
        n = self._streams.pop(res.request.index, 0)
        self._msg.setdefault("ends", []).append((res.request.index, res.output_token_ids[n:], res.logprobs[n:],
                                                 res.top_logprobs[n:], res.finish_reason, res.error, res.text,
                                                 res.metrics))

    def _flush(self) -> None:
        """Send the frame built since the last one, with the engine's gauges and adapter registry where they changed
        and the step stats when a frame goes anyway (no frame for the stats alone)."""
        engine, sched, stats = self.engine, self.engine.sched, self.engine.stats
        gauges = (len(sched.waiting), len(sched.running), stats.slot_hit_rate, engine.cache.stats.host_misses,
                  stats.adapter_loads)
        if gauges != self._gauges:
            self._gauges = self._msg["gauges"] = gauges
        if self._msg and stats.steps != self._steps:  # with a frame that goes anyway
            self._steps = stats.steps
            self._msg["steps"] = tuple(getattr(stats, f) for f in STEP_FIELDS)
        registry = (len(engine.adapters), len(engine.bad_adapters))
        if registry != self._registry:  # a load, an unload, or an adapter that failed its read
            self._registry = registry
            self._msg["adapters"] = self.adapter_registry()
        if self._msg:
            self.link.send(self._msg)
            self._msg = {}
        else:
            self.link.flush()
