"""Structured output: a request's response_format (any JSON object, or a JSON schema) as a grammar whose matcher
masks the logits of the request's rows, through xgrammar (the optional `structured` extra).

A grammar is compiled once per schema text (an LRU cache) when its request is checked, on every rank alike. Each
request then holds a matcher from its first sample to its end: before a step's draw the matchers of the step's
rows fill a bitmask on the host (while the device still runs the forward) that is copied to the device and applied
to those rows only; after the draw each matcher advances with its row's token (Sampler.finished, once the host has
the token: the engine reads a step with grammar rows before it launches the next). Matchers are deterministic, so
every TP rank, advanced with the same tokens, applies the same masks.

JSON is compact (no whitespace outside strings): a random or weak model cannot spend its tokens on whitespace.
A complete grammar allows only the stop tokens (EOS); a grammar that allows no token the tokenizer can spell
allows the stop tokens too (the output ends, cut short, finish_reason "stop"); max_tokens may cut a document
short (finish_reason "length")."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Optional

import torch

from tp_lora.engine.requests import Request
from tp_lora.engine.response_format import SEPARATORS, field_of, library, message, schema_error

CACHE_SIZE = 256  # compiled grammars kept, by schema text


def tokenizer_info(tok, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of a `tokenizers` Tokenizer for a model of `vocab_size` logits: each token's bytes, and the
    stop tokens a complete grammar allows."""
    xgr = library()
    from transformers import PreTrainedTokenizerFast  # a dependency of xgrammar
    return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab_size,
                                              stop_token_ids=stop_ids)


class Grammars:
    """The compiled grammars (by schema text) and the matchers of the requests that have one."""

    def __init__(self, tokenizer, eos: set[int]):
        self.tokenizer, self.stop_ids = tokenizer, sorted(eos)
        self.compiler = None  # built at the first grammar: the tokenizer's view is computed once
        self.vocab = 0
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.matchers: dict[int, object] = {}
        self.batch = None
        self.printable: Optional[torch.Tensor] = None  # the bitmask of the tokens JSON may hold

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
            self.batch = xgr.BatchGrammarMatcher(max(1, min(8, (os.cpu_count() or 2) // 2)))
        if req.grammar in self.compiled:
            self.compiled.move_to_end(req.grammar)
            return None
        kind, text = req.grammar
        try:
            compiled = self.compiler.compile_json_schema(text, any_whitespace=False, separators=SEPARATORS)
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
        """(the rows of reqs with a grammar, their int32 bitmask [rows, ceil(vocab / 32)] on the host, pinned where
        `pin`) for the next token, or None when no row has one. A row allowing nothing allows the stop tokens."""
        sel = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not sel:
            return None
        matchers = [self._matcher(reqs[i]) for i in sel]
        bits = torch.empty(len(sel), (self.vocab + 31) // 32, dtype=torch.int32, pin_memory=pin)
        self.batch.batch_fill_next_token_bitmask(matchers, bits)
        bits &= self.printable
        dead = ~bits.any(1)  # the tokenizer cannot go on: end the output
        if bool(dead.any()):
            bits[dead] = pack(self.stop_ids, self.vocab)
        return sel, bits

    def _matcher(self, req: Request):
        m = self.matchers.get(req.index)
        if m is None:
            if req.grammar not in self.compiled:  # evicted from the cache since its check
                self.check(req, self.vocab)
            m = self.matchers[req.index] = library().GrammarMatcher(self.compiled[req.grammar])
        return m

    def advance(self, index: int, tok: int) -> bool:
        """Request `index`'s matcher takes its drawn token `tok`; whether its grammar is now complete and stopped
        (True for a stop token). Requests without a grammar: False."""
        m = self.matchers.get(index)
        if m is None:
            return False
        m.accept_token(tok)
        return m.is_terminated()

    def forget(self, index: int) -> None:
        self.matchers.pop(index, None)

    def reset(self) -> None:
        self.matchers.clear()


def pack(ids: list[int], vocab: int) -> torch.Tensor:
    """The int32 bitmask [ceil(vocab / 32)] allowing exactly `ids` (bit i % 32 of word i // 32)."""
    allowed = torch.zeros((vocab + 31) // 32 * 32, dtype=torch.int64)
    allowed[ids] = 1
    words = (allowed.view(-1, 32) << torch.arange(32)).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def apply_mask(logits: torch.Tensor, sel: list[int], bits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with rows `sel` set to -inf where their host bitmask `bits` [len(sel), ceil(V / 32)] has a 0
    bit; a new tensor (the model's logits stay as they were for the reported log-probabilities)."""
    dev, vocab = logits.device, logits.shape[1]
    words = bits.to(dev, non_blocking=True)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    rows = torch.tensor(sel, device=dev)
    return logits.float().index_put((rows,), logits[rows].float().masked_fill(~allowed, float("-inf")))
