#!/usr/bin/env python
"""Issue #32's GPU targets, on one GPU:

1. decode step with DoRA adapters vs plain LoRA adapters of the same rank: the LoRA-carrying linear layers of a
   Llama-3-8B decoder stack (qkv, o, gate_up, down; H 4096, I 14336, 32 q / 8 kv heads of 128; --layers of them),
   batch --batch decode tokens, each of the --adapters adapters in its own slot, tokens spread round-robin. Both
   runs replay one CUDA graph of the whole stack; DoRA adds the per-token g scale (ops.lora_epilogue) after each
   layer's expand. Attention (context --context) is the same in both runs and left out, so the ratio printed is an
   upper bound of the whole step's. Target: DoRA / plain <= 1.25.
2. shrink + expand alone at rank 128 / 256 (T 64, 32 adapters, 4096 -> r -> 4096 and the qkv shape); the vLLM /
   SGLang side of that comparison runs in shared/tools/peer-kernels (add these shapes to its run).

Usage (repo root): python scripts/bench_dora.py [--rank 16] [--layers 32] [--out DIR]; --quick: tiny shapes, any
device (a smoke test of the script; on CPU eager, the torch backend).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.layers.linear import ParallelLinear, column_spec, qkv_spec, row_spec  # noqa: E402
from tp_lora.lora.layers import LoRARuntime, wrap  # noqa: E402
from tp_lora.ops import get_backend  # noqa: E402
from tp_lora.ops.batch import build_lora_batch  # noqa: E402


def _stack(a, rt, tp, dtype, device):
    """One decoder's four LoRA layers (Llama-3-8B shapes unless --quick), random weights, every slot filled."""
    layers = []
    for spec, paths in ((qkv_spec(a.hidden, a.heads, a.kv_heads, a.head_dim), ["q", "k", "v"]),
                        (row_spec(a.heads * a.head_dim, a.hidden), ["o"]),
                        (column_spec(a.hidden, a.inter, a.inter), ["gate", "up"]),
                        (row_spec(a.inter, a.hidden), ["down"])):
        base = ParallelLinear(spec, tp, False, dtype, device)
        base.weight.data.normal_(0, base.weight.shape[1] ** -0.5)
        layer = wrap(base, rt, [f"{p}_{len(layers)}_{id(rt)}" for p in paths])
        for p in layer.lora_a:
            p.data.normal_(0, 0.02)
        for p in layer.lora_b:
            p.data.normal_(0, 0.02)
        layer.scales.fill_(1.0)
        layers.append(layer)
    return layers


def _time(fn, device, reps: int) -> float:
    """Median ms of fn: a replayed CUDA graph on CUDA, eager elsewhere."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        import time
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def decode_step(a, device, dtype, dora: bool) -> float:
    ops = get_backend("auto", str(device))
    rt = LoRARuntime(a.adapters, a.rank, False, ops)
    tp = comm.single_process(device).tp
    stacks = [_stack(a, rt, tp, dtype, device) for _ in range(a.layers)]
    for layers in stacks:
        for layer in layers:
            layer.epilogue = dora
            if dora:  # g as a load leaves it: m / ||W + s B A||, here any per-slot per-column scale
                layer.dora_g.uniform_(0.9, 1.1)
    rt.batch = build_lora_batch([i % a.adapters for i in range(a.batch)], a.adapters, device)
    if hasattr(ops, "prepare"):
        ops.prepare(rt.batch)
    x = torch.randn(a.batch, a.hidden, dtype=dtype, device=device)
    h = torch.randn(a.batch, a.inter, dtype=dtype, device=device)

    def step():
        for qkv, o, gate_up, down in stacks:
            q = qkv(x)
            o(q[:, :a.heads * a.head_dim])
            gate_up(x)
            down(h)
    with torch.no_grad():
        return _time(step, device, a.reps)


def shrink_expand(a, device, dtype, rank: int, widths: list[int]) -> float:
    ops = get_backend("auto", str(device))
    n, t = 32, 64
    lora_a = [torch.randn(n, rank, a.hidden, dtype=dtype, device=device) * 0.02 for _ in widths]
    lora_b = [torch.randn(n, w, rank, dtype=dtype, device=device) * 0.02 for w in widths]
    scales = torch.ones(len(widths), n, device=device)
    batch = build_lora_batch(torch.randperm(t) % n, n, device)
    if hasattr(ops, "prepare"):
        ops.prepare(batch)
    x = torch.randn(t, a.hidden, dtype=dtype, device=device)
    out = torch.zeros(t, sum(widths), dtype=dtype, device=device)
    with torch.no_grad():
        return _time(lambda: ops.expand(ops.shrink(x, lora_a, scales, batch), lora_b, batch, out), device, a.reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="recorded only: attention is left out (see above)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="directory for dora.json")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a.hidden, a.inter, a.heads, a.kv_heads, a.head_dim = (4096, 14336, 32, 8, 128)
    if a.quick:  # tiny shapes; --reps, if given, still counts
        a.hidden, a.inter, a.heads, a.kv_heads, a.head_dim, a.layers = 256, 512, 4, 2, 64, 2
        a.reps = a.reps if a.reps != ap.get_default("reps") else 3
    plain, dora = decode_step(a, device, dtype, False), decode_step(a, device, dtype, True)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(a),
           "plain_ms": plain, "dora_ms": dora, "ratio": dora / plain}
    print(f"LoRA layers of {a.layers} decoders, batch {a.batch}, {a.adapters} adapters r={a.rank}: plain "
          f"{plain:.3f} ms, DoRA {dora:.3f} ms, ratio {dora / plain:.3f} ({'PASS' if dora / plain <= 1.25 else 'FAIL'}"
          f" vs 1.25)")
    for rank in (128, 256):
        for name, widths in (("square", [a.hidden]),
                             ("qkv", [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim])):
            us = shrink_expand(a, device, dtype, rank, widths) * 1e3
            res[f"shrink_expand_r{rank}_{name}_us"] = us
            print(f"shrink+expand T=64, 32 adapters, r={rank}, {name} {widths}: {us:.1f} us")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "dora.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
