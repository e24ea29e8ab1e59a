"""Launch configurations for the LoRA kernels, looked up per shape from small tables.

A key is a bucketed shape: (T bucket, rank bucket, reduction-or-output-width bucket), one table per scheduling
scheme; the value holds block sizes, split-K and warps. Bucket edges are upper bounds: a shape falls into the
first edge >= its size, the last edge is open-ended. The entries are the winners of
``scripts/bench_lora_ops.py --tune`` on an H100 80GB (triton 3.6, hidden 4096, bf16) at its TUNE_SHAPES, one
shape per (T, rank) bucket; the (16, 64, *) entries were not tuned (set by hand). Shapes outside the tuned buckets
take the nearest entry, which is safe (every config is correct for every shape) if not optimal. Re-tune on another
GPU with --tune and paste the tables it prints.

Why these shapes (both ops are memory-bound at every LoRA rank we serve):
- shrink [T, in] x [in, r]: N = r is tiny, so parallelism comes from token blocks and split-K. At decode (few tokens)
  one program per adapter would leave most SMs idle while it streams A (r x in), hence split-K; split-K 1 saves
  the zero fill of the output (the kernel then writes every row itself).
- expand [T, r] x [r, out]: K = r is tiny (one K tile), N = out is wide; parallelism comes from N blocks. The bytes
  that matter are the output rows read and written, so blocks are wide in N for long coalesced rows.
"""
from __future__ import annotations

import functools
import itertools

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
        (64, 16, 8192): dict(BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (64, 64, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (256, 16, 8192): dict(BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=3),
        (256, 64, 8192): dict(BLOCK_K=128, SPLIT_K=16, num_warps=4, num_stages=3),
        (2048, 16, 8192): dict(BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (2048, 64, 8192): dict(BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=3),
        (_INF, 16, 8192): dict(BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3),
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
        (256, 16, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (256, 64, 8192): dict(BLOCK_N=64, num_warps=4, num_stages=2),
        (2048, 16, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (2048, 64, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (_INF, 16, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
        (_INF, 64, 8192): dict(BLOCK_N=128, num_warps=4, num_stages=2),
    },
}
# chunked scheme: tokens per segment by T bucket (one segment = one program's token block, so also its BLOCK_M),
# the size that minimised shrink + expand at the bucket's rank-16 shape
_SEGMENT = {16: 16, 64: 16, 256: 16, 2048: 32, _INF: 32}

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


# --- fused shrink + expand (decode steps; tp_lora.ops.triton.shrink_expand) ---
# Per table entry (the tokens of one adapter) and slice s the fused kernel runs P_s programs in one of two ways:
# - N split: each program does the whole shrink (all of A_s, from L2 after the first program) and 1/P_s of the
#   slice's output columns. Costs P_s reads of A_s; suits wide slices (gate_up).
# - K split: each program does 1/P_s of the shrink's K and adds its partial into a small float32 workspace; the last
#   to arrive does every output column. Reads A_s once, but one program streams all of B_s; suits long K (down).
# fused_config picks the way and P_s per slice with the byte model below. Above FUSED_MAX_TOKENS tokens or
# FUSED_MAX_RANK ranks the runtime uses shrink + expand instead.
FUSED_MAX_TOKENS = 256
FUSED_MAX_RANK = 128
FUSED_SORTED_BLOCK_M = 16  # sorted scheme: token block of a program (chunked: the step's segment)
# Byte model, in units of one SM's share of the memory bandwidth: the L2 feeds the SMs at FUSED_L2_SPEEDUP x the
# memory bandwidth (H100 about 2x, H200 about 1.5x: same L2, faster memory); one program streams at that share (its
# loads in flight bound it, not the SM), programs sharing an SM add up to FUSED_SM_SPEEDUP x the share.
FUSED_L2_SPEEDUP = 1.5
FUSED_SM_SPEEDUP = 3.0


def _fused_times(programs: tuple[int, ...], splits: tuple[int, ...], busy: int, m: float, r: int, k: int,
                 widths: tuple[int, ...], sms: int) -> list[float]:
    """Modelled times of one fused launch, `busy` entries of m tokens each, slowest first (arbitrary units; only
    compared): memory, L2, and the busiest SM. Bytes in units of one rank-row element: A_s is k, x rows k * m / r,
    B_s w_s, output rows read + written 2 * m * w_s / r. splits[s]: slice s splits K (else N)."""
    a = k + k * m / r
    out = [w + 2 * m * w / r for w in widths]  # B_s and the output rows
    hbm = busy * (a * len(widths) + sum(out) - (len(widths) - 1) * k * m / r)  # x once
    l2 = busy * sum(a + o if sp else p * a + o for p, sp, o in zip(programs, splits, out))
    per_program = max(a / p + o if sp else a + o / p for p, sp, o in zip(programs, splits, out))
    per_sm = -(-busy * sum(programs) // sms)  # programs sharing the busiest SM
    return sorted((hbm / sms, l2 / (sms * FUSED_L2_SPEEDUP), per_sm * per_program / min(per_sm, FUSED_SM_SPEEDUP)),
                  reverse=True)


def fused_config(t: int, r: int, k: int, widths: tuple[int, ...], entries: int, sms: int) -> dict:
    """Fused shrink + expand of t tokens over a table of `entries` entries, slices of `widths` columns, rank r,
    k input features: BLOCK_R (covers r), BLOCK_K, BLOCK_N, PROGRAMS (P_s per slice), SPLIT_K (per slice: 1 splits
    K, 0 splits N), num_warps, num_stages. Depends only on the shapes, t and the table width, never on how tokens
    split between adapters (CUDA graphs)."""
    block_n = min(128, _pow2(max(widths)))
    # a program streams all of A_s (N split) alone: wider K blocks keep more of it in flight where it is long
    block_k = min(512 if k >= 8192 else 256, _pow2(k))
    programs, splits = _fused_programs(t, r, k, widths, entries, sms, block_n, block_k)
    return dict(BLOCK_R=_pow2(r), BLOCK_K=block_k, BLOCK_N=block_n, PROGRAMS=programs, SPLIT_K=splits,
                num_warps=4, num_stages=3)


def _pow2_upto(n: int) -> list[int]:
    return sorted({min(n, 1 << i) for i in range(n.bit_length() + 1)})


@functools.lru_cache(maxsize=None)
def _fused_programs(t: int, r: int, k: int, widths: tuple[int, ...], entries: int, sms: int, block_n: int,
                    block_k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(P_s, split_s) per slice with the least modelled time: N split into 1 .. the slice's N blocks programs, or K
    split into 2 .. the K blocks (powers of two or all of them)."""
    busy = max(1, min(entries, t))  # entries that can hold tokens at once
    m = t / busy
    k_blocks = -(-k // block_k)
    ways = [[(p, 0) for p in _pow2_upto(-(-w // block_n))] + [(p, 1) for p in _pow2_upto(k_blocks) if p > 1]
            for w in widths]

    def cost(choice):
        programs, splits = tuple(c[0] for c in choice), tuple(c[1] for c in choice)
        # slowest term first; where it ties (memory-bound), the next ones decide
        return _fused_times(programs, splits, busy, m, r, k, widths, sms), sum(programs)
    best = min(itertools.product(*ways), key=cost)
    return tuple(c[0] for c in best), tuple(c[1] for c in best)
