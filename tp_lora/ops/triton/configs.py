"""Launch configurations for the LoRA kernels, looked up per shape from small tables.

A key is a bucketed shape: (T bucket, rank bucket, reduction-or-output-width bucket), one table per scheduling
scheme; the value holds block sizes, split-K and warps. Bucket edges are upper bounds: a shape falls into the
first edge >= its size, the last edge is open-ended. The entries are the winners of
``scripts/bench_lora_ops.py --tune`` at its TUNE_SHAPES, one shape per (T, rank) bucket, some of them tuned inside
whole decode steps (where the shrink shares the GPU with the base GEMM) or at prefill sizes; BENCHMARKS.md says which.
Shapes outside the tuned buckets take the nearest entry, which is safe (every config is correct for every shape) if
not optimal. Re-tune on another GPU with --tune and paste the tables it prints.

Why these shapes (both ops are memory-bound at every LoRA rank we serve):
- shrink [T, in] x [in, r]: N = r is tiny, so parallelism comes from token blocks and split-K. At decode (few tokens)
  one program per adapter would leave most SMs idle while it streams A (r x in), hence split-K; split-K 1 saves
  the zero fill of the output (the kernel then writes every row itself).
- expand [T, r] x [r, out]: K = r is tiny (one K tile), N = out is wide; parallelism comes from N blocks. The bytes
  that matter are the output rows read and written, so blocks are wide in N for long coalesced rows.
"""
from __future__ import annotations

import functools

T_EDGES = (16, 64, 256, 2048, 1 << 62)
R_EDGES = (16, 64, 1 << 62)
W_EDGES = (2048, 8192, 1 << 62)  # in (shrink) / out (expand) features of one slice
_INF = 1 << 62

# scheme -> {(T bucket, r bucket, width bucket): config}. A missing key takes the nearest entry (T first).
# "chunked" entries have no BLOCK_M: a program's token block is the step's segment (segment_size() below), which
# shrink and expand share, so it is chosen per T bucket for the pair.
_SHRINK: dict[str, dict[tuple[int, int, int], dict]] = {
    "sorted": {
        (16, 16, 8192): dict(BLOCK_M=16, BLOCK_K=64, SPLIT_K=32, num_warps=4, num_stages=3),
        (16, 64, 8192): dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (64, 16, 8192): dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (64, 64, 8192): dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (256, 16, 8192): dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (256, 64, 8192): dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (2048, 16, 8192): dict(BLOCK_M=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (2048, 64, 8192): dict(BLOCK_M=128, BLOCK_K=128, SPLIT_K=4, num_warps=8, num_stages=3),
        (_INF, 16, 8192): dict(BLOCK_M=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3),
        (_INF, 64, 8192): dict(BLOCK_M=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=3),
    },
    "chunked": {
        (16, 16, 8192): dict(BLOCK_K=64, SPLIT_K=32, num_warps=4, num_stages=3),
        (16, 64, 8192): dict(BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (64, 16, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=2, num_stages=3),
        (64, 64, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (256, 16, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (256, 64, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (2048, 16, 8192): dict(BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (2048, 64, 8192): dict(BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (_INF, 16, 8192): dict(BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=3),
        (_INF, 64, 8192): dict(BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=3),
    },
}
_EXPAND: dict[str, dict[tuple[int, int, int], dict]] = {
    "sorted": {
        (16, 16, 8192): dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2),
        (16, 64, 8192): dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2),
        (64, 16, 8192): dict(BLOCK_M=16, BLOCK_N=256, num_warps=4, num_stages=2),
        (64, 64, 8192): dict(BLOCK_M=16, BLOCK_N=256, num_warps=8, num_stages=2),
        (256, 16, 8192): dict(BLOCK_M=32, BLOCK_N=256, num_warps=8, num_stages=2),
        (256, 64, 8192): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
        (2048, 16, 8192): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=2),
        (2048, 64, 8192): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
        (_INF, 16, 8192): dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=2),
        (_INF, 64, 8192): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
    },
    "chunked": {
        (16, 16, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (16, 64, 8192): dict(BLOCK_N=64, num_warps=4, num_stages=2),
        (64, 16, 8192): dict(BLOCK_N=256, num_warps=4, num_stages=2),
        (64, 64, 8192): dict(BLOCK_N=64, num_warps=4, num_stages=2),
        (256, 16, 8192): dict(BLOCK_N=256, num_warps=4, num_stages=2),
        (256, 64, 8192): dict(BLOCK_N=64, num_warps=4, num_stages=2),
        (2048, 16, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (2048, 64, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (_INF, 16, 8192): dict(BLOCK_N=256, num_warps=4, num_stages=2),
        (_INF, 64, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
    },
}
# chunked scheme: tokens per segment by T bucket (one segment = one program's token block, so also its BLOCK_M),
# the size that minimised shrink + expand at the bucket's rank-16 shape
_SEGMENT = {16: 16, 64: 16, 256: 16, 2048: 32, _INF: 64}

# Sorted scheme: programs per adapter group along the token axis are capped so that the whole grid stays near this
# many programs per SM *for one busy adapter*; the other groups' copies exit at once.
SORTED_PROGRAMS_PER_SM = 4
# Used when no CUDA device is there to ask (interpreter); only shapes the sorted grid.
DEFAULT_NUM_SMS = 132


def _bucket(value: int, edges: tuple[int, ...]) -> int:
    for edge in edges:
        if value <= edge:
            return edge
    return edges[-1]


def _lookup(table: dict, t: int, r: int, w: int) -> dict:
    key = (_bucket(t, T_EDGES), _bucket(r, R_EDGES), _bucket(w, W_EDGES))
    if key in table:
        return dict(table[key])
    # nearest entry: same T bucket first (T decides the parallelism), then rank, then width
    best = min(table, key=lambda k: (abs(T_EDGES.index(k[0]) - T_EDGES.index(key[0])),
                                     abs(R_EDGES.index(k[1]) - R_EDGES.index(key[1])),
                                     abs(W_EDGES.index(k[2]) - W_EDGES.index(key[2]))))
    return dict(table[best])


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def shrink_config(t: int, r: int, k: int, scheme: str = "sorted") -> dict:
    """x [t, k] x A^T [k, r]: BLOCK_M (sorted only), BLOCK_N (covers r), BLOCK_K, SPLIT_K, num_warps, num_stages."""
    cfg = _lookup(_SHRINK[scheme], t, r, k)
    cfg["BLOCK_N"] = min(_pow2(r), 128)
    # Split-K beyond the number of K blocks only adds programs with nothing to reduce.
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], _pow2(k))
    cfg["SPLIT_K"] = max(1, min(cfg["SPLIT_K"], -(-k // cfg["BLOCK_K"])))
    return cfg


def expand_config(t: int, r: int, n: int, scheme: str = "sorted") -> dict:
    """buf [t, r] x B^T [r, n]: BLOCK_M (sorted only), BLOCK_N, BLOCK_K (covers r up to 64, else loops),
    num_warps, num_stages."""
    cfg = _lookup(_EXPAND[scheme], t, r, n)
    cfg["BLOCK_K"] = min(_pow2(r), 64)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], _pow2(n))
    return cfg


# Steps of at most these many tokens (and ranks up to ROWS_MAX_R) run the one-token-per-program kernels
# (shrink_rows_kernel, expand_rows_kernel): with few tokens per adapter a tensor-core tile is mostly padding, and a
# token per program needs no work table. The bounds are where they stop winning (BENCHMARKS.md).
SHRINK_ROWS_MAX_T, EXPAND_ROWS_MAX_T, ROWS_MAX_R = 32, 64, 64
# shrink_rows_kernel splits K so that a program reduces at most K_PER_PROGRAM of it (a few wide tiles in flight).
SHRINK_ROWS = dict(BLOCK_K=1024, K_PER_PROGRAM=4096, num_warps=8, num_stages=3)
EXPAND_ROWS = dict(BLOCK_N=128, num_warps=4, num_stages=1)


def shrink_rows_config(t: int, r: int, k: int) -> dict | None:
    """shrink_rows_kernel's launch for x [t, k] x A^T [k, r], or None where shrink_kernel serves the shape."""
    if t > SHRINK_ROWS_MAX_T or r > ROWS_MAX_R:
        return None
    cfg = dict(SHRINK_ROWS, BLOCK_N=_pow2(r, 1))
    per = cfg.pop("K_PER_PROGRAM")
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], _pow2(k), per)
    cfg["SPLIT_K"] = -(-k // per)
    return cfg


def expand_rows_config(t: int, r: int, n: int) -> dict | None:
    """expand_rows_kernel's launch for buf [t, r] x B^T [r, n], or None where expand_kernel serves the shape."""
    if t > EXPAND_ROWS_MAX_T or r > ROWS_MAX_R:
        return None
    return dict(EXPAND_ROWS, BLOCK_N=min(EXPAND_ROWS["BLOCK_N"], _pow2(n)), BLOCK_K=_pow2(r, 1))


def embedding_config(t: int, r: int) -> dict:
    return dict(BLOCK_M=16 if t <= 64 else 64, BLOCK_N=_pow2(r), num_warps=4)


def segment_size(t: int) -> int:
    """Default chunk length of the chunked scheme for a step of t tokens (a power of two >= 16)."""
    return _SEGMENT[_bucket(t, T_EDGES)]


def num_sms(device_index: int | None) -> int:
    """Multiprocessors of a CUDA device (None: no device, e.g. the interpreter)."""
    return DEFAULT_NUM_SMS if device_index is None else _cuda_sms(device_index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(device_index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(device_index).multi_processor_count
