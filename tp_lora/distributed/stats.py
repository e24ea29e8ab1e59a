"""Counts of the collectives a process runs (per primitive and group, for tests and benchmarks) and a record of the
last ones it launched (for failure reports: tp_lora.distributed.last_calls)."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import torch

RECENT_CALLS = 12  # collectives a failure report lists (recent())


@dataclass
class CommStats:
    """Calls and bytes per (primitive, group name); reset() between the steps a test wants to count. Also this
    process's count of collectives issued from Python (a CUDA graph's once, at its capture) and the last RECENT_CALLS
    of them, never reset: where the ranks' sequences part, a failure report shows it (last_calls)."""
    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    launched: int = 0
    last: deque = field(default_factory=lambda: deque(maxlen=RECENT_CALLS))

    def record(self, op: str, group, t: torch.Tensor) -> None:
        """One call of primitive `op` over `group` (a tp_lora.distributed.Group) on t."""
        key = f"{op}:{group.name}"
        self.calls[key] += 1
        self.bytes[key] += t.numel() * t.element_size()
        self.launched += 1
        self.last.append((self.launched, key, group.pg, t.shape, t.dtype))

    def recent(self) -> str:
        """The collectives this process launched last (number, primitive:group, process group, shape, dtype), oldest
        first: compared across ranks, the first where they differ is where their sequences part."""
        return "; ".join(f"#{n} {key} ({getattr(pg, 'group_name', pg)}) {list(shape)} {str(dt).split('.')[-1]}"
                         for n, key, pg, shape, dt in self.last)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total(self, op: str | None = None) -> int:
        return sum(n for k, n in self.calls.items() if op is None or k.startswith(op + ":"))
