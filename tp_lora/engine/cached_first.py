"""Cached prefixes first: when a step's token budget cannot start every waiting prefill, the scheduler's admission scan
takes the waiting requests with the longest prefix in the prefix cache first (a hit's prefill is short, so its first
token comes soon), arrival order among equals. A request passed over (a request that arrived after it admitted
before it) in max_passes steps goes first from then on, with preempted sequences, so no request waits longer for
cached ones. Pure bookkeeping over request indices: the same on every rank."""
from __future__ import annotations

from typing import Optional

from tp_lora.engine.requests import Request


class CachedFirst:
    """Each waiting request's count of steps in which cached-first admissions passed it over."""

    def __init__(self, max_passes: int):
        if max_passes < 0:
            raise ValueError(f"max_prefix_overtakes={max_passes}: expected >= 0")
        self.max_passes = max_passes
        self.passed: dict[int, int] = {}  # request index -> steps it was passed over

    def order(self, window: list[Request], cached: list[int], uncached: int, budget: int, first: set[int]
              ) -> Optional[list[Request]]:
        """`window` (the first waiting requests, `cached[i]` tokens of window[i] in the prefix cache, `uncached`
        tokens to compute in all) in this step's admission order, or None to keep arrival order: the budget left
        starts every prefill, none hits, or max_passes is 0. `first`: request indices that go first anyway
        (preempted sequences)."""
        if not self.max_passes or budget <= 0 or uncached <= budget or not any(cached):
            return None

        def key(k: int) -> tuple:
            index = window[k].index
            ahead = index in first or self.passed.get(index, 0) >= self.max_passes
            return not ahead, 0 if ahead else -cached[k], k
        return [window[k] for k in sorted(range(len(window)), key=key)]

    def charge(self, waiting: list[Request], arrival: dict[int, int], admitted: list[Request]) -> None:
        """After an admission scan in cached-first order: each request still `waiting` (in arrival order; `arrival`:
        id(request) -> its place) that arrived before an `admitted` one is charged one step."""
        if not admitted:
            return
        last = max(arrival.get(id(r), -1) for r in admitted)
        for req in waiting:
            if arrival[id(req)] > last:
                break
            self.passed[req.index] = self.passed.get(req.index, 0) + 1

    def forget(self, index: int) -> None:
        self.passed.pop(index, None)

    def clear(self) -> None:
        self.passed.clear()
