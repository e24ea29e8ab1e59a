"""Sweep of the fp8 GEMM kernels' launch configurations (tp_lora.ops.triton.fp8_gemm) at Llama-3-8B layer shapes on
one GPU, beside bf16 F.linear, torch._scaled_mm (W8A8 per channel) and the FP8 weight-bytes floor:

    w8a16_mm  at --small-rows (decode): every (BLOCK_N, BLOCK_K, warps, stages, SWAP) x SPLIT_K, weight-only and
              ACT8 (the activations quantized per (row, 128 columns) in the kernel); the best few then at
              --check-rows; the weight-only grouped GEMM the layers ran before (grouped_mm, one expert) beside it
    w8a8_mm   at --prefill-rows: every (BLOCK_M, BLOCK_N, warps, stages), [128, 128]-block scales, with the
              activations' quantization kernel in the time (per-channel prefill: scripts/bench_fp8_gemm.py)

    experts   (--experts, alone) the grouped expert GEMM (tp_lora.ops.triton.grouped_mm) with fp8 experts and act8:
              every (BLOCK_N, warps, stages) of EXPERTS over a Qwen3-30B-A3B layer's w13 + w2 at 32 and 128 tokens

    python scripts/tune_fp8_gemm.py [--small-rows 32] [--check-rows 1,16,64] [--prefill-rows 2048] [--tp N] [--out DIR]
    python scripts/tune_fp8_gemm.py --experts [--out DIR]
    python scripts/tune_fp8_gemm.py --smoke [--out DIR]   (CPU / interpreter: tiny shapes, a few configs, no timing)

--tp N: one rank's shapes under tensor parallelism (qkv and gate_up split on their outputs, o_proj and down on their
inputs). Kernels compile in a pool of processes first (Triton's on-disk cache then serves this one). Times: CUDA graph
replays over weight copies spanning more than L2 (scripts/bench_fp8_gemm.graph_time). Prints the tables and writes
tune_fp8_gemm.json into --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported (triton.jit reads it then)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8_gemm import L2_BYTES, SHAPES, block_scales, copy_bandwidth, graph_time, moe_experts  # noqa: E402

from tp_lora.ops.fp8 import quantize_fp8_per_channel, quantize_per_group, w8a8_mm_ref, w8a16_mm_ref  # noqa: E402

SPLITS = (1, 2, 4, 8, 16)
SMALL = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, SWAP=swap)
         for (bn, bk), nw, ns, swap in itertools.product(
             [(16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128), (128, 256)],
             (4, 8), (3, 5), (False, True))]
SMALL += [dict(BLOCK_N=bn, BLOCK_K=128, num_warps=nw, num_stages=ns, SWAP=True, ACT8=True)  # bf16 activations
          for bn, nw, ns in itertools.product((64, 128, 256), (4, 8), (3, 4))]
PREFILL = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=ns)
           for (bm, bn, nw), ns in itertools.product(
               [(64, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8), (64, 256, 4), (128, 256, 8)], (3, 4))]
WARM_N, WARM_K = 256, 4096  # shapes compiled in the pool: the specialisations (multiples of 16) of the real ones


def kernels():
    from tp_lora.ops.triton import fp8_gemm, fp8_quant  # noqa: PLC0415 - after TRITON_INTERPRET is settled
    return fp8_gemm, fp8_quant


def weights(n, k, block_k, device):
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    return (quantize_fp8_per_channel(w) if block_k is None else block_scales(w)), w


def warm(task):
    """Compile one kernel configuration (a pool worker): task = (kernel, rows, block_k, cfg). A configuration that
    does not compile (shared memory, registers) is reported and left out of the sweep."""
    try:
        return compile_one(*task)
    except Exception as e:  # noqa: BLE001 - any compiler error drops the configuration
        return f"{task}: {type(e).__name__}: {str(e)[:200]}"


def compile_one(kind, m, block_k, cfg):
    fp8_gemm, fp8_quant = kernels()
    (w, s), _ = weights(WARM_N, WARM_K, block_k, "cuda")
    x = torch.randn(m, WARM_K, device="cuda", dtype=torch.bfloat16)
    for split in (1, 2):  # one kernel, both branches run
        if kind == "w8a16":
            fp8_gemm.w8a16_mm(x, w, s, block_k, dict(cfg, SPLIT_K=split))
    if kind == "w8a8":
        fp8_gemm.w8a8_mm(*fp8_quant.quantize_per_group(x, block_k), w, s, block_k, x.dtype, cfg)
    torch.cuda.synchronize()
    return None


def precompile(tasks, workers: int) -> None:
    with ProcessPoolExecutor(workers, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        for err in pool.map(warm, tasks):
            if err:
                print("not compiled:", err, flush=True)


def runs(call) -> bool:
    """Whether a configuration launches here (compiled in the pool, or compiles now)."""
    try:
        call()
        return True
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers: left out
        print(f"  skipped: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return False


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def small_sweep(k, block_k, m, cfgs, splits, q):
    """Every (cfg, split) of w8a16_mm at m rows over the weight copies q: {"cfg", "us"} rows, fastest first."""
    fp8_gemm, _ = kernels()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = []
    for cfg in cfgs:
        for split in splits:
            c = dict(cfg, SPLIT_K=split)
            if not runs(lambda: fp8_gemm.w8a16_mm(x, *q[0], block_k, c)):
                break
            t = graph_time([lambda q_=q_: fp8_gemm.w8a16_mm(x, *q_, block_k, c) for q_ in q], repeat=4)
            # after the replays (counters reset); against the reference of the same configuration (ACT8 or not)
            err = rel_err(fp8_gemm.w8a16_mm(x, *q[0], block_k, c), w8a16_mm_ref(x, *q[0], block_k, c))
            out.append(dict(cfg=c, us=t * 1e6, rel_err=err))
    out.sort(key=lambda r: r["us"])
    return out


def baselines_small(n, k, block_k, m, q, wb, bw):
    from tp_lora.ops.triton.grouped_mm import grouped_mm  # noqa: PLC0415
    _, fp8_quant = kernels()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row = dict(n=n, k=k, bf16_us=graph_time([lambda w=w: F.linear(x, w) for w in wb], repeat=4) * 1e6,
               floor_us=n * k / bw * 1e6,
               grouped_mm_us=graph_time([lambda q_=q_: grouped_mm(x, q_[0].unsqueeze(0), None, q_[1].unsqueeze(0),
                                                                  block_k, rows_per_expert=m) for q_ in q],
                                        repeat=4) * 1e6)
    if block_k is None:
        def w8a8(w, s):
            xq, xs = fp8_quant.quantize_per_token(x)
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)
        row["scaled_mm_us"] = graph_time([lambda q_=q_: w8a8(*q_) for q_ in q], repeat=4) * 1e6
    return row


def prefill(n, k, block_k, m, q, wb, bw):
    fp8_gemm, fp8_quant = kernels()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def quant():
        return fp8_quant.quantize_per_group(x, block_k)
    xq, xs = quant()
    want = w8a8_mm_ref(xq, xs, *q[0], block_k, x.dtype)
    row = dict(bf16_us=graph_time([lambda w=w: F.linear(x, w) for w in wb]) * 1e6,
               quant_us=graph_time([quant] * 4) * 1e6, sweep=[])
    for cfg in PREFILL:
        if not runs(lambda: fp8_gemm.w8a8_mm(xq, xs, *q[0], block_k, x.dtype, cfg)):
            continue
        err = rel_err(fp8_gemm.w8a8_mm(xq, xs, *q[0], block_k, x.dtype, cfg), want)
        t = graph_time([lambda q_=q_: fp8_gemm.w8a8_mm(xq, xs, *q_, block_k, x.dtype, cfg) for q_ in q])
        row["sweep"].append(dict(cfg=cfg, us=t * 1e6, rel_err=err))
    row["sweep"].sort(key=lambda r: r["us"])
    row["tflops_best"] = 2 * m * n * k / (row["sweep"][0]["us"] * 1e-6) / 1e12
    return row


# the grouped expert GEMM's (BLOCK_N, num_warps, ACT8_STAGES) for fp8 experts
EXPERTS = list(itertools.product((64, 128, 256), (4, 8), (3, 4, 5)))


def experts_sweep(bw: float, cfgs=EXPERTS, tokens=(32, 128), timer=graph_time, **sizes) -> list[dict]:
    """Every (BLOCK_N, warps, stages) of the grouped GEMM's act8 path (module constants, restored after) over the
    expert GEMMs of bench_fp8_gemm.moe_experts at each token count: rows {tokens, experts, cfg, us, floor_us,
    bf16_us}, fastest first per (tokens, experts); a configuration that does not compile is left out."""
    from tp_lora.ops.triton import grouped_mm as kernel  # noqa: PLC0415 - after TRITON_INTERPRET is settled
    saved = kernel.BLOCK_N, kernel.NUM_WARPS, kernel.ACT8_STAGES
    out = []
    try:
        for t in tokens:
            bf16 = None
            for cfg in cfgs:
                kernel.BLOCK_N, kernel.NUM_WARPS, kernel.ACT8_STAGES = cfg
                try:
                    rows = moe_experts(bw, tokens=t, timer=timer, **sizes)
                except Exception as e:  # noqa: BLE001 - out of shared memory: left out
                    print(f"  experts {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if cfg[0] == saved[0] and cfg[1] == saved[1]:  # bf16 experts at the module's own tile
                    bf16 = rows[0]["us"]
                out += [dict(tokens=t, experts=r["experts"], cfg=cfg, us=r["us"], floor_us=r["floor_us"])
                        for r in rows[1:]]
            for r in out:
                if r["tokens"] == t:
                    r["bf16_us"] = bf16
    finally:
        kernel.BLOCK_N, kernel.NUM_WARPS, kernel.ACT8_STAGES = saved
    out.sort(key=lambda r: (r["tokens"], r["experts"], r["us"]))
    return out


def experts(out_dir: str) -> None:
    """--experts: the sweep on this GPU, a table of the three fastest per (tokens, scales), tune_fp8_gemm.json."""
    bw = copy_bandwidth()
    swept = experts_sweep(bw)
    print(f"{torch.cuda.get_device_name()}: grouped expert GEMM, act8, (BLOCK_N, warps, stages), us")
    print("| tokens | scales | bf16 us | floor us | fastest three |")
    print("|---|---|---|---|---|")
    for key in dict.fromkeys((r["tokens"], r["experts"]) for r in swept):
        rows = [r for r in swept if (r["tokens"], r["experts"]) == key]
        best = ", ".join(f"{r['cfg']} {r['us']:.1f}" for r in rows[:3])
        print(f"| {key[0]} | {key[1]} | {rows[0]['bf16_us']:.1f} | {rows[0]['floor_us']:.1f} | {best} |")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune_fp8_gemm.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, experts=swept), f, indent=1)


def smoke(out_dir: str) -> None:
    """The sweep's calls on tiny shapes on the CPU (interpreter): catches typos before a GPU call. Writes each
    call's relative error against its reference into tune_fp8_gemm.json."""
    fp8_gemm, _ = kernels()
    errs = {}
    for block_k in (None, 128):
        (w, s), _ = weights(128, 256, block_k, "cpu")
        x = torch.randn(5, 256, dtype=torch.bfloat16)
        # weight-only tiles: ACT8's rounding under the interpreter is off on random rows (the kernel tests use
        # exactly representable ones)
        for cfg in SMALL[:1] + [c for c in SMALL if not c.get("ACT8")][-1:]:
            for split in SPLITS[:2]:
                got = fp8_gemm.w8a16_mm(x, w, s, block_k, dict(cfg, SPLIT_K=split))
                errs[f"w8a16/{block_k}/{fmt_cfg(cfg)}/{split}"] = rel_err(got, w8a16_mm_ref(x, w, s, block_k))
        if block_k is not None:
            xq, xs = quantize_per_group(x, block_k)
            got = fp8_gemm.w8a8_mm(xq, xs, w, s, block_k, x.dtype, dict(PREFILL[0], BLOCK_M=16, BLOCK_N=32))
            errs[f"w8a8/{block_k}"] = rel_err(got, w8a8_mm_ref(xq, xs, w, s, block_k, x.dtype))
    assert max(errs.values()) < 2e-2, errs
    from tp_lora.ops import fused  # noqa: PLC0415 - the grouped GEMM's kernel on the CPU

    def once(calls, repeat=1):  # no timing on the CPU: each call runs once
        calls[0]()
        return 1e-6
    fused.KERNELS = True
    swept = experts_sweep(1e12, EXPERTS[:2], (4,), once, e=4, h=256, inter=128, topk=2, device="cpu")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune_fp8_gemm.json"), "w") as f:
        json.dump(dict(device="cpu", smoke=errs, experts=swept), f, indent=1)
    print("smoke ok", max(errs.values()))


def run_small(result, top, key, n, k, block_k, m, q, wb, bw, keep=4):
    cfgs = [c for c in SMALL if block_k is None or c["BLOCK_K"] <= block_k]
    base = baselines_small(n, k, block_k, m, q, wb, bw)
    sweep = small_sweep(k, block_k, m, cfgs, SPLITS, q)
    result["small"][key] = dict(base, rows=m, sweep=sweep)
    top[(key, block_k)] = [{kk: v for kk, v in r["cfg"].items() if kk != "SPLIT_K"} for r in sweep[:keep]]
    b = sweep[0]
    print(f"small {key} rows {m}: bf16 {base['bf16_us']:.1f} us, floor {base['floor_us']:.1f}, grouped_mm "
          f"{base['grouped_mm_us']:.1f}, scaled_mm {base.get('scaled_mm_us', 0):.1f}, best {fmt_cfg(b['cfg'])} "
          f"{b['us']:.1f} us ({base['bf16_us'] / b['us']:.2f}x bf16, {base['floor_us'] / b['us']:.0%} of floor), "
          f"err {b['rel_err']:.1e}", flush=True)


def run_check(result, top, key, n, k, block_k, rows, q, wb, bw):
    cfgs = [dict(c) for c in {tuple(c.items()) for c in top[(key, block_k)]}]
    for m in rows:
        cb = baselines_small(n, k, block_k, m, q, wb, bw)
        cs = small_sweep(k, block_k, m, cfgs, SPLITS, q)
        result["check"][f"{key}/{m}"] = dict(cb, rows=m, sweep=cs)
        print(f"  {key} rows {m}: bf16 {cb['bf16_us']:.1f}, best {fmt_cfg(cs[0]['cfg'])} {cs[0]['us']:.1f} us "
              f"({cb['bf16_us'] / cs[0]['us']:.2f}x)", flush=True)


ROW_PARALLEL = ("o_proj", "down")  # split on their inputs under tensor parallelism; the others on their outputs


def rank_shape(name: str, tp: int) -> tuple[int, int]:
    """(out, in) of one rank's share of layer `name` at tensor parallelism tp."""
    n, k = SHAPES[name]
    return (n, k // tp) if name in ROW_PARALLEL else (n // tp, k)


def fmt_cfg(c: dict) -> str:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")
    return "/".join(str(c[k]) for k in keys if k in c) + ("/swap" if c.get("SWAP") else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-rows", type=int, default=32)
    p.add_argument("--check-rows", default="1,16,64")
    p.add_argument("--prefill-rows", type=int, default=2048)
    p.add_argument("--top", type=int, default=4, help="configs of the small sweep re-timed at --check-rows")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tp", type=int, default=1, help="one rank's shapes at this tensor parallelism")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--experts", action="store_true", help="the grouped expert GEMM's act8 sweep alone")
    args = p.parse_args()
    if args.smoke:
        return smoke(args.out)
    if args.experts:
        return experts(args.out)
    scales = (None, 128)
    check_rows = [int(r) for r in args.check_rows.split(",") if r]
    shapes = args.shapes.split(",")
    tasks = [("w8a16", args.small_rows, b, c) for b in scales for c in SMALL if b is None or c["BLOCK_K"] <= b]
    tasks += [("w8a8", args.prefill_rows, 128, c) for c in PREFILL]
    precompile(tasks, args.workers)
    print(f"compiled {len(tasks)} configurations", flush=True)
    bw = copy_bandwidth()
    result = dict(device=torch.cuda.get_device_name(), copy_bandwidth=bw, small={}, check={}, prefill={})
    top = {}
    for phase in ("small", "check"):
        if phase == "check":  # the winners at the other row counts: compiled first, in the pool
            winners = {(b, tuple(c.items())) for (_, b), cs in top.items() for c in cs}
            precompile([("w8a16", m, b, dict(c)) for m in check_rows for b, c in winners], args.workers)
        for name in shapes:
            n, k = rank_shape(name, args.tp)
            copies = max(2, -(-L2_BYTES // (n * k)))
            wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
            for block_k in scales:
                key = f"{name}{'' if args.tp == 1 else f' tp{args.tp}'}/{'channel' if block_k is None else 'block128'}"
                q = [quantize_fp8_per_channel(w) if block_k is None else block_scales(w) for w in wb]
                if phase == "small":
                    run_small(result, top, key, n, k, block_k, args.small_rows, q, wb, bw)
                else:
                    run_check(result, top, key, n, k, block_k, check_rows, q, wb, bw)
                    if block_k is None:
                        continue
                    pre = prefill(n, k, block_k, args.prefill_rows, q, wb, bw)
                    result["prefill"][key] = pre
                    b = pre["sweep"][0]
                    print(f"prefill {key} rows {args.prefill_rows}: bf16 {pre['bf16_us']:.0f} us, quant "
                          f"{pre['quant_us']:.1f}, best {fmt_cfg(b['cfg'])} {b['us']:.0f} us ({pre['bf16_us'] / (b['us'] + pre['quant_us']):.2f}x bf16 with quant, "
                          f"{pre['tflops_best']:.0f} TFLOP/s), err {b['rel_err']:.1e}", flush=True)
                del q
            del wb
    dev = result["device"]
    print(f"\n{dev}, copy bandwidth {bw / 1e12:.2f} TB/s (read + written)")
    print("| layer / scales | rows | bf16 us | fp8 floor us | grouped_mm (before) | scaled_mm W8A8 | w8a16_mm best "
          "| cfg N/K/split/warps/stages | of floor | of 3.35 TB/s floor | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in result["small"].items():
        items = [(r, r["rows"])] + [(result["check"][f"{key}/{m}"], m) for m in check_rows]
        for c, m in items:
            b = c["sweep"][0]
            sm = f"{c['bf16_us'] / c['scaled_mm_us']:.2f}x" if "scaled_mm_us" in c else "-"
            print(f"| {key} | {m} | {c['bf16_us']:.1f} | {c['floor_us']:.1f} | "
                  f"{c['bf16_us'] / c['grouped_mm_us']:.2f}x | {sm} | {b['us']:.1f} us "
                  f"{c['bf16_us'] / b['us']:.2f}x | {fmt_cfg(b['cfg'])} | {c['floor_us'] / b['us']:.0%} | "
                  f"{c['n'] * c['k'] / 3.35e12 * 1e6 / b['us']:.0%} | {max(e['rel_err'] for e in c['sweep']):.1e} |")
    print("\n| layer / scales | rows | bf16 us | quant us | w8a8_mm best (+quant) | cfg M/N/K/warps/stages | "
          "TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in result["prefill"].items():
        b = r["sweep"][0]
        print(f"| {key} | {args.prefill_rows} | {r['bf16_us']:.0f} | {r['quant_us']:.1f} | "
              f"{b['us']:.0f} us {r['bf16_us'] / (b['us'] + r['quant_us']):.2f}x | {fmt_cfg(b['cfg'])} | "
              f"{r['tflops_best']:.0f} | {max(e['rel_err'] for e in r['sweep']):.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_fp8_gemm.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
