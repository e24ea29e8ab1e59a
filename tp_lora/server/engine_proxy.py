"""The HTTP front end's proxy of rank 0's engine loop, in the front-end process: requests and adapter calls go out
over the channel (tp_lora.server.channel) batched per event-loop turn; each step's frame comes back and is dispatched
to the requests' sinks, and the engine's gauges, stop state and adapter registry are kept here for the routes."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from tp_lora.engine.requests import Request, Result
from tp_lora.server.channel import SHUTTING_DOWN, STOP, encode, read_frame
from tp_lora.server.metrics import Metrics

# The longest an unload call waits for the adapter's running and queued requests to end (new ones are refused
# meanwhile); past it the call answers that the unload is pending, and it completes when they end.
UNLOAD_WAIT_S = 30.0
UNLOAD_PENDING = "the unload is pending"


@dataclass
class Delta:
    """What a request's handler gets after a step: its new tokens, and its whole result once it ended."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    final: Optional[Result] = None


class _Open:
    """A request the engine holds: where its deltas go (None once its client left) and its tokens so far."""
    __slots__ = ("req", "sink", "ids", "lps", "tops")

    def __init__(self, req: Request, sink: Callable[[Delta], None]):
        self.req, self.sink = req, sink
        self.ids, self.lps, self.tops = [], [], []


class EngineProxy:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: int,
                 adapters: dict[str, str], metrics: Metrics):
        self.reader, self.writer = reader, writer
        self.context = context  # the longest prompt + max_tokens the engine holds
        self.adapters = adapters  # name -> directory: those a replica holds
        self._registries: dict[int, dict[str, str]] = {}  # replica -> its adapters as it last sent them
        self.metrics = metrics
        self.draining = False  # a stop signal came: nothing more is admitted
        self.linked = False  # rank 0 holds the ready frame: from then on a dead front end is a failure while serving
        self._open: dict[int, _Open] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._outbox: list = []
        self.closed = False

    @property
    def in_flight(self) -> int:
        """Requests handed to the engine and not ended yet."""
        return len(self._open)

    # ---- out: ops, one frame per event-loop turn ----------------------------------------------------------------
    def _post(self, op: tuple) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._write)
        self._outbox.append(op)

    def _write(self) -> None:
        if not self.closed:
            self.writer.write(encode(self._outbox))
        self._outbox = []

    def submit(self, req: Request, sink: Callable[[Delta], None], stream: bool) -> None:
        """Hand a request to the engine; sink gets its Deltas (per step for a stream, else one with the result)."""
        if self.closed:
            sink(Delta(final=Result(req, error=SHUTTING_DOWN)))
            return
        self._open[req.index] = _Open(req, sink)
        self._post(("add", req, time.perf_counter(), stream))

    def cancel(self, index: int) -> None:
        """The client went away: drop the request from the engine (it stays in flight until the engine confirms)."""
        entry = self._open.get(index)
        if entry is not None and entry.sink is not None:
            entry.sink = None
            self._post(("cancel", index))

    async def call(self, op: str, *args) -> Optional[str]:
        """load / unload an adapter on every rank: None, or the error. An unload answers once the adapter's last
        running or queued request ended, or after UNLOAD_WAIT_S with an error ending in UNLOAD_PENDING."""
        if self.closed:
            return SHUTTING_DOWN
        mid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[mid] = fut
        self._post((op, mid) + args)
        if op != "unload":
            return await fut
        try:
            return await asyncio.wait_for(fut, UNLOAD_WAIT_S)  # a later reply finds fut cancelled: dropped
        except asyncio.TimeoutError:
            return (f"adapter {args[0]!r} is still in use after {UNLOAD_WAIT_S:g} s: it takes no new requests and "
                    f"goes when they have ended; {UNLOAD_PENDING}")

    # ---- in: the engine's frames ---------------------------------------------------------------------------------
    async def run(self) -> bool:
        """Dispatch the engine's frames until it stops (True) or its process is gone (EOF: False); then every open
        request and call ends with SHUTTING_DOWN."""
        try:
            while True:
                frame = await read_frame(self.reader)
                if frame == STOP:
                    return True
                self._dispatch(frame)
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        finally:
            self.close()

    def _dispatch(self, frame: dict) -> None:
        if frame.get("draining"):
            self.draining = True
        for index, ids, lps, tops in frame.get("deltas", ()):
            entry = self._open.get(index)
            if entry is not None:
                entry.ids += ids
                entry.lps += lps
                entry.tops += tops
                if entry.sink is not None:
                    entry.sink(Delta(ids, lps, tops))
        for index, ids, lps, tops, finish, error, text, times in frame.get("ends", ()):
            entry = self._open.pop(index, None)
            if entry is None:
                continue
            res = Result(entry.req, entry.ids + ids, entry.lps + lps, finish, error, text, entry.tops + tops,
                         metrics=times)
            self.metrics.ended(res, "finished" if error is None else "error")
            if entry.sink is not None:
                entry.sink(Delta(ids, lps, tops, final=res))
        for index in frame.get("cancelled", ()):
            if self._open.pop(index, None) is not None:
                self.metrics.requests.labels("cancelled").inc()
        replica = frame.get("replica", 0)  # with data-parallel replicas, whose frame it is
        if "adapters" in frame:  # after the ends: an unloaded adapter's last requests were counted under its label
            self._registries[replica] = frame["adapters"]
            self.adapters = {n: p for reg in self._registries.values() for n, p in reg.items()}
            self.metrics.keep_adapters(self.adapters)  # gone once no replica holds it (nor runs its requests)
        for mid, err in frame.get("replies", ()):
            fut = self._calls.pop(mid, None)
            if fut is not None and not fut.done():  # done: its handler was cancelled (the client left)
                fut.set_result(err)
        if "gauges" in frame:
            self.metrics.set_gauges(replica, frame["gauges"])
        if "steps" in frame:
            self.metrics.set_steps(replica, frame["steps"])
        if "residency" in frame:
            self.metrics.set_residency(replica, *frame["residency"])

    def close(self) -> None:
        """The engine loop is over: what is open ends with SHUTTING_DOWN, and nothing more goes out."""
        self.closed = True
        self.draining = True
        for entry in self._open.values():
            res = Result(entry.req, error=SHUTTING_DOWN)
            self.metrics.ended(res, "error")
            if entry.sink is not None:
                entry.sink(Delta(final=res))
        self._open.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_result(SHUTTING_DOWN)
        self._calls.clear()
