"""n / best_of: several sequences for one prompt. A request asking for n of best_of sequences (best_of >= n) runs as
best_of engine requests: itself and best_of - 1 siblings, sibling i seeded seed + i. The siblings wait while the
first one's prompt is computed and join the batch in the step that computes its end (fork()): they share its full
KV blocks, copy its partial last one, and draw their first tokens from its logits row in that step, so the prompt
is computed once and no step is added (siblings that find no room then are admitted later, through the prefix
cache). Their results fold back into one Result whose `choices` are the n with the highest cumulative
log-probability (all of them, in order, when best_of == n). The HTTP endpoints stream each sibling as its own choice
and pick with `best`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from tp_lora.engine.requests import Request, Result
from tp_lora.engine.scheduler import Scheduler, Sequence


def per_prompt(req: Request) -> int:
    """Engine requests `req` runs as."""
    return req.best_of or req.n


def siblings(first: Request, indices: list[int]) -> list[Request]:
    """The engine requests beside `first` (one per index: sibling i of 1, 2, ... seeded first.seed + i)."""
    return [replace(first, index=index, sibling_of=first.index, n=1, best_of=None,
                    seed=None if first.seed is None else (first.seed + i) % 2 ** 63)
            for i, index in enumerate(indices, 1)]


def fork(sched: Scheduler, leaders: list[Sequence]) -> tuple[list[tuple[Sequence, Sequence]], list[tuple[int, int]]]:
    """The waiting siblings of `leaders` (sequences whose prompt the step being launched computes to its end, before
    their first token) join sched's running batch, while the batch and the free KV blocks last: each holds its
    leader's full prompt blocks (shared) and a block of its own for the partial last one and its first token.
    -> ((sibling, leader) pairs: each sibling samples its first token from its leader's logits row of this step;
    (source, destination) KV blocks to copy on the device after the step)."""
    by_leader = {s.request.index: s for s in leaders if s.generated == 0}
    if not by_leader:
        return [], []
    kids = [r for r in sched.waiting if r.sibling_of in by_leader and r.index not in sched.preempted]
    pairs, copies, pool = [], [], sched.blocks
    for req in kids:
        lead = by_leader[req.sibling_of]
        full, n = divmod(lead.prompt_len, pool.block_size)
        shared = lead.blocks[:full]
        if len(sched.running) >= sched.max_batch_size or pool.needed(shared, lead.prompt_len + 1) > pool.available:
            break
        sched.remove(req.index)  # out of the queue
        pool.take(shared)
        seq = Sequence(req, list(shared), lead.slot, list(lead.tokens), lead.prompt_len, lead.prompt_len,
                       Result(req), root=lead.root, hashes=lead.hashes[:full])
        pool.grow(seq.blocks, lead.prompt_len + 1)
        if n:
            copies.append((lead.blocks[full], seq.blocks[full]))
        if seq.slot >= 0:
            sched.slots.acquire(seq.slot)
        sched.running.append(seq)
        pairs.append((seq, lead))
    return pairs, copies


def best(group: list[Result], n: int) -> list[Result]:
    """The n of one prompt's results with the highest cumulative log-probability, best first; all of them in order
    when there are n."""
    if len(group) == n:
        return group
    return sorted(group, key=lambda r: -sum(r.logprobs))[:n]


class Choices:
    """requests -> the engine requests (`expanded`: the requests, then every sibling), and their results folded
    back: `fold` as each ends, `collect` for the whole run."""

    def __init__(self, requests: list[Request]):
        self.requests = requests
        self.expanded = list(requests)
        self.first: dict[int, int] = {}  # engine request index -> its prompt's first request's index (n > 1 only)
        self.members: dict[int, list[int]] = {}  # first index -> its engine requests' indices
        self.ended: dict[int, list[Result]] = {}  # first index -> results so far
        nxt = max((r.index for r in requests), default=-1) + 1
        for req in requests:
            count = per_prompt(req)
            if count > 1:
                more = siblings(req, list(range(nxt, nxt + count - 1)))
                nxt += count - 1
                self.expanded += more
                self.members[req.index] = [r.index for r in [req] + more]
                self.first.update({i: req.index for i in self.members[req.index]})
                self.ended[req.index] = []

    def fold(self, result: Result) -> Optional[Result]:
        """The Result to report once `result`'s prompt has all its sequences, else None."""
        first = self.first.get(result.request.index)
        if first is None:
            return result
        group = self.ended[first]
        group.append(result)
        return self._folded(group) if len(group) == len(self.members[first]) else None

    def collect(self, results: list[Result]) -> list[Result]:
        """Every request's Result (folded), in the order of `requests`, from the run's results."""
        by_index = {r.request.index: r for r in results}
        return [self._folded([by_index[i] for i in self.members[req.index]]) if req.index in self.members
                else by_index[req.index] for req in self.requests]

    @staticmethod
    def _folded(group: list[Result]) -> Result:
        group = sorted(group, key=lambda r: r.request.index)  # the first request, then its siblings in turn
        req = group[0].request
        failed = next((r for r in group if r.error is not None), None)
        if failed is not None:
            return Result(req, error=failed.error, metrics=group[0].metrics)
        return Result(req, interrupted=any(r.interrupted for r in group), metrics=group[0].metrics,
                      choices=best(group, req.n))
