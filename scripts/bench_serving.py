"""Serving benchmark with many adapters (S-LoRA style): Poisson arrivals over N adapters with power-law or uniform
popularity, mixed ranks, prompt / output lengths drawn from ranges. Measures, in one run:

  ours      tp_lora's engine: adapter cache (registry / host LRU / device slots), continuous batching, requests
            admitted as they arrive (Engine.generate(arrival_times=...))
  merged    one adapter at a time merged into the base weights (W + s B A), its waiting requests served as one
            continuously batched group, then the next adapter (what serving without multi-LoRA kernels does)
  peft      transformers + PEFT, every used adapter loaded, static batches with `adapter_names` (one process only,
            and only up to --peft-max-adapters adapters)
  server    (--server) the same trace through launch/serve.py (tp=--tp ranks, the same engine settings) with the
            async `openai` client streaming each request, from --clients processes (requests dealt round-robin, one
            start time); TTFT and TPOT measured at the client, and beside them the engine's own (the server's
            histograms), its step stats, and the busiest client's CPU share. The server is started once per adapter
            count and warmed up with the trace on its first adapter, as ours is (the CUDA graphs of LoRA steps are
            captured then, not in the measured run); its adapter cache is not reset between rates (the first rate's
            reads are cold but for that adapter's, later ones warm). Run the bench as one process for it: the bench
            starts the server's ranks itself (so `ours` there runs at tp=1 only).

and reports throughput (generated tokens/s over the whole trace), time to first token and time per output token
(mean, p50, p99), end-to-end latency, slot hit rate and swap time. Writes bench_serving.json, bench_serving.md and
bench_serving.png into --out.

    python scripts/bench_serving.py --smoke --out /tmp/bs                                  # CPU, < 1 minute
    python scripts/bench_serving.py --model llama-2048 --adapters 1,100,1000 --ranks 16 --out DIR
    torchrun --nproc_per_node=2 scripts/bench_serving.py --model llama-2048 --tp 2 --adapters 1,100,1000 --out DIR
    python scripts/bench_serving.py --server --systems ours,server --rate 4,16,0 --out DIR     # HTTP vs offline
    python scripts/bench_serving.py --server --systems server --tp 2 --rate 4,16,0 --out DIR   # HTTP at tp=2

--rate takes several rates (0 = all at once): every system runs the trace at each.

Adapters are real PEFT dirs: --distinct-weights random ones per rank written with tp_lora.assets.
write_random_adapter, the others hard links to them under their own names (same format, same bytes on disk; each
is still a separate adapter to every system). Assets are cached under --assets.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.assets import write_random_adapter, write_tiny_llama  # noqa: E402
from tp_lora.config import RunConfig, validate  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.stats import StepStats  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402
from tp_lora.lora.adapter import load_peft_adapter  # noqa: E402
from tp_lora.lora import cache as cache_module  # noqa: E402
from tp_lora.lora.cache import CacheStats  # noqa: E402
from tp_lora.server.channel import STEP_FIELDS  # noqa: E402
from tp_lora.sharding import shard_weight  # noqa: E402

PRESETS = {
    # Llama-shaped, 1.1B parameters (as scripts/bench_generate.py): 16 layers, hidden 2048, GQA 32/8 heads.
    "llama-2048": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SYSTEMS = ("ours", "merged", "peft", "server")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT_START_S = 0.5  # the client processes get their shares of the trace before its start time
SERVER_START_S = 1200.0  # checkpoint load, CUDA graph capture


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[bench_serving] {msg}", flush=True)


# ---- assets ---------------------------------------------------------------------------------------------------
def _wait_for(marker: str, what: str, limit_s: float = 3600) -> None:
    t0 = time.time()
    while not os.path.exists(marker):
        if time.time() - t0 > limit_s:
            raise TimeoutError(f"{what} not written by rank 0 within {limit_s}s ({marker} missing)")
        time.sleep(0.5)


def prepare_model(root: str, preset: str, dtype: torch.dtype) -> str:
    """The preset's checkpoint under root (written by rank 0 once; other ranks wait for it)."""
    path = os.path.join(root, f"model-{preset}-{str(dtype).removeprefix('torch.')}")
    marker = os.path.join(path, "config.json")  # write_tiny_llama writes config.json last
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(marker):
        log(f"writing the {preset} checkpoint to {path}")
        write_tiny_llama(path, dtype=dtype, seed=0, **PRESETS[preset])
    _wait_for(marker, "the model checkpoint")
    return path


def adapter_ranks(n: int, ranks: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(ranks) for _ in range(n)]


def prepare_adapters(root: str, model: str, n: int, ranks: list[int], distinct: int, dtype: torch.dtype,
                     seed: int) -> str:
    """n PEFT adapter dirs a00000.. with ranks drawn from `ranks`; `distinct` random weight sets per rank, the rest
    hard links to them."""
    dname = str(dtype).removeprefix("torch.")
    tag = f"{os.path.basename(model)}-n{n}-r{'_'.join(map(str, ranks))}-d{distinct}-s{seed}-{dname}"
    path = os.path.join(root, "adapters", tag)
    marker = os.path.join(path, ".complete")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(marker):
        log(f"writing {n} adapters to {path}")
        shutil.rmtree(path, ignore_errors=True)
        pool = os.path.join(root, "adapter-pool", f"{os.path.basename(model)}-{dname}")
        for i, r in enumerate(adapter_ranks(n, ranks, seed)):
            src = os.path.join(pool, f"r{r}-w{i % distinct}")
            if not os.path.exists(os.path.join(src, "adapter_model.safetensors")):
                write_random_adapter(src, model, r=r, lora_alpha=2 * r, seed=1000 * r + i % distinct,
                                     target_modules=TARGETS, dtype=dtype)
            dst = os.path.join(path, f"a{i:05d}")
            os.makedirs(dst)
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                try:
                    os.link(os.path.join(src, f), os.path.join(dst, f))
                except OSError:
                    shutil.copy(os.path.join(src, f), os.path.join(dst, f))
        open(marker, "w").close()
    _wait_for(marker, f"{n} adapters")
    return path


# ---- workload -------------------------------------------------------------------------------------------------
def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def make_trace(args, n_adapters: int, vocab: int) -> tuple[list[Request], list[float]]:
    """Requests with Poisson arrivals (rate args.rate per second), adapters by popularity, lengths uniform in the
    given ranges. The same on every rank (seeded)."""
    rng = random.Random(args.seed + n_adapters)
    names = [f"a{i:05d}" for i in range(n_adapters)]
    if args.popularity == "powerlaw":
        weights = [1.0 / (i + 1) ** args.alpha for i in range(n_adapters)]
    else:
        weights = [1.0] * n_adapters
    p0, p1 = _range(args.prompt_len)
    o0, o1 = _range(args.output_len)
    reqs, arrivals, t = [], [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate) if args.rate > 0 else 0.0
        adapter = rng.choices(names, weights)[0]
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(p0, p1))]
        reqs.append(Request(i, id=i, adapter=adapter, prompt_token_ids=prompt, max_new_tokens=rng.randint(o0, o1),
                            ignore_eos=True))
        arrivals.append(t)
    return reqs, arrivals


# ---- metrics --------------------------------------------------------------------------------------------------
def _stats(xs: list[float]) -> dict:
    if not xs:
        return dict(mean=None, p50=None, p99=None)
    s = sorted(xs)

    def pct(q):
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return dict(mean=sum(s) / len(s), p50=pct(0.5), p99=pct(0.99))


def summarize(timings: list[dict], t0: float) -> dict:
    """timings: per request {arrival, first_token, finished, tokens} (perf_counter seconds)."""
    ok = [t for t in timings if t.get("finished") is not None]
    tokens = sum(t["tokens"] for t in ok)
    span = max(t["finished"] for t in ok) - t0 if ok else float("nan")
    ttft = [t["first_token"] - t["arrival"] for t in ok]
    tpot = [(t["finished"] - t["first_token"]) / (t["tokens"] - 1) for t in ok if t["tokens"] > 1]
    e2e = [t["finished"] - t["arrival"] for t in ok]
    return dict(requests=len(ok), failed=len(timings) - len(ok), generated_tokens=tokens, seconds=span,
                tokens_per_s=tokens / span if span > 0 else None, ttft_s=_stats(ttft), tpot_s=_stats(tpot),
                e2e_s=_stats(e2e))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- systems --------------------------------------------------------------------------------------------------
def engine_cfg(args, ps: comm.ParallelState, lora: bool) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp_size = ps.tp.size
    cfg.parallel.timeout_s, cfg.parallel.host_threads = args.timeout, args.host_threads
    cfg.parallel.read_threads = args.read_threads
    cfg.device = ps.device.type
    cfg.dtype = "bfloat16" if ps.device.type == "cuda" else "float32"
    cfg.cuda_graphs = not args.no_graphs
    cfg.progress = False
    cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.lora.max_rank = args.max_loras, args.max_cpu_loras, \
        max(args.ranks)
    cfg.lora.fully_sharded, cfg.lora.dtype = args.fully_sharded, args.lora_dtype
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step = args.batch, args.tokens_per_step
    cfg.scheduler.kv_cache_mb = args.kv_cache_mb
    cfg.scheduler.admit_batch = args.admit_batch
    validate(cfg, ps.world.size)
    return cfg


def _warm_up(engine: Engine, batch: int, vocab: int, adapter: str | None, trace: list[Request]) -> None:
    """Staggered lengths sweep the decode batch from `batch` down to 1, so CUDA graphs of every size are captured
    outside the measured run; one request as long as the trace's longest sizes the KV cache for it (a cache that
    has to grow drops the captured graphs). Then the trace itself, untimed, with one adapter: the eager steps' token
    counts are new shapes to the GEMM and attention libraries, and a first pass over them can run slower (seen in
    one H200 run: eager steps 1.6x the time of the later passes)."""
    gen = random.Random(0)
    reqs = [Request(i, id=i, adapter=adapter if i % 2 else None, prompt_token_ids=[gen.randrange(3, vocab)
                                                                                     for _ in range(8)],
                    max_new_tokens=1 + i, ignore_eos=True) for i in range(batch)]
    reqs[0].prompt_token_ids = [3] * max(1, _row_len(trace) - 1)
    engine.generate(reqs)
    engine.generate([dataclasses.replace(r, adapter=adapter) for r in trace])
    _sync()


def _row_len(reqs) -> int:
    return max(len(r.prompt_token_ids) + r.max_new_tokens for r in reqs)


def run_ours(args, ps, model: str, adapters: str, reqs, arrivals, vocab) -> dict:
    """--repeats cold runs of the trace after one warm-up; the run with the median throughput is reported, with
    every run's throughput beside it."""
    engine = Engine(engine_cfg(args, ps, True), ps, model, adapters)
    _warm_up(engine, args.batch, vocab, reqs[0].adapter, reqs)
    runs = [_measured_run(args, ps, engine, reqs, arrivals) for _ in range(args.repeats)]
    engine.close()
    runs.sort(key=lambda r: r["tokens_per_s"] or 0.0)
    out = runs[len(runs) // 2]
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return out


def _measured_run(args, ps, engine: Engine, reqs, arrivals) -> dict:
    engine.registry.forget()
    engine.stats, engine.registry.cache.stats = StepStats(), CacheStats()
    _sync()
    t0 = time.perf_counter()
    if args.profile:
        results = _profiled(lambda: engine.generate(reqs, arrival_times=arrivals), args.out, ps)
    else:
        results = engine.generate(reqs, arrival_times=arrivals)
    _sync()
    timings = [dict(r.metrics, tokens=len(r.output_token_ids)) if r.error is None else {} for r in results]
    out = summarize(timings, t0)
    s, cs = engine.stats, engine.registry.cache.stats
    out.update(slot_hit_rate=s.slot_hit_rate, slot_loads=s.adapter_loads, disk_reads=cs.host_misses,
               host_hit_rate=cs.host_hits / max(1, cs.host_hits + cs.host_misses),
               swap_seconds=cs.read_seconds + cs.copy_seconds, read_seconds=cs.read_seconds, prefetched=cs.prefetched,
               copy_seconds=cs.copy_seconds, **_step_split({f: getattr(s, f) for f in STEP_FIELDS}),
               errors=sorted({r.error for r in results if r.error})[:3],
               _tokens=[r.output_token_ids for r in results])
    return out


def _step_split(values: dict) -> dict:
    """The engine's StepStats of a run ({STEP_FIELDS name: value}) under the report's names: counts as ints, the
    seconds fields as <kind>_step_seconds."""
    return {(f.replace("_seconds", "_step_seconds") if f.endswith("_seconds") else f):
            (v if f.endswith("_seconds") else int(v)) for f, v in values.items()}


def _profiled(fn, out: str, ps):
    """fn() under torch.profiler; the top ops by self CPU and self device time go to the log and profile.txt."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        result = fn()
    ev = prof.key_averages()
    text = ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    if torch.cuda.is_available():
        text += "\n" + ev.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60)
    if ps.is_driver:
        print(text, flush=True)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "profile.txt"), "a") as f:
            f.write(text + "\n")
    return result


def _merge_targets(model) -> dict:
    """PEFT module path -> (base ParallelLinear, slice) of a Llama-family model built without LoRA."""
    out = {}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for s, n in enumerate(("q_proj", "k_proj", "v_proj")):
            out[p + "self_attn." + n] = (layer.self_attn.qkv_proj, s)
        out[p + "self_attn.o_proj"] = (layer.self_attn.o_proj, 0)
        for s, n in enumerate(("gate_proj", "up_proj")):
            out[p + "mlp." + n] = (layer.mlp.gate_up_proj, s)
        out[p + "mlp.down_proj"] = (layer.mlp.down_proj, 0)
    return out


def _merge(targets: dict, adapter, device) -> None:
    """W += s B A on this rank's shard of every targeted slice."""
    for path, m in adapter.modules.items():
        if path not in targets:
            raise ValueError(f"merged baseline: cannot merge {path!r} (only Llama linear layers)")
        lin, s = targets[path]
        delta = (m.b.to(device, torch.float32) @ m.a.to(device, torch.float32)) * m.scale
        part = shard_weight(lin.spec, s, delta, lin.tp.rank, lin.tp.size)
        row0 = sum(lin.local_out_widths[:s])
        w = lin.weight.data[row0:row0 + part.shape[0]]
        w.copy_((w.float() + part).to(w.dtype))


def run_merged(args, ps, model: str, adapters: str, reqs, arrivals, vocab) -> dict:
    engine = Engine(engine_cfg(args, ps, False), ps, model, None)
    _warm_up(engine, args.batch, vocab, None, reqs)
    targets = _merge_targets(engine.model)
    backup = {id(lin): lin.weight.data.clone() for lin, _ in targets.values()}
    linears = {id(lin): lin for lin, _ in targets.values()}
    dtype = engine.dtype
    swap_s, swaps = 0.0, 0
    timings, tokens = {}, {}
    pending = list(range(len(reqs)))
    current = None
    _sync()
    t0 = time.perf_counter()
    while pending:
        # The head's adapter and every arrived request of it form the next group; rank 0's clock decides.
        now = time.perf_counter() - t0
        arrived = [i for i in pending if arrivals[i] <= now]
        choice = None
        if arrived:
            head = reqs[arrived[0]].adapter
            choice = (head, [i for i in arrived if reqs[i].adapter == head])
        choice = comm.broadcast_object(choice, ps.tp)
        if choice is None:
            time.sleep(min(0.005, max(0.0, arrivals[pending[0]] - now)))
            continue
        name, group = choice
        if name != current:
            ts = time.perf_counter()
            for key, lin in linears.items():
                lin.weight.data.copy_(backup[key])
            if name is not None:
                _merge(targets, load_peft_adapter(os.path.join(adapters, name), name=name, dtype=dtype),
                       engine.ps.device)
            _sync()
            swap_s += time.perf_counter() - ts
            swaps += 1
            current = name
        batch = [Request(k, id=reqs[i].id, adapter=None, prompt_token_ids=reqs[i].prompt_token_ids,
                         max_new_tokens=reqs[i].max_new_tokens, ignore_eos=True) for k, i in enumerate(group)]
        for i, res in zip(group, engine.generate(batch)):
            timings[i] = dict(res.metrics, arrival=t0 + arrivals[i], tokens=len(res.output_token_ids))
            tokens[i] = res.output_token_ids
        done = set(group)
        pending = [i for i in pending if i not in done]
    _sync()
    out = summarize([timings[i] for i in range(len(reqs))], t0)
    out.update(swaps=swaps, swap_seconds=swap_s, _tokens=[tokens[i] for i in range(len(reqs))])
    engine.close()
    return out


def run_peft(args, model: str, adapters: str, reqs, arrivals) -> dict:
    import peft
    import transformers
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = "cuda" if cuda else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(dev).eval()
    names = sorted({r.adapter for r in reqs})
    ts = time.perf_counter()
    pm = peft.PeftModel.from_pretrained(hf, os.path.join(adapters, names[0]), adapter_name=names[0])
    for n in names[1:]:
        pm.load_adapter(os.path.join(adapters, n), adapter_name=n)
    pm.eval()
    load_s = time.perf_counter() - ts

    class FirstToken(transformers.LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                _sync()
                self.t = time.perf_counter()
            return scores

    def generate(batch: list[int]) -> tuple[float, float, list[list[int]]]:
        width = max(len(reqs[i].prompt_token_ids) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):  # left padding
            p = reqs[i].prompt_token_ids
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        new = max(reqs[i].max_new_tokens for i in batch)
        clock = FirstToken()
        with torch.no_grad():
            seqs = pm.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False, pad_token_id=0,
                        max_new_tokens=new, min_new_tokens=new, adapter_names=[reqs[i].adapter for i in batch],
                        logits_processor=transformers.LogitsProcessorList([clock]))
        _sync()
        out = [seqs[row, width:width + reqs[i].max_new_tokens].tolist() for row, i in enumerate(batch)]
        return clock.t, time.perf_counter(), out

    generate([0])  # warm-up
    timings, tokens = {}, {}
    pending = list(range(len(reqs)))
    _sync()
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        batch = [i for i in pending if arrivals[i] <= now][:args.batch]
        if not batch:
            time.sleep(min(0.005, max(0.0, arrivals[pending[0]] - now)))
            continue
        first, end, outs = generate(batch)
        for i, toks in zip(batch, outs):
            tokens[i] = toks
            timings[i] = dict(arrival=t0 + arrivals[i], first_token=first, finished=end,
                              tokens=reqs[i].max_new_tokens)
        done = set(batch)
        pending = [i for i in pending if i not in done]
    out = summarize([timings[i] for i in range(len(reqs))], t0)
    out.update(adapters_loaded=len(names), adapter_load_seconds=load_s,
               _tokens=[tokens[i] for i in range(len(reqs))])
    del pm, hf
    return out


# ---- report ---------------------------------------------------------------------------------------------------
def _server_overrides(args, model: str, adapters: str, port: int) -> list[str]:
    """launch/serve.py overrides for engine_cfg's settings."""
    c = engine_cfg(args, comm.single_process("cpu"), True)
    o = [f"model.path={model}", f"lora.adapter_dir={adapters}", f"server.port={port}",
         f"server.max_queue={args.requests}", f"parallel.tp_size={args.tp}", "progress=false",
         "device=cuda" if torch.cuda.is_available() else "device=cpu", f"dtype={c.dtype}" if not
         torch.cuda.is_available() else "dtype=bfloat16"]
    for section, keys in (("parallel", ("timeout_s", "host_threads", "read_threads")),
                          ("lora", ("max_loras", "max_cpu_loras", "max_rank", "fully_sharded", "dtype")),
                          ("scheduler", ("max_batch_size", "max_tokens_per_step", "kv_cache_mb", "admit_batch"))):
        for k in keys:
            v = getattr(getattr(c, section), k)
            o.append(f"{section}.{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    o.append(f"cuda_graphs={str(c.cuda_graphs).lower()}")
    return o


class ServerProcess:
    """launch/serve.py (under torchrun for --tp > 1) in a process group of its own."""

    def __init__(self, args, model: str, adapters: str):
        import subprocess
        from tp_lora.testing import listen_port
        self.port = listen_port()
        serve = os.path.join(ROOT, "launch", "serve.py")
        cmd = [sys.executable, serve] if args.tp == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.tp}",
            f"--master_port={listen_port()}", serve]
        self.log_path = os.path.join(args.out, f"server-{os.path.basename(adapters)}.log")
        os.makedirs(args.out, exist_ok=True)
        self.proc = subprocess.Popen(cmd + _server_overrides(args, model, adapters, self.port),
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        self.n_clients = args.clients
        self.clients = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
        import httpx
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > SERVER_START_S:
                self.stop()
                raise RuntimeError(f"the server did not start within {SERVER_START_S:g}s; see {self.log_path}")
            time.sleep(0.5)

    def drive(self, reqs, arrivals, base: Optional[str] = None) -> tuple[list[dict], float, list, list, float]:
        """The trace from --clients client processes (requests dealt round-robin), all on one start time: per request
        timings and token ids in request order, the start time, the errors, and the busiest client's CPU share."""
        k = self.n_clients
        t0 = time.perf_counter() + CLIENT_START_S
        parts = [f.result() for f in [self.clients.submit(_drive_shard, self.url, reqs[i::k], arrivals[i::k], base, t0)
                                      for i in range(k)]]
        timings, tokens = [None] * len(reqs), [None] * len(reqs)
        for i, (part_timings, part_tokens, _, _) in enumerate(parts):
            timings[i::k], tokens[i::k] = part_timings, part_tokens
        return timings, t0, tokens, sorted({e for p in parts for e in p[2]}), max(p[3] for p in parts)

    def stop(self) -> None:
        import signal
        self.clients.shutdown()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def _drive_shard(url: str, reqs, arrivals, base: Optional[str], t0: float) -> tuple[list[dict], list, list, float]:
    """A client process's share of the trace, from perf_counter time t0 (one clock for every process): its
    requests' timings, token ids and errors, and the share of a core it spent."""
    import asyncio
    time.sleep(max(0.0, t0 - time.perf_counter()))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    timings, tokens, errors = asyncio.run(_drive(url, reqs, arrivals, base, t0))
    return timings, tokens, errors, (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)


async def _drive(url: str, reqs, arrivals, base: Optional[str], t0: float) -> tuple[list[dict], list, list]:
    """Send each request at its arrival time after t0 (streamed, greedy) -> per request {arrival, first_token,
    finished, tokens} at the client, its token ids, and the errors. base: send every request to this model instead
    (None: each its adapter)."""
    import asyncio
    import httpx
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=len(reqs) + 8)))

    async def one(req, at):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        t = dict(arrival=t0 + at, first_token=None, finished=None, tokens=0)
        ids = []
        stream = await client.completions.create(model=base or req.adapter, prompt=req.prompt_token_ids,
                                                 max_tokens=req.max_new_tokens, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].token_ids:
                if t["first_token"] is None:
                    t["first_token"] = time.perf_counter()
                ids += chunk.choices[0].token_ids
        t.update(finished=time.perf_counter(), tokens=len(ids))
        return t, ids

    outs = await asyncio.gather(*[one(r, a) for r, a in zip(reqs, arrivals)], return_exceptions=True)
    await client.close()
    timings = [o[0] if not isinstance(o, BaseException) else {} for o in outs]
    errors = sorted({f"{type(o).__name__}: {o}"[:200] for o in outs if isinstance(o, BaseException)})
    return timings, [o[1] if not isinstance(o, BaseException) else [] for o in outs], errors


def _server_metrics(url: str) -> dict[str, float]:
    import httpx
    text = httpx.get(url + "/metrics").text
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
            if ln and not ln.startswith("#") and " " in ln}


def run_server(args, model: str, adapters: str, reqs, arrivals, server: "ServerProcess") -> dict:
    """The trace through the server, and where its time went: the engine's own TTFT / TPOT means over this trace
    (the server's histograms, arrival at the front end to the tokens on rank 0) and the share of one core the
    busiest client process spent (near 1: the clients, not the server, set the pace: raise --clients)."""
    before = _server_metrics(server.url)
    timings, t0, tokens, errors, client_cpu = server.drive(reqs, arrivals)
    out = summarize(timings, t0)
    values = _server_metrics(server.url)

    def mean(name: str) -> Optional[float]:
        n = values.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        return (values.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / n if n else None
    out.update(slot_hit_rate=values.get("tp_lora_slot_hit_rate"), slot_loads=values.get("tp_lora_adapter_loads"),
               disk_reads=values.get("tp_lora_adapter_reads"), errors=errors[:3], _tokens=tokens,
               engine_ttft_mean_s=mean("tp_lora_time_to_first_token_seconds"),
               engine_tpot_mean_s=mean("tp_lora_time_per_output_token_seconds"), client_cpu_fraction=client_cpu,
               **_step_split({f: values.get(f"tp_lora_engine_{f}", 0.0) - before.get(f"tp_lora_engine_{f}", 0.0)
                              for f in STEP_FIELDS}))
    return out


def _fmt(x, scale=1.0, digits=1):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(report: dict) -> str:
    rows = ["| adapters | system | tokens/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | "
            "slot hit rate | swaps | swap time (s) | steps (graph) | eager / graph step time (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for n, systems in report["results"].items():
        for name, r in systems.items():
            if "skipped" in r:
                rows.append(f"| {n} | {name} | skipped: {r['skipped']} | | | | | | | |")
                continue
            t, p = r["ttft_s"], r["tpot_s"]
            hit = _fmt(r.get("slot_hit_rate"), 100, 0) + "%" if "slot_hit_rate" in r else "-"
            swaps = r.get("slot_loads", r.get("swaps", r.get("adapters_loaded", "-")))
            swap_s = r.get("swap_seconds", r.get("adapter_load_seconds"))
            steps = f"{r['steps']} ({r['graph_steps']})" if "graph_steps" in r else "-"
            split = f"{r['eager_step_seconds']:.2f} / {r['graph_step_seconds']:.2f}" if "graph_steps" in r else "-"
            rows.append(f"| {n} | {name} | {_fmt(r['tokens_per_s'])} | {_fmt(t['mean'], 1e3)} / {_fmt(t['p50'], 1e3)}"
                        f" / {_fmt(t['p99'], 1e3)} | {_fmt(p['mean'], 1e3, 2)} / {_fmt(p['p50'], 1e3, 2)} / "
                        f"{_fmt(p['p99'], 1e3, 2)} | {hit} | {swaps} | {_fmt(swap_s, 1, 3)} | {steps} | {split} |")
    return "\n".join(rows)


def plot(report: dict, path: str) -> bool:
    """The plot to `path`; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(report["results"])  # "N" or "N @ rate"
    series = sorted({(system, k.partition(" @ ")[2]) for k in keys for system in report["results"][k]})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [("tokens_per_s", None, "generated tokens/s"), ("ttft_s", "p50", "TTFT p50 (s)"),
              ("ttft_s", "p99", "TTFT p99 (s)"), ("tpot_s", "mean", "time per output token, mean (s)")]
    for ax, (key, sub, title) in zip(axes, panels):
        for system, rate in series:
            xs, ys = [], []
            for k in keys:
                r = report["results"][k].get(system)
                if k.partition(" @ ")[2] == rate and r and "skipped" not in r:
                    v = r[key] if sub is None else r[key][sub]
                    if v is not None:
                        xs.append(int(k.partition(" @ ")[0]))
                        ys.append(v)
            if xs:
                ax.plot(xs, ys, marker="o", label=f"{system} {rate}".strip())
        ax.set_xscale("log")
        ax.set_xlabel("adapters")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    w = report["workload"]
    fig.suptitle(f"{report['model']} tp={report['tp']} on {report['device']}: {w['requests']} requests at "
                 f"{w['rates']}/s, {w['popularity']} popularity, ranks {w['ranks']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main -----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_serving_results")
    p.add_argument("--assets", default=os.path.expanduser("~/.cache/tp_lora/bench_serving"))
    p.add_argument("--model", default="llama-2048", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--adapters", default="1,100,1000", help="comma-separated adapter counts, one run each")
    p.add_argument("--ranks", default="16", help="comma-separated LoRA ranks, each adapter draws one (e.g. 8,16,32,64)")
    p.add_argument("--distinct-weights", type=int, default=8, help="random weight sets per rank; others hard-linked")
    p.add_argument("--adapter-dtype", default="model", choices=["model", "float32"],
                   help="dtype of the adapter files: the model's, or float32 (PEFT's default when it saves adapters "
                        "trained beside a 16-bit model), which the engine casts as it reads")
    p.add_argument("--popularity", default="powerlaw", choices=["powerlaw", "uniform"])
    p.add_argument("--alpha", type=float, default=1.0, help="power-law exponent: P(adapter i) ~ 1/(i+1)^alpha")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", default="8", help="Poisson arrival rates (requests/s), comma-separated, each a run; "
                                               "0 = all at once")
    p.add_argument("--server", action="store_true", help="also run the trace through launch/serve.py (system "
                                                         "'server'); the bench must then be one process")
    p.add_argument("--clients", type=int, default=4, help="client processes driving the server (the openai client "
                   "parses every chunk in Python: one process can be slower than the server)")
    p.add_argument("--prompt-len", default="16:256", help="MIN:MAX, uniform")
    p.add_argument("--output-len", default="16:128", help="MIN:MAX, uniform")
    p.add_argument("--max-loras", type=int, default=64, help="lora.max_loras (64: a slot per row of --batch 64)")
    p.add_argument("--max-cpu-loras", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--kv-cache-mb", type=float, default=None)
    p.add_argument("--admit-batch", type=int, default=RunConfig().scheduler.admit_batch,
                   help="scheduler.admit_batch: group admissions while decoding so more steps replay the decode graph")
    p.add_argument("--reader-threads", type=int, default=cache_module.READERS,
                   help="adapter reader threads per rank (tp_lora.lora.cache.READERS), to compare")
    p.add_argument("--host-threads", type=int, default=RunConfig().parallel.host_threads,
                   help="parallel.host_threads: torch threads per rank (0: one on CUDA)")
    p.add_argument("--read-threads", type=int, default=RunConfig().parallel.read_threads,
                   help="parallel.read_threads: threads of a read the step loop waits on (0: auto)")
    p.add_argument("--fully-sharded", action="store_true")
    p.add_argument("--lora-dtype", default="auto", choices=["auto", "fp8"], help="lora.dtype: fp8 stores B as fp8")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--systems", default="ours,merged,peft")
    p.add_argument("--peft-max-adapters", type=int, default=100)
    p.add_argument("--timeout", type=float, default=600.0, help="parallel.timeout_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="measured runs of our engine per adapter count (cold "
                   "starts); the median-throughput run is reported")
    p.add_argument("--profile", action="store_true", help="our engine under torch.profiler: top ops -> profile.txt")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, every system, < 1 minute")
    args = p.parse_args(argv)
    if args.smoke:  # the tiny model and a small trace; --adapters, if given, still picks the counts
        args.model, args.ranks = "tiny", "8,16,32,64"
        args.adapters = args.adapters if args.adapters != p.get_default("adapters") else "1,8,40"
        args.requests, args.prompt_len, args.output_len = 24, "4:24", "2:10"
        args.rate = args.rate if args.rate != "8" else "100"
        args.max_loras, args.max_cpu_loras, args.batch, args.tokens_per_step = 4, 8, 8, 64
        args.distinct_weights, args.peft_max_adapters = 2, 8
        args.assets = os.path.join(args.out, "assets")
        torch.set_num_threads(1)  # tiny matmuls: threads only contend
    args.adapter_counts = [int(x) for x in args.adapters.split(",")]
    args.ranks = [int(x) for x in str(args.ranks).split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    args.rates = [float(x) for x in str(args.rate).split(",")]
    if args.server and "server" not in args.systems:
        args.systems.append("server")
    if "server" in args.systems:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            p.error("the server system starts its own ranks: run the bench as one process (python, not torchrun)")
        if args.tp > 1 and set(args.systems) - {"server", "peft"}:
            p.error(f"--tp {args.tp} with 'server' runs the server at tp={args.tp}; ours / merged need torchrun: run "
                    f"them in a separate command (or --systems server)")
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; expected some of {SYSTEMS}")
    return args


def _run_system(args, ps, system, res, model, adapters, reqs, arrivals, vocab, used, server) -> None:
    if system == "peft" and ps.world.size > 1:
        res[system] = dict(skipped="one process only")
    elif system == "peft" and used > args.peft_max_adapters:
        res[system] = dict(skipped=f"{used} adapters > --peft-max-adapters={args.peft_max_adapters}")
    elif system == "peft" and not ps.is_driver:
        return
    else:
        t = time.perf_counter()
        if system == "server":
            res[system] = run_server(args, model, adapters, reqs, arrivals, server)
        elif system == "peft":
            res[system] = run_peft(args, model, adapters, reqs, arrivals)
        else:
            res[system] = {"ours": run_ours, "merged": run_merged}[system](args, ps, model, adapters, reqs, arrivals,
                                                                          vocab)
        r = res[system]
        log(f"  {system}: {_fmt(r['tokens_per_s'])} tokens/s, TTFT p50 {_fmt(r['ttft_s']['p50'], 1e3)} "
            f"ms, TPOT mean {_fmt(r['tpot_s']['mean'], 1e3, 2)} ms ({time.perf_counter() - t:.1f}s)"
            + (f"; {r['steps']} steps ({r['graph_steps']} graph, {r['graph_captures']} captured, "
               f"{r['decode_steps']} decode), step time eager "
               f"{r['eager_step_seconds']:.2f} s / graph {r['graph_step_seconds']:.2f} s / decode "
               f"{r['decode_step_seconds']:.2f} s" if "decode_steps" in r else "")
            + (f"; engine TTFT mean {_fmt(r['engine_ttft_mean_s'], 1e3)} ms, TPOT mean "
               f"{_fmt(r['engine_tpot_mean_s'], 1e3, 2)} ms, client CPU {_fmt(r['client_cpu_fraction'], 100, 0)}%"
               if system == "server" else "")
            + (f", errors {r['errors']}" if r.get("errors") else ""))
    if "ours" in res and "_tokens" in res["ours"] and "_tokens" in res.get(system, {}) and system != "ours":
        # Same greedy tokens as ours: a check of the other systems (bf16 rounding may flip a few).
        a, b = res["ours"]["_tokens"], res[system]["_tokens"]
        res[system]["same_tokens_as_ours"] = sum(x == y for x, y in zip(a, b)) / len(a)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cache_module.READERS = args.reader_threads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    os.makedirs(args.assets, exist_ok=True)
    model = prepare_model(args.assets, args.model, dtype)
    adapter_dtype = dtype if args.adapter_dtype == "model" else getattr(torch, args.adapter_dtype)
    ps = comm.init_parallel(1 if "server" in args.systems else args.tp, device, args.timeout)
    vocab = PRESETS[args.model]["vocab_size"]
    report = dict(model=args.model, tp=args.tp, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  fully_sharded=args.fully_sharded, cuda_graphs=not args.no_graphs,
                  adapter_dtype=str(adapter_dtype).removeprefix("torch."), lora_dtype=args.lora_dtype,
                  reader_threads=args.reader_threads, host_threads=args.host_threads,
                  read_threads=args.read_threads,
                  engine=dict(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, batch=args.batch,
                              tokens_per_step=args.tokens_per_step, admit_batch=args.admit_batch),
                  workload=dict(requests=args.requests, rates=args.rates, popularity=args.popularity,
                                alpha=args.alpha, ranks=args.ranks, prompt_len=args.prompt_len,
                                output_len=args.output_len, distinct_weights=args.distinct_weights, seed=args.seed),
                  results={})
    try:
        for n in args.adapter_counts:
            adapters = prepare_adapters(args.assets, model, n, args.ranks, args.distinct_weights, adapter_dtype,
                                        args.seed)
            # The in-process systems at every rate first, then the server (which holds its GPU memory meanwhile).
            for system in args.systems:
                server = ServerProcess(args, model, adapters) if system == "server" else None
                try:
                    for i, rate in enumerate(args.rates):
                        args.rate = rate
                        reqs, arrivals = make_trace(args, n, vocab)
                        used = len({r.adapter for r in reqs})
                        key = str(n) if len(args.rates) == 1 else \
                            f"{n} @ {'all at once' if rate == 0 else f'{rate:g}/s'}"
                        log(f"{key}: {n} adapters, {used} used by {len(reqs)} requests "
                            f"{'all at once' if rate == 0 else f'over {arrivals[-1]:.1f}s'}")
                        if server is not None and i == 0:  # warm-up, untimed: the trace's shapes on one adapter
                            server.drive(reqs, [0.0] * len(reqs), base=reqs[0].adapter)
                        res = report["results"].setdefault(key, {})
                        _run_system(args, ps, system, res, model, adapters, reqs, arrivals, vocab, used, server)
                        gc.collect()
                        if device == "cuda":
                            torch.cuda.empty_cache()
                finally:
                    if server is not None:
                        server.stop()
    finally:
        comm.shutdown()
    for systems in report["results"].values():
        for r in systems.values():
            r.pop("_tokens", None)
    if ps.is_driver:
        os.makedirs(args.out, exist_ok=True)
        table = markdown(report)
        print(table)
        with open(os.path.join(args.out, "bench_serving.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(args.out, "bench_serving.md"), "w") as f:
            f.write(f"# bench_serving: {report['model']} tp={report['tp']} on {report['device']}\n\n"
                    f"workload: {json.dumps(report['workload'])}\n\nengine: {json.dumps(report['engine'])}\n\n"
                    f"{table}\n")
        plotted = plot(report, os.path.join(args.out, "bench_serving.png"))
        log(f"wrote bench_serving.json / .md{' / .png' if plotted else ' (no plot: matplotlib is not installed)'} to "
            f"{args.out}")
    return report


if __name__ == "__main__":
    main()
