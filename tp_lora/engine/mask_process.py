"""The structured-output matchers in processes of their own: each step's grammar rows take their tokens and fill
their next bitmask there, each process under its own interpreter lock. In a thread of the engine's process every
xgrammar call hands the lock to the thread that launches steps and waits to get it back, which slowed both; threads
of one process trade it the same way, and a sleeping thread or process takes long to wake (BENCHMARKS.md).

A request's matcher lives in process `index % count` (MaskProcesses.owner), so a step's rows are filled by the
processes side by side. They share one memory region with the engine: page-locked and mapped for the device on
CUDA, so the device's mask copy and its waits read what the processes wrote. It holds
- per process a cache line: its flag (the device waits on it, tp_lora.streamwait), the sequence number of its last
  socket reply, the last board job it has handled, and how many of those failed;
- the board: each step's job (flag number, bitmask slot, the rows' requests and tokens) in a ring of BOARD entries,
  and the number of the last one posted. Posting a job is stores only, no system call;
- the bitmask slots.
Other work (fills in line, accepts, forgets, resets) goes over each process's socket in order, one reply per fill
or accept by sequence number. Where the host has cores to spare (more than one process), a process polls the board
and its socket for SPIN_S after its last work, then every IDLE_S; a single process sleeps on its socket, and a
posted job rings it there. A process ends when its socket closes."""
from __future__ import annotations

import mmap
import os
import select
import socket
import subprocess
import sys
import time
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Callable, Optional

import numpy as np
import torch

from tp_lora.engine.ebnf import expand_repetitions
from tp_lora.engine.response_format import SEPARATORS, library, message
from tp_lora.streamwait import HostFlag, host_flag

LINE = 16  # int32 words of a cache line
MOST = 4  # matcher processes per engine rank
FLAG, REPLIED, DONE, FAILED = 0, 1, 2, 3  # words of process p's line (LINE * p + ...)
POSTED = LINE * MOST  # the word (a line of its own) holding the number of the last board job posted
HEADER = LINE * (MOST + 1)  # int32 words before the board
SLOTS = 4  # bitmask slots of the steps' jobs, taken in turn (a slot is read by the next step's draw); one more after
# them for fills in line
BOARD = SLOTS  # board entries: a job's entry is reused BOARD jobs later, once every process has handled it
FIELDS = 5  # an entry's int64 fields (job number, flag number, slot, rows, n) before its requests' indices and
# tokens (max_rows each)
WRAP = 0x7FFFFFFF  # job and sequence numbers in int32 words: modulo 2^31
CACHE_SIZE = 256  # compiled grammars kept, by schema text
REPLY_TIMEOUT_S = 120.0  # the longest the engine waits for a process's answer (a fill of a large batch of costly
# grammar states takes milliseconds a row)
SPIN_S = 0.5  # how long a process polls after its last work, where the host has cores to spare (past a long step)
IDLE_S = 0.01  # how often such a process looks at the board once idle (a new request's fill in line wakes it)
WAIT_S = 20e-6  # the engine's sleep between looks at the board's done words while it waits for a job


def compile_schema(compiler, text: str):
    """A JSON schema (text) compiled by an xgrammar GrammarCompiler, compact, its bounded repetitions written out as
    rules (tp_lora.engine.ebnf: the same language, faster masks)."""
    grammar = library().Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    return compiler.compile_grammar(expand_repetitions(str(grammar)))


class ProcessLost(RuntimeError):
    """A matchers' process ended, or did not answer in REPLY_TIMEOUT_S."""


def reached(word: int, number: int) -> bool:
    """Whether an int32 word holding a number modulo 2^31 has reached `number` (within 2^30 of it)."""
    return 0 <= (int(word) - number) & WRAP < 1 << 30


class Shared:
    """The shared region over `buf` for bitmask rows `words` wide, at most `max_rows` a step: its int32 words (a
    torch tensor and a numpy view), the board [BOARD, FIELDS + 2 * max_rows] int64, the bitmask slots."""

    def __init__(self, buf, words: int, max_rows: int):
        self.words, self.max_rows = words, max_rows
        self.region = torch.frombuffer(buf, dtype=torch.int32)
        self.w32 = self.region.numpy()  # the same memory: a word read or written without a torch call
        width = FIELDS + 2 * max_rows
        self.board = np.frombuffer(buf, dtype=np.int64, count=BOARD * width, offset=4 * HEADER).reshape(BOARD, width)
        self.slots_at = HEADER + 2 * BOARD * width

    @staticmethod
    def size(words: int, max_rows: int) -> int:
        """Bytes of a region for these sizes."""
        return 4 * HEADER + 8 * BOARD * (FIELDS + 2 * max_rows) + 4 * (SLOTS + 1) * max_rows * words

    def slot(self, k: int, rows: int) -> torch.Tensor:
        """Slot k's first `rows` bitmask rows [rows, words] (k == SLOTS: the fills in line)."""
        start = self.slots_at + k * self.max_rows * self.words
        return self.region[start:start + rows * self.words].view(rows, self.words)


class MaskProcesses:
    """The matchers' processes (`count`, for a tokenizer given as xgrammar TokenizerInfo JSON whose bitmask rows are
    `words` wide) and their shared region."""

    def __init__(self, info_json: str, words: int, max_rows: int, count: int):
        if not 1 <= count <= MOST:
            raise ValueError(f"{count} matcher processes: expected 1 to {MOST}")
        self.words, self.max_rows, self.spin = words, max_rows, count > 1
        size = Shared.size(words, max_rows)
        fd = os.memfd_create("tp_lora-masks")
        os.ftruncate(fd, size)
        self.shared = Shared(mmap.mmap(fd, size), words, max_rows)
        try:
            self.procs = [MaskProcess(self.shared, p, fd, size, info_json, count, self.spin) for p in range(count)]
        finally:
            os.close(fd)
        self.posted = 0  # the last board job's number
        self.stale = 0  # failures of board jobs up to this one are not raised (reset)
        self.registered = False

    def owner(self, index: int) -> MaskProcess:
        """The process holding request `index`'s matcher."""
        return self.procs[index % len(self.procs)]

    def slot(self, k: int, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise RuntimeError(f"{rows} grammar rows in one step: the bitmask slots hold {self.max_rows} "
                               f"(scheduler.max_batch_size)")
        return self.shared.slot(k, rows)

    def post(self, number: int, slot: int, rows: int, indices: list[int], tokens: list[int]) -> int:
        """Post a step's job: requests `indices` (rows 0.. of `slot`'s `rows`) took `tokens`; each process with
        some of them fills theirs and raises its flag to `number` (0: none). Its board job number (waits while
        every entry is still in use)."""
        no = self.posted + 1
        if no > BOARD:
            self.done(no - BOARD, self.procs, block=True)
        entry, n = self.shared.board[no % BOARD], len(indices)
        entry[:FIELDS] = (no, number, slot, rows, n)
        entry[FIELDS:FIELDS + n] = indices
        entry[FIELDS + self.max_rows:FIELDS + self.max_rows + n] = tokens
        self.shared.w32[POSTED] = no & WRAP  # after the entry's stores (x86 keeps stores in order)
        self.posted = no
        if not self.spin:
            self.procs[0].send(("post",))
        return no

    def done(self, no: int, procs: list[MaskProcess], block: bool) -> bool:
        """Whether `procs` have handled board job `no` (waited for if `block`). Raises RuntimeError with a failure
        of theirs; ProcessLost when one ended or did not finish in REPLY_TIMEOUT_S."""
        w32, deadline = self.shared.w32, None
        while behind := [p for p in procs if not reached(w32[LINE * p.p + DONE], no)]:
            for p in behind:
                p.alive()
            if not block:
                return False
            deadline = deadline or time.monotonic() + REPLY_TIMEOUT_S
            if time.monotonic() > deadline:
                raise ProcessLost(f"the grammar process did not answer in {REPLY_TIMEOUT_S:g} s")
            time.sleep(WAIT_S)
        for p in procs:
            p.failures(self.stale)
        return True

    def drop_replies(self) -> None:
        """Forget the replies to every message sent so far and the failures of every job posted (a reset)."""
        self.stale = self.posted
        for p in self.procs:
            p.drop_replies()

    def host_flags(self, device: torch.device) -> Optional[list[HostFlag]]:
        """The region page-locked for CUDA `device` and each process's flag word as a HostFlag, or None where that
        cannot be (the host then waits for the masks)."""
        region = self.shared.region
        if not self.registered:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(device):
                code = cudart.cudaHostRegister(region.data_ptr(), 4 * region.numel(), 3)  # portable, mapped
            if int(code) != 0:
                cudart.cudaGetLastError()  # not left for torch's next check to find
                return None
            self.registered = True
            weakref.finalize(self, _unregister, region)
        flags = [host_flag(device, region[LINE * p + FLAG:LINE * p + FLAG + 1]) for p in range(len(self.procs))]
        return None if None in flags else flags


class MaskProcess:
    """One matchers' process (number `p` of `count` over `shared`), its socket and its replies."""

    def __init__(self, shared: Shared, p: int, mem_fd: int, size: int, info_json: str, count: int, spin: bool):
        self.p, self.w32 = p, shared.w32
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                   CUDA_VISIBLE_DEVICES="")  # the process never touches a GPU
        self.proc = subprocess.Popen([sys.executable, "-m", "tp_lora.engine.mask_process", str(theirs.fileno()),
                                      str(mem_fd), str(size)], pass_fds=(theirs.fileno(), mem_fd), env=env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(("init", info_json, shared.words, shared.max_rows, p, count, spin))
        self.seq = 0  # the last sequence number handed out
        self.replies: dict[int, tuple] = {}  # replies read, not yet claimed, by sequence number (-job: a failure)
        self.stale = 0  # replies to messages up to this one are dropped unread (drop_replies)
        self.failed = 0  # failed board jobs taken
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

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise ProcessLost(f"the grammar process ended (exit code {self.proc.poll()})")

    def reply(self, seq: int) -> tuple:
        """The process's reply to message `seq`: ("done",) or a value. Raises RuntimeError with the process's error;
        ProcessLost when it ended, or past REPLY_TIMEOUT_S."""
        self._read_until(lambda: seq in self.replies,
                         lambda: not reached(self.w32[LINE * self.p + REPLIED], seq))
        got = self.replies.pop(seq)
        if got[0] == "error":
            raise RuntimeError(f"grammar: {got[1]}")
        return got

    def failures(self, stale: int) -> None:
        """Raise the first failure of a board job after `stale` that the process reported since the last call."""
        count = int(self.w32[LINE * self.p + FAILED])
        if count == self.failed:
            return
        self._read_until(lambda: sum(k < 0 for k in self.replies) >= count - self.failed, lambda: False)
        self.failed = count
        jobs = sorted(-k for k in self.replies if k < 0)
        errors = [self.replies.pop(-j)[1] for j in jobs]
        for j, why in zip(jobs, errors):
            if j > stale:
                raise RuntimeError(f"grammar: {why}")

    def _read_until(self, have: Callable[[], bool], wait: Callable[[], bool]) -> None:
        """Read the process's messages into `replies` until have(); while wait(), only once the socket has one
        (up to REPLY_TIMEOUT_S)."""
        while not have():
            if wait() and not self.conn.poll(REPLY_TIMEOUT_S):
                raise ProcessLost(f"the grammar process did not answer in {REPLY_TIMEOUT_S:g} s")
            try:
                got = self.conn.recv()
            except (EOFError, OSError):
                raise ProcessLost(f"the grammar process ended (exit code {self.proc.poll()})") from None
            if got[0] > self.stale or got[0] < 0:
                self.replies[got[0]] = got[1:]

    def drop_replies(self) -> None:
        """Forget the replies to every message sent so far (a reset: nobody claims them)."""
        self.stale = self.seq
        self.replies = {k: v for k, v in self.replies.items() if k < 0}

    @staticmethod
    def _end(conn: Connection, proc: subprocess.Popen) -> None:
        conn.close()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()


def processes_for_host() -> int:
    """Matcher processes per engine rank: one per two of this host's CPUs over its ranks beyond the two that each
    rank's host loop needs (at least one, at most MOST)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    spare = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 2
    return max(1, min(MOST, spare // 2))


def _unregister(region: torch.Tensor) -> None:
    """The region no longer page-locked (before its memory is unmapped: a later mapping may take its addresses)."""
    if int(torch.cuda.cudart().cudaHostUnregister(region.data_ptr())) != 0:
        torch.cuda.cudart().cudaGetLastError()


class Matchers:
    """Process p's side (of `count`): compiled grammars (by schema text) and each of its requests' matcher, over the
    shared region; its flag is the region's word LINE * p."""

    def __init__(self, info_json: str, shared: Shared, p: int = 0, count: int = 1):
        xgr = library()
        self.xgr, self.shared, self.p, self.count = xgr, shared, p, count
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                            cache_enabled=False)
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[int, object] = {}
        self.batch = xgr.BatchGrammarMatcher(1)  # one thread: xgrammar starts its threads anew at every call

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

    def board_job(self, no: int) -> None:
        """Board job `no`: the rows of this process's requests."""
        entry, most = self.shared.board[no % BOARD], self.shared.max_rows
        if int(entry[0]) != no:
            raise RuntimeError(f"board entry {no % BOARD} holds job {int(entry[0])}, expected {no}")
        _, number, slot, rows, n = (int(x) for x in entry[:FIELDS])
        indices, tokens = entry[FIELDS:FIELDS + n].tolist(), entry[FIELDS + most:FIELDS + most + n].tolist()
        mine = [k for k, i in enumerate(indices) if i % self.count == self.p]
        if mine:
            self.job(number, slot, rows, mine, [indices[k] for k in mine], [tokens[k] for k in mine])

    def job(self, number: int, slot: int, rows: int, at: list[int], indices: list[int], tokens: list[int]) -> None:
        """A step's rows of this process (requests `indices`, rows `at` of the slot's `rows`) take `tokens` (a
        finished row's is dropped) and fill their next bitmask (zeros for a forgotten request's row), all allowed if
        this fails; then this process's flag is raised to `number` (0: none), whatever happens."""
        bits = self.shared.slot(slot, rows)
        try:
            known = [k for k, i in enumerate(indices) if i in self.matchers]
            ms = [self.matchers[indices[k]] for k in known]
            live = [j for j, m in enumerate(ms) if not m.is_terminated()]
            self.xgr.BatchGrammarMatcher.batch_accept_token([ms[j] for j in live], [tokens[known[j]] for j in live])
            for k in sorted(set(range(len(indices))) - set(known)):
                bits[at[k]].zero_()
            self.fill(ms, bits, [at[k] for k in known])
        except BaseException:
            for a in at:
                bits[a].fill_(-1)
            raise
        finally:
            if number:
                self.shared.w32[LINE * self.p + FLAG] = number  # after the bitmask's stores (x86 keeps their order)

    def fill(self, ms: list, bits: torch.Tensor, at: list[int]) -> None:
        """Rows `at` of `bits` [rows, words] as xgrammar's bitmask of matchers `ms`' next token, zeros for a complete
        one."""
        live = [k for k, m in enumerate(ms) if not m.is_terminated()]
        for k in sorted(set(range(len(ms))) - set(live)):
            bits[at[k]].zero_()
        if live:
            self.batch.batch_fill_next_token_bitmask([ms[k] for k in live], bits, indices=[at[k] for k in live])

    def handle(self, msg: tuple) -> Optional[tuple]:
        """One socket message -> its reply's payload (None: no reply)."""
        kind = msg[0]
        if kind == "fill":  # rows `at` of the fills' slot of `rows`: [(at, index, grammar key)]
            _, _, rows, todo = msg
            self.fill([self.matcher(i, key) for _, i, key in todo], self.shared.slot(SLOTS, rows),
                      [a for a, _, _ in todo])
            return ("done",)
        if kind == "accept":
            m = self.matcher(msg[2], msg[3])
            m.accept_token(msg[4])
            return ("accepted", m.is_terminated())
        if kind == "forget":
            self.matchers.pop(msg[1], None)
        elif kind == "reset":
            self.matchers.clear()
        return None  # "post": the board is looked at anyway


def main(sock_fd: int, mem_fd: int, size: int) -> None:
    """A process: board jobs and socket messages until the socket closes (board jobs first, each in order). Work
    that fails is answered with its error (a board job's on the socket as job -number, counted in its FAILED
    word); the process goes on."""
    conn = Connection(sock_fd)
    buf = mmap.mmap(mem_fd, size)
    os.close(mem_fd)
    _, info_json, words, max_rows, p, count, spin = conn.recv()
    shared = Shared(buf, words, max_rows)
    state = Matchers(info_json, shared, p, count)
    w32, handled, last = shared.w32, 0, time.perf_counter()
    while True:
        if int(w32[POSTED]) != handled & WRAP:
            handled += 1
            try:
                state.board_job(handled)
            except Exception as e:  # noqa: BLE001 - answered to the engine, which raises it
                conn.send((-handled, "error", message(e) or type(e).__name__))
                w32[LINE * p + FAILED] += 1
            w32[LINE * p + DONE] = handled & WRAP
            last = time.perf_counter()
            continue
        wait = (0.0 if time.perf_counter() - last < SPIN_S else IDLE_S) if spin else None
        if not select.select([sock_fd], [], [], wait)[0]:
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        last = time.perf_counter()
        seq = msg[1] if msg[0] in ("fill", "accept") else None
        try:
            out = state.handle(msg)
        except Exception as e:  # noqa: BLE001 - answered to the engine, which raises it
            out = ("error", message(e) or type(e).__name__)
        if seq is not None:
            conn.send((seq, *out))
            w32[LINE * p + REPLIED] = seq & WRAP


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
