"""Issue 37: the MoE decode step through the engine (tp_lora.engine.Engine: scheduler, sampler, graphs), every layout
of the ranks present, with steps launched ahead of reading the last (the CUDA default) against reading every step,
in one process per rank. bench_moe_decode.py times the model runner alone; this is what a user's run gets.

    torchrun --nproc_per_node=2 scripts/bench_moe_engine.py [--model qwen3-30b-a3b] [--layers 24]
        [--layouts tp2,ep2,tp2_ep2] [--batch 32] [--context 512] [--new 64] [--out DIR]
    torchrun --nproc_per_node=2 scripts/bench_moe_engine.py --smoke --out DIR   # CPU + gloo, tiny model, seconds

Random weights drawn at load (bench_moe_decode's; only a config.json is written under --cache), no adapters. Each
DP replica (every rank of an EP-over-DP layout) decodes its own --batch requests; a row's decode-step ms is the mean
wall time (host included) of the steps that decoded the whole batch, as bench_step.py measures it, slowest rank.
Writes bench_moe_engine.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_moe_decode import DEFAULT_LAYOUTS, LAYOUTS, MODELS, randomize  # noqa: E402

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine import engine as engine_module  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402


def model_dir(cache: str, model: str, layers: int, max_pos: int) -> str:
    """A directory with the shape's config.json (its weights are drawn at load)."""
    path = os.path.join(cache, f"{model}-{layers}l")
    os.makedirs(path, exist_ok=True)
    cfg = dict(MODELS[model], num_hidden_layers=layers, max_position_embeddings=max_pos, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def requests(batch: int, context: int, new: int, vocab: int, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, id=i, prompt_token_ids=torch.randint(3, vocab, (context,), generator=gen).tolist(),
                    max_new_tokens=new, ignore_eos=True) for i in range(batch)]


def measure(engine: Engine, reqs: list[Request], batch: int) -> dict:
    """One generate(): its wall seconds and the mean ms of its decode steps of the whole batch."""
    before = list(engine.stats.decode_by_rows.get(batch, [0, 0.0]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    bad = [r.error for r in res if r.error]
    if bad:
        raise RuntimeError(bad[0])
    after = engine.stats.decode_by_rows.get(batch, [0, 0.0])
    steps = after[0] - before[0]
    return dict(seconds=seconds, decode_steps=steps,
                decode_step_ms=1e3 * (after[1] - before[1]) / steps if steps else None)


def run_layout(layout: str, path: str, args, device: str, seed: int) -> list[dict]:
    tp, ep, attn = LAYOUTS[layout]
    ps = comm.init_parallel(tp, device)
    cfg = RunConfig()
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = tp, ep, attn
    cfg.device, cfg.dtype = device, "bfloat16" if device == "cuda" else "float32"
    cfg.scheduler.max_batch_size = args.batch
    cfg.scheduler.max_tokens_per_step = max(4096, args.batch)
    load = engine_module.load_weights, engine_module.CheckpointReader
    # random weights, replicated ones (routers, norms) equal on every rank
    engine_module.load_weights = lambda model, reader: randomize(model, model.device)
    engine_module.CheckpointReader = lambda path: None
    try:
        engine = Engine(cfg, ps, path, None)
    finally:
        engine_module.load_weights, engine_module.CheckpointReader = load
    vocab, replica = engine.hf["vocab_size"], ps.dp.rank
    rows = []
    # a whole unreported run first: the first decode steps of each batch size capture graphs and compile kernels
    engine.generate(requests(args.batch, args.context, args.new, vocab, seed - 1 + 7919 * replica))
    for ahead in (True, False):
        engine.run_ahead = ahead
        got = measure(engine, requests(args.batch, args.context, args.new, vocab, seed + 1 + 7919 * replica),
                      args.batch)
        seed += 2
        slowest = max(comm.all_gather_object(got["decode_step_ms"] or 0.0, ps.world))
        rows.append(dict(layout=layout, run_ahead=engine.run_ahead, batch_per_replica=args.batch,
                         context=args.context, new=args.new, decode_step_ms=round(slowest, 3),
                         tokens_per_s=round(args.batch * ps.dp.size * args.new /
                                            max(comm.all_gather_object(got["seconds"], ps.world)), 1),
                         decode_steps=got["decode_steps"]))
        if ps.is_driver:
            print("row", json.dumps(rows[-1]), flush=True)
    engine.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--layouts", default=None,
                   help="names from bench_moe_decode's LAYOUTS (default: its default for the world's ranks)")
    p.add_argument("--batch", type=int, default=32, help="decode sequences per DP replica")
    p.add_argument("--context", type=int, default=512, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tp_lora/bench_moe_engine"))
    p.add_argument("--out", default="bench_results/moe_engine")
    p.add_argument("--smoke", action="store_true", help="tiny model, few tokens (CPU + gloo works)")
    args = p.parse_args()
    if args.smoke:
        args.model, args.layers, args.batch, args.context, args.new = "tiny", 2, 4, 8, 4
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    names = (args.layouts or DEFAULT_LAYOUTS[world]).split(",")
    first = comm.init_parallel(1, device)
    if first.is_driver:
        model_dir(args.cache, args.model, args.layers, args.context + args.new + 16)
    comm.all_gather_object(None, first.world)  # a barrier: the config is written
    path = os.path.join(args.cache, f"{args.model}-{args.layers}l")
    rows = [r for name in names for r in run_layout(name, path, args, device, seed=11)]
    if first.is_driver:
        print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, {args.model} {args.layers} layers, "
              f"batch {args.batch} per replica, context {args.context}, {args.new} new tokens")
        print("| layout | steps run ahead | decode step ms (slowest rank) | tokens/s |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['layout']} | {'yes' if r['run_ahead'] else 'no'} | {r['decode_step_ms']:.3f} | "
                  f"{r['tokens_per_s']:.0f} |")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe_engine.json"), "w") as f:
            json.dump(dict(device=device, model=args.model, layers=args.layers, rows=rows), f, indent=1)
    comm.shutdown()


if __name__ == "__main__":
    main()
