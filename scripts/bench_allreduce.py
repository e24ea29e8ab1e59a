"""The tp all-reduce inside a CUDA graph: NCCL against the peer-memory paths, bf16, one rank per GPU; then the
all-reduce fused with the residual add + RMSNorm that follow it, and the all-gather.

    torchrun --nproc_per_node=2 scripts/bench_allreduce.py --out DIR [--sizes 4096,...] [--iters 50]

Per size and path: a graph of --iters back-to-back all-reduces of one tensor, replayed --reps times, the median replay
over --iters (microseconds, CUDA events on rank 0). Each path's result is checked against NCCL's on the same data
first (small integers: every order of summation is exact).
Paths: NCCL, PyTorch's one-shot and two-shot (symmetric memory), ours (tp_lora.distributed.peer_kernels.all_reduce, at
any size a staging slot holds) and its two-shot form (two chunks of 1 / ranks in a slot), and the dispatch
parallel.allreduce=symm_mem makes by size.
Fused (rows x hidden bf16, 4 KB to 1 MB): the peer kernel (tp_lora/ops/triton/peer_norm.py) against the dispatched
all-reduce + the add_rms_norm kernel and NCCL + add_rms_norm (each result compared with NCCL + add_rms_norm's), and
the add_rms_norm kernel alone. All-gather (32 rows, output bytes): the peer kernel (where a staging slot holds a
rank's part) against NCCL, checked equal.
Prints the tables; writes bench_allreduce.json into --out.
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
from tp_lora.distributed.peer_kernels import all_reduce as peer_all_reduce  # noqa: E402
from tp_lora.ops import fused  # noqa: E402
from tp_lora.ops.triton.fused import add_rms_norm as norm_kernel  # noqa: E402
from tp_lora.ops.triton.peer_norm import reduce_add_rms_norm as fused_kernel  # noqa: E402

SIZES = "4096,16384,65536,131072,262144,524288,1048576,2097152,4194304,8388608"
# (rows, hidden) of the fused all-reduce + add + RMSNorm: 4 KB to 1 MB of bf16
FUSED = "1x2048,1x4096,4x4096,8x4096,16x4096,32x4096,64x4096,128x4096,32x8192,64x8192"
GATHER = "1024,8192,65536,262144,1048576,4194304,8388608"  # all-gather output bytes (32 rows of bf16)


def reducer(path: str, ps: comm.ParallelState, peer: comm.PeerAllReduce):
    """fn(t) summing t over the tp group in place by one path."""
    if path == "nccl":
        nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
        return lambda t: comm.all_reduce(t, nccl)
    if path == "dispatch":
        return lambda t: comm.all_reduce(t, ps.tp)
    if path == "one_shot":  # PyTorch's one-shot over the peer's buffer (t: whole 16-byte vectors)
        return lambda t: torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            peer.bufs[t.dtype][:t.numel()], t.view(-1), "sum", peer.name, t.view(-1))
    if path == "two_shot":
        return peer.two_shot
    two_shot = path == "ours_two_shot"
    return lambda t: peer_all_reduce(t, peer.buffer(t.dtype), two_shot)  # ours, at any size a slot holds


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


def fused_rows(ps: comm.ParallelState, peer: comm.PeerAllReduce, specs: list[str], iters: int, reps: int) -> list:
    """Per rows x hidden: microseconds of the fused kernel, the dispatched all-reduce + norm, NCCL + norm, the norm
    alone; each result's largest difference from NCCL + the add_rms_norm kernel (_diff) and + the torch reference
    (_ref_diff), bf16 random normal data."""
    nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
    gen = torch.Generator(device=ps.device).manual_seed(10 + ps.rank)
    buf = peer.buffer(torch.bfloat16)
    out = []
    for spec in specs:
        t, h = (int(v) for v in spec.split("x"))
        x = torch.randn(t, h, generator=gen, device=ps.device).to(torch.bfloat16)
        same = torch.Generator(device=ps.device).manual_seed(t * h)  # the residual stream and weight: every rank's
        res = torch.randn(t, h, generator=same, device=ps.device).to(torch.bfloat16)
        w = torch.randn(h, generator=same, device=ps.device).to(torch.bfloat16)
        paths = {"fused": lambda x: fused_kernel(x, res, w, 1e-5, False, None, buf),
                 "dispatch_norm": lambda x: norm_kernel(peer.all_reduce(x), res, w, 1e-5),
                 "nccl_norm": lambda x: norm_kernel(comm.all_reduce(x, nccl), res, w, 1e-5),
                 "norm_only": lambda x: norm_kernel(x, res, w, 1e-5)}
        want = norm_kernel(comm.all_reduce(x.clone(), nccl), res, w, 1e-5)
        ref = fused.add_rms_norm_ref(comm.all_reduce(x.clone(), nccl), res, w, 1e-5)
        row = {"rows": t, "hidden": h, "bytes": x.nbytes}
        for name, fn in paths.items():
            if name != "norm_only":
                got = fn(x.clone())
                row[name + "_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                row[name + "_ref_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
            row[name] = graph_us(fn, x.clone(), iters, reps)  # the all-reduces sum in place: timing only
        out.append(row)
        if ps.is_driver:
            print("fused", json.dumps(row), flush=True)
    return out


def gather_rows(ps: comm.ParallelState, peer: comm.PeerAllReduce, sizes: list[int], iters: int, reps: int) -> list:
    """Per output size: microseconds of the peer all-gather kernel and NCCL's (32 rows, last dim), checked equal."""
    nccl = comm.Group("tp", ps.tp.rank, ps.tp.size, ps.tp.ranks, ps.tp.pg)
    out = []
    for nbytes in sizes:
        cols = max(1, nbytes // 2 // 32 // ps.tp.size)
        x = torch.randn(32, cols, device=ps.device).to(torch.bfloat16)
        want = comm.all_gather(x, nccl, -1)
        row = {"bytes": want.nbytes, "peer": None, "nccl": graph_us(lambda x: comm.all_gather(x, nccl, -1), x, iters,
                                                                     reps)}
        if peer.buffer(x.dtype).fits(x):  # else over a staging slot
            if not torch.equal(peer.all_gather(x, -1), want):
                raise RuntimeError(f"peer all-gather of 32 x {cols} differs from NCCL's")
            row["peer"] = graph_us(lambda x: peer.all_gather(x, -1), x, iters, reps)
        out.append(row)
        if ps.is_driver:
            print("gather", json.dumps(row), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--sizes", default=SIZES, help="message sizes in bytes (bf16)")
    p.add_argument("--fused", default=FUSED, help="rows x hidden of the fused all-reduce + norm ('' skips)")
    p.add_argument("--gather", default=GATHER, help="all-gather output bytes ('' skips)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps = comm.init_parallel(world, "cuda", allreduce="symm_mem")
    sizes = [int(s) for s in args.sizes.split(",")]
    big = max(sizes)
    peer = comm.PeerAllReduce(ps.tp.pg, ps.device, big)
    slot = peer.buffer(torch.bfloat16).slot * 2  # bytes: the largest message our kernel takes
    paths = ["nccl", "one_shot", "two_shot", "ours", "ours_two_shot", "dispatch"]
    gen = torch.Generator(device=ps.device).manual_seed(ps.rank)
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        x = torch.randint(-8, 9, (n,), generator=gen, device=ps.device).to(torch.bfloat16)
        want = x.clone()
        reducer("nccl", ps, peer)(want)
        row = {"bytes": nbytes}
        for path in paths:
            if path == "ours" and nbytes > slot or path == "ours_two_shot" and 2 * -(-nbytes // world) > slot:
                row[path] = None
                continue
            got = x.clone()
            reducer(path, ps, peer)(got)
            if not torch.equal(got, want):
                raise RuntimeError(f"{path} at {nbytes} bytes differs from NCCL by "
                                   f"{(got.float() - want.float()).abs().max().item()}")
            row[path] = graph_us(reducer(path, ps, peer), x.clone(), args.iters, args.reps)
        rows.append(row)
        if ps.is_driver:
            print("row", json.dumps(row), flush=True)
    fused_out = fused_rows(ps, peer, [f for f in args.fused.split(",") if f], args.iters, args.reps)
    gather_out = gather_rows(ps, peer, [int(b) for b in args.gather.split(",") if b], args.iters, args.reps)
    two_shot_max = peer.two_shot_max
    del peer
    torch.cuda.synchronize()
    comm.shutdown()
    if not ps.is_driver:
        return
    name = torch.cuda.get_device_name()
    print(f"all-reduce of bf16 inside a CUDA graph, {world} ranks, {name}: microseconds per call")
    print("| bytes | NCCL | PyTorch one-shot | PyTorch two-shot | ours | ours, two-shot | symm_mem dispatch | "
          "NCCL / dispatch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ours, ours2 = ("-" if r[k] is None else f"{r[k]:.1f}" for k in ("ours", "ours_two_shot"))
        print(f"| {r['bytes']} | {r['nccl']:.1f} | {r['one_shot']:.1f} | {r['two_shot']:.1f} | {ours} | {ours2} | "
              f"{r['dispatch']:.1f} | {r['nccl'] / r['dispatch']:.2f} |")
    print(f"all-reduce + residual add + RMSNorm of bf16 rows inside a CUDA graph, {world} ranks, {name}: "
          "microseconds per call (largest difference from NCCL + the add_rms_norm kernel)")
    print("| rows x hidden | bytes | fused kernel | all-reduce + norm | NCCL + norm | norm alone | NCCL + norm / fused |")
    print("|---|---|---|---|---|---|---|")
    for r in fused_out:
        print(f"| {r['rows']} x {r['hidden']} | {r['bytes']} | {r['fused']:.1f} ({r['fused_diff']:.3g}) | "
              f"{r['dispatch_norm']:.1f} ({r['dispatch_norm_diff']:.3g}) | {r['nccl_norm']:.1f} | "
              f"{r['norm_only']:.1f} | {r['nccl_norm'] / r['fused']:.2f} |")
    print(f"all-gather of bf16 (32 rows, last dim) inside a CUDA graph, {world} ranks, {name}: microseconds per call")
    print("| output bytes | peer kernel | NCCL | NCCL / peer |\n|---|---|---|---|")
    for r in gather_out:
        if r["peer"] is None:
            print(f"| {r['bytes']} | - | {r['nccl']:.1f} | - |")
        else:
            print(f"| {r['bytes']} | {r['peer']:.1f} | {r['nccl']:.1f} | {r['nccl'] / r['peer']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_allreduce.json"), "w") as f:
        json.dump(dict(device=name, ranks=world, dtype="bfloat16", iters=args.iters, reps=args.reps,
                       peer_max_bytes=comm.PEER_MAX_BYTES, ours_max_bytes=comm.ours_max_bytes(world),
                       two_shot_max_bytes=two_shot_max,
                       rows=rows, fused=fused_out, gather=gather_out),
                  f, indent=2)


if __name__ == "__main__":
    main()
