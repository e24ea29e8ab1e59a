"""Programmatic dependent launch (tp_lora.ops.triton.pdl) in a decode layer's kernel chain, on one GPU.

Each layer of the Llama-3-8B shape at a tp's per-rank sizes is the chain a decode step runs, with its latency-bound
kernels (the fused all-reduce + norm, attention, the activation) stood in by kernels that hold the GPU for a fixed
time on a few programs:

    wait(ar) -> qkv -> wait(attn) -> o -> wait(ar) -> gate_up -> wait(act) -> down

each GEMM reading the previous one's output. Rows of the table (µs per layer, CUDA-graph replays of --layers layers
whose weights span more than L2):
    cublas          torch's x @ w^T, no PDL
    ours            the split-K GEMM (tp_lora.ops.triton.fp8_gemm.w8a16_mm, w8a16_config), no PDL
    pdl             the same kernels launched with PDL
    pdl_pfP         PDL, each GEMM program asking L2 for its first P K tiles of weights before it waits
    *_hint          each wait first asks L2 for up to --hint-mb of the next GEMM's weights
beside the floor (weight bytes / copy bandwidth + the waits). The PDL rows' outputs must equal the "ours" row's
bits. --waits 0,0,0 times the GEMMs back to back.

    python scripts/bench_pdl.py [--tp 1,2,4] [--rows 32] [--layers 8] [--waits 6,9,1.5] [--prefetch 2,4] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8_gemm import copy_bandwidth, graph_time  # noqa: E402

from tp_lora.ops.triton import fp8_gemm, pdl  # noqa: E402
from tp_lora.ops.triton.pdl import grid_wait, launch_kwargs, prefetch_l2  # noqa: E402

HIDDEN, QKV, INTER = 4096, 6144, 14336
HINT_MB = 16.0  # --hint-mb


@triton.jit
def _hold_kernel(out_ptr, ns, pf_ptr, pf_lines, PDL: tl.constexpr, LINES: tl.constexpr):
    grid_wait(PDL)
    p = tl.program_id(0)
    for l0 in range(p * LINES, pf_lines, tl.num_programs(0) * LINES):  # the next GEMM's weights, 128 B a line
        prefetch_l2(pf_ptr + tl.minimum(l0 + tl.arange(0, LINES), pf_lines - 1).to(tl.int64) * 128)
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl.extra.cuda.globaltimer()
    tl.store(out_ptr + tl.program_id(0), (t - t0).to(tl.int32))


def hold(us: float, scratch: torch.Tensor, nxt: torch.Tensor | None) -> None:
    """Hold the GPU for `us` on 32 programs; with HINT_MB, first ask L2 for up to that many MB of `nxt`."""
    if us > 0:
        on = pdl.active(scratch.device)
        lines = 0 if nxt is None else min(nxt.numel() * nxt.element_size(), int(HINT_MB * 2 ** 20)) // 128
        _hold_kernel[(32,)](scratch, int(us * 1e3), scratch if nxt is None else nxt, lines, PDL=on, LINES=1024,
                            num_warps=4, **launch_kwargs(on))


def layer_weights(tp: int, n_layers: int):
    def w(n, k):
        return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    return [dict(qkv=w(QKV // tp, HIDDEN), o=w(HIDDEN, HIDDEN // tp), gate_up=w(2 * INTER // tp, HIDDEN),
                 down=w(HIDDEN, INTER // tp)) for _ in range(n_layers)]


def first(h: torch.Tensor, k: int) -> torch.Tensor:
    """The first rows x k elements of h as a contiguous [rows, k] (the next GEMM's input: no copy kernel)."""
    return h.view(-1)[:h.shape[0] * k].view(h.shape[0], k)


def chain(x, layers, waits, gemm, scratch, hint):
    ar, attn, act = waits
    for lw in layers:
        hold(ar, scratch, lw["qkv"] if hint else None)
        h = gemm(x, lw["qkv"])
        hold(attn, scratch, lw["o"] if hint else None)
        h = gemm(first(h, lw["o"].shape[1]), lw["o"])
        hold(ar, scratch, lw["gate_up"] if hint else None)
        h = gemm(h, lw["gate_up"])
        hold(act, scratch, lw["down"] if hint else None)
        x = gemm(first(h, lw["down"].shape[1]), lw["down"])
    return x


def ours(prefetch: int):
    def gemm(x, w):
        cfg = dict(fp8_gemm.w8a16_config(x.shape[0], *w.shape), PREFETCH=prefetch)
        return fp8_gemm.w8a16_mm(x, w, None, None, cfg)
    return gemm


def main() -> None:
    global HINT_MB
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--waits", default="6,9,1.5", help="µs of the all-reduce, attention and activation stand-ins")
    ap.add_argument("--prefetch", default="2,4")
    ap.add_argument("--hint-mb", type=float, default=16.0,
                    help="MB of the next GEMM's weights each wait asks L2 for (the *_hint rows)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    HINT_MB = args.hint_mb
    waits = [float(v) for v in args.waits.split(",")]
    bw = copy_bandwidth()
    scratch = torch.zeros(64, dtype=torch.int32, device="cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, {args.rows} rows, waits {waits} µs")
    print(f"{'tp':>3} {'variant':>10} {'µs/layer':>9} {'floor':>7} {'of floor':>8}")
    for tp in (int(t) for t in args.tp.split(",")):
        layers = layer_weights(tp, args.layers)
        wbytes = sum(w.numel() * 2 for w in layers[0].values())
        floor = wbytes / bw * 1e6 + 2 * waits[0] + waits[1] + waits[2]
        x = torch.randn(args.rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        cublas = lambda a, w: a @ w.t()  # noqa: E731
        variants = [("cublas", False, cublas, False), ("cublas_hint", False, cublas, True),
                    ("cublas_hint_pdl", True, cublas, True), ("ours", False, ours(0), False),
                    ("pdl", True, ours(0), False), ("pdl_hint", True, ours(0), True)]
        variants += [(f"pdl_pf{p}", True, ours(p), False) for p in (int(v) for v in args.prefetch.split(",") if v)]
        ref = None
        for name, on, gemm, hint in variants:
            pdl.ENABLED = on
            out = chain(x, layers, waits, gemm, scratch, hint)
            if name == "ours":
                ref = out
            elif gemm is not cublas and ref is not None and not torch.equal(out, ref):
                raise SystemExit(f"tp{tp} {name}: output differs from the same kernels without PDL "
                                 f"(max {(out.float() - ref.float()).abs().max().item():.3g})")
            us = graph_time([lambda: chain(x, layers, waits, gemm, scratch, hint)]) / args.layers * 1e6
            rows.append(dict(tp=tp, variant=name, us_per_layer=us, floor_us=floor, waits_us=waits, rows=args.rows))
            print(f"{tp:>3} {name:>10} {us:9.1f} {floor:7.1f} {floor / us:8.0%}")
        pdl.ENABLED = True
        del layers
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_pdl.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
