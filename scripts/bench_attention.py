"""Paged decode and varlen attention against their floors on one GPU, with sweeps of the kernels' launch constants.

    python scripts/bench_attention.py --out DIR [--sweep] [--libs] [--kind decode|varlen|fp8_kv|tp|all]

Cases: (batch, context) at the Llama-3-8B head layout (32 query / 8 KV heads, head_dim 128) and the Llama 16x2048
one (32 / 8, 64), bf16, block size 16, each sequence's blocks scattered over the cache. Each call is captured in a CUDA
graph with 20 calls over rotated caches (ROTATE_BYTES in all, so K/V come from HBM, not L2) and replayed; median per
call of 10 replays.
floor = (K and V bytes attended + q and out bytes) / the device copy bandwidth measured in the same run (read +
written bytes / time). --sweep times every (BLOCK_N, TARGET_PROGRAMS, num_warps, num_stages) of a small grid and
prints the best per case beside the module's defaults.
Varlen cases (the mixed-step kernel, tp_lora.ops.triton.paged_varlen): a step's rows padded to the runner's graph
bucket for it (32 sequences) as the runner pads them (graph_inputs.pad_mixed_step): 31 decodes at context 128 + one
512-token chunk from position 0 at head_dim 64 and 128, one 2048-token chunk, and chat turns over a cached prefix
(7 decodes at context 1024 + 57 new tokens from position 1024; 15 / 31 decodes + 240 / 96 at 2048). floor = the
larger of FLOPs (4 h d per query and key it attends, causal) / --peak-tflops (dense bf16 peak, as bench_moe's) and
(K and V of every sequence's context once + q and out) bytes / copy bandwidth. --sweep times every (BLOCK_N,
CHUNK_ROWS, NUM_WARPS, NUM_STAGES) of VARLEN_SWEEP for the VARLEN_SWEPT cases, and every case at each partition
target of VARLEN_PART_SWEEP.
--libs also times libraries on the same work with each sequence's K/V contiguous (no paging: a bound on what they
could do over a paged cache, which adds an indirection): torch's scaled_dot_product_attention (its flash /
cuDNN / efficient backends, GQA) and torch.compile'd flex_attention, for every decode case and the prefill-only
varlen cases (causal). FlashInfer and flash-attention do not fit the lent GPU image (see BENCHMARKS.md).
fp8_kv rows (issue 38 item 3): the same kernels over a bf16 and an fp8 (float8_e4m3fn) cache at the 8B heads,
batch --batch (32), contexts --contexts (2048, 4096, 8192): decode, and a mixed step of batch - 1 decodes at that
context + one --chunk (512) token chunk (varlen); floor = bytes (K and V at the cache's width, q, out) / copy
bandwidth; speedup = bf16 µs / fp8 µs. With --sweep, after the table, the fp8 decode at the second context at every
setting of FP8_SWEEP.
tp rows (issue 36): the decode kernel at the per-rank head counts of tensor parallelism (--heads: 32 / 8 at tp1,
16 / 4 at tp2, 8 / 2 at tp4; head_dim 128, bf16), batch --batch, short contexts (--short-contexts), block tables as
wide as --max-len positions (the engine's graphs: the partition count follows the width, not the context); floor as
the decode rows'. --sweep adds every setting of TP_SWEEP.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_lora_ops import ROTATE_BYTES, Bench  # noqa: E402
from bench_step import copy_bandwidth  # noqa: E402
from tp_lora.engine.graph_inputs import pad_mixed_step  # noqa: E402
from tp_lora.engine.runner import mixed_sizes  # noqa: E402
from tp_lora.ops.triton import paged_attention as kernel  # noqa: E402
from tp_lora.ops.triton import paged_varlen as varlen  # noqa: E402

CASES = [  # (name, batch, context, query heads, kv heads, head_dim)
    ("8b", 32, 2048, 32, 8, 128), ("8b", 1, 2048, 32, 8, 128), ("8b", 128, 2048, 32, 8, 128),
    ("8b", 32, 8192, 32, 8, 128), ("8b", 32, 128, 32, 8, 128),
    ("2048", 32, 2048, 32, 8, 64), ("2048", 32, 128, 32, 8, 64),
]
SWEEP = dict(BLOCK_N=(32, 64, 128), TARGET_PROGRAMS=(264, 528, 1056), NUM_WARPS=(4, 8), NUM_STAGES=(2, 3))
SWEPT = {("8b", 32, 2048), ("8b", 1, 2048), ("8b", 128, 2048), ("2048", 32, 128)}  # cases the sweep covers
BS, CALLS = 16, 20


def copies(kv_bytes: int) -> int:
    """Copies of a case's K and V (kv_bytes for one copy of both) to rotate over (2 on a CPU: no L2 to defeat)."""
    return max(2, -(-ROTATE_BYTES // kv_bytes)) if torch.cuda.is_available() else 2
VARLEN_CASES = [  # (name, decodes, their context, chunk tokens, the chunk's first position, h, kv, d)
    ("2048", 31, 128, 512, 0, 32, 8, 64), ("8b", 31, 128, 512, 0, 32, 8, 128),
    ("2048", 0, 0, 2048, 0, 32, 8, 64), ("8b", 0, 0, 2048, 0, 32, 8, 128),
    # a chat turn over its cached conversation beside a few decodes (prefix caching's hits)
    ("2048", 7, 1024, 57, 1024, 32, 8, 64), ("8b", 7, 1024, 57, 1024, 32, 8, 128),
    ("8b", 15, 2048, 240, 2048, 32, 8, 128), ("8b", 31, 2048, 96, 2048, 32, 8, 128),
]
MAX_SEQS = 32  # the scheduler's batch limit the cases' graph buckets are sized for
VARLEN_SWEEP = dict(BLOCK_N=(64, 128), CHUNK_ROWS=(64, 128), NUM_WARPS=(4, 8), NUM_STAGES=(2, 3))
VARLEN_SWEPT = {("2048", 512), ("8b", 512), ("2048", 2048)}  # (name, chunk) of the cases the sweep covers
VARLEN_PART_SWEEP = dict(TARGET_PROGRAMS=(132, 264, 528, 1056, 2112))  # swept alone on every varlen case
FP8_SWEEP = dict(BLOCK_N_FP8=(64, 128), NUM_STAGES=(2, 3), TARGET_PROGRAMS=(264, 528))
TP_SWEEP = dict(MIN_PART=(64, 128, 256), TARGET_PROGRAMS=(264, 528))
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def random_cache(shape, g, dev, dtype) -> torch.Tensor:
    """Normal values in the cache's dtype (an fp8 one rounds them as the cache write does), drawn on the device from
    a generator seeded by g."""
    gen = torch.Generator(dev).manual_seed(int(torch.randint(1 << 62, (), generator=g)))
    return torch.randn(shape, generator=gen, device=dev).to(dtype)


def case_inputs(b, ctx, h, kv, d, dev, g, kv_dtype=torch.bfloat16, width=0):
    """(q, rotated caches, block table, context lens): each sequence's blocks scattered over the cache; a table
    `width` entries wide (past the context: the last block) where width > the context's blocks."""
    blocks = -(-ctx // BS)
    n_blocks = b * blocks
    perm = torch.randperm(n_blocks, generator=g)
    table = perm.view(b, blocks)
    if width > blocks:
        table = torch.cat([table, table[:, -1:].expand(b, width - blocks)], 1)
    table = table.to(dev, torch.int32)
    shape = (n_blocks, BS, kv, d)
    caches = [(random_cache(shape, g, dev, kv_dtype), random_cache(shape, g, dev, kv_dtype))
              for _ in range(copies(2 * n_blocks * BS * kv * d * kv_dtype.itemsize))]
    q = torch.randn(b, h, d, generator=g).to(dev, torch.bfloat16)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    return q, caches, table, lens


def varlen_inputs(decodes, ctx, chunk, h, kv, d, dev, g, kv_dtype=torch.bfloat16, chunk_start=0):
    """(q, caches, table, context_lens, cu_q) of the case padded to its graph bucket, (tokens, seqs) of the bucket, and
    (FLOPs, bytes) of its real work."""
    starts, lens = [ctx - 1] * decodes + [chunk_start], [1] * decodes + [chunk]
    tokens, seqs = next(sz for sz in mixed_sizes(4096, MAX_SEQS) if sz[0] >= sum(lens))
    need = [-(-(st + n) // BS) for st, n in zip(starts, lens)]
    perm = torch.randperm(sum(need) + 1, generator=g).tolist()  # + the scratch block
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    width = max(need)
    host = pad_mixed_step([0] * sum(lens), tables, starts, lens, tokens, seqs, width, BS, perm[-1])
    shape = (len(perm), BS, kv, d)
    caches = [(random_cache(shape, g, dev, kv_dtype), random_cache(shape, g, dev, kv_dtype))
              for _ in range(copies(2 * len(perm) * BS * kv * d * kv_dtype.itemsize))]
    q = torch.randn(tokens, h, d, generator=g).to(dev, torch.bfloat16)
    keys = sum(st + i + 1 for st, n in zip(starts, lens) for i in range(n))  # keys each real query attends
    flops = 4 * h * d * keys
    nbytes = (2 * sum(st + n for st, n in zip(starts, lens)) * kv * d * kv_dtype.itemsize
              + 2 * sum(lens) * h * d * 2)
    return ((q, caches, host.block_table.to(dev), host.context_lens.to(dev), host.cu_q.to(dev)), (tokens, seqs),
            (flops, nbytes))


def time_case(q, caches, table, lens, scale, cu_q=None) -> float:
    """Median µs per call of the decode kernel (cu_q None) or the varlen kernel over these inputs."""
    def call(i):
        k, v = caches[i % len(caches)]
        if cu_q is None:
            kernel.paged_decode(q, k, v, table, lens, scale)
        else:
            varlen.paged_varlen(q, k, v, table, lens, cu_q, scale)
    return graph_us(call)[0]


def library_us(q, k, v, causal: bool) -> dict[str, float]:
    """Median µs per call of torch SDPA and compiled flex_attention on q [B, H, Lq, d] over contiguous k / v
    [B, KV, Lk, d] lists (rotated like the caches), both captured in a CUDA graph."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    mask = None
    if causal:
        lq, lk = q.shape[2], k[0].shape[2]
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi + (lk - lq), None, None, lq, lk, device=q.device)
    fns = {"sdpa": lambda kk, vv: torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=causal,
                                                                                  enable_gqa=True),
           "flex": lambda kk, vv: flex(q, kk, vv, block_mask=mask, enable_gqa=True)}
    out = {}
    for name, fn in fns.items():
        try:
            us, mode = graph_us(lambda i: fn(k[i % len(k)], v[i % len(v)]))
            out[name] = us if mode == "graph" else f"{us:.1f} ({mode}: not capturable)"
        except Exception as e:  # noqa: BLE001 - a library that cannot run this case is reported, not fatal
            out[name] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    return out


def graph_us(call) -> tuple[float, str]:
    """(median µs per call of call(i) for i in range(CALLS), "graph", or "eager" where capture failed): bench_lora_ops'
    timer, 10 replays of one CUDA graph of the calls."""
    return Bench("cuda", reps=10, warmup=2).time_us(call, CALLS)


def fp8_kv_rows(contexts: list[int], batch: int, chunk: int, sweep: bool, bw: float, dev, g, rows: list,
                save) -> None:
    """issue 38 item 3's table: decode and a mixed step over a bf16 and an fp8 cache at the 8B heads (see the
    module docstring); rows appended as they finish."""
    h, kv, d = 32, 8, 128
    print(f"fp8 KV against bf16 KV, 8B heads ({h} / {kv}, head_dim {d}), decode batch {batch}; varlen: "
          f"{batch - 1} decodes + a {chunk}-token chunk; floor = bytes / copy bandwidth")
    print("| kernel | context | bf16 µs | bf16 floor | fp8 µs | fp8 floor | fp8 of floor | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, ctx in itertools.product(("decode", "varlen"), contexts):
        row = dict(kind=f"fp8_kv_{kind}", case="8b", batch=batch, context=ctx, chunk=chunk if kind == "varlen" else 0)
        for name, dtype in KV_DTYPES.items():
            if kind == "decode":
                q, caches, table, lens = case_inputs(batch, ctx, h, kv, d, dev, g, dtype)
                cu_q, nbytes = None, 2 * batch * ctx * kv * d * dtype.itemsize + 2 * q.numel() * 2
            else:
                (q, caches, table, lens, cu_q), _, (_, nbytes) = varlen_inputs(batch - 1, ctx, chunk, h, kv, d,
                                                                               dev, g, dtype)
            row[f"{name}_us"] = time_case(q, caches, table, lens, d ** -0.5, cu_q)
            row[f"{name}_floor_us"] = nbytes / bw * 1e6
            del caches
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        row["speedup"] = row["bf16_us"] / row["fp8_us"]
        row["fp8_of_floor"] = row["fp8_floor_us"] / row["fp8_us"]
        print(f"| {kind} | {ctx} | {row['bf16_us']:.1f} | {row['bf16_floor_us']:.1f} | {row['fp8_us']:.1f} | "
              f"{row['fp8_floor_us']:.1f} | {row['fp8_of_floor']:.0%} | {row['speedup']:.2f}x |", flush=True)
        rows.append(row)
        save()
    if sweep:  # after the table, so a run cut short keeps it
        ctx = contexts[min(1, len(contexts) - 1)]
        q, caches, table, lens = case_inputs(batch, ctx, h, kv, d, dev, g, KV_DTYPES["fp8"])
        timings = sweep_settings(kernel, FP8_SWEEP, lambda: time_case(q, caches, table, lens, d ** -0.5))
        rows.append(dict(kind="fp8_kv_decode_sweep", case="8b", batch=batch, context=ctx, sweep=timings))
        save()
        timed = {k: v for k, v in timings.items() if isinstance(v, float)}
        for setting, us in sorted(timed.items(), key=lambda kv_: kv_[1])[:6]:
            print(f"  fp8 decode, context {ctx}: {us:.1f} µs at {setting}", flush=True)


def tp_rows(heads: list[tuple[int, int]], contexts: list[int], batch: int, max_len: int, sweep: bool, bw: float, dev,
            g, rows: list, save) -> None:
    """issue 36's rows: the decode kernel at per-rank head counts and short contexts over wide block tables (see the
    module docstring); rows appended as they finish."""
    d = 128
    print(f"decode at tp head counts, batch {batch}, head_dim {d}, bf16, tables of {max_len} positions")
    print("| heads (q / kv) | context | µs | floor µs | of floor | best µs (setting) |")
    print("|---|---|---|---|---|---|")
    for (h, kv), ctx in itertools.product(heads, contexts):
        q, caches, table, lens = case_inputs(batch, ctx, h, kv, d, dev, g, width=-(-max_len // BS))
        floor = (2 * batch * ctx * kv * d * 2 + 2 * q.numel() * 2) / bw * 1e6
        us = time_case(q, caches, table, lens, d ** -0.5)
        row = dict(kind="tp", heads=h, kv_heads=kv, batch=batch, context=ctx, max_len=max_len, us=us,
                   floor_us=floor, sweep={})
        if sweep:
            row["sweep"] = sweep_settings(kernel, TP_SWEEP, lambda: time_case(q, caches, table, lens, d ** -0.5))
        table_row(rows, row, f"{h} / {kv} | {ctx}", floor, save)
        del caches
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def table_row(rows: list, row: dict, cells: str, floor: float, save) -> None:
    """Print a decode row (its leading cells, us, floor, share of floor, the sweep's best) and keep it, saved."""
    best = best_setting(row["sweep"])
    us = row["us"]
    print(f"| {cells} | {us:.1f} | {floor:.1f} | {floor / us:.0%} | {best[1]:.1f} ({best[0]}) |", flush=True)
    rows.append(row)
    save()


def best_setting(sweep: dict) -> tuple[str, float]:
    """The fastest setting of a sweep_settings() result and its µs, or ("-", nan) when none ran."""
    timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
    return min(timed.items(), key=lambda kv: kv[1]) if timed else ("-", float("nan"))


def sweep_settings(module, grid: dict, timed) -> dict:
    """{setting (JSON): µs, or "failed: ..."} of timed() at every setting of grid (names of the kernel module's
    constants), the module's values restored after."""
    old = {k: getattr(module, k) for k in grid}
    out = {}
    for values in itertools.product(*grid.values()):
        for k, v in zip(grid, values):
            setattr(module, k, v)
        try:
            out[json.dumps(dict(zip(grid, values)))] = timed()
        except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory) is skipped
            out[json.dumps(dict(zip(grid, values)))] = f"failed: {type(e).__name__}"
    for k, v in old.items():
        setattr(module, k, v)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_results")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--kind", choices=("decode", "varlen", "fp8_kv", "tp", "all"), default="all")
    p.add_argument("--contexts", default="2048,4096,8192", help="contexts of the fp8_kv rows")
    p.add_argument("--batch", type=int, default=32, help="batch of the fp8_kv rows")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk of the fp8_kv varlen rows")
    p.add_argument("--heads", default="32/8,16/4,8/2", help="query / KV heads per rank of the tp rows")
    p.add_argument("--short-contexts", default="128,512,2048", help="contexts of the tp rows")
    p.add_argument("--max-len", type=int, default=8192, help="block-table width of the tp rows, in positions")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the fp8_kv rows (TRITON_INTERPRET=1)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100/H200: 989)")
    p.add_argument("--libs", action="store_true", help="also time torch SDPA and flex_attention (contiguous K/V)")
    args = p.parse_args()
    dev = torch.device(args.device)
    bw = copy_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    defaults = {k: getattr(kernel, k) for k in {**SWEEP, **FP8_SWEEP, **TP_SWEEP}}
    rows = []
    varlen_defaults = {k: getattr(varlen, k) for k in {**VARLEN_SWEEP, **VARLEN_PART_SWEEP}}

    def save():  # after every case: a run cut short keeps what it measured
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
            json.dump(dict(device=device_name, bandwidth_Bps=bw, defaults=defaults,
                           varlen_defaults=varlen_defaults, rows=rows), f, indent=1)

    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {device_name}, copy bandwidth {bw / 1e12:.2f} TB/s, defaults {defaults}")
    if args.kind in ("decode", "all"):
        print("| case | batch | context | µs | floor µs | of floor | best µs (setting) |")
        print("|---|---|---|---|---|---|---|")
    for name, b, ctx, h, kv, d in CASES if args.kind in ("decode", "all") else []:
        q, caches, table, lens = case_inputs(b, ctx, h, kv, d, dev, g)
        nbytes = 2 * b * ctx * kv * d * 2 + 2 * q.numel() * 2
        floor = nbytes / bw * 1e6  # the copy's bytes read + written per second: what HBM moves either way
        us = time_case(q, caches, table, lens, d ** -0.5)
        row = dict(case=name, batch=b, context=ctx, us=us, floor_us=floor, of_floor=floor / us, sweep={})
        if args.libs:
            n = copies(2 * b * kv * ctx * d * 2)
            kc = [torch.randn(b, kv, ctx, d, generator=g).to(dev, torch.bfloat16) for _ in range(2 * n)]
            row["libs"] = library_us(q.unsqueeze(2), kc[:n], kc[n:], causal=False)
            print(f"libraries, contiguous K/V: {row['libs']}", flush=True)
            del kc
        if args.sweep and (name, b, ctx) in SWEPT:
            row["sweep"] = sweep_settings(kernel, SWEEP, lambda: time_case(q, caches, table, lens, d ** -0.5))
        table_row(rows, row, f"{name} | {b} | {ctx}", floor, save)
        del caches
        torch.cuda.empty_cache()
    if args.kind in ("varlen", "all"):
        print(f"varlen defaults {varlen_defaults}, floor: max(FLOPs / {args.peak_tflops:.0f} TFLOP/s, bytes / copy "
              f"bandwidth)")
        print("| case | decodes | context | chunk | bucket | µs | flop floor µs | byte floor µs | of floor | "
              "best µs (setting) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for name, decodes, ctx, chunk, start, h, kv, d in VARLEN_CASES if args.kind in ("varlen", "all") else []:
        inputs, (tokens, seqs), (flops, nbytes) = varlen_inputs(decodes, ctx, chunk, h, kv, d, dev, g,
                                                                chunk_start=start)
        q, caches, table, lens, cu_q = inputs
        flop_floor, byte_floor = flops / (args.peak_tflops * 1e12) * 1e6, nbytes / bw * 1e6
        us = time_case(q, caches, table, lens, d ** -0.5, cu_q)
        row = dict(case=name, kind="varlen", decodes=decodes, context=ctx, chunk=chunk, chunk_start=start,
                   tokens=tokens, seqs=seqs,
                   head_dim=d, us=us, flop_floor_us=flop_floor, byte_floor_us=byte_floor,
                   of_floor=max(flop_floor, byte_floor) / us, sweep={})
        if args.libs and decodes == 0:
            n = copies(2 * kv * chunk * d * 2)
            kc = [torch.randn(1, kv, chunk, d, generator=g).to(dev, torch.bfloat16) for _ in range(2 * n)]
            ql = torch.randn(1, h, chunk, d, generator=g).to(dev, torch.bfloat16)
            row["libs"] = library_us(ql, kc[:n], kc[n:], causal=True)
            print(f"libraries, contiguous K/V: {row['libs']}", flush=True)
            del kc
        if args.sweep:
            row["sweep"] = sweep_settings(varlen, VARLEN_PART_SWEEP,
                                          lambda: time_case(q, caches, table, lens, d ** -0.5, cu_q))
        if args.sweep and (name, chunk) in VARLEN_SWEPT:
            row["sweep"].update(sweep_settings(varlen, VARLEN_SWEEP,
                                               lambda: time_case(q, caches, table, lens, d ** -0.5, cu_q)))
        best = best_setting(row["sweep"])
        print(f"| {name} d{d} | {decodes} | {ctx} | {chunk} from {start} | {tokens}/{seqs} | {us:.1f} | "
              f"{flop_floor:.1f} | {byte_floor:.1f} | {row['of_floor']:.0%} | {best[1]:.1f} ({best[0]}) |", flush=True)
        rows.append(row)
        save()
        del caches
        torch.cuda.empty_cache()
    if args.kind in ("fp8_kv", "all"):
        fp8_kv_rows([int(c) for c in args.contexts.split(",")], args.batch, args.chunk, args.sweep, bw, dev, g, rows,
                    save)
    if args.kind in ("tp", "all"):
        heads = [tuple(int(x) for x in hk.split("/")) for hk in args.heads.split(",")]
        tp_rows(heads, [int(c) for c in args.short_contexts.split(",")], args.batch, args.max_len, args.sweep, bw, dev,
                g, rows, save)
    save()


if __name__ == "__main__":
    main()
