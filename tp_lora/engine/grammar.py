"""Structured output: a request's response_format (any JSON object, or a JSON schema) as a grammar whose matcher
masks the logits of the request's rows, through xgrammar (the optional `structured` extra).

A grammar is compiled once per schema text (an LRU cache) when its request is checked, on every rank alike; that
check starts the matchers' processes (tp_lora.engine.mask_process), which hold each request's matcher from its first
sample to its end. A step's grammar rows take their tokens and fill their next bitmask there (follow(), then
hand_on() once the step's tokens reach the host: the host thread posts them on the processes' board while the device
already runs the next step's forward, launched ahead); the next sample takes those masks (masks()). On a CUDA device
whose driver lets a stream wait on host memory (tp_lora.streamwait) the host does not wait for the masks: the masks'
copy and the draw are queued behind device-side waits for the job's number, which each process raises once its
rows are written; the host knows a row's end from its token (a stop token ends a grammar). Elsewhere masks() waits
for what is left of the jobs (StepStats.mask_wait_seconds). Rows not filled ahead (a first token, a resumed
sequence) are filled in line. The bitmask goes to the device in one copy as filled; the draw's kernel reads it for
those rows only, within the printable tokens, and takes a dead row's stop tokens
(tp_lora.ops.sampling.grammar_allowed). Matchers are deterministic, so every TP rank, advanced with the same tokens,
applies the same masks.

JSON is compact (no whitespace outside strings): a random or weak model cannot spend its tokens on whitespace.
A complete grammar allows only the stop tokens (EOS); a grammar that allows no token the tokenizer can spell
allows the stop tokens too (the output ends, cut short, finish_reason "stop"); max_tokens may cut a document
short (finish_reason "length")."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch

from tp_lora.engine.mask_process import (CACHE_SIZE, SLOTS, MaskProcess, MaskProcesses, ProcessLost, compile_schema,
                                         processes_for_host)
from tp_lora.engine.requests import Request
from tp_lora.engine.response_format import field_of, library, message, schema_error
from tp_lora.streamwait import HostFlag



def tokenizer_info(tok, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of a `tokenizers` Tokenizer for a model of `vocab_size` logits: each token's bytes, and the
    stop tokens a complete grammar allows."""
    xgr = library()
    from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar
    return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab_size,
                                              stop_token_ids=stop_ids)


class Grammars:
    """The compiled grammars (by schema text), and the requests whose matcher the matchers' processes hold (as many
    as `processes`; None: processes_for_host()); a step's grammar rows are at most `max_rows`."""

    def __init__(self, tokenizer, eos: set[int], max_rows: int = 64, processes: Optional[int] = None):
        self.tokenizer, self.stop_ids, self.max_rows = tokenizer, sorted(eos), max_rows
        self.count = processes or processes_for_host()
        self.compiler = None  # built at the first grammar: the tokenizer's view is computed once
        self.vocab = 0
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.procs: Optional[MaskProcesses] = None  # the matchers' processes, from the first grammar checked
        self.started: set[int] = set()  # request indices whose matcher a process holds
        self.took: dict[int, tuple[int, bool]] = {}  # request index -> (tokens taken in line, grammar complete)
        self.flags: Optional[list[HostFlag]] = None  # what the device waits on for each process's masks, where it can
        self.number = 0  # the last flag number handed out
        self.pending: list[Ahead] = []  # follow()'s work handed on, in order, until joined
        self.joined: Optional[Ahead] = None  # the last joined work: masks() takes its rows
        self.followed: dict[int, int] = {}  # request index -> the last token number handed on
        self.next_slot = 0  # the slot of the next follow()'s bitmask
        self.printable: Optional[torch.Tensor] = None  # the bitmask of the tokens JSON may hold
        self.allow: dict[torch.device, torch.Tensor] = {}  # [printable tokens, stop tokens] bitmasks per device
        self.waits: list[tuple] = []  # CUDA events around each device-side wait for masks, until read
        self.spare: list[tuple] = []  # such pairs read, for the next waits

    def check(self, req: Request, vocab: int) -> Optional[str]:
        """Why `req`'s grammar cannot run on a model of `vocab` logits, or None; compiles it into the cache."""
        if req.grammar is None:
            return None
        if req.min_tokens:
            return "'min_tokens' with 'response_format': the grammar decides where the output ends"
        if req.grammar in self.compiled:  # checked and compiled already
            self.compiled.move_to_end(req.grammar)
            return None
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
            self.procs = MaskProcesses(info.serialize_json(), (vocab + 31) // 32, self.max_rows, self.count)
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
        self._join()  # every step handed on, taken first
        rows = [(k, reqs[i].index, reqs[i].grammar) for k, i in enumerate(sel)]
        self.started.update(r[1] for r in rows)
        calls = []
        for proc, part in self._by_owner(rows):
            calls.append((proc, proc.next_seq()))
            proc.send(("fill", calls[-1][1], len(sel), part))
        for proc, seq in calls:
            self._lost_lets_go(proc.reply, seq)
        bits = torch.empty(len(sel), self.procs.words, dtype=torch.int32, pin_memory=pin)
        return sel, bits.copy_(self.procs.slot(SLOTS, len(sel)))

    def masks(self, reqs: list[Request], drawn: list[int], pin: bool
              ) -> tuple[Optional[tuple[list[int], torch.Tensor, Optional[tuple[list[HostFlag], int]]]], float]:
        """For on_device(): (fill()'s rows and bitmask for reqs whose requests drew drawn[i] tokens so far, what the
        device waits for first: (flags, number) or None), or None without grammar rows; and the seconds the host
        waited for masks (for the process's filling and for in-line fills, not for the device's tokens). The last
        follow()'s job, not waited for where the device can wait for it and it holds every row in order; else
        waited for, its rows taken and the others filled in line."""
        sel = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not sel:
            return None, 0.0
        job = self.pending[-1] if self.pending else None
        if job is not None and job.number and list(job.numbers) == [reqs[i].index for i in sel] and all(
                job.numbers[reqs[i].index] == drawn[i] for i in sel):
            return (sel, job.bits, (self._flags(job), job.number)), 0.0
        t0 = time.perf_counter()
        job = self._join()
        t1 = time.perf_counter()
        device_wait = max(0.0, min(t1, job.tokens_at) - t0) if job is not None else 0.0
        have = {} if job is None else job.rows
        ahead = [have.get(reqs[i].index, (-1, -1)) for i in sel]
        if all(n == drawn[i] for (n, _), i in zip(ahead, sel)) and [k for _, k in ahead] == list(
                range(job.bits.shape[0])):
            bits = job.bits  # every row, in order: the process's slot as it is
        else:
            bits = torch.empty(len(sel), self.procs.words, dtype=torch.int32, pin_memory=pin)
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
            stream = torch.cuda.current_stream(device)
            timed = self.spare.pop() if self.spare else (torch.cuda.Event(enable_timing=True),
                                                          torch.cuda.Event(enable_timing=True))
            timed[0].record(stream)
            for flag in after[0]:
                flag.wait(stream, after[1])
            timed[1].record(stream)
            self.waits.append(timed)
        if device not in self.allow:
            self.allow[device] = torch.stack([self.printable, pack(self.stop_ids, self.vocab)]).to(device)
        return sel, bits.to(device, non_blocking=True), self.allow[device]

    def device_waited(self) -> float:
        """Seconds the device waited for masks in the waits on_device() queued that have run since the last call."""
        done = 0
        while done < len(self.waits) and self.waits[done][1].query():
            done += 1
        seconds = sum(a.elapsed_time(b) for a, b in self.waits[:done]) / 1e3
        self.spare += self.waits[:done]
        del self.waits[:done]
        return seconds

    def follow(self, reqs: list[Request], drawn: list[int], host: torch.Tensor, done: Optional[torch.cuda.Event],
               device: torch.device) -> None:
        """Rows reqs[i] of a launched step on `device` drew their drawn[i]-th token, in host[0, i] once `done` has
        passed (None: there already): a job for the processes, whose matchers take those tokens and fill their next
        bitmask into a slot, for the next masks(). Posted in order once the host has them (hand_on(), or a join);
        the host does not wait here."""
        self._reap()
        rows = [(j, r.index, drawn[j]) for j, r in enumerate(reqs) if r.grammar is not None and r.index in self.started]
        if not rows:
            return
        if device.type == "cuda" and self.flags is None:
            self.flags = self.procs.host_flags(device)
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % SLOTS
        number = 0
        if self.flags is not None:
            number = self.number = self.number % 0x7FFFFFFF + 1
        for r in rows:
            self.followed[r[1]] = r[2]
        owners = sorted({self.procs.owner(r[1]) for r in rows}, key=lambda proc: proc.p)
        self.pending.append(Ahead({r[1]: r[2] for r in rows}, self.procs.slot(slot, len(rows)), number, owners, slot,
                                  [r[0] for r in rows], host, done))
        if done is None:
            self._send(self.pending[-1])

    def hand_on(self) -> None:
        """Post the jobs whose steps' tokens are on the host now, in order, without waiting."""
        for job in self.pending:
            if not job.sent:
                if job.done is not None and not job.done.query():
                    return
                self._send(job)

    def _send(self, job: Ahead) -> None:
        """The job's tokens (waited for) on the processes' board. If this fails, its slot allows every token and its
        flags are raised here (the device never waits for a job that was not posted)."""
        try:
            if job.done is not None:
                job.done.synchronize()
            job.tokens_at = time.perf_counter()
            toks = job.host[0].tolist()
            job.no = self._lost_lets_go(self.procs.post, job.number, job.slot, len(job.cols), list(job.numbers),
                                        [int(toks[c]) for c in job.cols])
            job.sent = True
        except BaseException:
            job.bits.fill_(-1)
            for flag in self._flags(job):
                flag.raise_to(job.number)
            raise

    def _flags(self, job: Ahead) -> list[HostFlag]:
        """The flags the device waits on for the job's masks (none without a number)."""
        return [self.flags[proc.p] for proc in job.owners] if job.number else []

    def _by_owner(self, rows: list[tuple]) -> list[tuple[MaskProcess, list[tuple]]]:
        """rows (each with its request index second) grouped by the process holding their matchers, in order."""
        parts: dict[int, list[tuple]] = {}
        for r in rows:
            parts.setdefault(self.procs.owner(r[1]).p, []).append(r)
        return [(self.procs.procs[p], part) for p, part in sorted(parts.items())]

    def _call(self, proc: MaskProcess, msg: tuple) -> tuple:
        """Send `msg` to `proc` (after every job before it) and wait for its reply."""
        proc.send(msg)
        return self._lost_lets_go(proc.reply, msg[1])

    def _lost_lets_go(self, call, *args):
        """call(*args); where a process is lost, the device's waits are let go first."""
        try:
            return call(*args)
        except ProcessLost:
            for flag in self.flags or []:
                flag.raise_to(self.number)
            raise

    def _join(self) -> Optional[Ahead]:
        """Every job handed on, done (the host waits for them here), their rows kept for masks() while their
        requests run; the last one joined (None before any)."""
        while self.pending:
            self._absorb(self.pending.pop(0), block=True)
        return self.joined

    def _reap(self) -> None:
        """The jobs the processes have finished, joined without waiting (a failed one raises here)."""
        self.hand_on()
        while self.pending and self.pending[0].sent and self._absorb(self.pending[0], block=False):
            self.pending.pop(0)

    def _absorb(self, job: Ahead, block: bool) -> bool:
        """Whether the job is done (posted first if it was not; waited for if `block`); if so, joined."""
        if not job.sent:
            self._send(job)
        if not self._lost_lets_go(self.procs.done, job.no, job.owners, block):
            return False
        job.rows = {}
        for k, (index, got) in enumerate(job.numbers.items()):
            if index in self.started:  # not forgotten (ended or cancelled) meanwhile
                job.rows[index] = (got, k)
        self.joined = job
        return True

    def advance(self, index: int, tok: int, number: int) -> bool:
        """Request `index`'s matcher takes `tok`, its `number`-th token (unless follow() handed it on); whether its
        grammar is now complete and stopped. Requests without a matcher: False. A token handed on ends the grammar
        exactly when it is a stop token (its mask allowed one only where the grammar may end, or where nothing else
        was left), so the host does not wait for a process to know."""
        if index not in self.started:
            return False
        if self.followed.get(index, -1) >= number:
            return tok in self.stop_ids
        got = self.took.get(index)
        if got is not None and got[0] >= number:
            return got[0] == number and got[1]
        self._join()
        proc = self.procs.owner(index)
        done = self._call(proc, ("accept", proc.next_seq(), index, None, tok))[1]
        self.took[index] = (number, done)
        return done

    def forget(self, index: int) -> None:
        if index in self.started:  # a job sent later with its row fills that row with zeros
            self.started.discard(index)
            self.procs.owner(index).send(("forget", index))
        self.took.pop(index, None)
        self.followed.pop(index, None)

    def reset(self) -> None:
        """Drop every matcher, the jobs not sent (their flags raised: nothing on the device waits for ever) and the
        processes' replies to the work still under way (they run on over dropped matchers)."""
        if self.procs is not None:
            for proc in self.procs.procs:
                proc.send(("reset",))
            self.procs.drop_replies()
        for job in self.pending:
            if not job.sent:
                for flag in self._flags(job):
                    flag.raise_to(job.number)
        self.started.clear()
        self.took.clear()
        self.followed.clear()
        self.pending.clear()
        self.joined = None


@dataclass
class Ahead:
    """One step's grammar rows handed on (Grammars.follow)."""
    numbers: dict[int, int]  # request index -> the number of the token it drew in that step, in bits' row order
    bits: torch.Tensor  # the rows' next bitmask as the processes fill it (its slot in the shared region)
    number: int  # the flag number each of its processes raises once its rows of bits are written (0: no flags)
    owners: list[MaskProcess]  # the processes holding its rows' matchers
    slot: int  # bits' slot
    cols: list[int]  # the rows' columns in host
    host: torch.Tensor  # [2, N] the step's drawn tokens and log-probabilities, once done has passed
    done: Optional[torch.cuda.Event]  # recorded after the step's copy to host (None: there already)
    sent: bool = False
    no: int = 0  # its board job number, once posted
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # once joined: request index -> (its token's
    # number, its row in bits)
    tokens_at: float = 0.0  # perf_counter() when the step's tokens were on the host, once posted


def pack(ids: list[int], vocab: int) -> torch.Tensor:
    """The int32 bitmask [ceil(vocab / 32)] allowing exactly `ids` (bit i % 32 of word i // 32)."""
    allowed = torch.zeros((vocab + 31) // 32 * 32, dtype=torch.int64)
    allowed[ids] = 1
    words = (allowed.view(-1, 32) << torch.arange(32)).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

