"""FP8 W8A8 GEMMs (tp_lora.ops.fp8.fp8_linear: per-token activation quantization + torch._scaled_mm) against bf16
(F.linear) and against the FP8 weight-bytes floor, on one GPU, at Llama-3-8B layer shapes.

    python scripts/bench_fp8_gemm.py [--rows 1,16,32,128,512,2048] [--out DIR]

Each (layer, rows) is captured in a CUDA graph of many calls over enough weight copies to leave L2 (every call reads
its weights from HBM); the mean time per call. Floor: the weight bytes (N x K x 1 for fp8, x 2 for bf16) / the device
copy bandwidth measured in the same run (read + written bytes / time). Also checks fp8_linear against its dequantized
reference (relative error) and prints a table; writes bench_fp8_gemm.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from tp_lora.ops.fp8 import dequantize, fp8_linear, quantize_fp8_per_channel

# name -> (N, K) of one Llama-3-8B layer's GEMMs at tp 1
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 64 << 20  # more than an H100's / H200's L2 (50 MiB): weight copies spanning it are read from HBM


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    e.synchronize()
    return 2 * x.numel() * 20 / (s.elapsed_time(e) / 1e3)


def graph_time(calls) -> float:
    """Seconds per call of the callables, replayed from one CUDA graph (the median of 5 replays)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / len(calls))
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,32,128,512,2048")
    p.add_argument("--out", default="bench_results")
    args = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-L2_BYTES // (n * k)))
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        q = [quantize_fp8_per_channel(x) for x in w]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ dequantize(*q[0], None).t()
            err = float((fp8_linear(x, *q[0], None).float() - ref).norm() / ref.norm())
            t_bf16 = graph_time([lambda w=w_: F.linear(x, w) for w_ in w])
            t_fp8 = graph_time([lambda q=q_: fp8_linear(x, q[0], q[1], None) for q_ in q])
            floor = n * k / bw
            rows.append(dict(layer=name, n=n, k=k, rows=m, bf16_us=t_bf16 * 1e6, fp8_us=t_fp8 * 1e6,
                             speedup=t_bf16 / t_fp8, fp8_of_floor=floor / t_fp8, bf16_of_floor=2 * floor / t_bf16,
                             rel_err=err))
            print("row", json.dumps(rows[-1]), flush=True)
        del w, q
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    print("| layer | rows | bf16 us | fp8 us | fp8 / bf16 speed | fp8 of floor | bf16 of floor | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['rows']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['speedup']:.2f}x | "
              f"{r['fp8_of_floor']:.0%} | {r['bf16_of_floor']:.0%} | {r['rel_err']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_gemm.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
