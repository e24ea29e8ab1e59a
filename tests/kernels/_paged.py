"""A paged K/V cache for kernel tests: each sequence's blocks shuffled over the cache, the unused entries of every
table (and every entry of a padding row) pointing at a NaN-poisoned block that a correct kernel never reads."""
import torch


def poisoned_cache(gen, contexts: list[int], rows: int, kv: int, d: int, bs: int, dtype, width: int | None = None):
    """contexts: positions of each of the first len(contexts) of `rows` tables -> (k_cache, v_cache, table [rows, W])
    on the CPU."""
    need = [-(-c // bs) for c in contexts]
    width = width or max(need)
    total = sum(need) + 1
    k_cache = torch.randn(total, bs, kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(total, bs, kv, d, generator=gen).to(dtype)
    poison = total - 1
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    ids = torch.randperm(total - 1, generator=gen).tolist()
    table = torch.full((rows, width), poison, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return k_cache, v_cache, table
