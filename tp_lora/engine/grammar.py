"""Structured output: a request's response_format (any JSON object, or a JSON schema) as a grammar whose matcher
masks the logits of the request's rows, through xgrammar (the optional `structured` extra).

A grammar is compiled once per schema text (an LRU cache) when its request is checked, on every rank alike. Each
request then holds a matcher from its first sample to its end. A step's grammar rows take their tokens and fill
their next bitmask on a worker thread (follow(): once the step's tokens reach the host, while the device already
runs the next step's forward, launched ahead); the next sample takes those masks (masks()). On a CUDA device whose
driver lets a stream wait on host memory (tp_lora.streamwait) the host does not wait for them: the masks' copy and
the draw are queued behind a device-side wait for the job's number, which the worker raises once its pinned bitmask
is written; the host queues each step's job behind the last without waiting for it, and knows a row's end from its
token (a stop token ends a grammar). Elsewhere masks() waits for what is left of the jobs
(StepStats.mask_wait_seconds). Rows the worker did not cover (a first token, a resumed sequence) are filled in line.
The bitmask goes to the device in one copy as filled; the draw's kernel reads it for those rows only, within the
printable tokens, and takes a dead row's stop tokens (tp_lora.ops.sampling.grammar_allowed).
The worker waits for the tokens without the GIL and runs few Python steps (one batched accept, one batched fill
over several threads); the interpreter's switch interval is cut so that it gets the GIL within SWITCH_INTERVAL_S
while the host thread runs Python (Python's default, 5 ms, held the fill back until the host blocked in masks()).
Matchers are deterministic, so every TP rank, advanced with the same tokens, applies the same masks, wherever they
were filled.

JSON is compact (no whitespace outside strings): a random or weak model cannot spend its tokens on whitespace.
A complete grammar allows only the stop tokens (EOS); a grammar that allows no token the tokenizer can spell
allows the stop tokens too (the output ends, cut short, finish_reason "stop"); max_tokens may cut a document
short (finish_reason "length")."""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tp_lora.engine.ebnf import expand_repetitions
from tp_lora.engine.requests import Request
from tp_lora.engine.response_format import SEPARATORS, field_of, library, message, schema_error
from tp_lora.streamwait import HostFlag, host_flag

CACHE_SIZE = 256  # compiled grammars kept, by schema text
SWITCH_INTERVAL_S = 5e-5  # the longest the grammar worker waits for the GIL (Python's default: 5 ms)
ROWS_PER_THREAD = 64  # rows of a batched fill per thread: xgrammar's threads cost more than they save on fewer


def tokenizer_info(tok, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of a `tokenizers` Tokenizer for a model of `vocab_size` logits: each token's bytes, and the
    stop tokens a complete grammar allows."""
    xgr = library()
    from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar
    return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab_size,
                                              stop_token_ids=stop_ids)


def compile_schema(compiler, text: str):
    """A JSON schema (text) compiled by an xgrammar GrammarCompiler, compact, its bounded repetitions written out as
    rules (tp_lora.engine.ebnf: the same language, faster masks)."""
    grammar = library().Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    return compiler.compile_grammar(expand_repetitions(str(grammar)))


class Grammars:
    """The compiled grammars (by schema text) and the matchers of the requests that have one."""

    def __init__(self, tokenizer, eos: set[int]):
        self.tokenizer, self.stop_ids = tokenizer, sorted(eos)
        self.compiler = None  # built at the first grammar: the tokenizer's view is computed once
        self.vocab = 0
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[int, object] = {}
        self.took: dict[int, tuple[int, bool]] = {}  # request index -> (tokens taken in line, grammar complete)
        self.worker: Optional[Worker] = None  # follow()'s thread, from the first follow()
        self.flag: Optional[HostFlag] = None  # what the device waits on for the worker's masks, where it can
        self.pending: list[Ahead] = []  # follow()'s work handed to the worker, in order, until joined
        self.joined: Optional[Ahead] = None  # the last joined work: masks() takes its rows
        self.followed: dict[int, int] = {}  # request index -> the last token number handed to the worker
        self.batches: dict[int, object] = {}  # xgrammar's batch matchers, by fill threads
        self.printable: Optional[torch.Tensor] = None  # the bitmask of the tokens JSON may hold
        self.allow: dict[torch.device, torch.Tensor] = {}  # [printable tokens, stop tokens] bitmasks per device

    def check(self, req: Request, vocab: int) -> Optional[str]:
        """Why `req`'s grammar cannot run on a model of `vocab` logits, or None; compiles it into the cache."""
        if req.grammar is None:
            return None
        if req.min_tokens:
            return "'min_tokens' with 'response_format': the grammar decides where the output ends"
        why = schema_error(req.grammar)
        if why:
            return why
        if self.tokenizer is None:
            return "'response_format' needs a tokenizer (tokenizer.json in the model dir)"
        if not self.stop_ids:
            return "'response_format' needs the model's eos_token_id (a complete grammar allows only EOS)"
        xgr = library()
        if self.compiler is None:
            self.vocab = vocab
            info = tokenizer_info(self.tokenizer.tok, vocab, self.stop_ids)
            # compact JSON holds no byte below 0x20 (they are escaped in strings; xgrammar's length-bounded
            # strings would let them through): tokens spelling one are never allowed
            printable = [i for i, b in enumerate(info.decoded_vocab) if b and min(b) >= 0x20]
            self.printable = pack(printable + self.stop_ids, vocab)
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if req.grammar in self.compiled:
            self.compiled.move_to_end(req.grammar)
            return None
        kind, text = req.grammar
        try:
            compiled = compile_schema(self.compiler, text)
        except (RuntimeError, ValueError) as e:
            return f"'{field_of(kind)}' cannot be compiled: {message(e)}"
        first = xgr.allocate_token_bitmask(1, vocab)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first)
        if not bool((first & self.printable).any()):
            return f"'{field_of(kind)}': the tokenizer has no token the grammar allows first (it cannot spell the " \
                   f"output's first character)"
        self.compiled[req.grammar] = compiled
        if len(self.compiled) > CACHE_SIZE:
            self.compiled.popitem(last=False)
        return None

    def fill(self, reqs: list[Request], pin: bool) -> Optional[tuple[list[int], torch.Tensor]]:
        """(the rows of reqs with a grammar, xgrammar's int32 bitmask [rows, ceil(vocab / 32)] of their next token on
        the host, pinned where `pin`; tp_lora.ops.sampling.grammar_allowed reads it), filled in line, or None when
        no row has one."""
        sel = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not sel:
            return None
        self._join()  # the worker's matchers are the same objects
        matchers = [self._matcher(reqs[i]) for i in sel]
        bits = torch.empty(len(sel), (self.vocab + 31) // 32, dtype=torch.int32, pin_memory=pin)
        return sel, self._fill(matchers, bits, [m.is_terminated() for m in matchers])

    def masks(self, reqs: list[Request], drawn: list[int], pin: bool
              ) -> tuple[Optional[tuple[list[int], torch.Tensor, Optional[tuple[HostFlag, int]]]], float]:
        """For on_device(): (fill()'s rows and bitmask for reqs whose requests drew drawn[i] tokens so far, what the
        device waits for first: (flag, number) or None), or None without grammar rows; and the seconds the host
        waited for masks (for the worker's filling and for in-line fills, not for the device's tokens). The last
        follow()'s job, not waited for where the device can wait for it and it holds every row in order; else
        waited for, its rows taken and the others filled in line."""
        sel = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not sel:
            return None, 0.0
        job = self.pending[-1] if self.pending else None
        if job is not None and job.number and list(job.numbers) == [reqs[i].index for i in sel] and all(
                job.numbers[reqs[i].index] == drawn[i] for i in sel):
            return (sel, job.bits, (self.flag, job.number)), 0.0
        t0 = time.perf_counter()
        job = self._join()
        t1 = time.perf_counter()
        device_wait = max(0.0, min(t1, job.tokens_at) - t0) if job is not None else 0.0
        have = {} if job is None else job.rows
        ahead = [have.get(reqs[i].index, (-1, -1)) for i in sel]
        if all(n == drawn[i] for (n, _), i in zip(ahead, sel)) and [k for _, k in ahead] == list(
                range(job.bits.shape[0])):
            bits = job.bits  # every row, in order: the worker's buffer as it is
        else:
            bits = torch.empty(len(sel), (self.vocab + 31) // 32, dtype=torch.int32, pin_memory=pin)
            took = [j for j, ((n, _), i) in enumerate(zip(ahead, sel)) if n == drawn[i]]
            if took:
                bits[took] = job.bits[[ahead[j][1] for j in took]]
            rest = sorted(set(range(len(sel))) - set(took))
            if rest:
                bits[rest] = self.fill([reqs[sel[j]] for j in rest], False)[1]
        return (sel, bits, None), time.perf_counter() - t0 - device_wait

    def on_device(self, masks: tuple, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """masks()'s (rows, bitmask) with the bitmask copied to `device` (behind the wait it names), and the
        vocabulary's allow rows there (printable tokens, stop tokens): draw()'s grammar."""
        sel, bits, after = masks
        if after is not None:
            after[0].wait(torch.cuda.current_stream(device), after[1])
        if device not in self.allow:
            self.allow[device] = torch.stack([self.printable, pack(self.stop_ids, self.vocab)]).to(device)
        return sel, bits.to(device, non_blocking=True), self.allow[device]

    def follow(self, reqs: list[Request], drawn: list[int], host: torch.Tensor, wait: Optional[Callable[[], None]],
               device: torch.device) -> None:
        """Rows reqs[i] of a launched step on `device` drew their drawn[i]-th token, in host[0, i] once wait()
        returns (None: there already): on the worker thread, the grammar rows' matchers take those tokens and fill
        their next bitmask (pinned for a CUDA device), for the next masks(). Queued behind the jobs before it
        (the worker runs them in order, so the matchers see their tokens in order); the host does not wait here."""
        self._reap()
        rows = [(j, r.index, self.matchers[r.index], drawn[j])
                for j, r in enumerate(reqs) if r.grammar is not None and r.index in self.matchers]
        if not rows:
            return
        if self.worker is None:
            self.worker = Worker(device)
            # The worker needs the GIL for a few moments of each step's work while the host thread runs Python
            # (the next step's scheduling and launch); by default it would get it only after 5 ms (or once the host
            # blocks), which serialised the fill behind the host's work.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self.flag = host_flag(device)
        bits = torch.empty(len(rows), (self.vocab + 31) // 32, dtype=torch.int32, pin_memory=device.type == "cuda")
        number = self.flag.take() if self.flag is not None else 0
        for r in rows:
            self.followed[r[1]] = r[3]
        self.pending.append(Ahead({r[1]: r[3] for r in rows}, bits, number,
                                  self.worker.submit(self._ahead, rows, host, wait, bits, number)))

    def _ahead(self, rows: list[tuple], host: torch.Tensor, wait: Optional[Callable[[], None]], bits: torch.Tensor,
               number: int) -> tuple[dict[int, tuple[int, bool]], float]:
        """follow()'s work on the worker: ({request index: (its token's number, grammar complete)}, perf_counter()
        when the tokens were on the host), the next bitmask written into `bits` [rows, ceil(vocab / 32)] (every
        token, if this fails) and then the flag raised to `number` (0: none), whatever happens. Few Python steps
        (one batched accept, one batched fill, no per-row calls): each needs the GIL, which the host thread holds
        while it runs Python."""
        try:
            if wait is not None:
                wait()
            tokens_at = time.perf_counter()
            toks = host[0].tolist()
            live = [r for r in rows if not r[2].is_terminated()]  # a finished row of a step launched ahead: its
            # token is dropped
            tokens = [int(toks[r[0]]) for r in live]
            accepted = library().BatchGrammarMatcher.batch_accept_token([r[2] for r in live], tokens)
            stops = set(self.stop_ids)  # a matcher that takes a stop token is complete (terminated)
            ends = {r[1]: ok and t in stops for r, t, ok in zip(live, tokens, accepted)}
            took = {r[1]: (r[3], ends.get(r[1], True)) for r in rows}  # in row order: row k of the bitmask
            self._fill([r[2] for r in rows], bits, [done for _, done in took.values()])
            return took, tokens_at
        except BaseException:
            bits.fill_(-1)
            raise
        finally:
            if number:
                self.flag.raise_to(number)

    def _join(self) -> Optional[Ahead]:
        """Every job handed to the worker, done (the host waits for them here), their rows kept for masks() while
        their matchers live; the last one joined (None before any)."""
        while self.pending:
            self._absorb(self.pending.pop(0))
        return self.joined

    def _reap(self) -> None:
        """The jobs the worker has finished, joined without waiting (a failed one raises here)."""
        while self.pending and self.pending[0].future.done():
            self._absorb(self.pending.pop(0))

    def _absorb(self, job: Ahead) -> None:
        took, job.tokens_at = job.future.result()
        job.rows = {}
        for k, (index, got) in enumerate(took.items()):
            if index in self.matchers:  # not forgotten (ended or cancelled) meanwhile
                job.rows[index] = (got[0], k)
        self.joined = job

    def _fill(self, matchers: list, bits: torch.Tensor, complete: list[bool]) -> torch.Tensor:
        """`bits` [len(matchers), ceil(vocab / 32)] (int32, on the host) as xgrammar's bitmask of each matcher's next
        token, zeros for a complete matcher (complete[i]); tp_lora.ops.sampling.grammar_allowed reads it."""
        live = [i for i, done in enumerate(complete) if not done]
        threads = fill_threads(len(live))
        batch = self.batches.get(threads)
        if batch is None:
            batch = self.batches[threads] = library().BatchGrammarMatcher(threads)
        if len(live) == len(matchers):
            batch.batch_fill_next_token_bitmask(matchers, bits)
        else:
            bits.zero_()
            if live:
                batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bits, indices=live)
        return bits

    def _matcher(self, req: Request):
        m = self.matchers.get(req.index)
        if m is None:
            if req.grammar not in self.compiled:  # evicted from the cache since its check
                self.check(req, self.vocab)
            m = self.matchers[req.index] = library().GrammarMatcher(self.compiled[req.grammar])
        return m

    def advance(self, index: int, tok: int, number: int) -> bool:
        """Request `index`'s matcher takes `tok`, its `number`-th token (unless follow()'s worker does); whether its
        grammar is now complete and stopped. Requests without a grammar: False. A token handed to the worker ends
        the grammar exactly when it is a stop token (its mask allowed one only where the grammar may end, or where
        nothing else was left), so the host does not wait for the worker to know."""
        m = self.matchers.get(index)
        if m is None:
            return False
        if self.followed.get(index, -1) >= number:
            return tok in self.stop_ids
        got = self.took.get(index)
        if got is not None and got[0] >= number:
            return got[0] == number and got[1]
        self._join()
        m.accept_token(tok)
        self.took[index] = (number, m.is_terminated())
        return m.is_terminated()

    def forget(self, index: int) -> None:
        self.matchers.pop(index, None)
        self.took.pop(index, None)
        self.followed.pop(index, None)

    def reset(self) -> None:
        """Drop every matcher, and the worker's last results (its work, if any, runs on over dropped matchers)."""
        self.matchers.clear()
        self.took.clear()
        self.followed.clear()
        self.pending.clear()
        self.joined = None


@dataclass
class Ahead:
    """One step's grammar rows handed to the worker (Grammars.follow)."""
    numbers: dict[int, int]  # request index -> the number of the token it drew in that step, in bits' row order
    bits: torch.Tensor  # the rows' next bitmask as xgrammar fills it, written by the worker (pinned on CUDA)
    number: int  # the flag number the worker raises once bits is written (0: no flag)
    future: Future  # -> Grammars._ahead's results
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # once joined: request index -> (its token's
    # number, its row in bits)
    tokens_at: float = 0.0  # once joined: perf_counter() when the step's tokens were on the host


class Worker:
    """One daemon thread running submitted calls in order, bound to `device` (its CUDA calls, the event wait and the
    pinned bitmask, make no context on another GPU). A daemon: a call blocked on a device that never finishes (a
    peer rank died; the host thread raises CollectiveTimeout) does not hold the process at exit."""

    def __init__(self, device: torch.device):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=Worker._run, args=(self.calls, device), name="tp_lora-grammar", daemon=True).start()
        weakref.finalize(self, self.calls.put, None)  # the thread ends with its Worker

    def submit(self, fn: Callable, *args) -> Future:
        future = Future()
        self.calls.put((future, fn, args))
        return future

    @staticmethod
    def _run(calls: queue.SimpleQueue, device: torch.device) -> None:
        bind_device(device)
        while (call := calls.get()) is not None:
            future, fn, args = call
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's result()
                future.set_exception(e)
            del call, future, fn, args  # no reference to the last call's objects while idle


def fill_threads(rows: int) -> int:
    """Threads of a batched bitmask fill of `rows` rows: one per ROWS_PER_THREAD rows, at most this process's CPUs
    over the ranks on its host less one for the host's own loop (and 16)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    most = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1
    return max(1, min(16, most, rows // ROWS_PER_THREAD))


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op for others)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def pack(ids: list[int], vocab: int) -> torch.Tensor:
    """The int32 bitmask [ceil(vocab / 32)] allowing exactly `ids` (bit i % 32 of word i // 32)."""
    allowed = torch.zeros((vocab + 31) // 32 * 32, dtype=torch.int64)
    allowed[ids] = 1
    words = (allowed.view(-1, 32) << torch.arange(32)).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

