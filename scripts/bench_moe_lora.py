"""The fused MoE LoRA kernels (tp_lora.ops.triton.moe_lora: shrink, expand, and shrink + expand fused) alone, at one
rank's shapes of a decode step in each 2-GPU layout, against their bytes floor; --sweep times their launch settings.

    python3 scripts/bench_moe_lora.py --out bench_results/moe_lora                          # the current settings
    python3 scripts/bench_moe_lora.py --sweep fused --jobs 12 --out bench_results/moe_lora  # + a sweep grid
    TRITON_INTERPRET=1 python3 scripts/bench_moe_lora.py --smoke --sweep shrink             # tiny, CPU (a check)

Shapes (Qwen3-30B-A3B's MoE layer: hidden 2048, 128 experts, top-8, expert intermediate 768; --adapters adapters of
rank --rank on w1, w3 and w2 of every expert, tokens round-robin over them), per rank of a 2-GPU layout: tp1 (32 rows,
128 experts), tp2 (32 rows, 128 experts, intermediate 384: w1/w3's A whole, B split; w2's A split, B whole; the
default LoRA mode), ep2 (64 dispatched rows of two replicas, 64 local experts), tp2_ep2 (32 rows, 64 local experts).
Routing is random (softmax top-8 of normal logits); each op is timed over --plans routings, one call per routing in a
CUDA graph (so the weights touched do not sit in L2 from the previous call), median of replays / calls, as the graphed
decode step runs them. The shrink's time includes the zero fill of its output.

Floor: the bytes an op must move (A and / or B of each distinct (expert, adapter) group the routing touches, the input
rows of pairs with an adapter, the output: the shrink writes every row, the expand and fused ops read and write the
rows of pairs with an adapter) over the device copy bandwidth measured in the same run (read + written bytes / s).
"node" is the time of one graph node that does nothing (a 4-byte memset): what a call costs beyond its bytes at the
least.

--sweep shrink,expand,fused times every launch setting of those GRIDS (compiled first by --jobs processes in
parallel, which fill Triton's cache) and prints per layout and op the best, and per settings dict the setting with the
least time summed over its two ops (w13, w2) and the layouts ("best summed"); --check compares the current and best
summed settings' outputs with the torch reference (tp_lora.ops.moe_ref). Writes bench_moe_lora.json into --out.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from contextlib import contextmanager

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora.ops import moe_ref  # noqa: E402
from tp_lora.ops.moe_plan import build_plan  # noqa: E402
from tp_lora.ops.triton import moe_lora  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
LAYOUTS = {"tp1": dict(rows=32, local=128, inter=INTER), "tp2": dict(rows=32, local=128, inter=INTER // 2),
           "ep2": dict(rows=64, local=64, inter=INTER), "tp2_ep2": dict(rows=32, local=64, inter=INTER)}
SMOKE = dict(hidden=64, experts=8, top_k=2, layouts={"tp1": dict(rows=6, local=8, inter=24),
                                                     "ep2": dict(rows=8, local=4, inter=24)})
OPS = ("w13 shrink", "w13 expand", "w2 shrink", "w2 expand", "w13 fused", "w2 fused")
# The launch settings dict of tp_lora.ops.triton.moe_lora each op reads, and the sweep's grid of it.
SETTINGS = {"shrink": "SHRINK", "expand": "EXPAND", "fused": "FUSED"}
GRIDS = {
    "shrink": [dict(BLOCK_K=bk, num_warps=w, num_stages=st) for bk in (64, 128, 256, 512) for w in (2, 4, 8)
               for st in (2, 3, 4)],
    "expand": [dict(BLOCK_N=bn, num_warps=w, num_stages=st) for bn in (64, 128, 256, 512) for w in (1, 2, 4, 8)
               for st in (1, 2)],
    "fused": [dict(BLOCK_K=bk, BLOCK_N=bn, N_PER_PROGRAM=npp, num_warps=w, num_stages=st) for bk in (128, 256)
              for bn in (64, 128, 256) for npp in (256, 512, 1024, 2048) for w in (2, 4) for st in (2, 3)],
}


def kind(op: str) -> str:
    return op.split()[-1]


class Case:
    """One layout's LoRA stacks (one set, shared by every routing) and --plans routings with their inputs."""

    def __init__(self, spec: dict, hidden: int, experts: int, top_k: int, adapters: int, rank: int, plans: int,
                 device, dtype, seed: int):
        torch.manual_seed(seed)
        L, E, R, I, H = adapters, spec["local"], rank, spec["inter"], hidden

        def w(*shape, std):
            return (torch.randn(*shape, device=device) * std).to(dtype)

        self.a13 = [w(L, E, R, H, std=H ** -0.5) for _ in range(2)]
        self.b13 = [w(L, E, I, R, std=0.1) for _ in range(2)]
        self.a2 = [w(L, E, R, I, std=I ** -0.5)]
        self.b2 = [w(L, E, H, R, std=0.1)]
        self.scales = torch.rand(3, L, E, device=device) + 0.5
        self.inputs, self.floor_bytes = [], []
        n = spec["rows"]
        for _ in range(plans):
            logits = torch.randn(n, experts, device=device)
            wts, ids = torch.softmax(logits, -1).topk(top_k, -1)
            slots = (torch.arange(n, device=device) % adapters).to(torch.int32)
            plan = build_plan(ids, wts, slots, 0, E, L, lora=True)
            c = plan.num_pairs
            x, h = w(c, H, std=1.0), w(c, I, std=1.0)
            u13 = moe_lora.moe_lora_shrink(x, self.a13, self.scales[:2], plan)
            u2 = moe_lora.moe_lora_shrink(h, self.a2, self.scales[2:], plan)
            self.inputs.append(dict(plan=plan, x=x, h=h, u13=u13, u2=u2, z=w(c, 2 * I, std=1.0), y=w(c, H, std=1.0)))
            self.floor_bytes.append(op_bytes(plan, H, I, R, dtype.itemsize))

    def call(self, op: str, i: int):
        """The op on routing i (the expands add into their output rows: repeated calls keep its values finite)."""
        d = self.inputs[i]
        if op == "w13 shrink":
            return moe_lora.moe_lora_shrink(d["x"], self.a13, self.scales[:2], d["plan"])
        if op == "w13 expand":
            return moe_lora.moe_lora_expand(d["u13"], self.b13, d["plan"], d["z"])
        if op == "w2 shrink":
            return moe_lora.moe_lora_shrink(d["h"], self.a2, self.scales[2:], d["plan"])
        if op == "w2 expand":
            return moe_lora.moe_lora_expand(d["u2"], self.b2, d["plan"], d["y"])
        if op == "w13 fused":
            return moe_lora.moe_lora_fused(d["x"], self.a13, self.scales[:2], self.b13, d["plan"], d["z"])
        return moe_lora.moe_lora_fused(d["h"], self.a2, self.scales[2:], self.b2, d["plan"], d["y"])

    def reference(self, op: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(Triton's, the torch reference's) result of the op on routing i, from the same inputs."""
        d = self.inputs[i]
        if op == "w13 shrink":
            return self.call(op, i), moe_ref.moe_lora_shrink(d["x"], self.a13, self.scales[:2], d["plan"])
        if op == "w2 shrink":
            return self.call(op, i), moe_ref.moe_lora_shrink(d["h"], self.a2, self.scales[2:], d["plan"])
        w13 = op.startswith("w13")
        out = d["z"] if w13 else d["y"]
        got, ref = out.clone(), out.clone()
        if kind(op) == "expand":
            u, b = (d["u13"], self.b13) if w13 else (d["u2"], self.b2)
            moe_lora.moe_lora_expand(u, b, d["plan"], got)
            moe_ref.moe_lora_expand(u, b, d["plan"], ref)
        else:
            x, a, b, sc = (d["x"], self.a13, self.b13, self.scales[:2]) if w13 else (d["h"], self.a2, self.b2,
                                                                                   self.scales[2:])
            moe_lora.moe_lora_fused(x, a, sc, b, d["plan"], got)
            moe_ref.moe_lora_fused(x, a, sc, b, d["plan"], ref)
        return got, ref


def op_bytes(plan, H: int, I: int, R: int, size: int) -> dict[str, float]:
    """Bytes each op must move on this routing (see the module docstring)."""
    g = plan.groups[plan.groups[:, 3] > 0].cpu()
    groups = len({(int(e), int(s)) for e, s, _, _ in g.tolist()})
    pairs, cap = int(g[:, 3].sum()) if len(g) else 0, plan.num_pairs
    return {"w13 shrink": groups * 2 * R * H * size + pairs * H * size + 2 * cap * R * 4,
            "w13 expand": groups * 2 * I * R * size + pairs * 2 * R * 4 + 2 * pairs * 2 * I * size,
            "w2 shrink": groups * R * I * size + pairs * I * size + cap * R * 4,
            "w2 expand": groups * H * R * size + pairs * R * 4 + 2 * pairs * H * size,
            "w13 fused": groups * 2 * R * (H + I) * size + pairs * H * size + 2 * pairs * 2 * I * size,
            "w2 fused": groups * R * (I + H) * size + pairs * I * size + 2 * pairs * H * size,
            "groups": groups, "pairs": pairs}


@contextmanager
def launch(op: str, cfg: dict | None):
    """The op's kernel with launch settings cfg over the module's own (None: the module's own)."""
    name = SETTINGS[kind(op)]
    saved = getattr(moe_lora, name)
    if cfg is not None:
        setattr(moe_lora, name, dict(saved, **cfg))
    try:
        yield
    finally:
        setattr(moe_lora, name, saved)


def time_graph(fns, reps: int) -> float:
    """Median µs of one call over replays of a CUDA graph of fns called in turn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:  # compiled and warm before capture
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        t1.synchronize()
        times.append(1e3 * t0.elapsed_time(t1) / len(fns))
    del g
    return statistics.median(times)


def measure(case: Case, op: str, cfg: dict | None, reps: int, cuda: bool) -> float | None:
    with launch(op, cfg):
        fns = [lambda i=i: case.call(op, i) for i in range(len(case.inputs))]
        if not cuda:
            for f in fns:
                f()
            return None
        return time_graph(fns, reps)


def compile_shard(cases: dict, sweep: list[str], shard: int, of: int) -> None:
    """Compile (one call each) every setting of the swept grids with index = shard mod of, for every layout and op."""
    work = [(op, cfg) for op in OPS if kind(op) in sweep for cfg in GRIDS[kind(op)]]
    for j, (op, cfg) in enumerate(work):
        if j % of == shard:
            for case in cases.values():
                with launch(op, cfg):
                    try:
                        case.call(op, 0)
                    except Exception as err:  # noqa: BLE001 - a setting the chip cannot run: the timing says so
                        print(f"compile {op} {key(cfg)}: {type(err).__name__}", flush=True)
    torch.cuda.synchronize()


def precompile(args) -> None:
    """--jobs processes compile shards of the grids into Triton's cache, then this one loads them."""
    cmd = [sys.executable, os.path.abspath(__file__), "--compile-shard", "{}", "--jobs", str(args.jobs),
           "--adapters", str(args.adapters), "--rank", str(args.rank), "--plans", "1", "--sweep", args.sweep]
    procs = [subprocess.Popen([c.replace("{}", str(i)) for c in cmd]) for i in range(args.jobs)]
    bad = [p.args for p in procs if p.wait() != 0]
    if bad:
        raise SystemExit(f"precompile failed: {bad}")


def key(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/moe_lora")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {list(LAYOUTS)}")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--plans", type=int, default=16, help="routings per timed graph (one call each)")
    ap.add_argument("--reps", type=int, default=20, help="timed graph replays")
    ap.add_argument("--sweep", default="", help=f"time every setting of these grids, comma list of {list(GRIDS)}")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the sweep's kernels first")
    ap.add_argument("--check", action="store_true", help="compare the chosen settings with the torch reference")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two settings of each grid (CPU works)")
    ap.add_argument("--compile-shard", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, experts, top_k, layouts = ((SMOKE["hidden"], SMOKE["experts"], SMOKE["top_k"], SMOKE["layouts"])
                                       if args.smoke else (HIDDEN, EXPERTS, TOP_K, LAYOUTS))
    sweep = [g for g in args.sweep.split(",") if g]
    if any(g not in GRIDS for g in sweep):
        raise SystemExit(f"--sweep {args.sweep!r}: expected names from {list(GRIDS)}")
    if args.smoke:
        args.plans, args.reps, args.adapters, args.rank = 2, 1, 3, 4
        for grid in GRIDS.values():
            del grid[2:]
    names = [n for n in args.layouts.split(",") if n in layouts]
    cases = {n: Case(layouts[n], hidden, experts, top_k, args.adapters, args.rank, args.plans, device, dtype,
                     seed=i) for i, n in enumerate(names)}
    if args.compile_shard is not None:
        compile_shard(cases, sweep, args.compile_shard, args.jobs)
        return
    from bench_step import copy_bandwidth  # noqa: PLC0415 - imports the engine: not in the compile workers
    bw = copy_bandwidth(device) if cuda else float("nan")
    node_us = None
    if cuda:
        t = torch.zeros(1, device=device)
        node_us = time_graph([t.zero_] * args.plans, args.reps)

    rows = []

    def run(name: str, op: str, cfg: dict | None, setting: str):
        case = cases[name]
        try:
            us, error = measure(case, op, cfg, args.reps, cuda), None
        except Exception as err:  # noqa: BLE001 - e.g. a setting over the shared-memory limit: recorded, skipped
            us, error = None, f"{type(err).__name__}: {str(err)[:200]}"
        floor_b = statistics.mean(b[op] for b in case.floor_bytes)
        floor_us = 1e6 * floor_b / bw if cuda else None
        rows.append(dict(layout=name, op=op, setting=setting, config=cfg or dict(getattr(moe_lora, SETTINGS[kind(op)])),
                         us=us, floor_us=floor_us,
            floor_bytes=floor_b, groups=statistics.mean(b["groups"] for b in case.floor_bytes),
            pct_of_floor=100 * floor_us / us if cuda and us else None, error=error))

    for name in names:
        for op in OPS:
            run(name, op, None, "current")
    if sweep:
        if cuda and args.jobs > 1:
            precompile(args)
        for name in names:
            for op in OPS:
                if kind(op) in sweep:
                    for cfg in GRIDS[kind(op)]:
                        run(name, op, cfg, "sweep")
    best = best_settings(rows, names) if sweep and cuda else {}
    for op in OPS:
        if kind(op) in best:
            for name in names:
                run(name, op, best[kind(op)], "best summed")
    checks = []
    if args.check:
        for name in names:
            for op in OPS:
                for setting, cfg in (("current", None), ("best summed", best.get(kind(op)))):
                    if setting == "current" or cfg is not None:
                        with launch(op, cfg):
                            got, ref = cases[name].reference(op, 0)
                        err = ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
                        checks.append(dict(layout=name, op=op, setting=setting, rel_err=err))
                        print(f"check {name} {op} ({setting}): |out - ref| / |ref| = {err:.2e}")
        if any(not c["rel_err"] < 1e-2 for c in checks):
            raise SystemExit("check failed: an output is off the torch reference")

    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", dtype=str(dtype), triton=moe_lora.triton
                .__version__, copy_bandwidth_gb_s=round(bw / 1e9, 1) if cuda else None, node_us=node_us,
                adapters=args.adapters, rank=args.rank, plans=args.plans, reps=args.reps, hidden=hidden,
                experts=experts, top_k=top_k, layouts={n: layouts[n] for n in names})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_moe_lora.json"), "w") as f:
        json.dump(dict(meta=meta, best_summed=best, rows=rows, checks=checks), f, indent=1)
    print(f"{meta['device']}, copy bandwidth {meta['copy_bandwidth_gb_s']} GB/s (read + write), one graph node "
          f"{node_us if node_us is None else round(node_us, 2)} us")
    print(table(rows, names))
    print(f"wrote {args.out}/bench_moe_lora.json")


def best_settings(rows: list[dict], names: list[str]) -> dict[str, dict]:
    """Per settings dict (shrink, expand, fused: each serves its w13 and w2 op), the swept setting with the least time
    summed over both ops and the layouts."""
    out = {}
    for k in GRIDS:
        sums = {}
        for r in rows:
            if kind(r["op"]) == k and r["setting"] == "sweep" and r["us"] is not None:
                sums.setdefault(key(r["config"]), [r["config"], 0.0, 0])
                sums[key(r["config"])][1] += r["us"]
                sums[key(r["config"])][2] += 1
        full = [v for v in sums.values() if v[2] == 2 * len(names)]
        if full:
            out[k] = min(full, key=lambda v: v[1])[0]
    return out


def table(rows: list[dict], names: list[str]) -> str:
    """Per layout and op: the current settings, the best swept for that layout, the best summed over layouts."""
    def cell(r):
        if r is None:
            return "-"
        if r["us"] is None:
            return "failed" if r["error"] else "ran"
        return f"{r['us']:.1f} ({r['pct_of_floor']:.0f}%)"

    head = "| layout | op | groups | floor us | current us (% of floor) | best here us (% of floor), setting | best summed |"
    lines = [head, "|---" * 7 + "|"]
    for name in names:
        for op in OPS:
            sel = [r for r in rows if r["layout"] == name and r["op"] == op]
            cur = next((r for r in sel if r["setting"] == "current"), None)
            swept = [r for r in sel if r["setting"] == "sweep" and r["us"] is not None]
            here = min(swept, key=lambda r: r["us"]) if swept else None
            summed = next((r for r in sel if r["setting"] == "best summed"), None)
            floor = "-" if cur["floor_us"] is None else f"{cur['floor_us']:.1f}"
            lines.append(f"| {name} | {op} | {cur['groups']:.0f} | {floor} | {cell(cur)} | "
                         f"{cell(here)}{', ' + key(here['config']) if here else ''} | {cell(summed)} |")
    for k in GRIDS:
        r = next((r for r in rows if kind(r["op"]) == k and r["setting"] == "best summed"), None)
        if r:
            lines.append(f"best summed {k}: {key(r['config'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
