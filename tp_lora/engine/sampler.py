"""Token choice from gathered logits, and the per-request rules around it: sampling parameters (the request's or the
run's defaults), logit rules (tp_lora.engine.logit_rules), grammars (tp_lora.engine.grammar), seeds, and when a
sequence ends (EOS, stop_token_ids, stop strings, a complete grammar, length) with its text. Reported
log-probabilities are the model's (before logit rules, grammars and temperature). Every TP rank holds the same logits
and the same generator states, so every rank picks the same token without a broadcast."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from tp_lora.config import GenerationConfig
from tp_lora.engine.grammar import Grammars
from tp_lora.engine.logit_rules import LogitRules
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.tokenizer import Detokenizer, TextTokenizer
from tp_lora.hostcopy import to_device
from tp_lora.ops.sampling import greedy


MASK32 = 0xFFFFFFFF
# Temperatures below this are greedy: float32 logits divided by a tinier one overflow (NaN probabilities), and the
# distribution is one-hot long before (the same bound as vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (each product stays below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def seeded_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 Exp(1) variates that depend only on each row's (seed, step) and the token id: a request's
    draws are the same whatever else shares its step, on every rank and device."""
    key = _mix((seeds & MASK32) ^ _mix(((seeds >> 32) & MASK32) ^ _mix(steps & MASK32)))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix(_mix((key[:, None] + ids[None, :] * 0x9E3779B1) & MASK32) ^ key[:, None])
    return -torch.log(((h >> 8).float() + 0.5) / float(1 << 24))


def draw(logits: torch.Tensor, temperatures: list[float], top_p: Union[float, Sequence[float]],
         generator: Optional[torch.Generator] = None, seeds: Optional[list[Optional[int]]] = None,
         steps: Optional[list[int]] = None, raw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [N, V] -> [2, N] float64 on logits' device: each row's token id (exact in float64) and its
    log-probability under `raw` (the model's logits before any logit rule; default: logits) unscaled by temperature,
    so one device->host copy reads both, with no host sync on the way. A temperature below GREEDY_BELOW (0
    included) is greedy; the others draw on the device with the exponential race (argmax of p / E, E ~ Exp(1): a draw from p). top_p is one
    for all rows or one per row; a row whose seeds[i] is set takes its noise from (seed, steps[i]) (seeded_noise),
    the others from `generator` (a generator of logits' device), in one call."""
    out = greedy(logits)  # [2, N] float64: each row's argmax token, its log-probability
    hot = [i for i, t in enumerate(temperatures) if t >= GREEDY_BELOW]  # on the host: no device round trip for greedy
    if hot:
        dev = logits.device
        tops = [top_p] * len(hot) if isinstance(top_p, (int, float)) else [top_p[i] for i in hot]
        own = [j for j, i in enumerate(hot) if seeds is not None and seeds[i] is not None]
        # the rows' parameters in one asynchronous copy (a plain torch.tensor(..., device=cuda) waits for the stream)
        rows, temps, keep, own_t, own_seeds, own_steps = to_device([
            torch.tensor(hot), torch.tensor([temperatures[i] for i in hot], dtype=torch.float32),
            torch.tensor(tops, dtype=torch.float32)[:, None], torch.tensor(own, dtype=torch.long),
            torch.tensor([seeds[hot[j]] for j in own], dtype=torch.long),
            torch.tensor([steps[hot[j]] for j in own], dtype=torch.long)], dev)
        probs = torch.softmax(logits[rows].float() / temps[:, None], -1)
        if min(tops) < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > keep  # keep the smallest prefix reaching top_p
            sorted_p.masked_fill_(drop, 0.0)  # not sorted_p[drop] = 0: a boolean index syncs with the host
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        if own:
            noise[own_t] = seeded_noise(own_seeds, own_steps, probs.shape[1])
        picks = (probs / noise).argmax(-1)
        out[0, rows] = picks.double()
    if raw is not None:  # every row's log-probability under the model's logits
        out[1] = torch.log_softmax(raw.float(), -1).gather(-1, out[0].long()[:, None]).flatten().double()
    elif hot:
        lp = torch.log_softmax(logits[rows].float(), -1).gather(-1, picks[:, None]).flatten()
        out[1, rows] = lp.double()
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """logits [N, V] -> per row the k most likely (token, log-probability), most likely first."""
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


class Sampler:
    """draw() with each request's parameters and logit rules, and the end of each sequence. Holds per-request state
    (stop-string text, tokens drawn so far, logit-rule rows) from a request's first token to its end (forget())."""

    def __init__(self, gen: GenerationConfig, eos: set[int], tokenizer: Optional[TextTokenizer]):
        self.gen, self.eos, self.tokenizer = gen, eos, tokenizer
        self.generators: dict[torch.device, torch.Generator] = {}  # the run's draws, per device
        self.decode_outputs = True  # finished results carry their text (a server's front end decodes on its own)
        self.rules = LogitRules(eos)
        self.grammars = Grammars(tokenizer, eos)
        self._text: dict[int, Detokenizer] = {}  # requests with stop strings: their text so far
        self._drawn: dict[int, int] = {}  # tokens drawn per request (its seeded noise, min_tokens)
        self._stop_ids: dict[int, frozenset[int]] = {}  # requests with stop_token_ids: them as a set
        self._last: tuple = ([], [], None)  # the last sample()'s requests, each one's draws, and its device

    def check(self, req: Request, vocab: int) -> Optional[str]:
        """Why req's grammar cannot run on a model of `vocab` logits, or None (compiled then, once per schema)."""
        return self.grammars.check(req, vocab)

    def sample(self, rows: torch.Tensor, reqs: list[Request], stats=None) -> torch.Tensor:
        """draw() over logits `rows` [N, V], row i for reqs[i], after their logit rules and grammars. stats: a
        StepStats that counts the host's wait for grammar masks."""
        temps = [r.temperature if r.temperature is not None else self.gen.temperature for r in reqs]
        top_ps = [r.top_p if r.top_p is not None else self.gen.top_p for r in reqs]
        steps = [self._drawn.get(r.index, 0) for r in reqs]
        chosen = self.rules.apply(rows, reqs, steps)
        # the grammar rows' bitmask last: filled ahead on the worker (follow()) while the device runs the step
        masks, waited = self.grammars.masks(reqs, steps, pin=rows.device.type == "cuda")
        if masks is not None:
            chosen = self.grammars.apply(chosen, masks)
            if stats is not None:
                stats.mask_steps += 1
                stats.mask_wait_seconds += waited
        gen = self.generators.get(rows.device)
        if gen is None:
            gen = self.generators[rows.device] = torch.Generator(rows.device).manual_seed(self.gen.seed)
        out = draw(chosen, temps, top_ps, gen, [r.seed for r in reqs], steps, None if chosen is rows else rows)
        self.rules.update(out[0])
        for r, n in zip(reqs, steps):
            self._drawn[r.index] = n + 1
        self._last = (reqs, [n + 1 for n in steps], rows.device)
        return out

    def follow(self, host: torch.Tensor, wait: Optional[Callable[[], None]]) -> None:
        """The last sample()'s tokens are copied into `host` ([2, N], pinned where on CUDA), there once wait()
        returns (None: already): its grammar rows take them and fill their next masks on a worker thread
        (Grammars.follow), while the host prepares the next step."""
        reqs, numbers, device = self._last
        if any(r.grammar is not None for r in reqs):
            self.grammars.follow(reqs, numbers, host, wait, device)

    def finished(self, res: Result, tok: int, generated: int) -> bool:
        """Whether the sequence of `res` ends with its `generated`-th new token `tok` (its grammar's matcher, if any,
        takes the token); sets its finish_reason and, at a stop string, its text."""
        req = res.request
        ignore = req.ignore_eos if req.ignore_eos is not None else self.gen.ignore_eos
        complete = self.grammars.advance(req.index, tok, generated)  # a complete grammar took its stop token
        if (complete or (not ignore and tok in self.eos) or (req.stop_token_ids and tok in self._stops(req))
                or (req.stop and self._stop_string(res, tok))):
            res.finish_reason = "stop"
            return True
        return generated >= req.max_new_tokens

    def _stops(self, req: Request) -> frozenset[int]:
        """req.stop_token_ids as a set, made at its first token: each token is checked in O(1), whatever their
        number."""
        stops = self._stop_ids.get(req.index)
        if stops is None:
            stops = self._stop_ids[req.index] = frozenset(req.stop_token_ids)
        return stops

    def _stop_string(self, res: Result, tok: int) -> bool:
        """Whether the text now holds one of the request's stop strings; the result's text then ends before it."""
        text = self._text.setdefault(res.request.index, Detokenizer(self.tokenizer))
        before = len(text.text)
        if not text.add([tok]):
            return False
        longest = max(len(s) for s in res.request.stop)
        window = max(0, before - longest + 1)  # a match must end in the new text
        hits = [i for i in (text.text.find(s, window) for s in res.request.stop) if i >= 0]
        if not hits:
            return False
        res.text = text.text[:min(hits)]
        return True

    def final_text(self, res: Result) -> None:
        """A finished result's decoded text (with a tokenizer, and decode_outputs), unless a stop string set it."""
        self.forget(res.request.index)
        if self.decode_outputs and self.tokenizer is not None and res.text is None:
            res.text = self.tokenizer.decode(res.output_token_ids)

    def forget(self, index: int) -> None:
        """Drop request `index`'s state (it ended)."""
        self._text.pop(index, None)
        self._drawn.pop(index, None)
        self._stop_ids.pop(index, None)
        self.rules.forget(index)
        self.grammars.forget(index)

    def reset(self) -> None:
        """Drop every request's state (a new run)."""
        self._text.clear()
        self._drawn.clear()
        self._stop_ids.clear()
        self.rules.reset()
        self.grammars.reset()
