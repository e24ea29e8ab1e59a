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


def fp8_edges(cache: torch.Tensor, gen) -> torch.Tensor:
    """An fp8 (float8_e4m3fn) copy of a poisoned float cache with e4m3's edges mixed in: values at +-448 (its largest)
    and subnormals (m x 2^-9), a tenth of the elements each, at random places; the poisoned block stays NaN."""
    big = torch.rand(cache.shape, generator=gen) < 0.1
    tiny = torch.rand(cache.shape, generator=gen) < 0.1
    sign = torch.where(torch.rand(cache.shape, generator=gen) < 0.5, -1.0, 1.0)
    sub = torch.randint(1, 8, cache.shape, generator=gen) * 2.0 ** -9
    out = torch.where(big, 448.0 * sign, torch.where(tiny, sub * sign, cache))
    return torch.where(cache.isnan(), cache, out).to(torch.float8_e4m3fn)
