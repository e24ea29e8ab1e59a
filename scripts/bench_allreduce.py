"""The tp all-reduce inside a CUDA graph: NCCL against the symmetric-memory path (one-shot, two-shot, and the
dispatch parallel.allreduce=symm_mem makes by size), bf16, one rank per GPU.

    torchrun --nproc_per_node=2 scripts/bench_allreduce.py --out DIR [--sizes 4096,...] [--iters 50]

Per size and path: a graph of --iters back-to-back all-reduces of one tensor, replayed --reps times, the median replay
over --iters (microseconds, CUDA events on rank 0). Each path's result is checked against NCCL's on the same data
first (small integers: every order of summation is exact). Prints a table; writes bench_allreduce.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora import distributed as comm  # noqa: E402

SIZES = "4096,16384,65536,131072,262144,524288,1048576,2097152,4194304,8388608"


def reducer(path: str, ps: comm.ParallelState, peers: dict):
    """fn(t) summing t over the tp group in place by one path."""
    if path == "nccl":
        nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
        return lambda t: comm.all_reduce(t, nccl)
    if path == "dispatch":
        return lambda t: comm.all_reduce(t, ps.tp)
    return peers[path].all_reduce


def graph_us(fn, t: torch.Tensor, iters: int, reps: int) -> float:
    """Median microseconds per call of fn(t), captured iters times in one CUDA graph."""
    for _ in range(3):
        fn(t)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn(t)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    del g
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--sizes", default=SIZES, help="message sizes in bytes (bf16)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps = comm.init_parallel(world, "cuda", allreduce="symm_mem")
    sizes = [int(s) for s in args.sizes.split(",")]
    big = max(sizes)
    peers = {"one_shot": comm.PeerAllReduce(ps.tp.pg, ps.device, big, one_shot_max=big),
             "two_shot": comm.PeerAllReduce(ps.tp.pg, ps.device, big, one_shot_max=0)}
    paths = ["nccl", "one_shot", "two_shot", "dispatch"]
    gen = torch.Generator(device=ps.device).manual_seed(ps.rank)
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randint(-8, 9, (n,), generator=gen, device=ps.device).to(torch.bfloat16)
        want = x.clone()
        reducer("nccl", ps, peers)(want)
        row = {"bytes": nbytes}
        for path in paths:
            got = x.clone()
            reducer(path, ps, peers)(got)
            if not torch.equal(got, want):
                raise RuntimeError(f"{path} at {nbytes} bytes differs from NCCL by "
                                   f"{(got.float() - want.float()).abs().max().item()}")
            row[path] = graph_us(reducer(path, ps, peers), x.clone(), args.iters, args.reps)
        rows.append(row)
        if ps.is_driver:
            print("row", json.dumps(row), flush=True)
    del peers
    torch.cuda.synchronize()
    comm.shutdown()
    if not ps.is_driver:
        return
    name = torch.cuda.get_device_name()
    print(f"all-reduce of bf16 inside a CUDA graph, {world} ranks, {name}: microseconds per call")
    print("| bytes | NCCL | one-shot | two-shot | symm_mem dispatch | NCCL / dispatch |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bytes']} | {r['nccl']:.1f} | {r['one_shot']:.1f} | {r['two_shot']:.1f} | {r['dispatch']:.1f} | "
              f"{r['nccl'] / r['dispatch']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_allreduce.json"), "w") as f:
        json.dump(dict(device=name, ranks=world, dtype="bfloat16", iters=args.iters, reps=args.reps,
                       peer_max_bytes=comm.PEER_MAX_BYTES, one_shot_max_bytes=comm.one_shot_max_bytes(world),
                       rows=rows),
                  f, indent=2)


if __name__ == "__main__":
    main()
