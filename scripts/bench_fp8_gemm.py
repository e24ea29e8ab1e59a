"""The fp8 GEMM paths against bf16 (F.linear) and against the FP8 weight-bytes floor, on one GPU, at Llama-3-8B
layer shapes, per-channel and [128, 128]-block scales:

    fp8_linear    what the layers run (tp_lora.ops.fp8.fp8_linear: the weight-only Triton kernel up to SMALL_ROWS
                  rows; past them W8A8 for per-channel scales, the dequantised GEMM for block scales)
    w8a16         the weight-only Triton kernel at every row count
    w8a8          per-token quantization kernel + torch._scaled_mm (per-channel scales only)
    scaled_mm     torch._scaled_mm alone on activations quantized beforehand (the library GEMM's own time)

    python scripts/bench_fp8_gemm.py [--rows 1,16,32,64,128,512,2048] [--out DIR]

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

from tp_lora.ops.fp8 import dequantize, fp8_linear, quantize_fp8_per_channel, quantize_per_token
from tp_lora.ops.triton.fp8_quant import quantize_per_token as quantize_kernel
from tp_lora.ops.triton.grouped_mm import grouped_mm

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


def graph_time(calls, repeat: int = 1) -> float:
    """Seconds per call of the callables (each `repeat` times in turn), replayed from one CUDA graph (the median of 5
    replays)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    calls = list(calls) * repeat
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


def paths(x: torch.Tensor, block_k):
    """name -> a callable of (w, scale) for each fp8 path that takes these scales."""
    out = {"fp8_linear": lambda w, s: fp8_linear(x, w, s, block_k),
           "w8a16": lambda w, s: grouped_mm(x, w.unsqueeze(0), None, s.unsqueeze(0), block_k,
                                            rows_per_expert=x.shape[0])}
    if block_k is None:
        xq, xs = quantize_per_token(x)

        def w8a8(w, s):
            xq_, xs_ = quantize_kernel(x)
            return torch._scaled_mm(xq_, w.t(), scale_a=xs_, scale_b=s.view(1, -1), out_dtype=x.dtype)
        out["w8a8"] = w8a8
        out["scaled_mm"] = lambda w, s: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1),
                                                         out_dtype=x.dtype)
    return out


def block_scales(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[128, 128]-block fp8 weights as Qwen3-*-FP8 ship them, in the layers' layout (each block's scale repeated on
    its rows): w [N, K] fp8, scale [N, K / 128]."""
    n, k = w.shape
    amax = w.float().abs().view(n // block, block, k // block, block).amax(dim=(1, 3)).clamp_min(1e-6)
    scale = (amax / 448.0).repeat_interleave(block, 0)
    q = (w.float() / scale.repeat_interleave(block, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,32,64,128,512,2048")
    p.add_argument("--out", default="bench_results")
    args = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-L2_BYTES // (n * k)))
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for block_k in (None, 128):
            q = [quantize_fp8_per_channel(x) if block_k is None else block_scales(x) for x in w]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ dequantize(*q[0], block_k).t()
                floor = n * k / bw
                row = dict(layer=name, n=n, k=k, rows=m, scales="channel" if block_k is None else "block128",
                           bf16_us=graph_time([lambda w=w_: F.linear(x, w) for w_ in w]) * 1e6)
                row["bf16_of_floor"] = 2 * floor / (row["bf16_us"] / 1e6)
                for path, call in paths(x, block_k).items():
                    err = float((call(*q[0]).float() - ref).norm() / ref.norm())
                    t = graph_time([lambda q=q_, call=call: call(*q) for q_ in q])
                    row[path] = dict(us=t * 1e6, speedup=row["bf16_us"] / 1e6 / t, of_floor=floor / t, rel_err=err)
                rows.append(row)
                print("row", json.dumps(row), flush=True)
            del q
        del w
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    names = ("fp8_linear", "w8a16", "w8a8", "scaled_mm")
    print("speed against bf16 (fp8 weight-bytes floor / time in brackets); rel err of fp8_linear")
    print("| layer | scales | rows | bf16 us | bf16 of floor | " + " | ".join(names) + " | rel err |")
    print("|---|---|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = [f"{r[p]['speedup']:.2f}x ({r[p]['of_floor']:.0%})" if p in r else "-" for p in names]
        print(f"| {r['layer']} | {r['scales']} | {r['rows']} | {r['bf16_us']:.1f} | {r['bf16_of_floor']:.0%} | "
              + " | ".join(cells) + f" | {r['fp8_linear']['rel_err']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_gemm.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
