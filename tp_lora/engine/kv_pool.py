"""KV-cache memory per sequence: how many rows the cache can have, and which rows are free.

The cache (tp_lora.models.attention.KVCache) gives each running sequence one row of `row_len` positions in every
layer, so memory is rows x row_len x bytes_per_token, plus the scratch row the ModelRunner adds for padded CUDA-graph
slots. Rows are sized from the memory left once the weights and the adapter slots are allocated: a request that
finds no free row waits in the scheduler instead of failing an allocation mid-run.
"""
from __future__ import annotations

import heapq

import torch

CPU_DEFAULT_MB = 1024.0


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one position in every layer on this rank (kv_heads: this rank's share)."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_budget_bytes(device: torch.device, fraction: float, cap_mb: float | None, reusable_bytes: int = 0) -> int:
    """Bytes the KV cache may take on this rank. CUDA: `fraction` of the free memory now (weights and adapter slots
    are already allocated), counting an existing cache of `reusable_bytes` as free since it is replaced; capped by
    cap_mb. CPU: cap_mb (default CPU_DEFAULT_MB): host memory cannot be measured as usefully."""
    cap = None if cap_mb is None else int(cap_mb * (1 << 20))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int((free + reusable_bytes) * fraction)
        return budget if cap is None else min(budget, cap)
    return cap if cap is not None else int(CPU_DEFAULT_MB * (1 << 20))


def plan_rows(budget_bytes: int, row_len: int, bytes_per_token: int, max_rows: int) -> int:
    """Rows of row_len positions that fit the budget together with the runner's scratch row, at most max_rows."""
    per_row = max(1, row_len * bytes_per_token)
    return max(0, min(max_rows, budget_bytes // per_row - 1))


def longest_fitting(budget_bytes: int, bytes_per_token: int) -> int:
    """The longest row (prompt + new tokens) for which one row and the scratch row fit the budget."""
    return budget_bytes // (2 * max(1, bytes_per_token))


class RowPool:
    """Free cache rows; the lowest free row first, so every rank of a TP group hands out the same rows."""

    def __init__(self, rows: int):
        if rows < 1:
            raise ValueError(f"a KV row pool needs at least one row, got {rows}")
        self.rows = rows
        self._free = list(range(rows))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.rows} KV rows are in use")
        return heapq.heappop(self._free)

    def release(self, row: int) -> None:
        if not 0 <= row < self.rows or row in self._free:
            raise ValueError(f"KV row {row} is not in use (pool of {self.rows})")
        heapq.heappush(self._free, row)
