"""One MoE layer with many adapters in every parallel layout the GPUs allow: time per step, LoRA overhead, bytes
communicated and memory per rank.

    torchrun --nproc_per_node=4 scripts/bench_moe.py --out bench_results/moe        # 2-4 GPUs, NCCL
    torchrun --nproc_per_node=2 scripts/bench_moe.py --smoke                         # tiny, CPU + gloo (CI check)

Shapes: "mixtral" (8 experts, top-2, hidden 4096, intermediate 14336), "qwen3-64" / "qwen3-128" (64 / 128 experts,
top-8, hidden 2048, intermediate 768, normalised top-k), random bf16 weights. Layouts for W ranks
(tp, ep, ep_attention): TP (W, 1), EP with DP attention (1, W), EP with TP attention (W, W, tp), and on 4+ ranks
EP x TP (2, W/2).
LoRA: none, default, fully sharded; --adapters adapters of rank --rank on w1/w3/w2 of every expert, tokens spread
round-robin over them. Tokens: --tokens per attention replica per step (decode-sized and prefill-sized by default);
EP with DP attention serves W replicas, so its global tokens per step are W times those of the TP layouts.

Per case, rank 0 reports: median ms per layer step (CUDA events, after warm-up; the slowest rank's median), global
tokens/s, LoRA overhead against the same layout without adapters, collectives and bytes one rank sends per step
(distributed.STATS), weight and LoRA MB per rank, peak CUDA memory, and the floors of the slowest rank: memory (bytes
of the local experts the step's tokens are actually routed to / this GPU's measured device copy bandwidth) and bf16
FLOPs (2 * local pairs * expert MLP MACs / --peak-tflops), with ms over the larger floor; LoRA rows add to the memory
floor the LoRA bytes the step reads (each distinct adapter x local expert pair routed to), shown on their own. --gemms times the
expert GEMMs several ways in one run: grouped (as the layer runs them: our Triton kernel for few rows per expert, else
torch's grouped GEMM), torch, triton (each of those alone) and loop (the per-expert reference loop over the same
routing plan, what the layer ran before grouped GEMMs). The EP-over-DP token-count exchange
happens once per model step, not per layer: it is excluded here. --graphs times replays of the layer captured in a
CUDA graph (not the loop: it reads offsets on the host), as a graphed decode step runs it; --profile
prints each case's kernels; --side-stream off runs the LoRA shrinks in line instead of beside the base GEMMs.
Writes bench_moe.json and bench_moe.png into --out and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step import copy_bandwidth, print_kernels  # noqa: E402

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.layers import moe as moe_layers  # noqa: E402
from tp_lora.lora import layers as lora_layers  # noqa: E402
from tp_lora.lora.layers import LoRARuntime  # noqa: E402
from tp_lora.models.moe import SparseMoE  # noqa: E402
from tp_lora.models.moe_step import MoEStep, prepare_step, validate_moe  # noqa: E402
from tp_lora.ops import get_backend  # noqa: E402
from tp_lora.ops.batch import build_lora_batch  # noqa: E402
from tp_lora.ops.grouped_mm import grouped_mm_ref, grouped_mm_torch, grouped_mm_triton  # noqa: E402


SHAPES = {
    "mixtral": {"model_type": "mixtral", "hidden_size": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 14336},
    "qwen3-64": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 64, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "norm_topk_prob": True},
    "qwen3-128": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": True},  # Qwen3-30B-A3B's MoE layer
}
SMOKE_SHAPES = {
    "mixtral-tiny": {"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "intermediate_size": 32},
    "qwen2-tiny": {"model_type": "qwen2_moe", "hidden_size": 64, "num_experts": 8, "num_experts_per_tok": 4,
                   "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32},
}


def layouts(world: int) -> dict[str, tuple[int, int, str]]:
    out = {f"tp{world}": (world, 1, "dp"), f"ep{world}": (1, world, "dp"), f"tp{world}_ep{world}": (world, world, "tp")}
    if world >= 4 and world % 2 == 0:
        out[f"ep{world // 2}_tp2"] = (2, world // 2, "dp")
    return out


def routed_floors(block, ps, x: torch.Tensor, slots: list[int], bandwidth: float, peak_tflops: float
                  ) -> tuple[float, float, float]:
    """(memory floor ms, FLOP floor ms, LoRA memory floor ms) of the slowest rank for one step over x: the weight
    bytes of the local experts the step's tokens are routed to, read once at `bandwidth` (the copy's read + written
    bytes per second); the expert MLP FLOPs of the local pairs at `peak_tflops`; the A and B bytes of each distinct
    (adapter slot, local expert) pair routed to plus each distinct slot of the block's other LoRA layers (0 without
    LoRA)."""
    ex = block.base_experts
    with torch.no_grad():
        ids, _ = block.gate(x)
    tags = torch.tensor(slots)[:, None].expand_as(ids.cpu())
    if ps.ep.size > 1 and ps.ep_attention == "dp":  # every replica's tokens reach this rank's experts
        ids = torch.cat([torch.as_tensor(i) for i in comm.all_gather_object(ids.cpu(), ps.ep)])
        tags = torch.cat([torch.as_tensor(t) for t in comm.all_gather_object(tags, ps.ep)])
    ids = ids.cpu()
    mine = (ids >= ex.e0) & (ids < ex.e1)
    local = ids[mine]
    per_expert = (ex.w13[0].numel() + ex.w2[0].numel()) * ex.w13.element_size()
    mem_ms = 1e3 * local.unique().numel() * per_expert / bandwidth if bandwidth else 0.0
    flop_ms = 1e3 * 2 * local.numel() * (ex.w13[0].numel() + ex.w2[0].numel()) / (peak_tflops * 1e12)
    expert_lora = sum(p[0, 0].numel() * p.element_size() for n, p in block.experts.named_parameters()
                      if "lora_" in n)
    other_lora = sum(p[0].numel() * p.element_size() for n, p in block.named_parameters()
                     if "lora_" in n and not n.startswith("experts."))
    pairs = (tags[mine] * ex.num_local + local - ex.e0).unique().numel()
    lora_bytes = pairs * expert_lora + tags.unique().numel() * other_lora
    lora_ms = 1e3 * lora_bytes / bandwidth if bandwidth else 0.0
    mem, flop, lora = zip(*comm.all_gather_object((mem_ms, flop_ms, lora_ms), ps.world))
    return max(mem), max(flop), max(lora)


def module_mb(m: torch.nn.Module, lora: bool) -> float:
    """MB of this rank's parameters and buffers: LoRA stacks (lora=True) or the rest."""
    total = 0
    for name, t in list(m.named_parameters()) + list(m.named_buffers()):
        is_lora = "lora_" in name or name.endswith("scales")
        if is_lora == lora:
            total += t.numel() * t.element_size()
    return total / 2**20


def build(hf: dict, ps: comm.ParallelState, dtype, device, mode: str, n_adapters: int, rank: int, ops):
    """The block with random weights (same router on every rank), its LoRA runtime (None for mode "none")."""
    hf = dict(hf, num_hidden_layers=1, hidden_act="silu")
    shape = validate_moe(hf, ps)
    rt = None if mode == "none" else LoRARuntime(n_adapters, rank, mode == "fully_sharded", ops)
    step = MoEStep()
    block = SparseMoE(hf, shape, 0, ps, step, dtype, device, rt, None)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    h = hf["hidden_size"]
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(block.gate.weight.shape, generator=gen))
        for name, p in block.named_parameters():
            if name.startswith("gate."):
                continue
            std = (1.0 if "lora_b" in name else p.shape[-1] ** -0.5) * (0.1 if "lora_" in name else 1.0)
            p.normal_(0, std)
        if rt is not None:
            for name, b in block.named_buffers():
                if name.endswith("scales"):
                    b.fill_(1.0)
    return block, step, rt, h


def time_case(block, step, rt, ps, x, slots, iters: int, warmup: int, device, graph: bool = False,
              profile: str | None = None) -> tuple[float, dict, float]:
    """(slowest rank's median ms, this rank's {collective: [calls, bytes]} of one step, peak MB). graph: time replays
    of the layer captured in a CUDA graph (routing metadata prepared once, as a graphed decode step does); profile:
    print this label and the step's kernels (rank 0)."""
    n = x.shape[0]
    counts = [n] * ps.ep.size

    def prepare():
        if rt is not None:
            rt.batch = build_lora_batch(slots, rt.max_loras, device)
        if ps.ep_attention == "dp":  # what lockstep would have agreed: no counts exchange inside the timed step
            step.counts, step.lora = counts, rt is not None and rt.active()
        prepare_step(step, ps, rt, n, device)

    def one():
        prepare()
        return block(x)

    cuda = device.type == "cuda"
    with torch.no_grad():
        for _ in range(warmup):
            one()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        comm.STATS.reset()
        one()
        stats = {k: [comm.STATS.calls[k], comm.STATS.bytes[k]] for k in comm.STATS.calls}
        run = one
        if graph and cuda:
            prepare()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                block(x)
            run = g.replay
        times = []
        for _ in range(iters):
            sync = torch.zeros(1, device=device)
            comm.all_reduce(sync, ps.world)  # start every rank's step together
            if cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                run()
                t1.record()
                torch.cuda.synchronize()
                times.append(t0.elapsed_time(t1))
            else:
                t0 = time.perf_counter()
                run()
                times.append(1e3 * (time.perf_counter() - t0))
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
        if profile and cuda:
            print_kernels(run, f"steps: {profile}", show=ps.is_driver)
        if run is not one:
            del g
    med = statistics.median(times)
    return max(comm.all_gather_object(med, ps.world)), stats, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/moe")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (CPU + gloo works)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {sorted(SHAPES)} (default: mixtral,qwen3-64)")
    ap.add_argument("--tokens", default=None, help="tokens per attention replica per step, comma list")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="auto", help="LoRA ops: auto (triton on cuda) | torch | triton")
    ap.add_argument("--gemms", default=None, help="expert GEMMs to time, comma list of grouped (as the layer runs), "
                                                  "torch, triton, loop (default: grouped,loop; grouped with --smoke)")
    ap.add_argument("--modes", default="none,default,fully_sharded", help="LoRA modes, comma list")
    ap.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of the layer (GPU)")
    ap.add_argument("--profile", action="store_true", help="print each case's kernels (torch.profiler, GPU)")
    ap.add_argument("--layouts", default=None, help="comma list of layout names (default: all for the world size)")
    ap.add_argument("--side-stream", choices=("on", "off"), default="on",
                    help="off: the LoRA shrinks run in line, never beside the base GEMM (LoRARuntime.beside)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100/H200: 989)")
    args = ap.parse_args()

    if args.side_stream == "off":
        lora_layers.SIDE_STREAM_MAX_ROWS = -1  # beside() reads it per call
    cuda = torch.cuda.is_available() and not args.smoke
    ps0 = comm.init_parallel(1, "cuda" if cuda else "cpu")
    world, device = ps0.world.size, ps0.device
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in (args.shapes or "mixtral,qwen3-64").split(",")}
    tokens = [int(t) for t in (args.tokens or ("5,12" if args.smoke else "64,2048")).split(",")]
    iters, warmup = (2, 1) if args.smoke else (args.iters, args.warmup)
    ops = get_backend(args.backend, str(device))
    gemms = (args.gemms or ("grouped" if args.smoke else "grouped,loop")).split(",")
    bandwidth = copy_bandwidth(device) if cuda else 0.0
    rows = []
    for lname, (tp, ep, attn) in layouts(world).items():
        if args.layouts and lname not in args.layouts.split(","):
            continue
        ps = comm.init_expert_parallel(comm.init_parallel(tp, str(device)), ep, attn)
        for sname, hf in shapes.items():
            for t in tokens:
                # Every rank draws its replica's tokens; TP ranks of one replica draw the same ones.
                gen = torch.Generator().manual_seed(100 + ps.dp.rank)
                x = torch.randn(t, hf["hidden_size"], generator=gen).to(device, dtype)
                slots = [i % args.adapters for i in range(t)]
                mem_ms = flop_ms = None
                lora_ms = {}
                for gemm in gemms:
                    base_ms = None
                    for mode in args.modes.split(","):
                        block, step, rt, _ = build(hf, ps, dtype, device, mode, args.adapters, args.rank, ops)
                        if mode not in lora_ms:
                            mem_ms, flop_ms, lora_ms[mode] = routed_floors(block, ps, x, slots, bandwidth,
                                                                           args.peak_tflops)
                        with expert_gemms(gemm):
                            graphed = args.graphs and cuda and gemm != "loop"  # the loop syncs: eager
                            label = f"{sname} {lname} {t} tokens/replica {gemm} GEMMs, LoRA {mode}"
                            ms, stats, peak = time_case(block, step, rt, ps, x, slots, iters, warmup, device,
                                                        graphed, label if args.profile else None)
                        base_ms = ms if mode == "none" else base_ms
                        global_tokens = t * ps.dp.size
                        floor = max(mem_ms + lora_ms[mode], flop_ms) if bandwidth else 0.0  # none on the CPU
                        rows.append(dict(
                            shape=sname, layout=lname, graphs=graphed, tp=tp, ep=ep, ep_attention=attn,
                            tokens_per_replica=t,
                            global_tokens=global_tokens, gemm=gemm, lora=mode, ms=round(ms, 4),
                            tokens_per_s=round(global_tokens / (ms / 1e3), 1),
                            lora_overhead_pct=None if base_ms is None or mode == "none"
                            else round(100 * (ms / base_ms - 1), 1),
                            mem_floor_ms=round(mem_ms, 4), flop_floor_ms=round(flop_ms, 4),
                            lora_floor_ms=round(lora_ms[mode], 4),
                            x_floor=round(ms / floor, 2) if floor else None,
                            collectives={k: v[0] for k, v in stats.items()},
                            comm_mb_per_rank=round(sum(v[1] for v in stats.values()) / 2**20, 3),
                            weights_mb_per_rank=round(module_mb(block, False), 2),
                            lora_mb_per_rank=round(module_mb(block, True), 2), peak_mb=round(peak, 1),
                            adapters=args.adapters, rank=args.rank))
                        del block, step, rt
                        if cuda:
                            torch.cuda.empty_cache()
    if ps0.is_driver:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(world=world, device=torch.cuda.get_device_name() if cuda else "cpu", dtype=str(dtype),
                    backend=ops.__name__, smoke=args.smoke, iters=iters, warmup=warmup,
                    copy_bandwidth_gb_s=round(bandwidth / 1e9, 1), peak_tflops=args.peak_tflops,
                    side_stream=args.side_stream)
        with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), bf16 peak {args.peak_tflops} TFLOP/s")
        print(table(rows))
        plot(rows, os.path.join(args.out, "bench_moe.png"))
        print(f"\nwrote {args.out}/bench_moe.json and bench_moe.png ({meta['device']}, {world} ranks)")
    comm.shutdown()


def table(rows: list[dict]) -> str:
    head = ("| shape | layout | tokens/replica | GEMMs | graph | LoRA | ms/step | x floor | mem floor ms | FLOP floor ms "
            "| LoRA floor ms | tokens/s | LoRA overhead | collectives | comm MB/rank | weights MB/rank | LoRA MB/rank | peak MB |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        coll = ", ".join(f"{k} x{v}" for k, v in sorted(r["collectives"].items())) or "-"
        over = "-" if r["lora_overhead_pct"] is None else f"{r['lora_overhead_pct']:+.1f}%"
        xf = "-" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
        lines.append(f"| {r['shape']} | {r['layout']} | {r['tokens_per_replica']} | {r['gemm']} | "
                     f"{'yes' if r['graphs'] else 'no'} | {r['lora']} | "
                     f"{r['ms']:.3f} | {xf} | {r['mem_floor_ms']:.3f} | {r['flop_floor_ms']:.3f} | "
                     f"{r['lora_floor_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {over} | {coll} | {r['comm_mb_per_rank']:.3f} | "
                     f"{r['weights_mb_per_rank']:.1f} | {r['lora_mb_per_rank']:.1f} | {r['peak_mb']:.0f} |")
    return "\n".join(lines)


@contextmanager
def expert_gemms(kind: str):
    """grouped: the layer as it runs (the dispatcher); torch / triton: every expert GEMM through torch's grouped GEMM /
    our Triton kernel; loop: through the per-expert reference loop."""
    impls = {"grouped": moe_layers.grouped_mm, "loop": grouped_mm_ref, "triton": grouped_mm_triton,
             "torch": grouped_mm_torch}
    if kind not in impls:
        raise ValueError(f"--gemms {kind!r}: expected names from {sorted(impls)}")
    saved = moe_layers.grouped_mm
    moe_layers.grouped_mm = impls[kind]
    try:
        yield
    finally:
        moe_layers.grouped_mm = saved


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    panels = sorted({(r["shape"], r["tokens_per_replica"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    modes = ("none", "default", "fully_sharded")
    for ax, (shape, t) in zip(axes[0], panels):
        sub = [r for r in rows if r["shape"] == shape and r["tokens_per_replica"] == t and r["gemm"] == "grouped"]
        names = list(dict.fromkeys(r["layout"] for r in sub))
        for j, mode in enumerate(modes):
            vals = [next((r["ms"] for r in sub if r["layout"] == n and r["lora"] == mode), 0) for n in names]
            ax.bar([i + 0.27 * (j - 1) for i in range(len(names))], vals, width=0.27, label=mode)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"{shape}, {t} tokens/replica")
        ax.set_ylabel("ms per MoE layer step")
    axes[0][0].legend(title="LoRA")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
