"""Token choice from gathered logits, and the per-request rules around it: sampling parameters (the request's or the
run's defaults), seeds, and when a sequence ends (EOS, stop strings, length) with its text. Every TP rank holds the
same logits and the same generator states, so every rank picks the same token without a broadcast."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from tp_lora.config import GenerationConfig
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.tokenizer import Detokenizer, TextTokenizer
from tp_lora.ops.sampling import greedy


def draw(logits: torch.Tensor, temperatures: list[float], top_p: Union[float, Sequence[float]],
         generator: Union[torch.Generator, None, Sequence[Optional[torch.Generator]]]) -> torch.Tensor:
    """logits [N, V] float32 -> [2, N] float64 on logits' device: each row's token id (exact in float64) and its
    log-probability under the unscaled distribution, so one device->host copy reads both. Temperature 0 is greedy
    (no host sync); top_p and generator are one for all rows or a list with one per row (a request with its own seed
    has its own generator); the rows sharing a generator draw in one call, in row order, on the host."""
    out = greedy(logits)  # [2, N] float64: each row's argmax token, its log-probability
    hot = [i for i, t in enumerate(temperatures) if t > 0]  # decided on the host: no device round trip for greedy
    if hot:
        rows = torch.tensor(hot, device=logits.device)
        temps = torch.tensor([temperatures[i] for i in hot], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits[rows] / temps[:, None], -1)
        tops = [top_p] * len(hot) if isinstance(top_p, (int, float)) else [top_p[i] for i in hot]
        if min(tops) < 1.0:
            keep = torch.tensor(tops, dtype=torch.float32, device=logits.device)[:, None]
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > keep  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs.cpu()
        gens = [generator] * len(hot) if not isinstance(generator, (list, tuple)) else [generator[i] for i in hot]
        picks = torch.empty(len(hot), dtype=torch.int64)
        for g in dict.fromkeys(gens):  # each generator draws its rows in one call
            mine = [j for j, x in enumerate(gens) if x is g]
            picks[mine] = torch.multinomial(probs[mine], 1, generator=g).flatten()
        picks = picks.to(logits.device)
        out[0, rows] = picks.double()
        out[1, rows] = torch.log_softmax(logits[rows], -1).gather(-1, picks[:, None]).flatten().double()
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """logits [N, V] -> per row the k most likely (token, log-probability), most likely first."""
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


class Sampler:
    """draw() with each request's parameters, and the end of each sequence. Holds per-request state (stop-string
    text, own-seed generators) from a request's first token to its end (forget())."""

    def __init__(self, gen: GenerationConfig, eos: set[int], tokenizer: Optional[TextTokenizer]):
        self.gen, self.eos, self.tokenizer = gen, eos, tokenizer
        self.generator = torch.Generator().manual_seed(gen.seed)
        self.decode_outputs = True  # finished results carry their text (a server's front end decodes on its own)
        self._text: dict[int, Detokenizer] = {}  # requests with stop strings: their text so far
        self._seeded: dict[int, torch.Generator] = {}  # requests with their own seed: their generator

    def sample(self, rows: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """draw() over logits `rows` [N, V], row i for reqs[i]."""
        temps = [r.temperature if r.temperature is not None else self.gen.temperature for r in reqs]
        top_ps = [r.top_p if r.top_p is not None else self.gen.top_p for r in reqs]
        return draw(rows, temps, top_ps, self._generators(reqs))

    def _generators(self, reqs: list[Request]):
        """The run's generator, or per request where one has its own seed (made at its first sample)."""
        if all(r.seed is None for r in reqs):
            return self.generator
        return [self.generator if r.seed is None else
                self._seeded.setdefault(r.index, torch.Generator().manual_seed(r.seed)) for r in reqs]

    def finished(self, res: Result, tok: int, generated: int) -> bool:
        """Whether the sequence of `res` ends with its `generated`-th new token `tok`; sets its finish_reason and, at
        a stop string, its text."""
        req = res.request
        ignore = req.ignore_eos if req.ignore_eos is not None else self.gen.ignore_eos
        if (not ignore and tok in self.eos) or (req.stop and self._stop_string(res, tok)):
            res.finish_reason = "stop"
            return True
        return generated >= req.max_new_tokens

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
        self._seeded.pop(index, None)

    def reset(self) -> None:
        """Drop every request's state (a new run)."""
        self._text.clear()
        self._seeded.clear()
