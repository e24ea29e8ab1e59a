"""Prefix caching on a chat trace, on one GPU: tokens/s and time to first token with scheduler.prefix_caching on and
off in one run, per model shape.

    python scripts/bench_prefix.py --out DIR [--shapes llama-2048,llama3-8b] [--conversations 100]

Trace ("chat"): --conversations conversations, each with its own adapter (a name per conversation over bench_step's
32 rank-16 adapters, each name a separate adapter to the engine) and its own --system-tokens system prompt, --turns turns; each
turn sends the whole history (system prompt, earlier user turns and the model's own replies) plus --user-tokens new
ones and generates --reply-tokens. Conversations start with Poisson arrivals (--rate per second); a turn is sent
--think-s after the previous turn's reply. The engine runs one run over the trace (the control loop of
tp_lora.engine.control with this closed-loop source), so later turns can find earlier ones' blocks.
Trace ("random"): as many single requests of the chat trace's lengths with random prompts (nothing to share), at the
same arrival rate: what caching costs where it cannot hit (decode step and tokens/s).
With caching on, the chat trace runs twice: cached prefixes first (scheduler.max_prefix_overtakes, the default) and
in arrival order (max_prefix_overtakes=0, column "order"); --rate high and --think-s 0 make the saturated case.
--traces / --orders pick the runs (default all; the caching-off chat run always runs, as the baseline).
Reports generated tokens/s over the trace, TTFT (arrival to first token) p50 / p99 and where it goes (p50 of the
wait to be admitted, and of admission to the first token read), TTFT p50 of the later turns alone (those the
cache can serve) and in steps ("later 1st@": steps launched from arrival to the first token read, p50), the prefix
hit rate, the mean decode step and the engine steps; writes bench_prefix.json into --out. --run-ahead launches
steps ahead of reading on the CPU too (the steps to a first token as on a GPU).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_serving import _stats  # noqa: E402
from bench_step import assets  # noqa: E402
from tp_lora import distributed as comm  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine.control import RUN, ListSink, control_loop  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request, Result  # noqa: E402
from tp_lora.engine.stats import StepStats  # noqa: E402


class Chat:
    """Closed-loop conversations as a control-loop source and sink (one rank): a turn's reply schedules the next."""

    lost = False

    def __init__(self, args, vocab: int, adapters: list[str], shared: bool, seed: int):
        rng = random.Random(seed)
        self.args, self.rng, self.vocab, self.shared = args, rng, vocab, shared
        self.t0 = time.perf_counter()
        self.due: list[tuple[float, Request]] = []  # (perf_counter arrival, request) not handed over yet
        self.history: dict[int, list[int]] = {}  # conversation -> its tokens so far
        self.turn: dict[int, int] = {}
        self.results: list[Result] = []
        self.stats: Optional[StepStats] = None  # the engine's, to count steps (set by run_trace)
        self.handed: dict[int, int] = {}  # request index -> engine steps launched when it was handed over
        self.first_steps: dict[int, int] = {}  # request index -> steps launched from its handover to its first token
        self.index = 0
        start = 0.0
        for c in range(args.conversations):
            start += rng.expovariate(args.rate)
            self.history[c] = self._tokens(args.system_tokens)
            self.turn[c] = 0
            self._send(c, self.t0 + start, adapters[c % len(adapters)])
        self.waiting_turns = args.conversations * (args.turns if shared else 1)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _send(self, c: int, at: float, adapter: str) -> None:
        if not self.shared:  # nothing in common with any other request
            self.history[c] = self._tokens(len(self.history[c]))
        prompt = self.history[c] + self._tokens(self.args.user_tokens)
        self.history[c] = prompt
        req = Request(self.index, id=c, adapter=adapter, prompt_token_ids=prompt,
                      max_new_tokens=self.args.reply_tokens, ignore_eos=True)
        self.index += 1
        self.due.append((at, req))
        self.due.sort(key=lambda x: x[0])

    # ---- source ----------------------------------------------------------------------------------------------------
    @property
    def more(self) -> bool:
        return self.waiting_turns > 0

    def take(self, wait: bool) -> int:
        now = time.perf_counter()
        return sum(1 for at, _ in self.due if at <= now)

    def merge(self, views: list) -> list:
        n = min(views)
        ops, self.due = [("add", req, at, None) for at, req in self.due[:n]], self.due[n:]
        self.handed.update((req.index, self.stats.steps) for _, req, _, _ in ops)
        return ops

    def close(self) -> list[Request]:
        out, self.due = [r for _, r in self.due], []
        return out

    def wait_s(self) -> float:
        return self.due[0][0] - time.perf_counter() if self.due else 0.01

    # ---- sink ------------------------------------------------------------------------------------------------------
    def ended(self, res: Result) -> None:
        if res.error:
            raise RuntimeError(f"request {res.request.index}: {res.error}")
        res.metrics.setdefault("finished", time.perf_counter())
        self.results.append(res)
        self.waiting_turns -= 1
        c = res.request.id
        self.turn[c] += 1
        if self.shared and self.turn[c] < self.args.turns:
            self.history[c] = self.history[c] + res.output_token_ids
            self._send(c, time.perf_counter() + self.args.think_s, res.request.adapter)

    def stepped(self, out) -> None:
        for res in out.advanced:
            if len(res.output_token_ids) == 1:  # its first token: the steps launched since it came
                self.first_steps[res.request.index] = self.stats.steps - self.handed[res.request.index]
        for res in out.finished:
            self.ended(res)

    def accepted(self, req, tag) -> None:
        pass

    def cancelled(self, index) -> None:
        pass

    def replied(self, tag, error) -> None:
        pass

    def stopped(self, requests, level) -> None:
        raise RuntimeError(f"stopped at level {level}")

    def flush(self) -> None:
        pass


def run_trace(engine: Engine, args, adapters: list[str], shared: bool, seed: int) -> dict:
    vocab = engine.vocab_size
    chat = Chat(args, vocab, adapters, shared, seed)
    longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    need = [longest] * engine.cfg.scheduler.max_batch_size
    blocks, fit = engine.plan_kv(need)
    engine.stats = chat.stats = StepStats()
    engine.open(blocks, min(fit, longest))
    t0 = time.perf_counter()
    try:
        control_loop(engine, chat, chat, lambda: RUN, min(fit, longest))
    finally:
        engine.close_run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rs = chat.results
    span = max(r.metrics["finished"] for r in rs) - t0
    tokens = sum(len(r.output_token_ids) for r in rs)
    s = engine.stats
    later = [r for r in rs if len(r.request.prompt_token_ids) > args.system_tokens + args.user_tokens]
    return dict(requests=len(rs), generated_tokens=tokens, seconds=span, tokens_per_s=tokens / span,
                ttft_s=_stats([r.metrics["first_token"] - r.metrics["arrival"] for r in rs]),
                # where TTFT goes: waiting to be admitted, then admission to the first token read (its prefill step
                # and the steps ahead of it); and TTFT of the later turns alone (those a prefix cache can serve)
                queue_s=_stats([r.metrics["admitted"] - r.metrics["arrival"] for r in rs]),
                admitted_to_first_s=_stats([r.metrics["first_token"] - r.metrics["admitted"] for r in rs]),
                later_turns_ttft_s=_stats([r.metrics["first_token"] - r.metrics["arrival"] for r in later]),
                # steps launched from a later turn's arrival to its first token read: the step in flight when it
                # came, the one launched ahead before it could join (if any), its prefill, ...
                later_turns_steps=_stats([chat.first_steps[r.request.index] for r in later]),
                prefix_hit_rate=s.prefix_hit_rate, prompt_tokens=s.prompt_tokens,
                prefix_hit_tokens=s.prefix_hit_tokens, steps=s.steps,
                decode_step_ms=1e3 * s.decode_seconds / s.decode_steps if s.decode_steps else None,
                # the other steps (prefill chunks, mixed): graphed, captured in the run, eager; their mean wall ms
                graph_steps=s.graph_steps, graph_captures=s.graph_captures, eager_steps=s.steps - s.graph_steps,
                other_step_ms=(1e3 * (s.graph_seconds + s.eager_seconds - s.decode_seconds)
                               / max(1, s.steps - s.decode_steps)),
                eager_step_ms=1e3 * s.eager_seconds / max(1, s.steps - s.graph_steps),
                adapter_loads=s.adapter_loads, ahead_steps=s.ahead_steps, decode_steps=s.decode_steps, blocks=blocks)


def engine_for(model: str, adapter_dir: str, caching: bool, args, arrival_order: bool = False) -> Engine:
    cfg = RunConfig()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script (--shapes smoke)
    cfg.device, cfg.dtype, cfg.progress = dev, "bfloat16" if dev == "cuda" else "float32", False
    cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.lora.max_rank = args.max_loras, args.conversations, 16
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step = args.batch, args.tokens_per_step
    cfg.scheduler.prefix_caching = caching
    if arrival_order:
        cfg.scheduler.max_prefix_overtakes = 0
    cfg.scheduler.kv_memory_fraction = args.kv_fraction
    engine = Engine(cfg, comm.single_process(dev), model, adapter_dir)
    engine.run_ahead = engine.run_ahead or args.run_ahead
    return engine


def named_adapters(src: str, n: int) -> str:
    """n adapter names c000.. linked to the shape's 32 adapters (each name its own adapter to the engine)."""
    out = src.rstrip("/") + f"-names{n}"
    if not os.path.exists(os.path.join(out, f"c{n - 1:03d}")):
        os.makedirs(out, exist_ok=True)
        base = sorted(os.listdir(src))
        for i in range(n):
            dst = os.path.join(out, f"c{i:03d}")
            if not os.path.exists(dst):
                os.symlink(os.path.join(src, base[i % len(base)]), dst)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_prefix_results")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tp_lora/bench_step"))
    p.add_argument("--shapes", default="llama-2048,llama3-8b")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="conversation starts per second (Poisson)")
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--max-loras", type=int, default=64)
    p.add_argument("--kv-fraction", type=float, default=0.8)
    p.add_argument("--traces", default="chat,random", help="random: what caching costs where nothing hits")
    p.add_argument("--orders", default="cached,arrival", help="the admission orders of the caching-on chat runs")
    p.add_argument("--run-ahead", action="store_true", help="on the CPU too (the CUDA default): steps to the first "
                   "token as on a GPU")
    args = p.parse_args()
    traces, orders = args.traces.split(","), args.orders.split(",")
    os.makedirs(args.out, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", args=vars(args),
                  rows=[])
    longest = args.system_tokens + args.turns * (args.user_tokens + args.reply_tokens)
    print(f"{'shape':<11} {'trace':<7} {'caching':<8} {'order':<7} {'tok/s':>8} {'TTFT p50 ms':>12} "
          f"{'TTFT p99 ms':>12} {'queue p50':>10} {'adm->1st p50':>13} {'later p50':>10} {'hit rate':>9} "
          f"{'decode ms':>10} {'steps':>6} {'later 1st@':>11}", flush=True)
    for shape in args.shapes.split(","):
        model, adapter_src = assets(args.cache, shape, longest + 16)
        adapter_dir = named_adapters(adapter_src, args.conversations)
        names = [f"c{i:03d}" for i in range(args.conversations)]
        for caching, order in [(False, "arrival")] + [(True, o) for o in ("cached", "arrival") if o in orders]:
            engine = engine_for(model, adapter_dir, caching, args, arrival_order=caching and order == "arrival")
            warm = argparse.Namespace(**{**vars(args), "conversations": 8, "turns": 2, "rate": 1000.0})
            run_trace(engine, warm, names, True, seed=1)  # graphs, kernels, adapter reads
            runs = [t for t in ("chat", "random") if t in traces and (t == "chat" or order == "cached" or not caching)]
            for trace, shared in ((t, t == "chat") for t in runs):
                row = dict(shape=shape, trace=trace, caching=caching, order=order,
                           **run_trace(engine, args, names, shared, 0))
                report["rows"].append(row)
                t, later, steps = row["ttft_s"], row["later_turns_ttft_s"]["p50"], row["later_turns_steps"]["p50"]
                print(f"{shape:<11} {trace:<7} {str(caching):<8} {order:<7} {row['tokens_per_s']:>8.0f} "
                      f"{1e3 * t['p50']:>12.1f} {1e3 * t['p99']:>12.1f} {1e3 * row['queue_s']['p50']:>10.1f} "
                      f"{1e3 * row['admitted_to_first_s']['p50']:>13.1f} "
                      f"{1e3 * later if later is not None else float('nan'):>10.1f} {row['prefix_hit_rate']:>9.1%} "
                      f"{row['decode_step_ms'] or float('nan'):>10.3f} {row['steps']:>6} "
                      f"{steps if steps is not None else float('nan'):>11}", flush=True)
                print(f"  steps: {row['graph_steps']} graphed ({row['graph_captures']} captured), "
                      f"{row['eager_steps']} eager ({row['eager_step_ms']:.2f} ms each); not decode: "
                      f"{row['steps'] - row['decode_steps']} steps, {row['other_step_ms']:.2f} ms each; "
                      f"{row['adapter_loads']} adapter loads, "
                      f"{row['ahead_steps']} launched ahead", flush=True)
            engine.close()
            del engine
            gc.collect()  # the engine's reference cycles hold its KV cache until collected
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        rows = {(r["trace"], r["caching"], r["order"]): r for r in report["rows"] if r["shape"] == shape}
        print(f"{shape}: " + "; ".join(_gains(rows)), flush=True)
    with open(os.path.join(args.out, "bench_prefix.json"), "w") as f:
        json.dump(report, f, indent=1)


def _gains(rows: dict) -> list[str]:
    """The summary's ratios, of the rows that ran: caching on (cached first) against off, cached first against
    arrival order, and caching's cost on the random trace."""
    out = []
    on, off = rows.get(("chat", True, "cached")), rows.get(("chat", False, "arrival"))
    fifo = rows.get(("chat", True, "arrival"))
    ron, roff = rows.get(("random", True, "cached")), rows.get(("random", False, "arrival"))
    if on and off:
        out.append(f"chat TTFT p50 {off['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}x lower, tokens/s "
                   f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x with caching")
    if on and fifo:
        out.append(f"cached first against arrival order: TTFT p50 {fifo['ttft_s']['p50'] / on['ttft_s']['p50']:.2f}x "
                   f"lower, tokens/s {on['tokens_per_s'] / fifo['tokens_per_s']:.2f}x")
    if ron and roff:
        out.append(f"random tokens/s {ron['tokens_per_s'] / roff['tokens_per_s']:.3f}x, decode step "
                   f"{ron['decode_step_ms'] / roff['decode_step_ms']:.3f}x")
    return out


if __name__ == "__main__":
    main()
