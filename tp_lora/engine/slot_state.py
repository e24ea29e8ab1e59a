"""Which adapter each device slot holds and which slot a new adapter takes (the scheduler's SlotState)."""
from __future__ import annotations

from typing import Optional

from tp_lora.lora.popularity import Popularity

SLOT_HALF_LIFE = 32  # admissions per slot over which an adapter's admission count halves (the slots' eviction order)


class SlotState:
    """Which adapter each device slot holds, how many running sequences use it, whether its copy is done, when it was
    last used, and how often each adapter was admitted lately (decayed over SLOT_HALF_LIFE x slots admissions).
    Mirrors the engine's SlotTable; lives across generate() calls so residents are reused."""

    def __init__(self, num_slots: int):
        self.names: list[Optional[str]] = [None] * num_slots
        self.users = [0] * num_slots
        self.ready = [True] * num_slots
        self.last_used = [0] * num_slots
        self.popularity = Popularity(SLOT_HALF_LIFE * max(num_slots, 1))
        self.pinned = False  # every adapter loaded once at start (EP over DP replicas): never reassign
        self._clock = 0

    def __len__(self) -> int:
        return len(self.names)

    def slot_of(self, name: str) -> Optional[int]:
        return self.names.index(name) if name in self.names else None

    def any_free(self) -> bool:
        return not self.pinned and any(u == 0 and r for u, r in zip(self.users, self.ready))

    def victim(self, avoid: set) -> Optional[int]:
        """A slot no running sequence uses: empty first, then one not in `avoid` (wanted soon), then one outside the
        most recently used half of the slots (a conversation's adapter between its turns: admitted once or twice,
        it would lose to adapters used more often long ago), and among those the adapter admitted least often
        lately, the least recently used of equals."""
        if self.pinned:
            return None
        free = [i for i in range(len(self.names)) if self.users[i] == 0 and self.ready[i]]
        if not free:
            return None
        held = [i for i in range(len(self.names)) if self.names[i] is not None]
        recent = set(sorted(held, key=lambda i: -self.last_used[i])[:len(self.names) // 2])
        pop = self.popularity
        return min(free, key=lambda i: (self.names[i] is not None, self.names[i] in avoid, i in recent,
                                        pop[self.names[i]] if self.names[i] is not None else 0.0, self.last_used[i], i))

    def assign(self, slot: int, name: str) -> None:
        """slot now holds `name`, once the engine has copied it in (loaded)."""
        if self.users[slot]:
            raise RuntimeError(f"slot {slot} holds {self.names[slot]!r} for {self.users[slot]} running sequences")
        self.names[slot], self.ready[slot] = name, False

    def loaded(self, slot: int) -> None:
        self.ready[slot] = True

    def clear(self, slot: int) -> None:
        self.names[slot], self.ready[slot] = None, True

    def acquire(self, slot: int) -> None:
        self._clock += 1
        self.users[slot] += 1
        self.last_used[slot] = self._clock
        if self.names[slot] is not None:
            self.popularity.use(self.names[slot])

    def release(self, slot: int) -> None:
        if self.users[slot] <= 0:
            raise RuntimeError(f"slot {slot} released more often than acquired")
        self.users[slot] -= 1
