"""Paged decode attention against its memory floor on one GPU, with a sweep of the kernel's launch constants.

    python scripts/bench_attention.py --out DIR [--sweep]

Cases: (batch, context) at the Llama-3-8B head layout (32 query / 8 KV heads, head_dim 128) and the Llama 16x2048
one (32 / 8, 64), bf16, block size 16, each sequence's blocks scattered over the cache. Each call is captured in a CUDA
graph with 20 calls over rotated caches (so K/V come from HBM, not L2) and replayed; median per call of 10 replays.
floor = (K and V bytes attended + q and out bytes) / the device copy bandwidth measured in the same run (read +
written bytes / time). --sweep times every (BLOCK_N, TARGET_PROGRAMS, num_warps, num_stages) of a small grid and
prints the best per case beside the module's defaults.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_step import copy_bandwidth  # noqa: E402
from tp_lora.ops.triton import paged_attention as kernel  # noqa: E402

CASES = [  # (name, batch, context, query heads, kv heads, head_dim)
    ("8b", 32, 2048, 32, 8, 128), ("8b", 1, 2048, 32, 8, 128), ("8b", 128, 2048, 32, 8, 128),
    ("8b", 32, 8192, 32, 8, 128), ("8b", 32, 128, 32, 8, 128),
    ("2048", 32, 2048, 32, 8, 64), ("2048", 32, 128, 32, 8, 64),
]
SWEEP = dict(BLOCK_N=(32, 64, 128), TARGET_PROGRAMS=(264, 528, 1056), NUM_WARPS=(4, 8), NUM_STAGES=(2, 3))
SWEPT = {("8b", 32, 2048), ("8b", 1, 2048), ("8b", 128, 2048), ("2048", 32, 128)}  # cases the sweep covers
BS, COPIES, CALLS = 16, 4, 20


def case_inputs(b, ctx, h, kv, d, dev, g):
    blocks = -(-ctx // BS)
    n_blocks = b * blocks
    perm = torch.randperm(n_blocks, generator=g)
    table = perm.view(b, blocks).to(dev, torch.int32)
    caches = [(torch.randn(n_blocks, BS, kv, d, generator=g).to(dev, torch.bfloat16),
               torch.randn(n_blocks, BS, kv, d, generator=g).to(dev, torch.bfloat16)) for _ in range(COPIES)]
    q = torch.randn(b, h, d, generator=g).to(dev, torch.bfloat16)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    return q, caches, table, lens


def time_case(q, caches, table, lens, scale) -> float:
    def calls():
        for i in range(CALLS):
            k, v = caches[i % COPIES]
            kernel.paged_decode(q, k, v, table, lens, scale)
    calls()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / CALLS)
    del graph
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_results")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    g = torch.Generator().manual_seed(0)
    defaults = {k: getattr(kernel, k) for k in SWEEP}
    rows = []
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, defaults {defaults}")
    print("| case | batch | context | µs | floor µs | of floor | best µs (setting) |")
    print("|---|---|---|---|---|---|---|")
    for name, b, ctx, h, kv, d in CASES:
        q, caches, table, lens = case_inputs(b, ctx, h, kv, d, dev, g)
        nbytes = 2 * b * ctx * kv * d * 2 + 2 * q.numel() * 2
        floor = nbytes / bw * 1e6  # the copy's bytes read + written per second: what HBM moves either way
        us = time_case(q, caches, table, lens, d ** -0.5)
        row = dict(case=name, batch=b, context=ctx, us=us, floor_us=floor, of_floor=floor / us, sweep={})
        if args.sweep and (name, b, ctx) in SWEPT:
            for values in itertools.product(*SWEEP.values()):
                for k, v in zip(SWEEP, values):
                    setattr(kernel, k, v)
                try:
                    row["sweep"][json.dumps(dict(zip(SWEEP, values)))] = time_case(q, caches, table, lens, d ** -0.5)
                except Exception as e:  # noqa: BLE001 - a setting the compiler refuses (shared memory) is skipped
                    row["sweep"][json.dumps(dict(zip(SWEEP, values)))] = f"failed: {type(e).__name__}"
            for k, v in defaults.items():
                setattr(kernel, k, v)
        timed = {k: v for k, v in row["sweep"].items() if isinstance(v, float)}
        best = min(timed.items(), key=lambda kv_: kv_[1]) if timed else ("-", float("nan"))
        print(f"| {name} | {b} | {ctx} | {us:.1f} | {floor:.1f} | {floor / us:.0%} | {best[1]:.1f} ({best[0]}) |",
              flush=True)
        rows.append(row)
        del caches
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), bandwidth_Bps=bw, defaults=defaults, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
