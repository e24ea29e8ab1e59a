"""Issue #31's sampling costs on one GPU, through the offline engine (tp_lora.LLM), in one run:

  n        --prompts prompts, each asking n=--n sampled sequences (one prefill: the siblings join the batch in the
           step that ends it, sharing its KV blocks and drawing from its logits) against the same prompts sent --n times as separate requests (each one
           prefilled): seconds and generated tokens/s of each; target n at least 1.5x separate.
  grammar  --batch requests with response_format json_schema (each of --schemas, bench_grammar.py's) against the
           same requests without one: generated tokens/s; target: the grammar costs at most 10%. Its documents:
           parsed, cut by max_tokens (finish_reason "length") and malformed, apart; and the host's wait for masks per
           step (StepStats.mask_wait_seconds over the grammar runs) and the device's (mask_device_wait_seconds).
           "nested" bounds its strings (maxLength), where xgrammar's fill takes milliseconds per row; "free_text" has
           unbounded strings.

Model: bench_step.py's random-weight shape (written once under --cache, rank-16 adapters beside it) with a
byte-level BPE tokenizer trained here on Python's standard library (bench_grammar.py's), so grammars find tokens
that spell JSON; the model dir for this run links the shape's weight files and adds the tokenizer. Random weights:
a grammar's document ends when the mask leaves only EOS, so the rows compare tokens/s, not lengths.

    python scripts/bench_sampling.py --shape llama-2048 --out DIR
    python scripts/bench_sampling.py --smoke --out DIR          # CPU, tiny shape, seconds
    python scripts/bench_sampling.py --timeline --reps 1 --out DIR  # + where each run's host time goes, per step
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_grammar import SCHEMAS, byte_level_tokenizer, corpus  # noqa: E402
from bench_step import SHAPES, assets  # noqa: E402


def model_with_tokenizer(cache: str, shape: str, max_pos: int) -> tuple[str, str]:
    """(model dir with a JSON-capable tokenizer, adapter dir): bench_step's shape, its files linked."""
    model, adapters = assets(cache, shape, max_pos)
    out = os.path.join(cache, f"{shape}-with-tokenizer")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        for f in os.listdir(model):
            if not os.path.exists(os.path.join(out, f)):
                os.symlink(os.path.join(model, f), os.path.join(out, f))
        vocab = SHAPES[shape]["vocab_size"]
        tok = byte_level_tokenizer(vocab, corpus())
        tok.save(os.path.join(out, "tokenizer.json"))
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                       "unk_token": "<unk>"}, f)
    return out, adapters


def timed(llm, prompts, adapters, **kw) -> dict:
    """One LLM.generate call: seconds, generated tokens (every choice), tokens/s, engine steps, and the results."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = llm.engine.stats.steps
    t0 = time.perf_counter()
    out = llm.generate(prompts, adapter=adapters, **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    s = time.perf_counter() - t0
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    tokens = sum(len(c["output_token_ids"]) for o in out for c in o.get("choices", [o]))
    return {"seconds": s, "tokens": tokens, "tokens_per_s": tokens / s, "steps": llm.engine.stats.steps - steps,
            "out": out}


class Timeline:
    """Host time per step by phase (--timeline): the engine's step phases, the sampler's pieces and the grammar calls,
    wrapped by name (wall seconds; calls on another thread than the main one apart). A path names a class (its
    methods) or a module (the functions as that module calls them). Diagnosis only: the wrappers add microseconds."""
    PHASES = {"engine.core.EngineCore": ["step", "_launch", "_read", "_schedule"],
              "engine.runner.ModelRunner": ["execute"], "engine.sampler.Sampler": ["sample", "follow", "finished"],
              "engine.sampler": ["draw", "to_device", "race"], "distributed": ["wait_event"],
              "engine.grammar.Grammars": ["masks", "follow", "hand_on", "_send", "fill", "advance", "on_device"]}

    def __init__(self):
        import importlib
        import threading
        self.calls: list[tuple[str, bool, float, float]] = []  # (name, on the main thread, start, end)
        main = threading.main_thread()
        for path, names in self.PHASES.items():
            try:
                owner, label = importlib.import_module(f"tp_lora.{path}"), path.rsplit(".", 1)[-1]
            except ModuleNotFoundError:
                mod, label = path.rsplit(".", 1)
                owner = getattr(importlib.import_module(f"tp_lora.{mod}"), label)
            for name in names:
                fn = getattr(owner, name)

                def wrapped(*a, _fn=fn, _name=f"{label}.{name}", **k):
                    t0 = time.perf_counter()
                    try:
                        return _fn(*a, **k)
                    finally:
                        self.calls.append((_name, threading.current_thread() is main, t0, time.perf_counter()))
                setattr(owner, name, wrapped)

    def summary(self, steps: int) -> dict:
        """{phase (worker phases prefixed 'worker:'): ms per step} over the calls since the last summary."""
        out: dict[str, float] = {}
        for name, on_main, t0, t1 in self.calls:
            key = name if on_main else f"worker:{name}"
            out[key] = out.get(key, 0.0) + 1e3 * (t1 - t0) / max(1, steps)
        self.calls.clear()
        return dict(sorted(out.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_sampling_results")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tp_lora/bench_step"))
    p.add_argument("--shape", default="llama-2048", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="requests of the grammar comparison")
    p.add_argument("--schemas", default="nested,free_text", help="bench_grammar.py's schemas, one grammar row each")
    p.add_argument("--reps", type=int, default=3, help="rounds: each compared pair run side by side once per round (medians)")
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, few tokens")
    p.add_argument("--timeline", action="store_true", help="print each run's host ms per step by phase")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.prompts, args.n, args.prompt_tokens, args.new_tokens, args.batch, args.reps = \
            "smoke", 2, 3, 24, 6, 4, 1
    from tp_lora import LLM
    max_pos = args.prompt_tokens + args.new_tokens + 64
    model, adapter_dir = model_with_tokenizer(args.cache, args.shape, max_pos)
    names = sorted(os.listdir(adapter_dir))
    llm = LLM(model, adapter_dir, **{"device": "cuda" if torch.cuda.is_available() else "cpu", "dtype": "bfloat16",
                                     "lora.max_loras": min(32, len(names)), "lora.max_rank": 16,
                                     "scheduler.max_batch_size": max(args.prompts * args.n, args.batch),
                                     "model.max_seq_len": max_pos})
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    adapters = [names[i % len(names)] for i in range(args.prompts)]
    sample = dict(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    rows = {}

    timeline = Timeline() if args.timeline else None

    def one(**kw) -> dict:
        """timed() of one run, with its host time by phase under --timeline."""
        if timeline is not None:
            timeline.calls.clear()
        r = timed(llm, **kw)
        if timeline is not None:
            r["timeline_ms_per_step"] = timeline.summary(r["steps"])
        return r
    # n: distinct prompts each run (a prompt seen before would be served from the prefix cache)
    fresh = iter(range(1, 1 << 30))

    def salted():
        salt = next(fresh)
        return [[3 + (salt + i) % (vocab - 3)] + p[1:] for i, p in enumerate(prompts)]
    def n_run() -> dict:
        return one(prompts=salted(), adapters=adapters, n=args.n, seed=1, **sample)

    def separate_run() -> dict:
        return one(prompts=[q for q in salted() for _ in range(args.n)],
                   adapters=[a for a in adapters for _ in range(args.n)], seed=1, **sample)
    n_run(), separate_run()  # untimed: every batch size's graphs captured, kernels compiled, slots filled
    pairs = [(n_run(), separate_run()) for _ in range(args.reps)]  # rounds: n beside separate requests, same moment
    speedups = sorted(n["tokens_per_s"] / sep["tokens_per_s"] for n, sep in pairs)
    rows["n"], rows["separate"] = (sorted((p[k] for p in pairs), key=lambda r: r["seconds"])[len(pairs) // 2]
                                   for k in (0, 1))
    batch_prompts = [salted()[i % args.prompts][:64] for i in range(args.batch)]
    batch_adapters = [names[i % len(names)] for i in range(args.batch)]
    free = dict(max_new_tokens=args.new_tokens, temperature=1.0)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "shape": args.shape,
              "args": vars(args), "n_speedup": speedups[len(speedups) // 2], "n_speedup_per_round": speedups,
              "grammars": {}}
    # rounds: each grammar run beside a no-grammar run of the same moment (the machine's speed drifts between runs)
    schemas = {name: {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name][0]}}
               for name in args.schemas.split(",")}
    runs: dict[str, list[dict]] = {"no_grammar": [], **{f"grammar_{name}": [] for name in schemas}}
    st, waits = llm.engine.stats, {name: [0, 0.0, 0.0] for name in schemas}
    def batch_run(name: str) -> dict:
        return one(prompts=batch_prompts, adapters=batch_adapters, **free,
                   **({"response_format": schemas[name]} if name in schemas else {}))
    for key in runs:  # untimed: grammars compiled, the masking's kernels too
        batch_run(key.removeprefix("grammar_"))
    for _ in range(args.reps):
        for key, got in runs.items():
            name = key.removeprefix("grammar_")
            steps0, wait0, device0 = st.mask_steps, st.mask_wait_seconds, st.mask_device_wait_seconds
            got.append(batch_run(name))
            if name in schemas:
                waits[name][0] += st.mask_steps - steps0
                waits[name][1] += st.mask_wait_seconds - wait0
                waits[name][2] += st.mask_device_wait_seconds - device0
    for key, got in runs.items():
        rows[key] = sorted(got, key=lambda r: r["seconds"])[len(got) // 2]
    for name in schemas:
        costs = sorted(1 - g["tokens_per_s"] / n["tokens_per_s"]
                       for g, n in zip(runs[f"grammar_{name}"], runs["no_grammar"]))
        docs = [(o.get("text", ""), o["finish_reason"]) for o in rows[f"grammar_{name}"]["out"]]
        parsed = sum(1 for t, _ in docs if _parses(t))
        truncated = sum(1 for t, why in docs if not _parses(t) and why == "length")  # cut, not malformed
        report["grammars"][name] = {
            "cost": costs[len(costs) // 2], "cost_per_round": costs, "parsed": parsed, "truncated": truncated,
            "malformed": args.batch - parsed - truncated, "mask_steps": waits[name][0],
            "mask_wait_ms_per_step": 1e3 * waits[name][1] / max(1, waits[name][0]),
            "mask_device_wait_ms_per_step": 1e3 * waits[name][2] / max(1, waits[name][0])}
    report["rows"] = {k: {x: v for x, v in r.items() if x != "out"} for k, r in rows.items()}
    print(f"device {report['device']}, shape {args.shape}, {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens")
    print("| run | requests | seconds | generated tokens | tokens/s | steps |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        count = {"n": f"{args.prompts} x n={args.n}", "separate": f"{args.prompts * args.n}"}.get(name, args.batch)
        print(f"| {name} | {count} | {r['seconds']:.3f} | {r['tokens']} | {r['tokens_per_s']:.0f} | {r['steps']} |")
    print(f"n={args.n} against separate requests: {report['n_speedup']:.2f}x tokens/s, median of the rounds "
          f"{', '.join(f'{x:.2f}' for x in speedups)} (target >= 1.5x)")
    for name, r in rows.items():
        if "timeline_ms_per_step" in r:
            print(f"{name}: host ms per step by phase: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r["timeline_ms_per_step"].items()))
    for name, g in report["grammars"].items():
        print(f"grammar {name}: costs {g['cost']:.1%} of tokens/s, median of the rounds "
              f"{', '.join(f'{x:.1%}' for x in g['cost_per_round'])} (target <= 10%); documents: {g['parsed']} parse, "
              f"{g['truncated']} cut by max_tokens, {g['malformed']} malformed; the host waited "
              f"{g['mask_wait_ms_per_step']:.3f} ms per step for masks, the device "
              f"{g['mask_device_wait_ms_per_step']:.3f} ({g['mask_steps']} steps)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sampling.json"), "w") as f:
        json.dump(report, f, indent=2)
    llm.close()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


if __name__ == "__main__":
    main()
