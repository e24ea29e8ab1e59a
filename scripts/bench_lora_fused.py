#!/usr/bin/env python
"""The fused LoRA op (tp_lora.ops.triton.shrink_expand: one launch per layer) against the shrink + expand pair and
the memory floor, at decode sizes, inside CUDA graphs.

Per point (T tokens, n adapters, r=16, bf16, one layer shape): the fused result is first checked against the pair on
the GPU (relative error, must be < 1e-2), then both are timed the way bench_lora_ops.py times them (16 calls captured
in one graph, median replay over --reps; weights rotate over copies so that small points are not served from L2;
default scheme chunked). Shapes: o (4096 -> 4096), qkv (4096 -> 4096 + 1024 + 1024), gate_up (4096 -> 2 x 14336),
down (14336 -> 4096), i.e. one Llama-3-8B decoder layer at TP 1. floor = (adapter bytes read + x read + out read and
written) / measured copy bandwidth. --sweep also times the fused op with its programs per slice (configs.fused_config)
scaled by 1/2, 2 and 4, with every slice splitting N, then K (x1, x2), and at T=32 other block sizes, stages and
warps, all at 32 adapters: how far the byte model's pick is from the best of those.

First (the number that matters most) the layer-set proxy: the four LoRA layers of one 8B decoder layer captured
together, fused vs pair, 32 adapters.

Writes <out>/lora_fused.json and prints two tables. Usage (repo root): python scripts/bench_lora_fused.py --out DIR
[--sweep] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_lora_ops import Bench, Workload, copy_bandwidth  # noqa: E402

SHAPES = {"o": (4096, (4096,)), "qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
GRID_T, GRID_N = (1, 32, 64, 128, 256), (32, 8, 1)  # the case (32 adapters) first
QUICK_T, QUICK_N = (1, 32, 256), (32,)
SWEEP = (0.5, 2.0, 4.0)  # factors on the programs per slice (then both ways of splitting, x1 and x2)
SWEEP_N = 32  # the sweep runs at this many adapters
SWEEP_CONFIG_T = (32,)  # where block sizes, stages and warps are swept too (recompiles)
SWEEP_CONFIGS = (dict(BLOCK_N=256), dict(BLOCK_K=512), dict(num_stages=4), dict(num_warps=8))
RANK = 16
N_INNER = 16


def fused(ops, wl):
    def fn(i):
        k = i % wl.n_sets
        ops.shrink_expand(wl.x, wl.a[k], wl.b[k], wl.scales, wl.batch, wl.out)
    return fn


def pair(ops, wl):
    def fn(i):
        k = i % wl.n_sets
        ops.expand(ops.shrink(wl.x, wl.a[k], wl.scales, wl.batch), wl.b[k], wl.batch, wl.out)
    return fn


def check(ops, wl) -> float:
    """Relative error of the fused op against the pair on the same inputs (weight set 0)."""
    results = []
    for method in (fused, pair):
        wl.out.zero_()
        method(ops, wl)(0)
        results.append(wl.out.double().clone())
    got, want = results
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def variant(real, factor=1.0, split=None, **overrides):
    """configs.fused_config with other block sizes / stages (overrides), every slice's program count scaled by
    factor (within 1 .. its N blocks, or K blocks where it splits K) and, unless split is None, every slice split
    the same way (1: K, 0: N)."""
    def cfg(t, r, k, widths, entries, sms):
        c = dict(real(t, r, k, widths, entries, sms), **overrides)
        if split is not None:
            c["SPLIT_K"] = (split,) * len(widths)
        limits = [-(-k // c["BLOCK_K"]) if sp else -(-w // c["BLOCK_N"]) for w, sp in zip(widths, c["SPLIT_K"])]
        c["PROGRAMS"] = tuple(max(1, min(n, round(p * factor))) for p, n in zip(c["PROGRAMS"], limits))
        return c
    return cfg


def _key(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(c.items()))


def run_point(bench, ops, shape, t, n, bw, sweep: bool) -> dict:
    from tp_lora.ops.triton import configs
    hidden, widths = SHAPES[shape]
    wl = Workload(t, n, RANK, hidden, widths, torch.bfloat16, "cuda", seed=t * 1000 + n, with_base=False)
    ops.prepare(wl.batch)  # the engine builds the step's table right after the batch, outside graphs
    rec = dict(shape=shape, T=t, adapters=n, rank=RANK, widths=list(widths), used_adapters=wl.used,
               weight_sets=wl.n_sets, rel_err=check(ops, wl))
    rec["fused_us"], _ = bench.time_us(fused(ops, wl), N_INNER)
    rec["pair_us"], _ = bench.time_us(pair(ops, wl), N_INNER)
    rec["floor_us"] = wl.floor_bytes() / bw * 1e6
    sched = ops.prepare(wl.batch)
    real = configs.fused_config
    args = (t, RANK, hidden, tuple(widths), sched.entries, configs.num_sms(0))
    rec["config"] = real(*args)
    rec["programs"] = rec["config"]["PROGRAMS"]
    if sweep and n == SWEEP_N:
        rec["sweep"] = {}
        seen = {_key(rec["config"])}
        variants = [variant(real, f) for f in SWEEP] + [variant(real, f, sp) for sp in (0, 1) for f in (1.0, 2.0)]
        if t in SWEEP_CONFIG_T:  # these recompile: a few points only
            variants += [variant(real, f, **o) for o in SWEEP_CONFIGS for f in (1.0, 2.0)]
        for v in variants:
            configs.fused_config = v
            try:
                key = _key(v(*args))
                if key in seen:
                    continue
                seen.add(key)
                rec["sweep"][key], _ = bench.time_us(fused(ops, wl), N_INNER)
            finally:
                configs.fused_config = real
    del wl
    torch.cuda.empty_cache()
    return rec


def run_layer_set(bench, ops, t, n, bw) -> dict:
    """The four LoRA layers of one 8B decoder layer (same token split), captured together."""
    wls = [Workload(t, n, RANK, hidden, widths, torch.bfloat16, "cuda", seed=t * 1000 + n, with_base=False)
           for hidden, widths in SHAPES.values()]
    for wl in wls:
        ops.prepare(wl.batch)
    rec = dict(T=t, adapters=n, rank=RANK)
    for name, method in (("fused", fused), ("pair", pair)):
        fns = [method(ops, wl) for wl in wls]
        rec[f"{name}_us"], _ = bench.time_us(lambda i, fns=fns: [fn(i) for fn in fns], N_INNER)
    rec["floor_us"] = sum(wl.floor_bytes() for wl in wls) / bw * 1e6
    del wls
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for lora_fused.json")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--sweep", action="store_true", help="also time the fused op with scaled programs per slice")
    ap.add_argument("--quick", action="store_true", help="T 1, 32, 256 at 32 adapters only")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new point after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lora_fused.py times CUDA graphs: it needs a GPU")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    from tp_lora.ops import triton as ops
    ts, ns = (QUICK_T, QUICK_N) if args.quick else (GRID_T, GRID_N)
    bw = copy_bandwidth("cuda")
    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    bench = Bench("cuda", args.reps)
    result = dict(device=name, torch=torch.__version__, bandwidth_Bps=bw, reps=args.reps, points=[], layer_set=[])
    path = os.path.join(args.out, "lora_fused.json")
    bad = []
    for t in ts:
        rec = run_layer_set(bench, ops, t, 32, bw)
        result["layer_set"].append(rec)
        print(f"layer set T={t:<4} n=32: fused {rec['fused_us']:6.1f}  pair {rec['pair_us']:6.1f}  floor "
              f"{rec['floor_us']:6.1f} us", flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    points = [(shape, n, t) for n in ns for shape in SHAPES for t in ts]
    for i, (shape, n, t) in enumerate(points):
        if time.time() - t0 > args.budget_s:
            print(f"budget reached: {i}/{len(points)} points done", flush=True)
            break
        rec = run_point(bench, ops, shape, t, n, bw, args.sweep)
        result["points"].append(rec)
        if not rec["rel_err"] < 1e-2:
            bad.append(rec)
        best = min(rec.get("sweep", {}).items(), key=lambda kv: kv[1], default=None)
        sweep = f"best swept {best[1]:.1f} ({best[0]})" if best else ""
        print(f"{shape:>7} T={t:<4} n={n:<3} fused {rec['fused_us']:6.1f}  pair {rec['pair_us']:6.1f}  floor "
              f"{rec['floor_us']:5.1f} us  programs {rec['programs']} split_k {rec['config']['SPLIT_K']}  "
              f"err {rec['rel_err']:.1e}  {sweep}",
              flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n== one LoRA layer, us ({name}, r={RANK}, bf16, graph replay, median of {args.reps}) ==")
    print(f"{'shape':>7} {'T':>4} {'n':>3} | {'fused':>6} {'pair':>6} {'floor':>6} | {'pair/fused':>10} "
          f"{'floor/fused':>11} | {'best swept':>10}")
    for p in result["points"]:
        best = min([p["fused_us"]] + list(p.get("sweep", {}).values()))
        print(f"{p['shape']:>7} {p['T']:>4} {p['adapters']:>3} | {p['fused_us']:6.1f} {p['pair_us']:6.1f} "
              f"{p['floor_us']:6.1f} | {p['pair_us'] / p['fused_us']:10.2f} {p['floor_us'] / p['fused_us']:11.2f} | "
              f"{best:10.1f}")
    print("\n== layer set (qkv + o + gate_up + down of one 8B decoder layer), 32 adapters, us ==")
    for r in result["layer_set"]:
        print(f"T={r['T']:<4} fused {r['fused_us']:6.1f}  pair {r['pair_us']:6.1f}  floor {r['floor_us']:6.1f}  "
              f"pair/fused {r['pair_us'] / r['fused_us']:.2f}  floor/fused {r['floor_us'] / r['fused_us']:.2f}")
    result["elapsed_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"json: {path}; {result['elapsed_s']:.0f} s")
    if bad:
        sys.exit(f"FAIL: fused differs from the pair at {[(p['shape'], p['T'], p['adapters']) for p in bad]}")


if __name__ == "__main__":
    main()
