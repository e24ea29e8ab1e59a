"""The engine's decode step against its memory floor, on one GPU (or TP ranks under torchrun).

    python scripts/bench_step.py --out DIR [--shapes llama-2048,llama3-8b] [--batches 1,32,128] [--contexts 128,2048]
    torchrun --nproc_per_node=2 scripts/bench_step.py --tp 2 --shapes llama3-8b --out DIR

Shapes (random bf16 weights, written once under --cache): llama-2048 (16 layers, hidden 2048, GQA 32/8, vocab 32000)
and llama3-8b (32 layers, hidden 4096, intermediate 14336, GQA 32/8, vocab 128256); llama3-70b-8l and -32l (8 / 32
layers of the 70B shape: hidden 8192, intermediate 28672, GQA 64/8, vocab 128256; the step's fixed costs weigh less
over 32) have random weights drawn in memory at load (no checkpoint on disk; --in-memory: every shape). For each batch x context, without
adapters and with 32 distinct rank-16 adapters on all seven projections (one per sequence, round-robin):
- decode step: the mean wall time of the decode-only steps of all `batch` sequences (one new token each) of the last
  of --reps runs generating --new tokens more than the steps the prompts take to fill (so about --new steps decode
  the whole batch, at any context), each run one engine.generate() with every prompt `context` tokens long, per
  step from its launch, or the previous step's tokens on the host when later (steps launched ahead overlap), to its
  own sampled tokens on the host (host work included; at these sizes every decode step replays a CUDA graph). Where
  the prompts take several steps, sequences start decoding (and finish) at different steps: only steps of the whole
  batch count. Every run draws prompts of its own, so no run reuses another's cached prefix whatever
  --prefix-caching says (the JSON's prefix_hit_tokens counts the long run's cache hits: 0);
- floor: (bytes of the weights a step reads, the embedding table excepted, + bytes of the K/V it attends over at the
  decode's mean context, + with adapters the A and B of each distinct adapter in the batch) / the device copy
  bandwidth measured in the same run (read + written bytes / time); "of floor" = floor / decode step; "adapters /
  none" gives the floors' ratio beside the steps';
- prefill tokens/s: from the median of --reps runs generating one token.
With --mixed, also one step of 31 decodes + one 512-token prefill chunk, replayed from its CUDA graph and run eagerly,
against a 32-sequence decode step (the runner alone on steps built beforehand, CUDA events, medians; whether each
replayed a graph; and the host's time until execute() returns, its preparation and launches, during which a graph
step's GPU idles).
--quantization none,fp8 runs each shape once per value (fp8: the linear layers quantized at load, W8A8 on CUDA) and
--kv-cache-dtype auto,fp8 once per KV cache dtype; the floor counts the weights' and the cache's bytes as stored.
--torch-ops runs the decoder layers' norms, RoPE + cache write and activations as torch ops instead of the fused
Triton kernels (tp_lora/ops/fused.py). --allreduce sets parallel.allreduce (auto | nccl | symm_mem).
--kernels: the device time per kernel of one graphed decode step of 32 sequences at each --contexts (torch.profiler
over replays, this rank; without adapters, and unless --no-adapters-only with 32), by kernel and by kind (GEMM,
attention, all-reduce, norm, ...), into the JSON; `--kernel-compare A.json B.json` prints two runs' tables side by
side (e.g. tp1 against tp2: what does not halve). Kernels launched early (tp_lora/ops/triton/pdl.py: the fp8 decode
chain on Hopper) count their wait for the kernel before, so their times overlap and can sum past the step; the
table's "roles" hold each kernel kind's (and each projection's GEMM's) marginal time on the step's critical path
(scripts/kernel_marginals.py), which sums to the step.
Prints a table; writes bench_step.json into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.assets import write_random_adapter, write_tiny_llama  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine import engine as engine_module  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402
from tp_lora.ops import fused  # noqa: E402
from kernel_marginals import role_table  # noqa: E402

SHAPES = {
    "llama-2048": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "llama3-70b-8l": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=8,
                          num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
    "llama3-70b-32l": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=32,
                           num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0),
    "smoke": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}
IN_MEMORY = {"llama3-70b-8l", "llama3-70b-32l"}  # shapes whose random weights are drawn at load (every shape with --in-memory)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS, RANK = 32, 16


def write_random_llama(path: str, shape: dict, max_pos: int, dev: str = "cuda") -> None:
    """A bf16 Llama checkpoint with random weights drawn on the GPU (write_tiny_llama draws on the CPU: minutes for
    an 8B model), one safetensors file per layer."""
    from safetensors.torch import save_file
    from tp_lora.assets import tiny_llama_config
    cfg = tiny_llama_config(dtype=torch.bfloat16, max_position_embeddings=max_pos, **shape)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads

    def rnd(*dims, std=0.02, mean=0.0):
        return (torch.randn(*dims, device=dev, dtype=torch.bfloat16) * std + mean).cpu()

    os.makedirs(path, exist_ok=True)
    files = {"model-embed.safetensors": {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": rnd(h, mean=1.0),
                                         "lm_head.weight": rnd(v, h, std=2 * h ** -0.5)}}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        files[f"model-layer{i:03d}.safetensors"] = {
            p + "input_layernorm.weight": rnd(h, mean=1.0), p + "post_attention_layernorm.weight": rnd(h, mean=1.0),
            p + "self_attn.q_proj.weight": rnd(heads * hd, h, std=h ** -0.5),
            p + "self_attn.k_proj.weight": rnd(kv * hd, h, std=h ** -0.5),
            p + "self_attn.v_proj.weight": rnd(kv * hd, h, std=h ** -0.5),
            p + "self_attn.o_proj.weight": rnd(h, heads * hd, std=h ** -0.5),
            p + "mlp.gate_proj.weight": rnd(inter, h, std=h ** -0.5),
            p + "mlp.up_proj.weight": rnd(inter, h, std=h ** -0.5),
            p + "mlp.down_proj.weight": rnd(h, inter, std=inter ** -0.5)}
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def fill_random(model, reader=None) -> None:
    """Random weights in place of a checkpoint (IN_MEMORY shapes): 1-dim parameters (norms) 1, matrices
    N(0, 1 / in_features), the embedding N(0, 0.02); fp8 matrices N(0, 1) with that std as their scale; LoRA slots
    untouched. Replaces engine's load_weights."""
    gen = torch.Generator(device=model.device).manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        std = 0.02 if "embed" in name else p.shape[-1] ** -0.5
        if p.dim() == 1:
            p.data.fill_(1.0)
        elif p.dtype == torch.float8_e4m3fn:
            p.data.copy_(torch.randn(p.shape, generator=gen, device=p.device))
            model.get_submodule(name.rpartition(".")[0]).weight_scale.fill_(std)
        elif p.dtype.is_floating_point:
            p.data.normal_(0.0, std, generator=gen)


def assets(cache: str, shape: str, max_pos: int, adapters_too: bool = True) -> tuple[str, str | None]:
    model, adapters = os.path.join(cache, shape), os.path.join(cache, f"{shape}-adapters-{ADAPTERS}x{RANK}")
    config = os.path.join(model, "config.json")
    if not os.path.exists(config):
        if shape in IN_MEMORY:
            from tp_lora.assets import tiny_llama_config
            os.makedirs(model, exist_ok=True)
            with open(config, "w") as f:
                json.dump(tiny_llama_config(dtype=torch.bfloat16, max_position_embeddings=max_pos,
                                            **SHAPES[shape]), f)
        elif torch.cuda.is_available():
            write_random_llama(model, SHAPES[shape], max_pos)
        else:
            write_tiny_llama(model, dtype=torch.bfloat16, max_position_embeddings=max_pos, **SHAPES[shape])
    with open(config) as f:
        hf = json.load(f)
    if hf["max_position_embeddings"] < max_pos:  # written by a run of shorter contexts: the weights serve any
        hf["max_position_embeddings"] = max_pos
        with open(config, "w") as f:
            json.dump(hf, f)
    if not adapters_too:
        return model, None
    for i in range(ADAPTERS):
        path = os.path.join(adapters, f"a{i:03d}")
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            write_random_adapter(path, model, r=RANK, lora_alpha=2 * RANK, seed=i, target_modules=TARGETS,
                                 dtype=torch.bfloat16)
    return model, adapters


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB (median of 20)."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * (1 << 30) / statistics.median(times[5:])


def weight_bytes(model) -> int:
    """Bytes of this rank's base weights a decode step reads: all but the embedding table (only B rows of it) and
    the LoRA slots."""
    emb = {id(p) for p in model.embed_tokens.parameters()} if not model.tied else set()
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if id(p) not in emb and "lora_" not in n)


def adapter_bytes(model) -> int:
    """Bytes of one adapter slot's A and B stacks on this rank (what a step reads per distinct adapter)."""
    return sum(p[0].numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


def print_kernels(run, label: str, rows: int = 16, show: bool = True) -> None:
    """The CUDA kernels of 3 calls of run() (torch.profiler), by total device time; every rank profiles (collectives
    inside run() need all of them), `show` ranks print."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    if show:
        print(f"kernels of 3 {label}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))


def kv_bytes(model, batch: int, context: float) -> float:
    return 2 * len(model.layers) * model.kv_heads * model.head_dim * model.kv_dtype.itemsize * batch * context


def requests(batch: int, context: int, new: int, vocab: int, adapters: bool, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [Request(i, id=i, adapter=f"a{i % ADAPTERS:03d}" if adapters else None,
                    prompt_token_ids=torch.randint(3, vocab, (context,), generator=gen).tolist(),
                    max_new_tokens=new, ignore_eos=True) for i in range(batch)]


def timed(engine, reqs) -> float:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    bad = [r.error for r in res if r.error]
    if bad:
        raise RuntimeError(bad[0])
    return time.perf_counter() - t0


def _ms(fn) -> float:
    """Milliseconds fn() takes on the device (CUDA events), or on the host's clock on CPU."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def runner_batch(vocab: int, tables: list[list[int]], slot, gen, mixed: bool, context: int):
    """A runner step of 32 sequences at `context` (block tables `tables`, adapter slot(i)): one new token each, or
    (mixed) 31 decodes and a 512-token prefill chunk."""
    from tp_lora.engine.runner import StepBatch
    step = StepBatch()
    for i in range(32):
        n = 512 if mixed and i == 31 else 1
        step.add(torch.randint(3, vocab, (n,), generator=gen).tolist(), tables[i], 0 if n > 1 else context, slot(i))
    return step


def slots_of(engine, adapters: bool):
    """Sequence i -> its adapter slot in a runner step: with adapters i % max_loras, every slot loaded with one of
    the bench's adapters; else none (-1)."""
    if not adapters:
        return lambda i: -1
    for i in range(engine.cfg.lora.max_loras):
        engine.registry.cache.load_slot(engine.registry.slots, i, engine.registry.cache.fetch(f"a{i:03d}"))
    return lambda i: i % engine.cfg.lora.max_loras


def mixed_step(engine, vocab: int, adapters: bool, profile: bool) -> dict:
    """Runner-level: one step of 31 decodes (context 128) + one 512-token prefill chunk, replayed from a graph and run
    eagerly (mixed graphs off), against a decode step of 32 sequences (a graph replay) at context 128 and 2048,
    CUDA-event medians, each with whether its last run replayed a graph. profile: the kernels of the decode step at
    context 2048 and of the graphed mixed step (torch.profiler over replays), printed."""
    bs = engine.cfg.scheduler.kv_block_size
    per_seq = -(-(2048 + 2) // bs)
    cache = engine.runner.kv_cache(32 * per_seq, bs, 2048 + 2)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(32)]
    slot = slots_of(engine, adapters)
    gen = torch.Generator().manual_seed(1)

    def batch(mixed: bool, context: int = 128):
        return runner_batch(vocab, tables, slot, gen, mixed, context)

    out = {}
    runner = engine.runner
    graphed_sizes = runner.mixed_sizes
    for name, mixed, context, sizes in (("decode_32", False, 128, graphed_sizes),
                                        ("mixed_31_plus_512", True, 128, graphed_sizes),
                                        ("mixed_31_plus_512_eager", True, 128, []),
                                        ("decode_32_ctx2048", False, 2048, graphed_sizes)):
        runner.mixed_sizes = sizes
        steps = [batch(mixed, context) for _ in range(12)]  # built beforehand: the scheduler's work, not the runner's
        host = []  # seconds until execute() returns: the host's share (preparation + launches)

        def run(step):
            t0 = time.perf_counter()
            runner.execute(step, cache)
            host.append(time.perf_counter() - t0)

        times = [_ms(lambda: run(step)) for step in steps]
        out[name + "_ms"] = statistics.median(times[2:])
        out[name + "_host_ms"] = statistics.median(host[2:]) * 1e3
        out[name + "_replayed"] = runner.replayed
    runner.mixed_sizes = graphed_sizes
    out["ratio"] = out["mixed_31_plus_512_ms"] / out["decode_32_ms"]
    out["eager_ratio"] = out["mixed_31_plus_512_eager_ms"] / out["decode_32_ms"]
    if profile and torch.cuda.is_available():
        for what, mixed, context in (("decode steps at context 2048", False, 2048),
                                     ("graphed mixed steps (31 decodes + 512 prefill)", True, 128)):
            print_kernels(lambda: runner.execute(batch(mixed, context), cache),
                          f"{what} ({'with' if adapters else 'no'} adapters)", rows=14)
    return out


KINDS = (("all-reduce + norm (fused)", ("reduce_add_rms_norm",)),
         ("all-gather", ("all_gather", "allgather")),
         ("all-reduce", ("nccl", "allreduce", "all_reduce", "two_shot")),
         ("add + RMSNorm", ("rms_norm",)),
         ("attention", ("attention", "attn", "paged", "flash", "_decode_kernel", "varlen")),
         ("RoPE + KV write", ("rope",)),
         ("act * mul", ("act_mul",)),
         ("LoRA", ("shrink", "expand", "lora", "sgmv")),
         ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "matmul", "splitk", "ampere", "w8a16", "w8a8",
                   "grouped_mm")),
         ("copy / fill", ("copy", "fill", "memcpy", "memset", "elementwise")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_table(engine, vocab: int, contexts: list[int], adapters: bool, steps: int = 20) -> dict:
    """Device microseconds per kernel (and per kind) of one graphed decode step of 32 sequences (with adapters: one
    each, slots_of) at each context: torch.profiler over `steps` replays on this rank, against the step's CUDA-event
    time."""
    from torch.profiler import ProfilerActivity, profile
    runner, bs = engine.runner, engine.cfg.scheduler.kv_block_size
    per_seq = -(-(max(contexts) + 2) // bs)
    cache = runner.kv_cache(32 * per_seq, bs, max(contexts) + 2)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(32)]
    gen = torch.Generator().manual_seed(2)
    slot, out = slots_of(engine, adapters), {}
    for ctx in contexts:
        batches = [runner_batch(vocab, tables, slot, gen, False, ctx) for _ in range(steps + 4)]
        for b in batches[:4]:
            runner.execute(b, cache)
        step_ms = statistics.median(_ms(lambda b=b: runner.execute(b, cache)) for b in batches[4:])
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for b in batches[4:]:
                runner.execute(b, cache)
            torch.cuda.synchronize()
        device = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if us and e.count:
                kernels[e.key] = dict(us=us / steps, calls=e.count / steps, kind=kernel_kind(e.key))
        kinds = {}
        for k in kernels.values():
            kind = kinds.setdefault(k["kind"], dict(us=0.0, calls=0.0))
            kind["us"] += k["us"]
            kind["calls"] += k["calls"]
        out[str(ctx)] = dict(step_us=step_ms * 1e3, replayed=runner.replayed, kernels=kernels, kinds=kinds,
                             roles=role_table(device, kernel_kind, steps))
    return out


def kernel_compare(paths: list[str], top: int = 14) -> None:
    """Two runs' kernel tables (bench_step.json of runs with --kernels) side by side, per kind and the top kernels:
    microseconds per decode step, and B's time over A's (0.5: halved)."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    a, b = runs
    label = [f"tp{r['tp']} {r.get('allreduce', '')}" for r in runs]
    for shape, ka in a.get("kernels", {}).items():
        kb = b.get("kernels", {}).get(shape, {})
        for ctx, ta in ka.items():
            tb = kb.get(ctx)
            if tb is None:
                continue
            print(f"{shape} decode step, batch 32, ctx {ctx}, {a['device']}: {label[0]} {ta['step_us']:.0f} us, "
                  f"{label[1]} {tb['step_us']:.0f} us ({tb['step_us'] / ta['step_us']:.2f}); per step, us (calls):")
            print(f"| kind | {label[0]} | {label[1]} | ratio |\n|---|---|---|---|")
            for kind in sorted(set(ta["kinds"]) | set(tb["kinds"]), key=lambda k: -ta["kinds"].get(k, {"us": 0})["us"]):
                x, y = ta["kinds"].get(kind, dict(us=0, calls=0)), tb["kinds"].get(kind, dict(us=0, calls=0))
                ratio = f"{y['us'] / x['us']:.2f}" if x["us"] else "-"
                print(f"| {kind} | {x['us']:.0f} ({x['calls']:.0f}) | {y['us']:.0f} ({y['calls']:.0f}) | {ratio} |")
            print(f"| kernels' sum | {sum(k['us'] for k in ta['kinds'].values()):.0f} | "
                  f"{sum(k['us'] for k in tb['kinds'].values()):.0f} | |")
            print("marginal us per step by role (the critical path; kernel_marginals.py), A / B:")
            for role in sorted(set(ta.get("roles", {})) | set(tb.get("roles", {})),
                               key=lambda r: -ta.get("roles", {}).get(r, {"marginal_us": 0})["marginal_us"]):
                x, y = (t.get("roles", {}).get(role, dict(marginal_us=0.0, calls=0.0)) for t in (ta, tb))
                print(f"  {role}: {x['marginal_us']:.0f} ({x['calls']:.0f}) / "
                      f"{y['marginal_us']:.0f} ({y['calls']:.0f})")
            for name, t in (("A", ta), ("B", tb)):
                print(f"top kernels of {name} ({label[0 if name == 'A' else 1]}): us per step, calls, us per call")
                for k, v in sorted(t["kernels"].items(), key=lambda kv: -kv[1]["us"])[:top]:
                    per_call = v["us"] / max(v["calls"], 1)
                    print(f"  {v['us']:8.1f} {v['calls']:5.0f} {per_call:7.2f}  [{v['kind']}] {k[:90]}")


def scaling_table(paths: list[str]) -> None:
    """The decode step of earlier runs' bench_step.json files by tp and all-reduce, each against the tp1 run among
    them (same shape, batch, context; no adapters / 32 adapters); with their kernel tables (--kernels), the graphed
    step of each tp too."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    base = next(r for r in runs if r["tp"] == 1)

    def steps(run, adapters):
        return {(r["shape"], r["batch"], r["context"]): r["decode_step_ms"] for r in run["rows"]
                if r["adapters"] == adapters and r["decode_step_ms"]}

    keys = sorted(steps(base, False))
    print(f"decode step ms (x faster than tp1), {base['device']}; columns: "
          + ", ".join(f"{s} batch {b} ctx {c}" for s, b, c in keys) + "; then the same with 32 adapters")
    print("| tp | all-reduce | " + " | ".join(f"ctx {c}" for _, _, c in keys) + " | "
          + " | ".join(f"adapters, ctx {c}" for _, _, c in keys) + " |")
    print("|---|---|" + "---|" * (2 * len(keys)))
    for run in sorted(runs, key=lambda r: (r["tp"], r.get("allreduce", ""))):
        cells = []
        for adapters in (False, True):
            mine, ref = steps(run, adapters), steps(base, adapters)
            cells += [f"{mine[k]:.2f} ({ref[k] / mine[k]:.2f}x)" if k in mine and k in ref else "-" for k in keys]
        print(f"| {run['tp']} | {run.get('allreduce', 'nccl')} | " + " | ".join(cells) + " |")
    graphed = {run["tp"]: {c: t["step_us"] for c, t in next(iter(run["kernels"].values())).items()}
               for run in runs if run.get("kernels")}
    if 1 in graphed:  # runs with --kernels: the runner's graphed step alone, a median of replays (no host work)
        ctxs = sorted(graphed[1], key=int)
        print("graphed decode step, us (x faster than tp1): " + ", ".join(
            f"tp{tp} " + " / ".join(f"ctx {c} {g[c]:.0f} ({graphed[1][c] / g[c]:.2f}x)" for c in ctxs if c in g)
            for tp, g in sorted(graphed.items())))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scaling", nargs="+", metavar="JSON",
                   help="print the tp scaling table of these earlier runs' bench_step.json files and exit")
    p.add_argument("--kernel-compare", nargs=2, metavar="JSON",
                   help="print two earlier --kernels runs' kernel tables side by side and exit")
    p.add_argument("--kernels", action="store_true", help="the kernel table of a graphed decode step (see above)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tp_lora/bench_step"))
    p.add_argument("--shapes", default="llama-2048,llama3-8b")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="128,2048")
    p.add_argument("--new", type=int, default=33,
                   help="whole-batch decode steps the long run aims for (the short one makes 1 token)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mixed", action="store_true")
    p.add_argument("--profile", action="store_true", help="with --mixed: print the decode step's kernels")
    p.add_argument("--no-adapters-only", action="store_true")
    p.add_argument("--prefix-caching", default="on", choices=["on", "off"],
                   help="scheduler.prefix_caching (on: the KV cache takes the whole budget)")
    p.add_argument("--quantization", default="none", help="comma list of none | fp8 (weights quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto", help="comma list of auto | fp8")
    p.add_argument("--lora-dtype", default="auto", choices=["auto", "fp8"],
                   help="lora.dtype: the adapters' A and B as the model's dtype, or fp8 with per-channel scales")
    p.add_argument("--allreduce", default="auto", choices=["auto", "nccl", "symm_mem"],
                   help="parallel.allreduce: the tp group's all-reduce")
    p.add_argument("--in-memory", action="store_true",
                   help="every shape's random weights drawn at load, none written to --cache (adapters still are)")
    p.add_argument("--no-peer-kernels", action="store_true",
                   help="A/B: with symm_mem, the all-reduce apart from the norm after it and NCCL all-gathers")
    p.add_argument("--torch-ops", action="store_true",
                   help="norms, RoPE + cache write and activations in torch, not the fused Triton kernels (A/B)")
    args = p.parse_args()
    if args.scaling:
        scaling_table(args.scaling)
        return
    if args.kernel_compare:
        kernel_compare(args.kernel_compare)
        return
    fused.KERNELS = False if args.torch_ops else None
    if args.in_memory:
        IN_MEMORY.update(SHAPES)
    if args.no_peer_kernels:
        comm.fused_peer = lambda t, group: None
        comm.PeerAllReduce.takes_gather = lambda self, t, world: False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps = comm.init_parallel(args.tp, device, allreduce=args.allreduce)
    allreduce = "symm_mem" if ps.tp.peer is not None else "nccl" if ps.tp.size > 1 else "none"
    allreduce += " unfused" if args.no_peer_kernels and ps.tp.peer is not None else ""
    bw = copy_bandwidth(ps.device)
    seeds = itertools.count()  # a seed per generate(): prompts never repeat, so no run hits another's prefix cache
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows, extra, kernels = [], {}, {}
    step_tokens = max(4096, max(batches))  # scheduler.max_tokens_per_step

    def long_run(b: int, ctx: int) -> int:
        """Tokens each sequence of the long run makes: --new past the steps that b prompts of ctx take to fill."""
        return args.new + -(-b * ctx // step_tokens)
    longest = max(contexts) + long_run(max(batches), max(contexts)) + 8
    variants = [(q, kv) for q in args.quantization.split(",") for kv in args.kv_cache_dtype.split(",")]
    for shape, (quant, kv_dtype) in ((s, v) for s in args.shapes.split(",") for v in variants):
        if ps.is_driver:  # one writer; the other ranks read what it wrote
            assets(args.cache, shape, longest, not args.no_adapters_only)
        comm.all_gather_object(None, ps.world)  # a barrier
        model_dir, adapter_dir = assets(args.cache, shape, longest, not args.no_adapters_only)
        cfg = RunConfig()
        cfg.parallel.tp_size = ps.tp.size
        cfg.device = device
        cfg.dtype = "bfloat16" if device == "cuda" else "float32"
        cfg.lora.max_loras, cfg.lora.max_rank = ADAPTERS, RANK
        cfg.lora.dtype = args.lora_dtype
        cfg.scheduler.max_batch_size = max(batches)
        cfg.scheduler.max_tokens_per_step = step_tokens
        cfg.quantization = None if quant == "none" else quant
        cfg.scheduler.kv_cache_dtype = kv_dtype
        cfg.scheduler.prefix_caching = args.prefix_caching == "on"
        load = engine_module.load_weights, engine_module.CheckpointReader
        if shape in IN_MEMORY:
            engine_module.load_weights, engine_module.CheckpointReader = fill_random, lambda path: None
        try:
            engine = Engine(cfg, ps, model_dir, adapter_dir)
        finally:
            engine_module.load_weights, engine_module.CheckpointReader = load
        vocab = engine.hf["vocab_size"]
        wb, ab = weight_bytes(engine.model), adapter_bytes(engine.model)
        for with_ad in ([False] if args.no_adapters_only else [False, True]):
            engine.generate(requests(min(batches), 16, 3, vocab, with_ad, next(seeds)))  # warm-up: compile, capture
            for b in batches:
                for ctx in contexts:
                    engine.generate(requests(b, ctx, 3, vocab, with_ad, next(seeds)))  # this size's graphs, kernels
                    ones = []
                    for _ in range(args.reps):
                        ones.append(timed(engine, requests(b, ctx, 1, vocab, with_ad, next(seeds))))
                        st = dataclasses.replace(engine.stats)
                        full0 = list(engine.stats.decode_by_rows.get(b, [0, 0.0]))
                        timed(engine, requests(b, ctx, long_run(b, ctx), vocab, with_ad, next(seeds)))  # errors raise
                    # The last long run: steps replayed from graphs (prefill too), and the count and mean wall time
                    # (host included) of its decode-only steps of the whole batch.
                    graph_steps = engine.stats.graph_steps - st.graph_steps
                    hits = engine.stats.prefix_hit_tokens - st.prefix_hit_tokens  # 0: the run computed its prompts
                    full = engine.stats.decode_by_rows.get(b, [0, 0.0])
                    decode_steps = full[0] - full0[0]
                    decode_ms = 1e3 * (full[1] - full0[1]) / decode_steps if decode_steps else None
                    t1 = statistics.median(ones)
                    lora_b = min(b, ADAPTERS) * ab if with_ad else 0
                    floor = (wb + lora_b + kv_bytes(engine.model, b, ctx + long_run(b, ctx) - args.new / 2)) / bw
                    rows.append(dict(shape=shape, quantization=quant, kv_cache_dtype=kv_dtype, adapters=with_ad,
                                     lora_dtype=args.lora_dtype, batch=b, context=ctx,
                                     floor_ms=floor * 1e3, of_floor=floor / (decode_ms / 1e3) if decode_ms else None,
                                     prefill_tokens_per_s=b * ctx / t1,
                                     graph_steps=graph_steps, decode_steps=decode_steps, decode_step_ms=decode_ms,
                                     prefix_hit_tokens=hits, one_token_runs_s=ones))
                    if ps.is_driver:  # as measured, so a run cut short still shows its rows
                        print("row", json.dumps(rows[-1]), flush=True)
        if args.kernels and device == "cuda":  # one table per engine: every weight and cache dtype keeps its own
            label = shape if (quant, kv_dtype) == ("none", "auto") else f"{shape} {quant} kv={kv_dtype}"
            kernels[label] = kernel_table(engine, vocab, contexts, False)
            if not args.no_adapters_only:
                kernels[f"{label} adapters"] = kernel_table(engine, vocab, contexts, True)
        if args.mixed:
            extra[f"{shape} {quant} kv={kv_dtype}"] = {"no_adapters": mixed_step(engine, vocab, False, args.profile),
                            "adapters": mixed_step(engine, vocab, True, args.profile)}
        engine.close()
        del engine
        torch.cuda.empty_cache() if device == "cuda" else None
    comm.shutdown()
    if not ps.is_driver:
        return
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, tp={ps.tp.size} (all-reduce "
          f"{allreduce}), copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read + written), layer ops {'torch' if args.torch_ops else 'fused'}")
    head = ("| shape | weights | kv | adapters | batch | context | floor ms | of floor | adapters / none | "
            "prefill tok/s | graph steps | decode steps | decode step ms |")
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    def key(r):
        return r["shape"], r["quantization"], r["kv_cache_dtype"], r["batch"], r["context"]

    base = {key(r): r for r in rows if not r["adapters"]}
    for r in rows:
        none = base[key(r)]
        ratio = r["vs_no_adapters"] = (r["decode_step_ms"] / none["decode_step_ms"]
                                       if r["decode_step_ms"] and none["decode_step_ms"] else None)
        r["floor_vs_no_adapters"] = r["floor_ms"] / none["floor_ms"]
        print(f"| {r['shape']} | {r['quantization']} | {r['kv_cache_dtype']} | {32 if r['adapters'] else 0} | {r['batch']} | {r['context']} | "
              f"{r['floor_ms']:.3f} | {'-' if r['of_floor'] is None else format(r['of_floor'], '.0%')} | "
              f"{'-' if ratio is None else format(ratio, '.2f')} (floor {r['floor_vs_no_adapters']:.2f}) | "
              f"{r['prefill_tokens_per_s']:.0f} | "
              f"{r['graph_steps']} | {r['decode_steps']} | "
              f"{'-' if r['decode_step_ms'] is None else format(r['decode_step_ms'], '.3f')} |")
    for shape, m in extra.items():
        for k, v in m.items():
            print(f"runner {shape} {k}: decode 32 at context 128 {v['decode_32_ms']:.3f} ms, at 2048 "
                  f"{v['decode_32_ctx2048_ms']:.3f} ms; 31 decodes + 512 prefill {v['mixed_31_plus_512_ms']:.3f} ms "
                  f"({v['ratio']:.2f}x the decode step, graph replayed: {v['mixed_31_plus_512_replayed']}), eagerly "
                  f"{v['mixed_31_plus_512_eager_ms']:.3f} ms ({v['eager_ratio']:.2f}x); host until execute returns: "
                  f"decode {v['decode_32_host_ms']:.3f} ms, mixed {v['mixed_31_plus_512_host_ms']:.3f} ms")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_step.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", tp=ps.tp.size,
                       allreduce=allreduce, prefix_caching=args.prefix_caching,
                       copy_bandwidth=bw, fused_ops=not args.torch_ops, rows=rows, mixed=extra, kernels=kernels), f,
                  indent=2)


if __name__ == "__main__":
    main()
