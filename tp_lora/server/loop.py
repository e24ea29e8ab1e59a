"""The server's source and sink for the shared control loop (tp_lora.engine.control), on every rank of the TP group.
Rank 0 holds the channel to the front-end process (tp_lora.server.channel): its source reads the front end's ops
without waiting (up to IDLE_WAIT_S when idle) and the control loop hands them to every rank; its sink sends one
frame per step with every sequence's new token ids (no text: the front end detokenizes).
"""
from __future__ import annotations

from typing import Callable, Optional

from tp_lora import distributed as comm
from tp_lora.engine.control import ABORT, Op, control_loop
from tp_lora.engine.core import EngineCore
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.stats import StepOutput
from tp_lora.server.channel import SHUTTING_DOWN, STEP_FIELDS, EngineEnd
from tp_lora.server.replicas import Forward, Outbox, ReplicaSource
from tp_lora.server.router import Router

IDLE_WAIT_S = 0.01


class ChannelSource:
    """The front end's ops: read by rank 0 from the channel, handed to every rank by the control loop."""

    more = True  # a server takes requests until it stops

    def __init__(self, link: Optional[EngineEnd]):
        self.link = link  # rank 0's; None on the other ranks
        self.went_away = False  # rank 0: the loop saw the front end gone

    @property
    def lost(self) -> bool:
        """Rank 0: the front end went away."""
        self.went_away |= self.link is not None and self.link.closed
        return self.went_away

    def take(self, wait: bool) -> Optional[list]:
        if self.link is None:
            return None
        return [op for frame in self.link.receive(IDLE_WAIT_S if wait else 0.0) for op in frame]

    def merge(self, views: list) -> list[Op]:
        return views[0] or []

    def close(self) -> list[Request]:
        return []

    def wait_s(self) -> float:
        return 0.0  # take() waited on the channel already


class FrameSink:
    """A replica's leader: the step's frame to `link` (rank 0's channel to the front end, or with several replicas
    what carries it there: tp_lora.server.replicas); ranks without a link build nothing."""

    def __init__(self, engine: EngineCore, link, registry: Callable[[], dict[str, str]]):
        self.engine, self.link, self.registry = engine, link, registry
        self._streams: dict[int, int] = {}  # streamed request index -> tokens sent so far
        self._msg: dict = {}  # this step's frame, being built
        self._gauges = None
        self._steps = -1  # the step count the front end was last sent stats of
        self._adapters = (len(engine.adapters), len(engine.bad_adapters))  # sent at start by the launcher
        self._loads = None  # the adapter-load counts residency was last sent at

    def accepted(self, req: Request, stream: bool) -> None:
        if stream and self.link is not None:
            self._streams[req.index] = 0

    def ended(self, res: Result) -> None:
        """The request ended (finished or failed): its result, with the tokens its stream has not had yet."""
        if self.link is None:
            return
        n = self._streams.pop(res.request.index, 0)
        self._msg.setdefault("ends", []).append((res.request.index, res.output_token_ids[n:], res.logprobs[n:],
                                                 res.top_logprobs[n:], res.finish_reason, res.error, res.text,
                                                 res.metrics))

    def stepped(self, out: StepOutput) -> None:
        if self.link is None:
            return
        ended = {id(r) for r in out.finished}
        deltas = []
        for res in out.advanced:
            index = res.request.index
            n = self._streams.get(index)
            if n is not None and id(res) not in ended:  # an ending stream gets its last tokens with its result
                self._streams[index] = len(res.output_token_ids)
                deltas.append((index, res.output_token_ids[n:], res.logprobs[n:], res.top_logprobs[n:]))
        if deltas:
            self._msg.setdefault("deltas", []).extend(deltas)
        for res in out.finished:
            self.ended(res)

    def cancelled(self, index: int) -> None:
        if self.link is not None:
            self._streams.pop(index, None)
            self._msg.setdefault("cancelled", []).append(index)

    def replied(self, tag, error: Optional[str]) -> None:
        if self.link is not None:
            self._msg.setdefault("replies", []).append((tag, error))

    def stopped(self, requests: list[Request], level: int) -> None:
        why = SHUTTING_DOWN + (" (scheduler.stop_grace_s passed)" if level >= ABORT else "")
        for req in requests:
            self.ended(Result(req, error=why))
        if self.link is not None:
            self._msg["draining"] = True

    def flush(self) -> None:
        """Send the frame built since the last one, with the engine's gauges and adapter registry where they changed
        and the step stats when a frame goes anyway (no frame for the stats alone)."""
        if self.link is None:
            return
        engine, stats = self.engine, self.engine.stats
        gauges = tuple(engine.gauges())
        if gauges != self._gauges:
            self._gauges = self._msg["gauges"] = gauges
        if self._msg and stats.steps != self._steps:  # with a frame that goes anyway
            self._steps = stats.steps
            self._msg["steps"] = tuple(getattr(stats, f) for f in STEP_FIELDS)
        reg = engine.registry
        loads = (stats.adapter_loads, reg.cache.stats.host_misses, len(engine.adapters))
        if loads != self._loads:  # residency changes only with a slot load, a host read or an unload
            self._loads = loads
            self._msg["residency"] = (tuple(reg.state.names), tuple(reg.cache.host))
        adapters = (len(engine.adapters), len(engine.bad_adapters))
        if adapters != self._adapters or "replies" in self._msg:  # a load, an unload, or a failed read
            self._adapters = adapters
            self._msg["adapters"] = self.registry()
        if self._msg:
            self.link.send(self._msg)
            self._msg = {}
        else:
            self.link.flush()


class ServingLoop:
    """The engine side of the server on one rank: a run open for serving, stepped by the control loop (over the TP
    group, or the world group when there are several replicas: tp_lora.server.replicas)."""

    def __init__(self, engine: EngineCore, ps: comm.ParallelState, routing: str = "affinity", max_imbalance: int = 0):
        self.engine, self.ps = engine, ps
        self.routing, self.max_imbalance = routing, max_imbalance
        self.context = engine.open_for_serving()  # prompt + max_new_tokens bound (a collective: every rank)
        engine.sampler.decode_outputs = False  # results carry token ids; the front end makes the text
        self.link: Optional[EngineEnd] = None  # rank 0: the channel to the front end (set before run)
        self.frontend_lost = False  # rank 0: the front end went away while serving

    def adapter_registry(self) -> dict[str, str]:
        """The usable adapters' names and directories (the front end's /v1/models and model check)."""
        return {name: info.path for name, info in self.engine.adapters.items()}

    def run(self, stop: Callable[[], int]) -> None:
        """Serve until a stop signal (agreed by the ranks) has drained the run: requests in flight finish within
        scheduler.stop_grace_s, then the rest end with an error. Rank 0 also stops (ABORT) when the front end goes
        away."""
        ps, channel = self.ps, ChannelSource(self.link)
        if ps.dp.size == 1:
            source, group, out = channel, ps.tp, self.link
        else:
            leader, forward, outbox = ps.tp.rank == 0, None, None
            if self.link is not None:
                batch = self.engine.cfg.scheduler.max_batch_size
                forward = out = Forward(self.link, Router(ps.dp.size, self.routing, batch, self.max_imbalance))
            elif leader:
                outbox = out = Outbox()
            else:
                out = None
            source = ReplicaSource(self.engine, ps.dp.rank, ps.tp.size, leader,
                                   channel if self.link is not None else None, forward, outbox)
            group = ps.world
        control_loop(self.engine, source, FrameSink(self.engine, out, self.adapter_registry), stop, self.context,
                     group)
        self.frontend_lost = channel.went_away
