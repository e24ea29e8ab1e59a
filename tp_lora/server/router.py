"""Which data-parallel replica serves a request (server.routing), decided on global rank 0 from what the replicas
report at each exchange (their adapters in device slots and in host memory) and the requests it routed that have not
ended yet (each replica's load). Plain Python: no torch, no collectives.

    affinity      a replica holding the request's adapter in a device slot (or running requests of it), else one
                  holding it in host memory, else the adapter's home replica (a hash of its name: an adapter that
                  left every cache comes back where it was, so each replica's caches hold a share of the adapters
                  instead of all of them churning everywhere), else the least loaded; a replica is passed over
                  while it would queue more than server.max_imbalance requests beyond the least queued one (a hot
                  adapter then spreads). A replica's queue: its requests beyond the batch, or the requests its
                  scheduler last reported waiting (for a slot, say), whichever is more
    least_loaded  the replica with the fewest requests in flight
    round_robin   the next replica in turn
"""
from __future__ import annotations

import zlib
from typing import Optional

POLICIES = ("affinity", "least_loaded", "round_robin")


class Router:
    def __init__(self, replicas: int, policy: str, batch: int, max_imbalance: int):
        if policy not in POLICIES:
            raise ValueError(f"server.routing={policy!r}: expected one of {', '.join(POLICIES)}")
        self.replicas, self.policy, self.batch, self.max_imbalance = replicas, policy, batch, max_imbalance
        self.slots: list[set] = [set() for _ in range(replicas)]  # as last reported
        self.host: list[set] = [set() for _ in range(replicas)]
        self.load = [0] * replicas  # requests routed and not ended
        self.waiting = [0] * replicas  # requests the replica's scheduler held back, as last reported
        self.inflight: dict[int, tuple[int, Optional[str]]] = {}  # request index -> (replica, adapter)
        self.users: list[dict] = [{} for _ in range(replicas)]  # adapter -> requests in flight on the replica
        self.turn = 0

    def report(self, replica: int, slots, host) -> None:
        """A replica's adapter residency: names in its device slots (None for a free slot) and in host memory."""
        self.slots[replica] = {n for n in slots if n is not None}
        self.host[replica] = set(host)

    def report_waiting(self, replica: int, waiting: int) -> None:
        """How many requests the replica's scheduler holds back (no room in the batch, or no slot for its adapter)."""
        self.waiting[replica] = waiting

    def route(self, index: int, adapter: Optional[str]) -> int:
        """The replica for request `index` (of `adapter`, None for the base model); counted in flight until ended."""
        if self.policy == "round_robin":
            d = self.turn % self.replicas
            self.turn += 1
        elif self.policy == "least_loaded" or adapter is None:
            d = self._least(range(self.replicas))
        else:
            d = self._affine(adapter)
        self.inflight[index] = (d, adapter)
        self.load[d] += 1
        users = self.users[d]
        users[adapter] = users.get(adapter, 0) + 1
        return d

    def ended(self, index: int) -> None:
        """Request `index` ended (finished, failed or cancelled) on its replica."""
        got = self.inflight.pop(index, None)
        if got is None:
            return
        d, adapter = got
        self.load[d] -= 1
        users = self.users[d]
        users[adapter] -= 1
        if not users[adapter]:
            del users[adapter]

    def _queue(self, d: int) -> int:
        return max(0, self.load[d] - self.batch, self.waiting[d])

    def _least(self, candidates) -> int:
        """The least loaded of `candidates`, ties broken in turn (so equal replicas share the work)."""
        candidates = list(candidates)
        low = min(self.load[d] for d in candidates)
        tied = [d for d in candidates if self.load[d] == low]
        self.turn += 1
        return tied[self.turn % len(tied)]

    def _affine(self, adapter: str) -> int:
        bound = min(self._queue(d) for d in range(self.replicas)) + self.max_imbalance
        fits = [d for d in range(self.replicas) if self._queue(d) + 1 <= bound or
                (self.load[d] < self.batch and not self.waiting[d])]
        for holds in (lambda d: adapter in self.slots[d] or adapter in self.users[d],
                      lambda d: adapter in self.host[d]):
            mine = [d for d in fits if holds(d)]
            if mine:
                return self._least(mine)
        home = zlib.crc32(adapter.encode()) % self.replicas
        return home if home in fits else self._least(range(self.replicas))
