"""Requests' logit rules, applied on the device to a step's logits in one batched pass over the rows that have any:
logit_bias, repetition / frequency / presence penalties (vLLM's and OpenAI's definitions) and min_tokens (EOS and
stop_token_ids held back). Each such request holds a row of device state from its first sample to its end: the counts
of the tokens it generated, its prompt's tokens (repetition), its bias and its held-back tokens. A row is written once,
at the request's first sample; the counts are then updated on the device from the drawn tokens, so no step waits for
the host (a step launched ahead of the host's read counts its token all the same)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tp_lora.engine.requests import Request
from tp_lora.hostcopy import to_device


def has_rules(req: Request) -> bool:
    return bool(req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1.0 or req.logit_bias
                or req.min_tokens)


def apply_rules(logits: torch.Tensor, counts: Optional[torch.Tensor], prompt: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], held: Optional[torch.Tensor], presence: torch.Tensor,
                frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> the logits the choice is made from. counts [R, V]: each token's occurrences in the generated
    tokens (None: no penalties); prompt [R, V] bool: tokens in the prompt (None: no repetition penalty); bias [R, V]
    added first; held [R, V] bool: tokens set to -inf; presence / frequency / repetition [R]. Repetition divides a
    positive logit of a token seen in the prompt or the output by the penalty and multiplies a negative one; then
    frequency * count + presence * (count > 0) is subtracted (OpenAI)."""
    x = logits.float()
    if bias is not None:
        x = x + bias
    if counts is not None:
        seen = counts > 0
        if prompt is not None:
            rep = repetition[:, None]
            x = torch.where(seen | prompt, torch.where(x > 0, x / rep, x * rep), x)
        x = x - frequency[:, None] * counts - presence[:, None] * seen
    if held is not None:
        x = x.masked_fill(held, float("-inf"))
    return x


@dataclass
class RulePlan:
    """One step's rows with rules: their logits rows and their state rows (device index tensors)."""
    sel: torch.Tensor
    rows: torch.Tensor


class LogitRules:
    """The device state rows of the requests with logit rules, and their application to a step's logits."""

    def __init__(self, eos: set[int]):
        self.eos = sorted(eos)
        self.row_of: dict[int, int] = {}  # request index -> state row
        self.free: list[int] = []
        self.cap = 0
        self.t: dict[str, torch.Tensor] = {}  # counts / prompt / bias / held [cap, V]; presence / ... [cap]
        self.plan: Optional[RulePlan] = None  # the last apply()'s rows, for update()

    def apply(self, logits: torch.Tensor, reqs: list[Request], generated: list[int]) -> torch.Tensor:
        """logits [N, V] of reqs (reqs[i] has generated[i] tokens so far) -> logits after each row's rules (the same
        tensor when no row has any)."""
        sel = [i for i, r in enumerate(reqs) if has_rules(r)]
        self.plan = None
        if not sel:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        for i in sel:
            if reqs[i].index not in self.row_of:
                self._assign(reqs[i], dev, vocab)
        rows_l = [self.row_of[reqs[i].index] for i in sel]
        holding = [generated[i] < reqs[i].min_tokens for i in sel]
        sel_t, rows, holding_t = to_device([torch.tensor(sel), torch.tensor(rows_l), torch.tensor(holding)], dev)
        t = self.t
        pick = (lambda name: t[name][rows] if name in t else None)
        held = pick("held")
        if held is not None:
            held = held & holding_t[:, None] if any(holding) else None
        x = apply_rules(logits[sel_t], pick("counts"), pick("prompt"), pick("bias"), held, t["presence"][rows],
                        t["frequency"][rows], t["repetition"][rows])
        self.plan = RulePlan(sel_t, rows)
        out = logits.float().clone()
        out[sel_t] = x
        return out

    def update(self, tokens: torch.Tensor) -> None:
        """The last apply()'s rows drew `tokens` [N] (all rows of the step, float64 ids): their counts go up."""
        p = self.plan
        if p is None or "counts" not in self.t:
            return
        self.t["counts"].index_put_((p.rows, tokens[p.sel].long()), torch.ones_like(p.rows, dtype=torch.float32),
                                    accumulate=True)

    def _assign(self, req: Request, dev: torch.device, vocab: int) -> None:
        """A state row for `req`, written from its rules."""
        if not self.free:
            self._grow(max(8, 2 * self.cap), dev, vocab)
        row = self.row_of[req.index] = self.free.pop()
        t = self.t
        penalised = req.presence_penalty or req.frequency_penalty or req.repetition_penalty != 1.0
        wants = {"counts": penalised, "prompt": req.repetition_penalty != 1.0, "bias": bool(req.logit_bias),
                 "held": req.min_tokens > 0}
        for name, want in wants.items():
            if want and name not in t:
                t[name] = torch.zeros(self.cap, vocab, dtype=torch.bool if name in ("prompt", "held")
                                      else torch.float32, device=dev)
        for name in wants:
            if name in t:
                t[name][row] = 0
        ids = {}  # token ids to set per table, sent in one asynchronous copy (a tensor made on the device syncs)
        if wants["prompt"]:
            ids["prompt"] = torch.tensor(req.prompt_token_ids)
        if wants["bias"]:
            ids["bias"] = torch.tensor(list(req.logit_bias))
            ids["values"] = torch.tensor(list(req.logit_bias.values()), dtype=torch.float32)
        if wants["held"] and (self.eos or req.stop_token_ids):
            ids["held"] = torch.tensor(self.eos + list(req.stop_token_ids))
        ids = dict(zip(ids, to_device(list(ids.values()), dev))) if ids else {}
        for name in ("prompt", "held"):
            if name in ids:
                t[name][row, ids[name]] = True
        if "bias" in ids:
            t["bias"][row, ids["bias"]] = ids["values"]
        t["presence"][row] = req.presence_penalty
        t["frequency"][row] = req.frequency_penalty
        t["repetition"][row] = req.repetition_penalty

    def _grow(self, cap: int, dev: torch.device, vocab: int) -> None:
        for name in ("presence", "frequency", "repetition"):
            self.t.setdefault(name, torch.zeros(0, device=dev))
        for name, old in self.t.items():
            new = torch.zeros((cap,) + tuple(old.shape[1:]), dtype=old.dtype, device=dev)
            new[:self.cap] = old
            self.t[name] = new
        self.free += list(range(cap - 1, self.cap - 1, -1))
        self.cap = cap

    def forget(self, index: int) -> None:
        row = self.row_of.pop(index, None)
        if row is not None:
            self.free.append(row)

    def reset(self) -> None:
        self.free += list(self.row_of.values())
        self.row_of.clear()
