"""How often each adapter has been wanted lately: counts that halve every `half_life` uses, the eviction order of the
adapter caches (device slots, host memory). Under skewed popularity (many adapters, a few hot) recency alone lets a
burst of one-off adapters push the hot ones out; decayed counts keep the hot ones and still follow a shift in
popularity within a few half-lives. Pure Python and deterministic: every rank that sees the same uses decides alike.
"""
from __future__ import annotations

RENORMALIZE_AT = 1e100


class Popularity:
    def __init__(self, half_life: float):
        if half_life <= 0:
            raise ValueError(f"half_life={half_life}: expected > 0")
        self.growth = 2.0 ** (1.0 / half_life)
        self.weight = 1.0  # a use's weight now; older uses weigh less relative to it
        self.counts: dict[str, float] = {}

    def use(self, name: str) -> None:
        self.weight *= self.growth
        self.counts[name] = self.counts.get(name, 0.0) + self.weight
        if self.weight > RENORMALIZE_AT:
            self.counts = {n: c / self.weight for n, c in self.counts.items()}
            self.weight = 1.0

    def __getitem__(self, name: str) -> float:
        """Decayed uses of `name`, in units of the latest use's weight (0 if never used)."""
        return self.counts.get(name, 0.0) / self.weight

    def forget(self, name: str) -> None:
        self.counts.pop(name, None)
