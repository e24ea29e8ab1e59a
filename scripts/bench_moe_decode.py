"""End-to-end MoE decode step (every layer, attention + MoE + LM head) at a fixed batch, with and without adapters,
in each 2- or 4-GPU layout (and tp1, one GPU per model copy, as the baseline in the same call), against the step's
active-weight floor.

    torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --model qwen3-30b-a3b --out bench_results/moe_decode
    torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --model mixtral-8x7b --layers 16
    torchrun --nproc_per_node=4 scripts/bench_moe_decode.py --layers 24 --prefill 512  # tp1, tp4, ep4, ep2_tp2, tp4_ep4
    torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --smoke                  # tiny, CPU + gloo (4 ranks too)
    torchrun --nproc_per_node=1 scripts/bench_moe_decode.py --layouts tp1 --profile  # one GPU, with its kernels

Models (random bf16 weights, built in memory, no checkpoint): "qwen3-30b-a3b" (48 layers, hidden 2048, 128 experts,
top-8, expert intermediate 768, GQA 32/4, head_dim 128, vocab 151936) and "mixtral-8x7b" (32 layers, hidden 4096,
8 experts, top-2, intermediate 14336, GQA 32/8, vocab 32000); --layers cuts the depth (the step time and the floor
scale together). Layouts, as configs/parallel names them: tp1 (one GPU; on more, each GPU its own copy), tp2 / tp4
(experts' intermediate split), ep2 / ep4 (EP over 2 / 4 DP replicas, each serving --batch sequences; the replicas
agree on their token counts once per step, before it, timed with it), tp2_ep2 / tp4_ep4 (EP over the attention TP
group), ep2_tp2 (the 2D mesh: EP over 2 DP replicas of tp2 attention, each expert's intermediate split over tp). A
layout of fewer ranks than launched runs as that many DP copies (ep2 on 4 GPUs: two EP groups). Default --layouts: the
launched size's layouts (tp1 first on 4 GPUs). LoRA: none, or --adapters adapters of rank --rank on every attention and
expert projection, sequences round-robin over them, in each of --lora-modes (default: B split, A whole on every
rank; fully_sharded: A split on the rank dim too); --quantization none,fp8 runs every case with bf16 and with fp8
weights (fp8_experts: fp8 experts beside bf16 attention).

A step is ModelRunner.execute of --batch decode tokens at position --context (CUDA graphs where the model's layout is
capturable; the table says which ran) and its greedy draw as the engine draws (from each rank's vocabulary shard of
the logits where tp > 1, else from the gathered logits), timed from the host call to the tokens on the device, median
of --iters after warm-up (and capture); the slowest rank's median. "back to back": --iters steps launched with no host
wait between them (the engine's run-ahead overlaps a step's host preparation with the last step on the device), per
step. Floor: the bytes one rank must read in the step (its attention, norm and LM-head weights, the weights of its
experts that the step's tokens are actually routed to, measured on one eager step over its EP group, and the K/V its
sequences attend over) over the measured device copy bandwidth (a copy's read + written bytes per second); "% of
floor" is floor / step. Adapters' bytes are not in the floor; an adapter row gives beside its adapters (floor + the
A and B bytes its tokens' adapters and (expert, adapter) groups read) / floor, the least ratio of its step to the step
without adapters. The lockstep floor (JSON) counts each layer's busiest
rank's experts, as a step whose every MoE layer ends in a collective must wait for them. --prefill N also times a
mixed step (batch - 1 decodes + one N-token prompt chunk) replayed from its graph (EP over DP replicas: every replica
the same mix, replaying the group's agreed size) and run eagerly. --hf (one process) also times transformers + PEFT
on the same shape (adapters on attention only: PEFT refuses mixed-adapter batches over 3D expert weights). Prints
each row as it is done (a cut run keeps them), then a markdown table; writes bench_moe_decode.json to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_step import copy_bandwidth, kv_bytes  # noqa: E402
from kernel_marginals import marginals  # noqa: E402
from tp_lora import distributed as comm  # noqa: E402
from tp_lora.engine.runner import ModelRunner, StepBatch  # noqa: E402
from tp_lora.engine.sampler import draw, draw_shard  # noqa: E402
from tp_lora.layers.moe import Router  # noqa: E402
from tp_lora.layers.quant import FP8Scheme, QuantConfig, quant_config  # noqa: E402
from tp_lora.lora.layers import LoRARuntime  # noqa: E402
from tp_lora.models.moe import MoECausalLM, SparseMoE  # noqa: E402
from tp_lora.ops import get_backend  # noqa: E402

COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
              tie_word_embeddings=False)
MODELS = {
    "qwen3-30b-a3b": dict(COMMON, model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                          norm_topk_prob=True),
    "mixtral-8x7b": dict(COMMON, model_type="mixtral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                         num_experts_per_tok=2, intermediate_size=14336, sliding_window=None),
    "tiny": dict(COMMON, model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True),
}
# name -> (tp_size, ep_size, ep_attention), as configs/parallel
LAYOUTS = {"tp1": (1, 1, "dp"), "tp2": (2, 1, "dp"), "ep2": (1, 2, "dp"), "tp2_ep2": (2, 2, "tp"),
           "tp4": (4, 1, "dp"), "ep4": (1, 4, "dp"), "ep2_tp2": (2, 2, "dp"), "tp4_ep4": (4, 4, "tp")}
DEFAULT_LAYOUTS = {1: "tp1", 2: "tp2,ep2,tp2_ep2", 4: "tp1,tp4,ep4,ep2_tp2,tp4_ep4"}


def layout_ranks(layout: str) -> int:
    """Ranks one copy of the model spans: tp, times ep where the experts are split over DP replicas."""
    tp, ep, attn = LAYOUTS[layout]
    return tp * ep if attn == "dp" else tp


@torch.no_grad()
def randomize(model: torch.nn.Module, device) -> None:
    """Weights ~ N(0, 1/in), norms 1, LoRA small, scales 1; each tensor from a generator seeded by its name, so
    replicated tensors (routers, norms) are equal on every rank. fp8 weights (--quantization fp8): N(0, 1) with
    1/sqrt(in) as their per-channel scale (`<name>_scale`)."""
    tensors = dict(list(model.named_parameters()) + list(model.named_buffers()))
    fp8 = {name for name, p in tensors.items() if p.dtype == torch.float8_e4m3fn}
    for name in fp8:
        w = tensors[name]
        g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        w.copy_(torch.randn(w.shape, generator=g, device=device).clamp_(-448, 448))
        tensors[name + "_scale"].fill_(w.shape[-1] ** -0.5)
    for name, p in tensors.items():
        if not p.is_floating_point() or name in fp8 or name.removesuffix("_scale") in fp8:
            continue
        if name.endswith("scales"):
            p.fill_(1.0)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            std = (1.0 if "lora_b" in name else p.shape[-1] ** -0.5) * (0.1 if "lora_" in name else 1.0)
            p.normal_(0.0, std, generator=g)


def execute(runner: ModelRunner, model: MoECausalLM, step: StepBatch, cache) -> torch.Tensor:
    """One step and its greedy tokens [2, N] (token, log-probability); EP over DP replicas first agrees on the step's
    token counts and LoRA flag (the engine's lockstep)."""
    model.lockstep(len(step.ids), any(s >= 0 for s in step.slots))  # a no-op outside EP over DP replicas
    logits = runner.execute(step, cache)
    greedy = [0.0] * logits.shape[0]
    if runner.vocab_shard is None:
        return draw(logits, greedy, 1.0, None)
    return draw_shard(logits, runner.vocab_shard[0], greedy, None, runner.vocab_shard[1])


def routing(model: MoECausalLM, runner_eager: ModelRunner, step: StepBatch, cache, ps) -> tuple[list, torch.Tensor]:
    """(per MoE layer the expert of every (token, choice) pair, the pairs' adapter slots): one eager step, every
    rank's pairs over its EP group gathered in rank order (the pairs dispatched to its experts)."""
    routed: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: routed.append(out[0].cpu()))
             for m in model.modules() if isinstance(m, Router)]
    execute(runner_eager, model, step, cache)
    for h in hooks:
        h.remove()
    k = routed[0].shape[-1] if routed else 1
    gathered = comm.all_gather_object(([r.flatten() for r in routed], torch.tensor(step.slots).repeat_interleave(k)),
                                      ps.ep)
    return [torch.cat(layer) for layer in zip(*(g[0] for g in gathered))], torch.cat([g[1] for g in gathered])


def floor_bytes(model: MoECausalLM, ids: list[torch.Tensor]) -> tuple[int, list[int]]:
    """(bytes this rank reads in one decode step, its experts' share of them layer by layer): every non-expert,
    non-LoRA weight except the embedding table (one row per token), plus its experts that the step's pairs (ids,
    from routing()) are routed to."""
    total = 0
    for name, p in model.named_parameters():
        if "lora_" in name or "embed_tokens" in name or ".experts." in name:
            continue
        total += p.numel() * p.element_size()
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    layers = []
    for block, layer_ids in zip(blocks, ids):
        ex = block.base_experts
        hit = layer_ids[(layer_ids >= ex.e0) & (layer_ids < ex.e1)].unique().numel()
        layers.append(hit * (ex.w13[0].numel() + ex.w2[0].numel()) * ex.w13.element_size())
    return total + sum(layers), layers


def adapter_bytes(model: MoECausalLM, step: StepBatch, ids: list[torch.Tensor], slots: torch.Tensor) -> int:
    """Bytes of LoRA weights this rank reads in the step: of each adapter its tokens use, its A and B of the
    attention projections; of each (local expert, adapter) group of the routed pairs (ids and slots from routing()),
    that expert's A and B of the adapter."""
    used = len({s for s in step.slots if s >= 0})
    moe = iter(ids)
    total = 0
    for layer in model.layers:
        total += sum(used * p[0].numel() * p.element_size() for name, p in layer.named_parameters()
                     if "lora_" in name and ".experts." not in name)  # [L, ...]: a slot's share
        if isinstance(layer.mlp, SparseMoE):
            ex, layer_ids = layer.mlp.base_experts, next(moe)
            live = (layer_ids >= ex.e0) & (layer_ids < ex.e1) & (slots >= 0)
            groups = torch.unique(torch.stack([layer_ids[live], slots[live]]), dim=1).shape[1]
            total += groups * sum(p[0, 0].numel() * p.element_size()  # [L, E, ...]: one (slot, expert)'s share
                                  for name, p in layer.mlp.experts.named_parameters() if "lora_" in name)
    return total


def kernel_times(run, steps: int = 3) -> dict[str, list[float]]:
    """{kernel name: [µs per step, launches per step, marginal µs per step]} of `steps` calls of run() on this
    rank's device (torch.profiler; every rank profiles, so the collectives inside run() meet their peers). The
    marginal µs is the kernel's time on the step's critical path (kernel_marginals.py: under PDL device times
    overlap); the first call is a warm-up whose marginals are not counted."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps + 1):
            run()
            torch.cuda.synchronize()
    events = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[1])
    cut = len(events) // (steps + 1)  # the warm-up call's kernels (every call launches the same ones)
    out: dict[str, list[float]] = {}
    for (name, start, end), m in zip(events[cut:], marginals([(s, e) for _, s, e in events[cut:]])):
        row = out.setdefault(name, [0.0, 0.0, 0.0])
        row[0] += (end - start) / steps
        row[1] += 1 / steps
        row[2] += m / steps
    return {k: [round(v, 2) for v in row] for k, row in out.items()}


def bench_quant(hf: dict, weights: str) -> QuantConfig | None:
    """--quantization's value as the model's QuantConfig: fp8_experts keeps attention in bf16, as a checkpoint whose
    quantization_config ignores self_attn does."""
    if weights == "fp8_experts":
        return QuantConfig(FP8Scheme(at_load=True), (r"re:.*\.self_attn\..*",), "fp8 experts, bf16 attention")
    return quant_config(hf, None if weights == "none" else weights)


def run_case(hf, layout: str, n_adapters: int, args, device, dtype, ops, bandwidth: float,
             allreduce: str = "auto", weights: str = "none", fully_sharded: bool = False) -> dict:
    tp, ep, attn = LAYOUTS[layout]
    ps = comm.init_expert_parallel(comm.init_parallel(tp, str(device), allreduce=allreduce), ep, attn,
                                   allreduce=allreduce)
    rt = LoRARuntime(n_adapters, args.rank, fully_sharded, ops) if n_adapters else None
    model = MoECausalLM(hf, ps, dtype, device, rt, None, bench_quant(hf, weights))
    randomize(model, device)
    graphs = args.graphs and device.type == "cuda" and model.graph_blocker is None
    runner = ModelRunner(model, rt, device, graphs)
    eager = ModelRunner(model, rt, device, False)
    runner.vocab_shard = eager.vocab_shard = model.vocab_shard()  # as the engine sets it
    bs, per_seq = 16, -(-(args.context + 2) // 16)
    chunk_blocks = -(-args.prefill // bs)
    cache = runner.kv_cache(args.batch * per_seq + chunk_blocks, bs, max(args.context + 2, args.prefill))
    gen = torch.Generator().manual_seed(7 + ps.dp.rank)
    step = StepBatch()
    for i, tok in enumerate(torch.randint(0, hf["vocab_size"], (args.batch,), generator=gen).tolist()):
        step.add([tok], list(range(i * per_seq, (i + 1) * per_seq)), args.context, i % n_adapters if n_adapters else -1)
    ids, slots = routing(model, eager, step, cache, ps)
    nbytes, layer_bytes = floor_bytes(model, ids)
    nbytes += int(kv_bytes(model, args.batch, args.context + 1))
    lora_bytes = adapter_bytes(model, step, ids, slots) if n_adapters else 0
    floor = nbytes / bandwidth * 1e3 if bandwidth else 0.0
    # Lockstep: every layer waits for its busiest rank's experts (EP layouts), not the step for the busiest rank's.
    ranks = comm.all_gather_object((nbytes - sum(layer_bytes), layer_bytes), ps.world)
    lockstep = max(b for b, _ in ranks) + sum(max(layer) for layer in zip(*(lb for _, lb in ranks)))
    lock_floor = lockstep / bandwidth * 1e3 if bandwidth else 0.0
    cuda = device.type == "cuda"

    def timed(run: ModelRunner, s: StepBatch) -> tuple[float, bool]:
        """(slowest rank's median ms of the step, whether it replayed a graph)."""
        for _ in range(args.warmup):
            execute(run, model, s, cache)
        replayed = run.replayed
        times = []
        for _ in range(args.iters):
            comm.all_reduce(torch.zeros(1, device=device), ps.world)  # start every rank's step together
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            execute(run, model, s, cache)
            if cuda:
                torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        return max(comm.all_gather_object(statistics.median(times), ps.world)), replayed

    def back_to_back(run: ModelRunner, s: StepBatch) -> float:
        """Slowest rank's ms per step of --iters steps launched one after another, no host wait between them: the
        host prepares a step while the device runs the last, as the engine's run-ahead does (EP over DP replicas
        still read their agreed counts each step)."""
        comm.all_reduce(torch.zeros(1, device=device), ps.world)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            execute(run, model, s, cache)
        if cuda:
            torch.cuda.synchronize()
        return max(comm.all_gather_object(1e3 * (time.perf_counter() - t0) / args.iters, ps.world))

    ms, replayed = timed(runner, step)
    ahead_ms = back_to_back(runner, step)
    floor, nbytes, lock_floor, lora_bytes = max(comm.all_gather_object((floor, nbytes, lock_floor, lora_bytes),
                                                                       ps.world))
    mixed = {}
    if args.prefill:  # batch - 1 decodes + one prefill chunk from position 0, graphed (where the layout allows) / eager
        m = StepBatch()
        for i in range(args.batch - 1):
            m.add(step.ids[i:i + 1], step.blocks[i], step.starts[i], step.slots[i])
        chunk = torch.randint(0, hf["vocab_size"], (args.prefill,), generator=gen).tolist()
        m.add(chunk, list(range(args.batch * per_seq, args.batch * per_seq + chunk_blocks)), 0,
              (args.batch - 1) % n_adapters if n_adapters else -1)
        graph_ms, graph_replayed = timed(runner, m)
        eager_ms, _ = timed(eager, m)
        mixed = dict(mixed_ms=round(graph_ms, 3), mixed_graphs=graph_replayed, mixed_eager_ms=round(eager_ms, 3))
        if args.profile and cuda:
            mixed["mixed_kernels"] = kernel_times(lambda: execute(runner, model, m, cache))
    kernels = kernel_times(lambda: execute(runner, model, step, cache)) if args.profile and cuda else {}
    runner.release_graphs()
    tokens = args.batch * ps.dp.size
    return dict(layout=layout, weights=weights, collectives=allreduce, adapters=n_adapters,
                fully_sharded=bool(n_adapters) and fully_sharded, rank=args.rank if n_adapters else 0,
                batch_per_replica=args.batch,
                global_tokens=tokens, graphs=bool(replayed), ms=round(ms, 3), tokens_per_s=round(tokens / ms * 1e3, 1),
                back_to_back_ms=round(ahead_ms, 3),
                pct_of_floor_back_to_back=round(100 * floor / ahead_ms, 1) if floor else None,
                floor_mb=round(nbytes / 2**20, 3), floor_ms=round(floor, 3), adapter_mb=round(lora_bytes / 2**20, 3),
                adapter_floor_ratio=round((nbytes + lora_bytes) / nbytes, 4) if nbytes else None,
                pct_of_floor=round(100 * floor / ms, 1) if floor else None, lockstep_floor_ms=round(lock_floor, 3),
                pct_of_lockstep_floor_back_to_back=round(100 * lock_floor / ahead_ms, 1) if floor else None,
                peak_mb=round(torch.cuda.max_memory_allocated() / 2**20) if cuda else 0, **mixed,
                **(dict(kernels=kernels) if kernels else {}))


CONFIG_CLASSES = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}


def run_hf(hf: dict, args, device, dtype) -> list[dict]:
    """transformers (+ PEFT) on the same shape in one process: a decode step of --batch sequences after a prefill of
    --context random tokens each (greedy, the model's own KV cache), median of --iters after --warmup; without
    adapters, then with --adapters rank --rank adapters mixed in the batch (`adapter_names`) on the attention
    projections only: PEFT refuses mixed-adapter batches over 3D expert weights (`target_parameters`, the layout
    transformers 5 gives MoE experts)."""
    import peft
    import transformers
    cfg = getattr(transformers, CONFIG_CLASSES[hf["model_type"]])(
        **{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, hf["vocab_size"], (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cuda = device.type == "cuda"
    rows = []
    for n in (0, args.adapters):
        m, kw = model, {}
        if n:
            lc = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, init_lora_weights=False,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            m = peft.get_peft_model(model, lc, adapter_name="a0")
            for i in range(1, n):
                m.add_adapter(f"a{i}", lc)
            m.eval()
            kw = dict(adapter_names=[f"a{i % n}" for i in range(args.batch)])
        times = []
        with torch.no_grad():
            out = m(input_ids=ids, use_cache=True, **kw)
            for _ in range(args.warmup + args.iters):
                tok = out.logits[:, -1:].argmax(-1)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = m(input_ids=tok, past_key_values=out.past_key_values, use_cache=True, **kw)
                if cuda:
                    torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
        ms = statistics.median(times[args.warmup:])
        rows.append(dict(system=f"transformers {transformers.__version__} + PEFT {peft.__version__}", adapters=n,
                         lora_on="attention" if n else "-", batch=args.batch, ms=round(ms, 3),
                         tokens_per_s=round(args.batch / ms * 1e3, 1)))
    del model, m
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--layouts", default=None, help=f"names from {sorted(LAYOUTS)} (default by ranks: "
                                                     f"{DEFAULT_LAYOUTS})")
    ap.add_argument("--batch", type=int, default=32, help="decode sequences per attention replica")
    ap.add_argument("--context", type=int, default=512, help="position of the decoded token")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false")
    ap.add_argument("--profile", action="store_true",
                    help="each case's kernels per graphed decode step (and mixed step, with --prefill; "
                         "torch.profiler, GPU): a table side by side")
    ap.add_argument("--nccl-layouts", default="",
                    help="also run these layouts (no adapters) with parallel.allreduce=nccl: every collective on "
                         "NCCL, beside the default rows' peer-memory path")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time a mixed step: batch - 1 decodes + one chunk of this many prompt tokens")
    ap.add_argument("--hf", action="store_true",
                    help="also time transformers + PEFT on the same shape (one process, layout tp1)")
    ap.add_argument("--out", default="bench_results/moe_decode")
    ap.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU + gloo works)")
    ap.add_argument("--lora-modes", default="default",
                    help="comma list of default | fully_sharded: the adapter rows once per LoRA mode "
                         "(lora.fully_sharded=true: A split on the rank dim, the shrink outputs all-gathered)")
    ap.add_argument("--quantization", default="none",
                    help="comma list of none | fp8 | fp8_experts: each layout's rows once per value (fp8: every "
                         "linear layer and expert quantized per channel, as quantization=fp8 does at load; "
                         "fp8_experts: the experts alone, attention in bf16)")
    args = ap.parse_args()
    if set(args.quantization.split(",")) - {"none", "fp8", "fp8_experts"}:
        ap.error(f"--quantization {args.quantization!r}: expected a comma list of none, fp8, fp8_experts")
    if args.smoke:
        args.model, args.batch, args.context, args.adapters, args.rank = "tiny", 4, 8, 2, 4
        args.iters, args.warmup = 2, 1
    cuda = torch.cuda.is_available() and not args.smoke
    ps0 = comm.init_parallel(1, "cuda" if cuda else "cpu")
    device = ps0.device
    world = ps0.world.size
    if args.layouts is None:
        if world not in DEFAULT_LAYOUTS:
            raise SystemExit(f"{world} ranks: name --layouts (defaults for {sorted(DEFAULT_LAYOUTS)} ranks)")
        args.layouts = DEFAULT_LAYOUTS[world]
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts {layout!r}: expected names from {sorted(LAYOUTS)}")
        if world % layout_ranks(layout):
            raise SystemExit(f"--layouts {layout}: spans {layout_ranks(layout)} ranks, which do not divide the "
                             f"{world} launched (torchrun --nproc_per_node)")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = dict(MODELS[args.model])
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    ops = get_backend("triton" if cuda else "torch", str(device))
    bandwidth = copy_bandwidth(device) if cuda else 0.0
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", dtype=str(dtype), ranks=ps0.world.size,
                copy_bandwidth_gb_s=round(bandwidth / 1e9, 1), context=args.context)
    rows = []
    modes = args.lora_modes.split(",")
    if set(modes) - {"default", "fully_sharded"}:
        raise SystemExit(f"--lora-modes {args.lora_modes!r}: expected default and / or fully_sharded")
    adapter_cases = [(args.adapters, m == "fully_sharded") for m in modes]
    cases = [(layout, n, "auto", q, fully) for layout in args.layouts.split(",") for q in args.quantization.split(",")
             for n, fully in [(0, False)] + adapter_cases]
    cases += [(layout, 0, "nccl", "none", False) for layout in args.nccl_layouts.split(",") if layout]
    for layout, n, allreduce, weights, fully in cases:
        rows.append(dict(model=args.model, layers=hf["num_hidden_layers"],
                         **run_case(hf, layout, n, args, device, dtype, ops, bandwidth, allreduce, weights, fully)))
        if ps0.is_driver:
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("kernels")}), flush=True)
            write(args.out, meta, rows, [])  # a run cut short keeps the cases done
        gc.collect()  # the LoRA runtime and its layers reference each other: free the model before the next
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    hf_rows = run_hf(hf, args, device, dtype) if args.hf and ps0.world.size == 1 else []
    if ps0.is_driver:
        write(args.out, meta, rows, hf_rows)
        print(f"{meta['device']}, copy bandwidth {meta['copy_bandwidth_gb_s']} GB/s (read + write)")
        print(table(rows))
        for key in ("kernels", "mixed_kernels"):
            if any(key in r for r in rows):
                print(kernel_table(rows, key))
        for r in hf_rows:
            print(f"{r['system']}: {r['adapters']} adapters (LoRA on {r['lora_on']}), batch {r['batch']}: "
                  f"{r['ms']:.3f} ms/step, {r['tokens_per_s']:.0f} tokens/s")
    comm.shutdown()


def write(out: str, meta: dict, rows: list[dict], hf_rows: list[dict]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_moe_decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, transformers=hf_rows), f, indent=1)


def row_name(r: dict) -> str:
    return (f"{r['layout']}{'' if r['collectives'] == 'auto' else ' ' + r['collectives']}"
            f"{'' if r['weights'] == 'none' else ' ' + r['weights']} {r['adapters']}a{' fs' * r['fully_sharded']}")


# (kind, name substrings) in match order: the kernel table's rows
KINDS = (("step inputs (memcpy, memset)", ("Memcpy", "Memset")),
         ("expert grouped GEMM (ours, torch's)", ("_grouped_mm", "GroupProblemShape", "prepare_grouped_gemm")),
         ("MoE LoRA shrink + expand", ("moe_shrink", "moe_expand", "moe_fused")),
         ("dense LoRA shrink + expand", ("shrink_rows", "expand_rows", "shrink_kernel", "expand_kernel")),
         ("EP dispatch: peer all-gather", ("_all_gather_kernel",)),
         ("NCCL all-gather (EP counts / dispatch, tp logits)", ("AllGather",)),
         ("combine / MoE all-reduce: peer kernels, NCCL", ("_all_reduce_kernel", "two_shot", "ReduceScatter",
                                                            "AllReduce")),
         ("fused all-reduce + add + RMSNorm", ("_reduce_add_rms",)),
         ("attention", ("_decode_kernel", "_varlen")),
         ("dense GEMMs (qkv, o, LM head)", ("nvjet", "splitKreduce", "gemm", "cutlass", "_w8a16")),
         ("routing (top-k, the plan)", ("_moe_topk", "_rank_kernel", "_blocks_kernel", "searchsorted", "RadixSort")),
         ("the token draw (race, shards' combine)", ("_race_kernel", "_combine_kernel")),
         ("pack, combine, act, norms, rope (Triton)", ("_pack_kernel", "_moe_combine", "_act_mul", "_add_rms_norm",
                                                       "_rope_write")))
OTHER = "torch elementwise / copies / fills / gathers"


def kernel_table(rows: list[dict], key: str = "kernels") -> str:
    """Rank 0's µs per graphed decode step (key "kernels"; "mixed_kernels": per mixed step) by kind of kernel:
    device time / time on the critical path (launches in brackets), one column per profiled case, then the sums
    beside the step's wall time (the rest: the host's part of the step, gaps between kernels)."""
    cases = [r for r in rows if key in r]
    mixed = key == "mixed_kernels"
    sums = []
    for r in cases:
        kinds = {}
        for name, (us, n, marginal) in r[key].items():
            kind = next((k for k, subs in KINDS if any(x in name for x in subs)), OTHER)
            got = kinds.setdefault(kind, [0.0, 0.0, 0.0])
            got[0], got[1], got[2] = got[0] + us, got[1] + n, got[2] + marginal
        sums.append(kinds)
    lines = [f"| {'mixed-step ' if mixed else ''}kernels | " + " | ".join(row_name(r) for r in cases) + " |",
             "|---" * (len(cases) + 1) + "|"]
    for kind in [k for k, _ in KINDS] + [OTHER]:
        if any(kind in k for k in sums):
            lines.append(f"| {kind} | " + " | ".join(
                "-" if kind not in k else f"{k[kind][0]:.0f} / {k[kind][2]:.0f} ({k[kind][1]:g})" for k in sums) + " |")
    lines.append("| sum of kernels | " + " | ".join(
        f"{sum(v[0] for v in k.values()):.0f} / {sum(v[2] for v in k.values()):.0f}" for k in sums) + " |")
    lines.append("| step (wall, slowest rank) | " + " | ".join(
        f"{1e3 * r['mixed_ms' if mixed else 'ms']:.0f}" for r in cases) + " |")
    return "\n".join(lines)


def mixed_cell(r: dict) -> str:
    if "mixed_ms" not in r:
        return "-"
    graph = f"{r['mixed_ms']:.3f}" if r["mixed_graphs"] else "(eager)"
    return f"{graph} / {r['mixed_eager_ms']:.3f}"


def table(rows: list[dict]) -> str:
    head = ("| model | layers | layout | weights | adapters | graphs | batch/replica | ms/step | tokens/s | "
            "floor MB/rank | floor ms | % of floor | back to back ms (% of floor) | peak MB | "
            "mixed step ms (graph / eager) |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        pct = "-" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.1f}%"
        layout = r["layout"] + ("" if r["collectives"] == "auto" else f" ({r['collectives']})")
        adapters = f"{r['adapters']} x r{r['rank']}" + (" fully sharded" if r["fully_sharded"] else "")
        if r["adapters"] and r.get("adapter_floor_ratio"):
            adapters += f" (floor {r['adapter_floor_ratio']:.3f}x)"
        lines.append(f"| {r['model']} | {r['layers']} | {layout} | {r['weights']} | {adapters} | "
                     f"{'yes' if r['graphs'] else 'no'} | {r['batch_per_replica']} | {r['ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['floor_mb']:.1f} | {r['floor_ms']:.3f} | {pct} | "
                     f"{r['back_to_back_ms']:.3f} ({r['pct_of_floor_back_to_back'] or 0:.1f}%) | {r['peak_mb']} | "
                     f"{mixed_cell(r)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
