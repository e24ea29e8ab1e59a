"""Can a tp decode step hide weight reads behind its all-reduces? One GPU, the per-rank GEMMs of a decode layer
(32 rows) in a chain as a tp step runs them, with a stand-in for each of the layer's two all-reduce windows: a kernel
whose first 32 programs spin for --window-us (the peer all-reduce's programs waiting on NVLink) while the other SMs'
programs read the first bytes of the weight the next GEMM reads (into L2), so that GEMM finds them there.

    python scripts/bench_l2_prefetch.py [--shapes llama3-8b:4,llama3-8b:2,llama3-70b:4] [--window-us 10] [--out DIR]

Per layer: window -> qkv -> o -> window -> gate_up -> down, over layer copies spanning several times L2. Variants:
no prefetch; after the down window the next qkv (and o), after the o window the first MB of gate_up; normal or
evict_last L2 policy. Also the GEMMs alone and the windows alone (what no overlap costs). Times: CUDA-graph replays
(median of 5), per layer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_gemm import MODELS  # noqa: E402
from bench_fp8_gemm import copy_bandwidth, graph_time  # noqa: E402

SPIN_PROGRAMS = 32


@triton.jit
def _clock(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _window_kernel(a_ptr, a_n, b_ptr, b_n, sink, ns, SPIN: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Programs < SPIN: spin ns nanoseconds; the rest read a_n then b_n int32 words (grid-stride) into L2."""
    p = tl.program_id(0)
    if p < SPIN:
        t0 = _clock(p)
        now = t0
        while now - t0 < ns:
            now = _clock(p)
    else:
        q = p - SPIN
        step = (tl.num_programs(0) - SPIN) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        offs = tl.arange(0, BLOCK)
        for start in range(q * BLOCK, a_n, step):
            acc ^= tl.load(a_ptr + start + offs, mask=start + offs < a_n, eviction_policy=EVICT)
        for start in range(q * BLOCK, b_n, step):
            acc ^= tl.load(b_ptr + start + offs, mask=start + offs < b_n, eviction_policy=EVICT)
        if tl.sum(acc) == 1234567:  # never in practice: keeps the loads
            tl.store(sink, 1)


def window(ns: int, prefetch, programs: int, evict: str, sink) -> None:
    """prefetch: up to two (int32 tensor, words) pairs."""
    (a, an), (b, bn) = (list(prefetch) + [(sink, 0), (sink, 0)])[:2]
    grid = SPIN_PROGRAMS + (programs if an + bn else 0)
    _window_kernel[(grid,)](a, an, b, bn, sink, ns, SPIN=SPIN_PROGRAMS, BLOCK=4096, EVICT=evict, num_warps=4)


def per_rank(model: str, tp: int) -> dict:
    out = {}
    for name, (n, k, kind) in MODELS[model].items():
        if name != "lm_head":
            out[name] = (n // tp, k) if kind == "column" else (n, k // tp)
    return out


def run_shape(model: str, tp: int, window_us: float, programs: int, bw: float) -> dict:
    shp = per_rank(model, tp)
    layer_bytes = sum(n * k * 2 for n, k in shp.values())
    layers = max(4, -(-(2 << 30) // layer_bytes))  # about 2 GiB of weights
    # one flat buffer per layer, weights in step order, so "the next bytes" of a weight run on into the next one
    flat = [torch.randn(layer_bytes // 2, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
    w = []
    for f in flat:
        views, off = {}, 0
        for name in ("qkv", "o", "gate_up", "down"):
            n, k = shp[name]
            views[name] = f[off:off + n * k].view(n, k)
            off += n * k
        w.append(views)
    xs = {name: torch.randn(32, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in shp.items()}
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    ns = int(window_us * 1000)
    mb = 1 << 20

    def words(t: torch.Tensor, nbytes: int):
        return t.view(-1).view(torch.int32), min(nbytes, t.numel() * 2) // 4

    def chain(pre_attn: int, pre_mlp: int, evict: str, spin: bool = True, gemms: bool = True):
        def call():
            for i in range(layers):
                nxt = w[i]
                if spin:
                    pf = [words(nxt["qkv"], pre_attn), words(nxt["o"], max(0, pre_attn - nxt["qkv"].numel() * 2))]
                    window(ns, [p for p in pf if p[1]] if pre_attn else [], programs, evict, sink)
                if gemms:
                    F.linear(xs["qkv"], nxt["qkv"])
                    F.linear(xs["o"], nxt["o"])
                if spin:
                    window(ns, [words(nxt["gate_up"], pre_mlp)] if pre_mlp else [], programs, evict, sink)
                if gemms:
                    F.linear(xs["gate_up"], nxt["gate_up"])
                    F.linear(xs["down"], nxt["down"])
        return graph_time([call]) / layers * 1e6

    qkv_b, o_b = (shp[n][0] * shp[n][1] * 2 for n in ("qkv", "o"))
    row = dict(model=model, tp=tp, window_us=window_us, layers=layers, layer_mb=layer_bytes / mb,
               floor_us=layer_bytes / bw * 1e6, gemms_us=chain(0, 0, "", spin=False),
               windows_us=chain(0, 0, "", gemms=False), base_us=chain(0, 0, ""), variants=[])
    for evict in ("", "evict_last"):
        for pre_attn in (qkv_b, qkv_b + o_b):
            for pre_mlp in (0, 8 * mb, 16 * mb, 24 * mb, 32 * mb):
                t = chain(pre_attn, pre_mlp, evict)
                row["variants"].append(dict(evict=evict or "normal", attn_mb=pre_attn / mb, mlp_mb=pre_mlp / mb, us=t))
                print(f"  {model} tp{tp} {evict or 'normal'} attn {pre_attn / mb:.1f} MB mlp {pre_mlp / mb:.0f} MB: "
                      f"{t:.1f} us/layer (no prefetch {row['base_us']:.1f})", flush=True)
    row["windows_only_prefetch_us"] = chain(qkv_b + o_b, 16 * mb, "", gemms=False)
    del flat, w
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama3-8b:4,llama3-8b:2,llama3-70b:4")
    p.add_argument("--window-us", type=float, default=10.0)
    p.add_argument("--programs", type=int, default=0, help="prefetch programs (0: the SMs the spinners leave)")
    p.add_argument("--out", default="bench_results")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or sms - SPIN_PROGRAMS
    bw = copy_bandwidth()
    res = dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, sms=sms, programs=programs, rows=[])
    for spec in args.shapes.split(","):
        model, tp = spec.split(":")
        res["rows"].append(run_shape(model, int(tp), args.window_us, programs, bw))
    print(f"\n{res['device']}, {sms} SMs, {programs} prefetch programs, copy {bw / 1e12:.2f} TB/s; per layer, 32 rows")
    print("| shape | layer MB | floor us | GEMMs alone | windows alone | GEMMs + windows | best prefetch | saved us "
          "| best variant |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        best = min(r["variants"], key=lambda v: v["us"])
        print(f"| {r['model']} tp{r['tp']} | {r['layer_mb']:.0f} | {r['floor_us']:.1f} | {r['gemms_us']:.1f} | "
              f"{r['windows_us']:.1f} | {r['base_us']:.1f} | {best['us']:.1f} | {r['base_us'] - best['us']:.1f} | "
              f"{best['evict']}, attn {best['attn_mb']:.1f} MB, mlp {best['mlp_mb']:.0f} MB |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_l2_prefetch.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
