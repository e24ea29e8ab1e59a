"""The local channel between rank 0's engine loop and the HTTP front-end process: a Unix socket pair carrying frames
(4-byte big-endian length + a pickle). Light (no torch): the front-end process imports it.

Front end -> engine, one frame per event-loop turn: a list of ops
    ("add", Request, arrival perf_counter time, stream?)   ("cancel", index)
    ("load", call id, name, path)                          ("unload", call id, name)
Engine -> front end, one frame per step (only the keys with news): a dict
    "deltas":    [(index, token ids, logprobs, top logprobs)]                 streams' new tokens
    "ends":      [(index, token ids, logprobs, top logprobs, finish_reason, error, text, metrics)]
                 requests that ended, with the tokens not sent before; text only where a stop string cut it
    "cancelled": [index]             dropped from the engine after the front end's cancel
    "replies":   [(call id, error or None)]
    "gauges":    tp_lora.engine.stats.Gauges as a tuple (queue, running, slots, adapter reads, KV blocks)
    "steps":     the engine's StepStats values named by STEP_FIELDS (totals since start), when they changed
    "residency": (slot names (None: free), host-memory names)    adapter residency, when loads changed it
    "draining":  True                 a stop signal came: admit nothing more
    "adapters":  {name: path}         the registry, when it changed
    "replica":   d                    with data-parallel replicas: the replica whose frame it is (its gauges,
                                      steps and residency; ends, deltas and replies are the front end's alike)
and at the end STOP: the engine loop is over; the front end fails what is still open and exits.

The engine end never blocks: its socket is non-blocking, unsent bytes wait in a buffer written between steps, and it
reads only what has arrived. The front end's end is asyncio streams (read_frame / encode).
"""
from __future__ import annotations

import pickle
import select
import socket
import struct
import time
from typing import Any

HEADER = struct.Struct("!I")
STOP = "stop"
SHUTTING_DOWN = "the server is shutting down"
READ_BYTES = 1 << 20
# The engine's StepStats fields the "steps" key carries (steps, and how many replayed graphs / captured one / were
# decode-only, with their wall seconds: where the step loop's time goes under the server; prompt tokens admitted and
# those found in the prefix cache).
STEP_FIELDS = ("steps", "graph_steps", "graph_captures", "decode_steps", "graph_seconds", "eager_seconds",
               "decode_seconds", "prompt_tokens", "prefix_hit_tokens")


def encode(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


async def read_frame(reader) -> Any:
    """The next frame from an asyncio StreamReader (IncompleteReadError at EOF)."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(n))


def read_frame_blocking(sock: socket.socket) -> Any:
    """The next frame from a blocking socket (EOFError when it closes first)."""
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise EOFError("the channel closed")
            buf += part
        return bytes(buf)
    (n,) = HEADER.unpack(exactly(HEADER.size))
    return pickle.loads(exactly(n))


class EngineEnd:
    """Rank 0's end of the channel: send() and receive() never wait on the front end (receive waits up to `wait`
    seconds for something to arrive). `closed` turns True when the front end is gone (EOF or a broken socket)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setblocking(False)
        self._out = bytearray()
        self._in = bytearray()
        self.closed = False

    def send(self, obj: Any) -> None:
        if not self.closed:
            self._out += encode(obj)
            self.flush()

    def flush(self) -> None:
        while self._out and not self.closed:
            try:
                n = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._lost()
                return
            del self._out[:n]

    def receive(self, wait: float = 0.0) -> list[Any]:
        """The frames that arrived, after waiting up to `wait` seconds for one (writing pending bytes meanwhile)."""
        if self.closed:
            return []
        if wait > 0 and not self._has_frame():
            try:
                writable = select.select([self.sock], [self.sock] if self._out else [], [], wait)[1]
            except InterruptedError:
                writable = []
            if writable:
                self.flush()
        else:
            self.flush()
        self._read()
        return self._frames()

    def drain_out(self, timeout: float) -> bool:
        """Write every pending byte, waiting up to `timeout` seconds; whether all went."""
        deadline = time.monotonic() + timeout
        while self._out and not self.closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [self.sock], [], left)
            self.flush()
        return not self._out

    def _read(self) -> None:
        while True:
            try:
                part = self.sock.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._lost()
                return
            if not part:
                self._lost()
                return
            self._in += part

    def _has_frame(self) -> bool:
        return len(self._in) >= HEADER.size and len(self._in) >= HEADER.size + HEADER.unpack_from(self._in)[0]

    def _frames(self) -> list[Any]:
        out, pos = [], 0
        view = memoryview(self._in)
        while len(self._in) - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(self._in, pos)
            if len(self._in) - pos - HEADER.size < n:
                break
            out.append(pickle.loads(view[pos + HEADER.size:pos + HEADER.size + n]))
            pos += HEADER.size + n
        view.release()
        del self._in[:pos]
        return out

    def _lost(self) -> None:
        self.closed = True
        self._out.clear()
