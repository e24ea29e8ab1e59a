"""The fp8 GEMM paths against bf16 (F.linear) and against the FP8 weight-bytes floor, on one GPU, at Llama-3-8B
layer shapes, per-channel and [128, 128]-block scales (each W8A8 path's time includes its activation quantization):

    fp8_linear    what the layers run (tp_lora.ops.fp8.fp8_linear, blocks of whole 128 rows: w8a16_mm with the
                  activations quantized in the kernel (ACT8) up to ACT8_ROWS rows, weight-only up to
                  small_rows(w, block_k); past them W8A8: per-channel torch._scaled_mm with fast accumulation,
                  block scales cuBLAS's block-scaled GEMM where torch has it, else w8a8_mm)
    fp8_rows      per-channel: fp8_linear of rows already quantized per token (x8: what qkv, gate_up and down
                  get from the norm or act_mul before them, whose pass writes them; their quantization not timed)
    head_rows     rows up to ACT8_ROWS already quantized per (row, 128 columns) (x8 with a scale a head or group:
                  what o_proj gets from decode attention, and block-scaled layers from the norm or act_mul before
                  them, whose pass writes them): ACT8 without its quantization (G8)
    w8a16         tp_lora.ops.triton.fp8_gemm.w8a16_mm weight-only (split-K), rows <= 64 (what the layers ran
                  before ACT8)
    w8a8          block scales: per-group quantization kernel + w8a8_mm (Triton, fp8 tensor cores)
    scaled_mm     per-channel: per-token quantization kernel + torch._scaled_mm (rowwise scales)
    scaled_fast   the same with use_fast_accum
    blockwise     block scales: tp_lora.ops.fp8.blockwise_mm (per-group quantization + F.scaled_mm
                  BlockWise1x128 x BlockWise128x128, cuBLAS), where this torch has it

    python scripts/bench_fp8_gemm.py [--rows 1,16,32,64,256,2048] [--out DIR] [--no-moe]

Also (unless --no-moe) the expert GEMMs of one Qwen3-30B-A3B MoE layer at decode (128 experts, hidden 2048,
intermediate 768, top-8 of 32 tokens, uniform random routing: w13 then w2 through tp_lora.ops.grouped_mm as the
layer calls it), bf16 experts against fp8 experts per channel and per [128, 128] block, beside the routed experts'
weight-bytes floor.

Each (layer, rows) is captured in a CUDA graph of many calls over enough weight copies to leave L2 (every call reads
its weights from HBM); the median replay's mean time per call. bf16 is timed before and after the fp8 paths and its
faster time kept (the first timing of cuBLAS's largest GEMMs can come out slower). Floor: the weight bytes (N x K x 1
for fp8, x 2 for bf16) / the device copy bandwidth measured in the same run (read + written bytes / time). Checks
every path against the dequantized reference (relative error) and prints a table; writes bench_fp8_gemm.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora.ops import grouped_mm as moe_ops  # noqa: E402
from tp_lora.ops.fp8 import (ACT8_GROUP, ACT8_ROWS, blockwise_mm, dequantize, fp8_linear,  # noqa: E402
                             quantize_fp8_per_channel)
from tp_lora.ops.triton import fp8_gemm  # noqa: E402
from tp_lora.ops.triton.fp8_quant import quantize_per_group, quantize_per_token  # noqa: E402

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
    """name -> a callable of (w, scale) for each fp8 path that takes these scales at x's rows."""
    m = x.shape[0]
    out = {"fp8_linear": lambda w, s: fp8_linear(x, w, s, block_k, block_k)}  # blocks of 128 x 128
    if block_k is None:
        x8 = quantize_per_token(x)
        out["fp8_rows"] = lambda w, s: fp8_linear(x, w, s, None, None, x8)
    if m <= ACT8_ROWS:
        heads8 = quantize_per_group(x, ACT8_GROUP)
        heads8 = heads8[0], heads8[1].contiguous()
        out["head_rows"] = lambda w, s: fp8_linear(x, w, s, block_k, block_k, heads8)
    if m <= fp8_gemm.MAX_ROWS:
        out["w8a16"] = lambda w, s: fp8_gemm.w8a16_mm(x, w, s, block_k, fp8_gemm.w8a16_config(m, *w.shape))
    if m < 16:
        return out
    if block_k is None:
        def scaled(w, s, fast):
            xq, xs = quantize_per_token(x)
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype,
                                    use_fast_accum=fast)
        out["scaled_mm"] = lambda w, s: scaled(w, s, False)
        out["scaled_fast"] = lambda w, s: scaled(w, s, True)
        return out
    out["w8a8"] = lambda w, s: fp8_gemm.w8a8_mm(*quantize_per_group(x, block_k), w, s, block_k, x.dtype)
    if hasattr(F, "scaled_mm"):
        out["blockwise"] = lambda w, s: blockwise_mm(x, w, s)
    return out


def moe_experts(bw: float, e=128, h=2048, inter=768, topk=8, tokens=32, device="cuda", timer=graph_time):
    """The expert GEMMs of one Qwen3-30B-A3B layer at a 32-token decode: bf16 against fp8 experts (us, floors)."""
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.rand(tokens, e, device=device, generator=gen).topk(topk, dim=-1).indices.flatten()
    counts = torch.bincount(ids, minlength=e)
    ends = counts.cumsum(0).to(torch.int32)
    x = torch.randn(ids.numel(), h, device=device, dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * inter, h, device=device, dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, inter, device=device, dtype=torch.bfloat16) * inter ** -0.5
    routed = int((counts > 0).sum())
    out = []
    for fmt in ("bf16", "channel", "block128"):
        if fmt == "bf16":
            a, b, block_k = (w13, None), (w2, None), None
        elif fmt == "channel":
            a, b, block_k = quantize_fp8_per_channel(w13), quantize_fp8_per_channel(w2), None
        else:
            a, b = (tuple(torch.stack(t) for t in zip(*map(block_scales, ws))) for ws in (w13, w2))
            block_k = 128

        def step(a=a, b=b, block_k=block_k):
            hmid = moe_ops.grouped_mm(x, a[0], ends, a[1], block_k)
            return moe_ops.grouped_mm(hmid[:, :inter].contiguous(), b[0], ends, b[1], block_k)
        per_byte = 2 if fmt == "bf16" else 1
        floor = routed * (2 * inter * h + h * inter) * per_byte / bw
        t = timer([step], repeat=8)
        out.append(dict(experts=fmt, us=t * 1e6, floor_us=floor * 1e6, routed=routed))
        print("moe", json.dumps(out[-1]), flush=True)
    for r in out:
        r["speedup"] = out[0]["us"] / r["us"]
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
    p.add_argument("--rows", default="1,16,32,64,256,2048")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--no-moe", dest="moe", action="store_false")
    args = p.parse_args()
    bw = copy_bandwidth()
    rows = []
    moe = moe_experts(bw) if args.moe else []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-L2_BYTES // (n * k)))
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        for block_k in (None, 128):
            q = [quantize_fp8_per_channel(x) if block_k is None else block_scales(x) for x in w]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ dequantize(*q[0], block_k).t()
                floor = n * k / bw
                row = dict(layer=name, n=n, k=k, rows=m, scales="channel" if block_k is None else "block128")
                bf16 = [graph_time([lambda w=w_: F.linear(x, w) for w_ in w])]
                for path, call in paths(x, block_k).items():
                    try:
                        err = float((call(*q[0]).float() - ref).norm() / ref.norm())
                    except Exception as e:  # noqa: BLE001 - a library path this stack lacks: left out
                        print(f"{name} {m} {path}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    t = graph_time([lambda q=q_, call=call: call(*q) for q_ in q], repeat=2)
                    row[path] = dict(us=t * 1e6, of_floor=floor / t, rel_err=err)
                bf16.append(graph_time([lambda w=w_: F.linear(x, w) for w_ in w]))  # again, after the fp8 paths
                row.update(bf16_us=min(bf16) * 1e6, bf16_first_us=bf16[0] * 1e6, bf16_of_floor=2 * floor / min(bf16))
                for path in paths(x, block_k):
                    if path in row:
                        row[path]["speedup"] = row["bf16_us"] / row[path]["us"]
                rows.append(row)
                print("row", json.dumps(row), flush=True)
            del q
        del w
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    names = ("fp8_linear", "fp8_rows", "head_rows", "w8a16", "w8a8", "scaled_mm", "scaled_fast", "blockwise")
    print("speed against bf16 (fp8 weight-bytes floor / time in brackets); rel err of fp8_linear / the largest")
    print("| layer | scales | rows | bf16 us | bf16 of floor | fp8_linear us | " + " | ".join(names) + " | rel err |")
    print("|---|---|---|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = [f"{r[p]['speedup']:.2f}x ({r[p]['of_floor']:.0%})" if p in r else "-" for p in names]
        err = max(r[p]["rel_err"] for p in names if p in r)
        print(f"| {r['layer']} | {r['scales']} | {r['rows']} | {r['bf16_us']:.1f} | {r['bf16_of_floor']:.0%} | "
              f"{r['fp8_linear']['us']:.1f} | " + " | ".join(cells) + f" | {r['fp8_linear']['rel_err']:.1e} / "
              f"{err:.1e} |")
    if moe:
        print("\nQwen3-30B-A3B expert GEMMs of one layer, 32-token decode (w13 + w2, routed experts' bytes floor)")
        print("| experts | us | floor us | of floor | speed vs bf16 |")
        print("|---|---|---|---|---|")
        for r in moe:
            print(f"| {r['experts']} | {r['us']:.1f} | {r['floor_us']:.1f} | {r['floor_us'] / r['us']:.0%} | "
                  f"{r['speedup']:.2f}x |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_fp8_gemm.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, rows=rows, moe=moe), f, indent=2)


if __name__ == "__main__":
    main()
