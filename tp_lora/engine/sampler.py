"""Token choice from gathered logits (or, for rows that need only the race, from each TP rank's vocabulary shard), and
the per-request rules around it: sampling parameters (the request's or the run's defaults), logit rules
(tp_lora.engine.logit_rules), grammars (tp_lora.engine.grammar), seeds, and when a sequence ends (EOS,
stop_token_ids, stop strings, a complete grammar, length) with its text. Reported log-probabilities are the model's
(before logit rules, grammars and temperature). Every TP rank holds the same logits (or the same exchanged race
parts) and the same generator states, so every rank picks the same token without a broadcast."""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch

from tp_lora import distributed as comm
from tp_lora.config import GenerationConfig
from tp_lora.engine.grammar import Grammars
from tp_lora.engine.logit_rules import LogitRules, has_rules
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.tokenizer import Detokenizer, TextTokenizer
from tp_lora.hostcopy import to_device
from tp_lora.ops.sampling import MASK32, grammar_allowed, mix32, race, race_combine, race_shard


# Temperatures below this are greedy: float32 logits divided by a tinier one overflow (NaN probabilities), and the
# distribution is one-hot long before (the same bound as vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5


def seed_key(seed: int, step: int) -> int:
    """The noise key of a seeded request's `step`-th draw: the same on every rank and device."""
    return mix32((seed & MASK32) ^ mix32(((seed >> 32) & MASK32) ^ mix32(step & MASK32)))


def draw(logits: torch.Tensor, temperatures: list[float], top_p: Union[float, Sequence[float]],
         generator: Optional[torch.Generator], seeds: Optional[list[Optional[int]]] = None,
         steps: Optional[list[int]] = None, raw: Optional[torch.Tensor] = None,
         grammar: Optional[tuple[list[int], torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """logits [N, V] -> [2, N] float64 on logits' device: each row's token id (exact in float64) and its
    log-probability under `raw` (the model's logits before any logit rule; default: logits) unscaled by temperature,
    so one device->host copy reads both, with no host sync on the way (tp_lora.ops.sampling.race, one launch). A
    temperature below GREEDY_BELOW (0 included) is greedy; the others draw by the exponential race, their noise keyed
    by (seed, steps[i]) where seeds[i] is set (seed_key), else by a key from `generator` (CPU; None: torch's). Only
    the keys travel each step; the rows' other parameters are kept on the device (row_params). top_p is one for all
    rows or one per row; grammar: (rows, their bitmasks and the vocabulary's allow rows on logits' device,
    tp_lora.ops.sampling.grammar_allowed) limits those rows to the tokens their grammars allow."""
    n = len(temperatures)
    temps = [t if t >= GREEDY_BELOW else 0.0 for t in temperatures]
    tops = [top_p] * n if isinstance(top_p, (int, float)) else list(top_p)
    keys = noise_keys(n, generator, seeds, steps)
    sel, words, allow = grammar if grammar is not None else ([], None, None)
    where = [-1] * n
    for k, i in enumerate(sel):
        where[i] = k
    # asynchronous copies (a plain torch.tensor(..., device=cuda) waits for the stream)
    keys_t, = to_device([keys], logits.device)
    temps_t, where_t, nucleus_t, tops_t = row_params(tuple(temps), tuple(tops), tuple(where), logits.device)
    if nucleus_t.numel():
        if raw is None:
            raw = logits
        logits = top_p_filter(logits, nucleus_t, temps_t, tops_t, words, where_t, allow)
    return race(logits, raw, temps_t, keys_t, words, where_t if words is not None else None, allow)


def noise_keys(n: int, generator: Optional[torch.Generator], seeds: Optional[list[Optional[int]]],
               steps: Optional[list[int]]) -> torch.Tensor:
    """[n] int64 noise keys on the CPU: seed_key(seed, step) for seeded rows, else drawn from `generator`."""
    keys = torch.randint(0, 1 << 32, (n,), generator=generator)
    if seeds is not None and any(s is not None for s in seeds):
        keys = torch.tensor([k if s is None else seed_key(s, step) for k, s, step in zip(keys.tolist(), seeds, steps)])
    return keys


def draw_shard(logits: torch.Tensor, offset: int, temperatures: list[float], generator: Optional[torch.Generator],
               group, seeds: Optional[list[Optional[int]]] = None, steps: Optional[list[int]] = None
               ) -> torch.Tensor:
    """draw(logits, temperatures, 1.0, ...) where each rank of the TP group `group` holds its vocabulary shard of the
    logits, [N, V / p] from token `offset` on: each races its shard, the ranks exchange 4 numbers a row and part
    (tp_lora.ops.sampling.race_shard, one all-gather) and every rank combines them alike. The same tokens as draw()
    on the gathered logits; log-probabilities within float32 rounding."""
    n = len(temperatures)
    keys_t, = to_device([noise_keys(n, generator, seeds, steps)], logits.device)
    temps_t = row_params(tuple(t if t >= GREEDY_BELOW else 0.0 for t in temperatures), (1.0,) * n, (-1,) * n,
                         logits.device)[0]
    parts = race_shard(logits, temps_t, keys_t, offset)  # [P, 4, N], P alike on every rank
    return race_combine(comm.all_gather(parts.reshape(1, -1), group, dim=0).view(-1, 4, n))


@functools.lru_cache(maxsize=8)
def row_params(temps: tuple, tops: tuple, where: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rows' draw parameters on `device`: temperatures [N] float32, grammar bitmask rows [N] int32, the nucleus
    rows (hot, top_p < 1) [M] int64 and their top_p [M] float32. Kept for the next steps: a batch's rows keep their
    parameters from step to step, so a step sends only its noise keys."""
    nucleus = [i for i in range(len(temps)) if temps[i] > 0 and tops[i] < 1.0]
    return tuple(to_device([torch.tensor(temps, dtype=torch.float32), torch.tensor(where, dtype=torch.int32),
                            torch.tensor(nucleus, dtype=torch.long),
                            torch.tensor([tops[i] for i in nucleus], dtype=torch.float32)], device))


def top_p_filter(logits: torch.Tensor, rows: torch.Tensor, temps: torch.Tensor, tops: torch.Tensor,
                 words: Optional[torch.Tensor], where: torch.Tensor, allow: Optional[torch.Tensor]) -> torch.Tensor:
    """logits as float32 with rows `rows` set to -inf outside the smallest prefix of their tokens, most likely first
    under softmax(logits / temps), that reaches tops (per row; tokens their grammar bits forbid count as
    impossible). A new tensor; the race over it draws from each row's renormalized nucleus."""
    x = logits[rows].float()
    if words is not None:
        own = where[rows]
        allowed = grammar_allowed(words, allow, x.shape[1])[own.clamp(min=0)] | (own < 0)[:, None]
        x = x.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(x / temps[rows][:, None], -1)
    sorted_p, idx = probs.sort(-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > tops[:, None]  # keep the smallest prefix reaching top_p
    x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, idx, drop), float("-inf"))
    return logits.float().index_put((rows,), x)


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """logits [N, V] -> per row the k most likely (token, log-probability), most likely first."""
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


class Sampler:
    """draw() with each request's parameters and logit rules, and the end of each sequence. Holds per-request state
    (stop-string text, tokens drawn so far, logit-rule rows) from a request's first token to its end (forget())."""

    def __init__(self, gen: GenerationConfig, eos: set[int], tokenizer: Optional[TextTokenizer], max_rows: int = 64):
        self.gen, self.eos, self.tokenizer = gen, eos, tokenizer
        self.generator = torch.Generator().manual_seed(gen.seed)  # unseeded rows' noise keys, on every rank alike
        self.decode_outputs = True  # finished results carry their text (a server's front end decodes on its own)
        self.rules = LogitRules(eos)
        self.grammars = Grammars(tokenizer, eos, max_rows)  # max_rows: rows per sample()
        self._text: dict[int, Detokenizer] = {}  # requests with stop strings: their text so far
        self._drawn: dict[int, int] = {}  # tokens drawn per request (its seeded noise, min_tokens)
        self._stop_ids: dict[int, frozenset[int]] = {}  # requests with stop_token_ids: them as a set
        self._last: tuple = ([], [], None)  # the last sample()'s requests, each one's draws, and its device

    def check(self, req: Request, vocab: int) -> Optional[str]:
        """Why req's grammar cannot run on a model of `vocab` logits, or None (compiled then, once per schema)."""
        return self.grammars.check(req, vocab)

    def _params(self, reqs: list[Request]) -> tuple[list[float], list[float], list[int]]:
        """Each request's temperature and top_p (its own, else the run's) and its tokens drawn so far."""
        temps = [r.temperature if r.temperature is not None else self.gen.temperature for r in reqs]
        top_ps = [r.top_p if r.top_p is not None else self.gen.top_p for r in reqs]
        return temps, top_ps, [self._drawn.get(r.index, 0) for r in reqs]

    def plain(self, reqs: list[Request]) -> bool:
        """Whether the rows of reqs need nothing but the race (no logit rule, grammar, nucleus or top
        log-probabilities): sample_shard can draw them from vocabulary shards."""
        temps, top_ps, _ = self._params(reqs)
        return all(not has_rules(r) and r.grammar is None and not r.logprobs and (t < GREEDY_BELOW or p >= 1.0)
                   for r, t, p in zip(reqs, temps, top_ps))

    def sample_shard(self, rows: torch.Tensor, offset: int, group, reqs: list[Request]) -> torch.Tensor:
        """sample() of plain rows (plain(reqs)) where each rank of the TP group holds its vocabulary shard `rows`
        [N, V / p], tokens `offset` onward (draw_shard)."""
        temps, _, steps = self._params(reqs)
        self.rules.apply(rows, reqs, steps)  # none: this step's rule plan is empty
        out = draw_shard(rows, offset, temps, self.generator, group, [r.seed for r in reqs], steps)
        self._drawn_now(reqs, steps, out, rows.device)
        return out

    def sample(self, rows: torch.Tensor, reqs: list[Request], stats=None) -> torch.Tensor:
        """draw() over logits `rows` [N, V], row i for reqs[i], after their logit rules and grammars. stats: a
        StepStats that counts the host's wait for grammar masks."""
        temps, top_ps, steps = self._params(reqs)
        chosen = self.rules.apply(rows, reqs, steps)
        # the grammar rows' bitmask last: filled ahead by their matchers' process while the device runs the step
        masks, waited = self.grammars.masks(reqs, steps, pin=rows.device.type == "cuda")
        grammar = None
        if masks is not None:
            grammar = self.grammars.on_device(masks, rows.device)
            if stats is not None:
                stats.mask_steps += 1
                stats.mask_wait_seconds += waited
                stats.mask_device_wait_seconds += self.grammars.device_waited()
        out = draw(chosen, temps, top_ps, self.generator, [r.seed for r in reqs], steps,
                   None if chosen is rows else rows, grammar)
        self._drawn_now(reqs, steps, out, rows.device)
        return out

    def _drawn_now(self, reqs: list[Request], steps: list[int], out: torch.Tensor, device: torch.device) -> None:
        self.rules.update(out[0])
        for r, n in zip(reqs, steps):
            self._drawn[r.index] = n + 1
        self._last = (reqs, [n + 1 for n in steps], device)

    def follow(self, host: torch.Tensor, done: Optional[torch.cuda.Event]) -> None:
        """The last sample()'s tokens are copied into `host` ([2, N], pinned where on CUDA), there once `done` has
        passed (None: already): its grammar rows' matchers will take them and fill their next masks (Grammars.follow)
        while the device runs the next step."""
        reqs, numbers, device = self._last
        if any(r.grammar is not None for r in reqs):
            self.grammars.follow(reqs, numbers, host, done, device)

    def hand_on(self) -> None:
        """A launched step's tokens reached the host: its grammar rows' tokens go on to their matchers now."""
        if self.grammars.pending:
            self.grammars.hand_on()

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
