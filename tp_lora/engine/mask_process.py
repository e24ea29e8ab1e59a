"""The structured-output matchers in a process of their own: each step's grammar rows take their tokens and fill their
next bitmask there, under that process's interpreter lock. In a thread of the engine's process every xgrammar call
hands the lock to the thread that launches steps and waits to get it back, which slowed both (BENCHMARKS.md).

MaskProcess (the engine's side) starts the process (`python -m tp_lora.engine.mask_process`), sends it work over a
socket in order and reads one reply per job, fill or accept, by sequence number. Bitmask slots and the flag word
the device waits on (tp_lora.streamwait) live in one shared memory region: page-locked and mapped for the device on
CUDA, so the device's copy and its wait read what the process wrote. The process ends when its socket closes."""
from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Optional

import torch

from tp_lora.engine.ebnf import expand_repetitions
from tp_lora.engine.response_format import SEPARATORS, library, message
from tp_lora.streamwait import HostFlag, host_flag

HEADER = 16  # int32 words before the slots: word 0 is the flag the device waits on (a cache line of its own)
SLOTS = 4  # bitmask slots of the steps' jobs, taken in turn (a slot is read by the next step's draw); one more after
# them for fills in line
CACHE_SIZE = 256  # compiled grammars kept, by schema text
REPLY_TIMEOUT_S = 120.0  # the longest the engine waits for the process's answer (a fill of a large batch of
# costly grammar states takes milliseconds a row)
ROWS_PER_THREAD = 8  # rows of a fill per thread


def compile_schema(compiler, text: str):
    """A JSON schema (text) compiled by an xgrammar GrammarCompiler, compact, its bounded repetitions written out as
    rules (tp_lora.engine.ebnf: the same language, faster masks)."""
    grammar = library().Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    return compiler.compile_grammar(expand_repetitions(str(grammar)))


class ProcessLost(RuntimeError):
    """The matchers' process ended, or did not answer in REPLY_TIMEOUT_S."""


class MaskProcess:
    """The matchers' process and the shared region [HEADER + (SLOTS + 1) * max_rows * words] int32 of its bitmasks,
    for a tokenizer (xgrammar TokenizerInfo as JSON) whose bitmask rows are `words` wide."""

    def __init__(self, info_json: str, words: int, max_rows: int):
        self.words, self.max_rows = words, max_rows
        size = 4 * (HEADER + (SLOTS + 1) * max_rows * words)
        fd = os.memfd_create("tp_lora-masks")
        os.ftruncate(fd, size)
        self.region = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.int32)
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                   CUDA_VISIBLE_DEVICES="")  # the process never touches a GPU
        self.proc = subprocess.Popen([sys.executable, "-m", "tp_lora.engine.mask_process", str(theirs.fileno()),
                                      str(fd), str(size)], pass_fds=(theirs.fileno(), fd), env=env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        os.close(fd)
        self.conn = Connection(ours.detach())
        self.conn.send(("init", info_json, words, max_rows))
        self.seq = 0  # the last sequence number handed out
        self.replies: dict[int, tuple] = {}  # replies read, not yet claimed, by sequence number
        self.stale = 0  # replies to messages up to this one are dropped unread (drop_replies)
        self.registered = False
        weakref.finalize(self, MaskProcess._end, self.conn, self.proc)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send(self, msg: tuple) -> None:
        """Send one message (from one thread at a time)."""
        try:
            self.conn.send(msg)
        except OSError:
            raise ProcessLost(f"the grammar process ended (exit code {self.proc.poll()})") from None

    def slot(self, k: int, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise RuntimeError(f"{rows} grammar rows in one step: the bitmask slots hold {self.max_rows} "
                               f"(scheduler.max_batch_size)")
        return slot_view(self.region, k, rows, self.max_rows, self.words)

    def host_flag(self, device: torch.device) -> Optional[HostFlag]:
        """The region page-locked for CUDA `device` and its flag word as a HostFlag, or None where that cannot be
        (the host then waits for the masks)."""
        if not self.registered:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(device):
                code = cudart.cudaHostRegister(self.region.data_ptr(), 4 * self.region.numel(), 3)  # portable, mapped
            if int(code) != 0:
                cudart.cudaGetLastError()  # not left for torch's next check to find
                return None
            self.registered = True
            weakref.finalize(self, _unregister, self.region)
        return host_flag(device, self.region[:1])

    def reply(self, seq: int, block: bool = True) -> Optional[tuple]:
        """The process's reply to message `seq`: ("done",) or a value; None when not here yet and not `block`.
        Raises RuntimeError with the process's error; ProcessLost when it ended, or past REPLY_TIMEOUT_S."""
        while seq not in self.replies:
            if not self.conn.poll(REPLY_TIMEOUT_S if block else 0):
                if not block:
                    return None
                raise ProcessLost(f"the grammar process did not answer in {REPLY_TIMEOUT_S:g} s")
            try:
                got = self.conn.recv()
            except (EOFError, OSError):
                raise ProcessLost(f"the grammar process ended (exit code {self.proc.poll()})") from None
            if got[0] > self.stale:
                self.replies[got[0]] = got[1:]
        got = self.replies.pop(seq)
        if got[0] == "error":
            raise RuntimeError(f"grammar: {got[1]}")
        return got

    def drop_replies(self) -> None:
        """Forget the replies to every message sent so far (a reset: nobody claims them)."""
        self.stale = self.seq
        self.replies.clear()

    @staticmethod
    def _end(conn: Connection, proc: subprocess.Popen) -> None:
        conn.close()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()


def slot_view(region: torch.Tensor, k: int, rows: int, max_rows: int, words: int) -> torch.Tensor:
    """Slot k's first `rows` bitmask rows [rows, words] in the region (k == SLOTS: the fills in line)."""
    start = HEADER + k * max_rows * words
    return region[start:start + rows * words].view(rows, words)


def _unregister(region: torch.Tensor) -> None:
    """The region no longer page-locked (before its memory is unmapped: a later mapping may take its addresses)."""
    if int(torch.cuda.cudart().cudaHostUnregister(region.data_ptr())) != 0:
        torch.cuda.cudart().cudaGetLastError()


class Matchers:
    """The process's side: compiled grammars (by schema text) and each request's matcher, over the region."""

    def __init__(self, info_json: str, words: int, max_rows: int, region: torch.Tensor):
        xgr = library()
        self.xgr, self.words, self.max_rows, self.region = xgr, words, max_rows, region
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                            cache_enabled=False)
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[int, object] = {}
        self.batch = xgr.BatchGrammarMatcher(1)  # one thread: xgrammar starts its threads anew at every call
        self.pool: Optional[ThreadPoolExecutor] = None  # the fill's threads beside this one, from the first need

    def slot(self, k: int, rows: int) -> torch.Tensor:
        return slot_view(self.region, k, rows, self.max_rows, self.words)

    def matcher(self, index: int, key: Optional[tuple[str, str]]):
        """Request `index`'s matcher, made for grammar `key` at its first use."""
        m = self.matchers.get(index)
        if m is None:
            if key not in self.compiled:
                self.compiled[key] = compile_schema(self.compiler, key[1])
                if len(self.compiled) > CACHE_SIZE:
                    self.compiled.popitem(last=False)
            self.compiled.move_to_end(key)
            m = self.matchers[index] = self.xgr.GrammarMatcher(self.compiled[key])
        return m

    def job(self, number: int, slot: int, indices: list[int], tokens: list[int]) -> None:
        """A step's rows (requests `indices`, in bitmask row order) take `tokens` (a finished row's is dropped) and
        fill their next bitmask into `slot` (zeros for a forgotten request's row), all allowed if this fails; then
        the flag is raised to `number` (0: none), whatever happens."""
        bits = self.slot(slot, len(indices))
        try:
            known = [k for k, i in enumerate(indices) if i in self.matchers]
            ms = [self.matchers[indices[k]] for k in known]
            live = [j for j, m in enumerate(ms) if not m.is_terminated()]
            self.xgr.BatchGrammarMatcher.batch_accept_token([ms[j] for j in live], [tokens[known[j]] for j in live])
            if len(known) < len(indices):
                part = torch.empty(len(known), self.words, dtype=torch.int32)
                self.fill(ms, part)
                bits.zero_()
                bits[known] = part
            else:
                self.fill(ms, bits)
        except BaseException:
            bits.fill_(-1)
            raise
        finally:
            if number:
                self.region[0] = number  # after the bitmask's stores (x86 keeps stores in order)

    def fill(self, ms: list, bits: torch.Tensor) -> None:
        """`bits` [len(ms), words] as xgrammar's bitmask of each matcher's next token, zeros for a complete one."""
        live = [i for i, m in enumerate(ms) if not m.is_terminated()]
        if len(live) < len(ms):
            bits.zero_()
        parts = fill_threads(len(live))
        chunks = [live[k::parts] for k in range(parts)]  # rows spread: a costly grammar state is often several rows'
        if parts > 1 and self.pool is None:
            self.pool = ThreadPoolExecutor(parts, thread_name_prefix="tp_lora-fill")
        futures = [self.pool.submit(self._fill_rows, ms, bits, c) for c in chunks[1:]]  # each releases the GIL
        self._fill_rows(ms, bits, chunks[0])
        for f in futures:
            f.result()

    def _fill_rows(self, ms: list, bits: torch.Tensor, rows: list[int]) -> None:
        if rows:
            self.batch.batch_fill_next_token_bitmask([ms[i] for i in rows], bits, indices=rows)

    def handle(self, msg: tuple) -> Optional[tuple]:
        """One message -> its reply's payload (None: no reply)."""
        kind = msg[0]
        if kind == "job":
            self.job(*msg[2:])
            return ("done",)
        if kind == "fill":  # [(index, grammar key)] into the fills' slot
            rows = msg[2]
            self.fill([self.matcher(i, key) for i, key in rows], self.slot(SLOTS, len(rows)))
            return ("done",)
        if kind == "accept":
            m = self.matcher(msg[2], msg[3])
            m.accept_token(msg[4])
            return ("accepted", m.is_terminated())
        if kind == "forget":
            self.matchers.pop(msg[1], None)
        elif kind == "reset":
            self.matchers.clear()
        return None


def fill_threads(rows: int) -> int:
    """Threads of a bitmask fill of `rows` rows: one per ROWS_PER_THREAD rows, at most this host's CPUs over its ranks
    less two for each rank's host loop and worker (and 8)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    most = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 2
    return max(1, min(8, most, rows // ROWS_PER_THREAD))


def main(sock_fd: int, mem_fd: int, size: int) -> None:
    """The process: messages in order until the socket closes. A message that fails is answered with its error; the
    process goes on."""
    conn = Connection(sock_fd)
    region = torch.frombuffer(mmap.mmap(mem_fd, size), dtype=torch.int32)
    os.close(mem_fd)
    _, info_json, words, max_rows = conn.recv()
    state = Matchers(info_json, words, max_rows, region)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        seq = msg[1] if msg[0] in ("job", "fill", "accept") else None
        try:
            out = state.handle(msg)
        except Exception as e:  # noqa: BLE001 - answered to the engine, which raises it
            out = ("error", message(e) or type(e).__name__)
        if seq is not None:
            conn.send((seq, *out))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
