"""The structured-output matchers in processes of their own: each step's grammar rows take their tokens and fill
their next bitmask there, each process under its own interpreter lock. In a thread of the engine's process every
xgrammar call hands the lock to the thread that launches steps and waits to get it back, which slowed both; threads
of one process trade it the same way, and a sleeping thread or process takes long to wake (BENCHMARKS.md).

A request's matcher lives in process `index % count` (MaskProcesses.owner), so a step's rows are filled by the
processes side by side. MaskProcess (the engine's side of one) starts it (`python -m tp_lora.engine.mask_process`),
sends it work over a socket in order and reads one reply per job, fill or accept, by sequence number. Bitmask slots,
and each process's flag word the device waits on (tp_lora.streamwait), live in one shared memory region: page-locked
and mapped for the device on CUDA, so the device's copy and its waits read what the processes wrote. Where the host
has cores to spare (more than one process), a process polls its socket for SPIN_S after each message instead of
sleeping, so the next step's job starts at once. A process ends when its socket closes."""
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
from typing import Optional

import torch

from tp_lora.engine.ebnf import expand_repetitions
from tp_lora.engine.response_format import SEPARATORS, library, message
from tp_lora.streamwait import HostFlag, host_flag

LINE = 16  # int32 words of a cache line
MOST = 4  # matcher processes per engine rank
HEADER = LINE * MOST  # int32 words before the slots: process p's line holds its flag (word LINE * p), which the
# device waits on, and the sequence number of its last reply, written once that is sent (word LINE * p + 1)
SLOTS = 4  # bitmask slots of the steps' jobs, taken in turn (a slot is read by the next step's draw); one more after
# them for fills in line
CACHE_SIZE = 256  # compiled grammars kept, by schema text
REPLY_TIMEOUT_S = 120.0  # the longest the engine waits for a process's answer (a fill of a large batch of costly
# grammar states takes milliseconds a row)
SPIN_S = 0.05  # how long a process polls its socket after a message, where the host has cores to spare


def compile_schema(compiler, text: str):
    """A JSON schema (text) compiled by an xgrammar GrammarCompiler, compact, its bounded repetitions written out as
    rules (tp_lora.engine.ebnf: the same language, faster masks)."""
    grammar = library().Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    return compiler.compile_grammar(expand_repetitions(str(grammar)))


class ProcessLost(RuntimeError):
    """A matchers' process ended, or did not answer in REPLY_TIMEOUT_S."""


class MaskProcesses:
    """The matchers' processes (`count`, for a tokenizer given as xgrammar TokenizerInfo JSON whose bitmask rows are
    `words` wide) and their shared region [HEADER + (SLOTS + 1) * max_rows * words] int32."""

    def __init__(self, info_json: str, words: int, max_rows: int, count: int):
        if not 1 <= count <= MOST:
            raise ValueError(f"{count} matcher processes: expected 1 to {MOST}")
        self.words, self.max_rows = words, max_rows
        size = 4 * (HEADER + (SLOTS + 1) * max_rows * words)
        fd = os.memfd_create("tp_lora-masks")
        os.ftruncate(fd, size)
        self.region = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.int32)
        self.words_np = self.region.numpy()  # the same memory: a word read without a torch call
        try:
            self.procs = [MaskProcess(self, p, fd, size, info_json, spin=count > 1) for p in range(count)]
        finally:
            os.close(fd)
        self.registered = False

    def owner(self, index: int) -> MaskProcess:
        """The process holding request `index`'s matcher."""
        return self.procs[index % len(self.procs)]

    def slot(self, k: int, rows: int) -> torch.Tensor:
        if rows > self.max_rows:
            raise RuntimeError(f"{rows} grammar rows in one step: the bitmask slots hold {self.max_rows} "
                               f"(scheduler.max_batch_size)")
        return slot_view(self.region, k, rows, self.max_rows, self.words)

    def host_flags(self, device: torch.device) -> Optional[list[HostFlag]]:
        """The region page-locked for CUDA `device` and each process's flag word as a HostFlag, or None where that
        cannot be (the host then waits for the masks)."""
        if not self.registered:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(device):
                code = cudart.cudaHostRegister(self.region.data_ptr(), 4 * self.region.numel(), 3)  # portable, mapped
            if int(code) != 0:
                cudart.cudaGetLastError()  # not left for torch's next check to find
                return None
            self.registered = True
            weakref.finalize(self, _unregister, self.region)
        flags = [host_flag(device, self.region[LINE * p:LINE * p + 1]) for p in range(len(self.procs))]
        return None if None in flags else flags


class MaskProcess:
    """One matchers' process (number `p` of `shared`, a MaskProcesses), its socket and its replies."""

    def __init__(self, shared: MaskProcesses, p: int, mem_fd: int, size: int, info_json: str, spin: bool):
        self.p, self.words_np = p, shared.words_np
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                   CUDA_VISIBLE_DEVICES="")  # the process never touches a GPU
        self.proc = subprocess.Popen([sys.executable, "-m", "tp_lora.engine.mask_process", str(theirs.fileno()),
                                      str(mem_fd), str(size)], pass_fds=(theirs.fileno(), mem_fd), env=env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(("init", info_json, shared.words, shared.max_rows, p, spin))
        self.seq = 0  # the last sequence number handed out
        self.replies: dict[int, tuple] = {}  # replies read, not yet claimed, by sequence number
        self.stale = 0  # replies to messages up to this one are dropped unread (drop_replies)
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

    def reply(self, seq: int, block: bool = True) -> Optional[tuple]:
        """The process's reply to message `seq`: ("done",) or a value; None when not here yet and not `block`
        (known from its reply word, without a system call). Raises RuntimeError with the process's error;
        ProcessLost when it ended, or past REPLY_TIMEOUT_S."""
        while seq not in self.replies:
            replied = int(self.words_np[LINE * self.p + 1])
            sent = 0 <= (replied - seq) & 0x7FFFFFFF < 1 << 30  # the replies up to seq are in the socket
            if not sent and not block:
                return None
            if not sent and not self.conn.poll(REPLY_TIMEOUT_S):
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


def processes_for_host() -> int:
    """Matcher processes per engine rank: one per two of this host's CPUs over its ranks beyond the two that each
    rank's host loop needs (at least one, at most MOST)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    spare = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 2
    return max(1, min(MOST, spare // 2))


def slot_view(region: torch.Tensor, k: int, rows: int, max_rows: int, words: int) -> torch.Tensor:
    """Slot k's first `rows` bitmask rows [rows, words] in the region (k == SLOTS: the fills in line)."""
    start = HEADER + k * max_rows * words
    return region[start:start + rows * words].view(rows, words)


def _unregister(region: torch.Tensor) -> None:
    """The region no longer page-locked (before its memory is unmapped: a later mapping may take its addresses)."""
    if int(torch.cuda.cudart().cudaHostUnregister(region.data_ptr())) != 0:
        torch.cuda.cudart().cudaGetLastError()


class Matchers:
    """A process's side: compiled grammars (by schema text) and each of its requests' matcher, over the region; its
    flag is the region's word LINE * p."""

    def __init__(self, info_json: str, words: int, max_rows: int, region: torch.Tensor, p: int = 0):
        xgr = library()
        self.xgr, self.words, self.max_rows, self.region, self.p = xgr, words, max_rows, region, p
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                            cache_enabled=False)
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[int, object] = {}
        self.batch = xgr.BatchGrammarMatcher(1)  # one thread: xgrammar starts its threads anew at every call

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

    def job(self, number: int, slot: int, rows: int, at: list[int], indices: list[int], tokens: list[int]) -> None:
        """A step's rows of this process (requests `indices`, rows `at` of the slot's `rows`) take `tokens` (a
        finished row's is dropped) and fill their next bitmask (zeros for a forgotten request's row), all allowed if
        this fails; then this process's flag is raised to `number` (0: none), whatever happens."""
        bits = self.slot(slot, rows)
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
                self.region[LINE * self.p] = number  # after the bitmask's stores (x86 keeps stores in order)

    def fill(self, ms: list, bits: torch.Tensor, at: list[int]) -> None:
        """Rows `at` of `bits` [rows, words] as xgrammar's bitmask of matchers `ms`' next token, zeros for a complete
        one."""
        live = [k for k, m in enumerate(ms) if not m.is_terminated()]
        for k in sorted(set(range(len(ms))) - set(live)):
            bits[at[k]].zero_()
        if live:
            self.batch.batch_fill_next_token_bitmask([ms[k] for k in live], bits, indices=[at[k] for k in live])

    def handle(self, msg: tuple) -> Optional[tuple]:
        """One message -> its reply's payload (None: no reply)."""
        kind = msg[0]
        if kind == "job":
            self.job(*msg[2:])
            return ("done",)
        if kind == "fill":  # rows `at` of the fills' slot of `rows`: [(at, index, grammar key)]
            _, _, rows, todo = msg
            self.fill([self.matcher(i, key) for _, i, key in todo], self.slot(SLOTS, rows), [a for a, _, _ in todo])
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


def main(sock_fd: int, mem_fd: int, size: int) -> None:
    """A process: messages in order until the socket closes. A message that fails is answered with its error; the
    process goes on. Spinning, it polls the socket for SPIN_S after each message before it blocks."""
    conn = Connection(sock_fd)
    region = torch.frombuffer(mmap.mmap(mem_fd, size), dtype=torch.int32)
    os.close(mem_fd)
    _, info_json, words, max_rows, p, spin = conn.recv()
    state = Matchers(info_json, words, max_rows, region, p)
    while True:
        if spin:
            until = time.perf_counter() + SPIN_S
            while not select.select([sock_fd], [], [], 0)[0] and time.perf_counter() < until:
                pass
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
            region[LINE * p + 1] = seq & 0x7FFFFFFF


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
