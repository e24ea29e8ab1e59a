"""The MoE routing plan alone (tp_lora.ops.moe_plan.build_plan) at decode and mixed-step sizes: torch's path (stable
sort, searchsorted, the LoRA blocks' torch ops) against the Triton kernels (all-pairs ranking, then with adapter slots
the block table) at several launch settings, with and without adapter slots; where build_plan's limit (SMALL_SORT)
and the kernels' SETTINGS should sit.

    python scripts/bench_moe_plan.py --out bench_results/moe_plan          # GPU: graphs of --calls builds, medians
    python scripts/bench_moe_plan.py --tokens 4,16 --reps 3                  # CPU: torch's path only (smoke)

Tokens are dispatched tokens (a mixed step of 31 decodes + a 512-token chunk: 543 a replica, 1086 at ep2); pairs =
tokens x --k over --experts local experts (one rank holding all: tp layouts). Settings: BLOCK_I:NUM_WARPS:BLOCK_J of
the ranking kernel (tp_lora.ops.triton.moe_plan; "default": its SETTINGS). Prints a table, writes bench_moe_plan.json
into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_moe_lora import time_graph  # noqa: E402 - this directory's (scripts/)
from tp_lora.ops import moe_plan  # noqa: E402


def timed_us(fn, reps: int, calls: int, cuda: bool) -> float:
    """Median µs per call: replays of a CUDA graph of `calls` calls on a GPU, else wall time of one call."""
    if cuda:
        return time_graph([fn] * calls, reps)
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def build(ids, w, slots, experts: int, max_loras: int, kernel: bool):
    """build_plan on torch's path (kernel False) or the Triton kernels (kernel True), whatever the limit says."""
    saved = moe_plan.SMALL_SORT
    moe_plan.SMALL_SORT = (1 << 30) if kernel else 0
    try:
        return moe_plan.build_plan(ids, w, slots, 0, experts, max_loras, lora=slots is not None)
    finally:
        moe_plan.SMALL_SORT = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32,256,543,768,1086,2172", help="dispatched tokens, comma list")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", default="0,32", help="adapter slots (0: a plan without LoRA), comma list")
    ap.add_argument("--settings", default="default,4:8:256,8:4:256,16:4:256,16:4:512,32:8:256",
                    help="kernel launch settings BLOCK_I:NUM_WARPS:BLOCK_J (GPU), comma list")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=10, help="builds per graph (GPU)")
    ap.add_argument("--out", default="bench_results/moe_plan")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        from tp_lora.ops.triton.moe_plan import plan_pairs  # noqa: PLC0415 - GPU only
    rows = []
    print("| tokens | pairs | slots | torch µs | same plan | " + " | ".join(args.settings.split(",")) + " |" if cuda
          else "| tokens | pairs | slots | torch µs |")
    for n in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(n)
        ids = torch.rand(n, args.experts, generator=gen).topk(args.k, -1).indices.to(device)
        w = torch.rand(n, args.k, generator=gen).to(device)
        for L in (int(s) for s in args.slots.split(",")):
            slots = torch.randint(-1, L, (n,), generator=gen, dtype=torch.int32).to(device) if L else None
            row = dict(tokens=n, pairs=n * args.k, slots=L,
                       torch_us=round(timed_us(lambda: build(ids, w, slots, args.experts, L, False), args.reps,
                                               args.calls, cuda), 1))
            if cuda:  # the kernel's plan is torch's (the LoRA block tables' row orders differ: not compared)
                got, want = (build(ids, w, slots, args.experts, L, kernel) for kernel in (True, False))
                row["same_plan"] = all(torch.equal(getattr(got, f), getattr(want, f))
                                       for f in ("token", "pos", "sorted_key", "expert_ends"))
            for name in args.settings.split(",") if cuda else ():
                if name == "default":
                    fn = lambda: build(ids, w, slots, args.experts, L, True)  # noqa: E731
                else:
                    setting = tuple(int(v) for v in name.split(":"))
                    fn = lambda: plan_pairs(ids, slots, 0, args.experts, L, setting)  # noqa: E731
                row[name] = round(timed_us(fn, args.reps, args.calls, cuda), 1)
            rows.append(row)
            print("| " + " | ".join(str(v) for v in row.values()) + " |", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", k=args.k, experts=args.experts,
                limit=moe_plan.SMALL_SORT)
    with open(os.path.join(args.out, "bench_moe_plan.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
