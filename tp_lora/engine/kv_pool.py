"""KV-cache memory: how many blocks the cache can have, and which blocks are free.

The cache (tp_lora.models.attention.KVCache) is a pool of blocks of `block_size` positions in every layer, plus a
scratch block for padded CUDA-graph rows; a running sequence holds the blocks its positions need so far (its block
table) and takes more as it grows. Blocks are sized from the memory left once the weights and the adapter slots are
allocated: a request that finds too few free blocks waits in the scheduler instead of failing an allocation mid-run.
"""
from __future__ import annotations

import heapq

import torch

from tp_lora import distributed as comm
from tp_lora.config import SchedulerConfig

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


def plan_blocks(budget_bytes: int, block_size: int, bytes_per_token: int, wanted: int) -> int:
    """Blocks that fit the budget together with the cache's scratch block, at most `wanted`."""
    per_block = max(1, block_size * bytes_per_token)
    return max(0, min(wanted, budget_bytes // per_block - 1))


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def plan_kv(runner, ps: comm.ParallelState, sc: SchedulerConfig, needs: list[int]) -> tuple[int, int]:
    """(blocks, longest fitting need) for a run whose requests need `needs` positions each: as many blocks as its
    max_batch_size largest requests hold at once (each with its admission's extra position), at most what the memory
    this rank has left holds (runner: the ModelRunner, whose current cache is replaced); the TP ranks take the
    smallest plan so they schedule alike."""
    m, bs = runner.model, sc.kv_block_size
    bpt = kv_bytes_per_token(len(m.layers), m.kv_heads, m.head_dim, m.dtype)
    old = runner.cache
    reusable = 0 if old is None else (old.num_blocks + 1) * old.block_size * bpt
    budget = kv_budget_bytes(ps.device, sc.kv_memory_fraction, sc.kv_cache_mb, reusable)
    wanted = sum(sorted(blocks_for(n + 1, bs) for n in needs)[-sc.max_batch_size:])
    blocks = plan_blocks(budget, bs, bpt, wanted)
    if ps.tp.size > 1:
        blocks = min(comm.all_gather_object(blocks, ps.tp))
    return blocks, max(0, blocks * bs - 1)


def misfit(need: int, fit: int, kv_memory_fraction: float, kv_cache_mb) -> str:
    """Why a request needing `need` positions cannot run where `fit` fit."""
    return (f"prompt + max_new_tokens = {need} positions of KV cache do not fit the {fit} this rank can hold "
            f"(scheduler.kv_memory_fraction={kv_memory_fraction}, scheduler.kv_cache_mb={kv_cache_mb})")


class BlockPool:
    """Free KV-cache blocks of `block_size` positions; the lowest free first, so every rank of a TP group hands out
    the same blocks."""

    def __init__(self, blocks: int, block_size: int):
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV block pool needs blocks >= 1 and block_size >= 1, got {blocks}, {block_size}")
        self.blocks, self.block_size = blocks, block_size
        self._free = list(range(blocks))
        self._held = [False] * blocks

    @property
    def available(self) -> int:
        return len(self._free)

    def needed(self, table: list[int], positions: int) -> int:
        """More blocks a sequence holding `table` needs to hold `positions` positions."""
        return max(0, blocks_for(positions, self.block_size) - len(table))

    def grow(self, table: list[int], positions: int) -> None:
        """Extend `table` in place to hold `positions` positions."""
        n = self.needed(table, positions)
        if n > len(self._free):
            raise RuntimeError(f"{n} KV blocks wanted, {len(self._free)} of {self.blocks} free")
        for _ in range(n):
            b = heapq.heappop(self._free)
            self._held[b] = True
            table.append(b)

    def release(self, table: list[int]) -> None:
        """Return every block of `table` (emptied in place)."""
        for b in table:
            if not 0 <= b < self.blocks or not self._held[b]:
                raise ValueError(f"KV block {b} is not in use (pool of {self.blocks})")
            self._held[b] = False
            heapq.heappush(self._free, b)
        table.clear()
