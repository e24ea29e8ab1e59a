"""The server over data-parallel replicas (each a TP group; EP over DP replicas too): one front end on global rank 0,
the control loop's agreement over the world group (tp_lora.engine.control). What travels in that exchange:

    global rank 0        ("ops", the front end's ops, each add tagged with the replica the router chose)
    a replica's leader   (its frames since the last exchange, its adapter residency when it changed)   [tp rank 0]
    other ranks          None

Every rank applies the loads, unloads and cancellations and the adds routed to its replica. Rank 0 forwards the
other replicas' frames to the front end tagged with their replica, answers a load or unload once every replica has
(the first error, if any), and feeds the router (tp_lora.server.router) each replica's residency and the requests
that ended.
"""
from __future__ import annotations

from typing import Optional

from tp_lora.engine.control import Op
from tp_lora.engine.core import EngineCore
from tp_lora.engine.requests import Request
from tp_lora.server.channel import EngineEnd
from tp_lora.server.router import Router


class Outbox:
    """A replica leader's frames (rank 0's FrameSink interface: send / flush), handed over at the next exchange."""

    def __init__(self):
        self.frames: list[dict] = []

    def send(self, msg: dict) -> None:
        self.frames.append(msg)

    def flush(self) -> None:
        pass

    def take(self) -> list[dict]:
        out, self.frames = self.frames, []
        return out


class Forward:
    """Rank 0: every replica's frames to the front end, tagged with their replica; replies to loads and unloads held
    until every replica has answered; ended requests told to the router."""

    def __init__(self, link: EngineEnd, router: Router):
        self.link, self.router = link, router
        self.replies: dict[object, list] = {}  # call id -> the replicas' errors so far

    def send(self, msg: dict, replica: int = 0) -> None:
        for end in msg.get("ends", ()):
            self.router.ended(end[0])
        for index in msg.get("cancelled", ()):
            self.router.ended(index)
        ready = []
        for tag, error in msg.pop("replies", ()):
            got = self.replies.setdefault(tag, [])
            got.append(error)
            if len(got) == self.router.replicas:
                del self.replies[tag]
                ready.append((tag, next((e for e in got if e is not None), None)))
        if ready:
            msg["replies"] = ready
        msg["replica"] = replica
        self.link.send(msg)

    def flush(self) -> None:
        self.link.flush()


class ReplicaSource:
    """The control loop's source on every rank of a server over several replicas."""

    more = True  # a server takes requests until it stops

    def __init__(self, engine: EngineCore, replica: int, tp_size: int, leader: bool,
                 channel, forward: Optional[Forward], outbox: Optional[Outbox]):
        self.engine, self.replica, self.tp_size, self.leader = engine, replica, tp_size, leader
        # rank 0's ChannelSource and Forward, the other leaders' Outbox
        self.channel, self.forward, self.outbox = channel, forward, outbox
        self._residency = None  # what this leader last reported

    @property
    def lost(self) -> bool:
        return self.channel is not None and self.channel.lost

    def residency(self) -> Optional[tuple]:
        """This replica's adapter residency when it changed since the last report, else None."""
        reg = self.engine.registry
        now = (tuple(reg.state.names), tuple(reg.cache.host))
        if now == self._residency:
            return None
        self._residency = now
        return now

    def take(self, wait: bool):
        if self.channel is not None:
            return "ops", self._route(self.channel.take(wait))
        if self.leader:
            return self.outbox.take(), self.residency(), self.engine.gauges().waiting
        return None

    def _route(self, ops: list) -> list[Op]:
        """Rank 0: each add tagged with its replica."""
        router, out = self.forward.router, []
        now = self.residency()
        if now is not None:
            router.report(0, *now)
        router.report_waiting(0, self.engine.gauges().waiting)
        for op in ops:
            if op[0] == "add":
                op = op + (router.route(op[1].index, op[1].adapter),)
            out.append(op)
        return out

    def merge(self, views: list) -> list[Op]:
        mine = []
        for op in views[0][1]:
            if op[0] == "add":
                if op[4] != self.replica:
                    continue
                op = op[:4]
            mine.append(op)
        if self.forward is not None:
            for d in range(1, self.forward.router.replicas):
                frames, residency, waiting = views[d * self.tp_size]
                if residency is not None:
                    self.forward.router.report(d, *residency)
                self.forward.router.report_waiting(d, waiting)
                for msg in frames:
                    self.forward.send(msg, d)
        return mine

    def close(self) -> list[Request]:
        return []

    def wait_s(self) -> float:
        return 0.0  # rank 0's take() waited on the channel; the others wait in the exchange
