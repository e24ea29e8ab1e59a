"""KV-cache memory: how many blocks the cache can have, and which blocks are free.

The cache (tp_lora.models.attention.KVCache) is a pool of blocks of `block_size` positions in every layer, plus a
scratch block for padded CUDA-graph rows; a running sequence holds the blocks its positions need so far (its block
table) and takes more as it grows. Blocks are sized from the memory left once the weights and the adapter slots are
allocated: a request that finds too few free blocks waits in the scheduler instead of failing an allocation mid-run.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Optional

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
    cap_mb. Free means free on the device and, where the process limits its allocator
    (torch.cuda.set_per_process_memory_fraction), under that limit. CPU: cap_mb (default CPU_DEFAULT_MB), since
    the host's free memory says little about what a run may take."""
    cap = None if cap_mb is None else int(cap_mb * (1 << 20))
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        free, total = torch.cuda.mem_get_info(index)
        limit = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(index)  # torch < 2.9: none
        if limit < 1.0:
            free = max(0, min(free, int(limit * total) - torch.cuda.memory_reserved(index)))
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
    this rank has left holds (runner: the ModelRunner, whose current cache is replaced); on CUDA with prefix caching,
    all the memory the budget gives (the blocks beyond the batch's hold the cache), or the cache there is where it
    holds the batch. The TP ranks take the smallest plan so they schedule alike."""
    m, bs = runner.model, sc.kv_block_size
    bpt = kv_bytes_per_token(len(m.layers), m.kv_heads, m.head_dim, m.kv_dtype)
    old = runner.cache
    reusable = 0 if old is None else (old.num_blocks + 1) * old.block_size * bpt
    budget = kv_budget_bytes(ps.device, sc.kv_memory_fraction, sc.kv_cache_mb, reusable)
    wanted = sum(sorted(blocks_for(n + 1, bs) for n in needs)[-sc.max_batch_size:])
    if not (sc.prefix_caching and ps.device.type == "cuda"):
        blocks = plan_blocks(budget, bs, bpt, wanted)
    elif old is not None and old.block_size == bs and old.num_blocks >= wanted:
        # the cache there is, whole, whatever the budget says now that later allocations took memory: its blocks
        # and the cached prefixes they hold stay for this run
        blocks = old.num_blocks
    else:  # all the budget: the blocks beyond the batch's hold the cache
        blocks = plan_blocks(budget, bs, bpt, budget // max(1, bs * bpt))
    if ps.tp.size > 1:
        blocks = min(comm.all_gather_object(blocks, ps.tp))
    return blocks, max(0, blocks * bs - 1)


def misfit(need: int, fit: int, kv_memory_fraction: float, kv_cache_mb) -> str:
    """Why a request needing `need` positions cannot run where `fit` fit."""
    return (f"prompt + max_new_tokens = {need} positions of KV cache do not fit the {fit} this rank can hold "
            f"(scheduler.kv_memory_fraction={kv_memory_fraction}, scheduler.kv_cache_mb={kv_cache_mb})")


def block_hash(parent: int, tokens: list[int]) -> int:
    """A full block's identity in the prefix cache: its parent's (or the adapter's) and its token ids."""
    return hash((parent, *tokens))


class BlockPool:
    """KV-cache blocks of `block_size` positions: free ones (the lowest first, so every rank of a TP group hands out
    the same blocks), ones held by running sequences (reference-counted: a cached prefix may be shared), and with
    `caching` the prefix cache: full blocks whose contents are known, kept when no sequence holds them and evicted
    least recently used first, only when no free block is left.

    A cached block's identity is a hash chained over the blocks before it: hash((parent's hash, its token ids)),
    the first block's parent being the adapter's identity (`root`: an integer that changes whenever an adapter is
    loaded, so a reload never meets its old blocks). Hashes of tuples of ints are the same in every process."""

    def __init__(self, blocks: int, block_size: int, caching: bool = False):
        if blocks < 1 or block_size < 1:
            raise ValueError(f"a KV block pool needs blocks >= 1 and block_size >= 1, got {blocks}, {block_size}")
        self.blocks, self.block_size, self.caching = blocks, block_size, caching
        self._free = list(range(blocks))
        self._refs = [0] * blocks
        self._cached: dict[int, int] = {}  # hash -> the block holding those contents
        self._hash: dict[int, int] = {}  # block -> its hash (registered blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, LRU first

    @property
    def available(self) -> int:
        """Blocks a sequence can take: free, or cached and held by none."""
        return len(self._free) + len(self._evictable)

    @property
    def cached(self) -> int:
        """Cached blocks held by no sequence."""
        return len(self._evictable)

    def needed(self, table: list[int], positions: int) -> int:
        """More blocks a sequence holding `table` needs to hold `positions` positions."""
        return max(0, blocks_for(positions, self.block_size) - len(table))

    def grow(self, table: list[int], positions: int) -> None:
        """Extend `table` in place to hold `positions` positions: free blocks first, then the least recently used
        cached ones (forgotten)."""
        n = self.needed(table, positions)
        if n > self.available:
            raise RuntimeError(f"{n} KV blocks wanted, {self.available} of {self.blocks} free")
        for _ in range(n):
            if self._free:
                b = heapq.heappop(self._free)
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash.pop(b)]
            self._refs[b] = 1
            table.append(b)

    def release(self, table: list[int]) -> None:
        """Drop a sequence's hold on every block of `table` (emptied in place). Cached blocks stay, the table's last
        first in line for eviction (a prefix outlives its continuations)."""
        for b in table:
            if not 0 <= b < self.blocks or self._refs[b] <= 0:
                raise ValueError(f"KV block {b} is not in use (pool of {self.blocks})")
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash:
                    self._evictable[b] = None
                else:
                    heapq.heappush(self._free, b)
        table.clear()

    def match(self, tokens: list[int], root: int, chain: Optional[list[int]] = None) -> tuple[list[int], list[int]]:
        """(cached blocks, their hashes) holding the longest prefix of `tokens` under `root`, in full blocks and
        leaving the last token out (its logits are computed); nothing taken yet (take()). chain: the hashes of the
        first blocks of `tokens` known so far, extended in place as far as the match looks (a waiting request is
        matched every step; its blocks are hashed once)."""
        blocks, chain = [], [] if chain is None else chain
        if not self.caching:
            return blocks, []
        bs = self.block_size
        for i in range((len(tokens) - 1) // bs):
            if i == len(chain):
                chain.append(block_hash(chain[-1] if chain else root, tokens[i * bs:(i + 1) * bs]))
            b = self._cached.get(chain[i])
            if b is None:
                break
            blocks.append(b)
        return blocks, chain[:len(blocks)]

    def take(self, blocks: list[int]) -> None:
        """Hold matched cached blocks (a sequence's first blocks)."""
        for b in blocks:
            self._refs[b] += 1
            self._evictable.pop(b, None)

    def evictable_in(self, blocks: list[int]) -> int:
        """How many of `blocks` (matched) are held by no sequence: taking them uses up that many available."""
        return sum(self._refs[b] == 0 for b in blocks)

    def commit(self, table: list[int], tokens: list[int], computed: int, hashes: list[int], root: int) -> None:
        """Cache the blocks of a sequence (`table`, its `tokens`) that are full and computed (KV written for the
        first `computed` positions) and not yet in `hashes` (extended in place). Stops at a token not known yet
        (negative: sampled on the device, not read). The first holder of some contents is the one cached."""
        if not self.caching:
            return
        bs = self.block_size
        while len(hashes) < min(computed // bs, len(table)):
            i = len(hashes)
            block = tokens[i * bs:(i + 1) * bs]
            if min(block) < 0:
                return
            h = block_hash(hashes[-1] if hashes else root, block)
            hashes.append(h)
            b = table[i]
            if h not in self._cached and b not in self._hash:
                self._cached[h], self._hash[b] = b, h
