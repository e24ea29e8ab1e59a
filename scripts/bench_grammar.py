"""Grammar libraries for structured output, side by side on CPU: xgrammar and outlines-core.

For each tokenizer (a byte-complete tiny BPE of the default model's size, and a 32k BPE trained here with
`tokenizers`) and each schema: the time to build the tokenizer's side once, to compile the schema, and per token
of a valid document (compact JSON, the schema's own example) the time to fill the next-token bitmask, then advance.

    python scripts/bench_grammar.py [--vocab 320 32000] [--reps 3]
    python scripts/bench_grammar.py --forced     # what jump-forward could skip (forced_tokens)
    python scripts/bench_grammar.py --batch-fill --vocab 32000 --threads 1 2 4 8 15   # the engine's batched calls
        (each schema compiled by xgrammar and as the runtime compiles it: its bounds written out as rules)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sysconfig
import time

import torch

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"]},
             {"name": "ada lovelace", "age": 36, "ok": True}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "role": {"enum": ["admin", "user", "guest"]}},
                 "required": ["id", "role"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["user", "tags"]},
        {"user": {"id": 7, "role": "guest"}, "tags": ["red", "blue"]}),
    "wide": ({"type": "object", "properties": {f"field_{i}": {"type": "number"} for i in range(16)},
              "required": [f"field_{i}" for i in range(16)]},
             {f"field_{i}": i * 1.5 for i in range(16)}),
    "free_text": ({"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"},
                                                    "kind": {"enum": ["note", "mail"]}},
                   "required": ["title", "body", "kind"]},
                  {"title": "a short title", "body": "some longer text, with words: and a comma", "kind": "mail"}),
}
# any object (OpenAI's json_object); the runtime's grammar for it
JSON_OBJECT = ({"type": "object"}, {"a": [1, 2, {"b": "c d"}], "e": None})


def byte_level_tokenizer(vocab: int, texts: list[str]):
    """A byte-level BPE of `vocab` tokens (<unk>, <s>, </s>, the 256 bytes, merges) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def corpus() -> list[str]:
    """Python's standard library sources and the schemas' documents: text with code and JSON punctuation."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:400]
    texts = [open(f, encoding="utf-8", errors="ignore").read() for f in files]
    return texts + [json.dumps(doc, separators=(",", ":")) for _, doc in SCHEMAS.values()] * 50


def timed(fn, reps: int = 1) -> tuple[object, float]:
    """(fn()'s last result, its best time over reps in seconds)."""
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def compact(name: str, doc) -> str:
    """The document as xgrammar spells it: no whitespace (its any-object rules put a space after ',')."""
    return json.dumps(doc, separators=(", " if name == "json_object" else ",", ":"))


def stats(compile_s: float, fills: list[float]) -> dict:
    us = sorted(1e6 * t for t in fills)
    return {"compile_s": compile_s, "mask_us_mean": statistics.mean(us), "mask_us_p50": us[len(us) // 2],
            "mask_us_max": us[-1], "tokens": len(us)}


def bench_xgrammar(tok, vocab: int, reps: int) -> dict:
    import xgrammar as xgr
    from tp_lora.engine.grammar import tokenizer_info
    info, t_info = timed(lambda: tokenizer_info(tok, vocab, [2]))
    out = {"tokenizer_s": t_info}
    for name, (schema, doc) in {**SCHEMAS, "json_object": JSON_OBJECT}.items():
        text = json.dumps(schema)
        # a fresh compiler per rep: its cache would answer the later reps
        compiler = (lambda: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False))
        compiled, t_compile = timed(lambda: compiler().compile_json_schema(text, any_whitespace=False,
                                                                           separators=(",", ":")), reps)
        ids = tok.encode(compact(name, doc)).ids + [2]
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        fills = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            fills.append(time.perf_counter() - t0)
            assert matcher.accept_token(t), (name, t, tok.decode([t]))
        out[name] = stats(t_compile, fills)
    return out


def bench_outlines(tok, vocab: int, reps: int) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import decoders
    dec = decoders.ByteLevel()

    def vocabulary():
        words: dict[bytes, list[int]] = {}
        for s, i in tok.get_vocab().items():
            if i > 2:  # the specials are not text
                words.setdefault(dec.decode([s]).encode("utf-8", "surrogatepass"), []).append(i)
        return oc.Vocabulary(2, words)
    voc, t_voc = timed(vocabulary)
    out = {"tokenizer_s": t_voc}
    # json_object: the library's regex for {"type": "object"} (nesting bounded: a regex cannot nest without bound)
    for name, (schema, doc) in {**SCHEMAS, "json_object": JSON_OBJECT}.items():
        regex = build_regex_from_schema(json.dumps(schema), r"")
        index, t_compile = timed(lambda: oc.Index(regex, voc), reps)
        ids = tok.encode(json.dumps(doc, separators=(",", ":"))).ids
        guide = oc.Guide(index)
        mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        fills = []
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            fills.append(time.perf_counter() - t0)
            guide.advance(t)
        out[name] = stats(t_compile, fills)
    return out


def forced_tokens(tok, vocab: int, docs: int = 20, steps: int = 64) -> dict:
    """What jump-forward could skip, per schema: random walks (each token drawn uniformly from what the mask allows,
    as a random-weight model does; the JSON bytes the engine allows only) counting the steps, those whose mask allows
    a single token (forced), the steps a token-level jump-forward saves in an engine that launches a step before
    reading the last (each run of forced tokens but its first, which the step launched meanwhile draws); and as many
    walks jumping xgrammar's jump-forward strings (forced text emitted as the tokenizer spells it, not the tokens the
    model would draw): the tokens so emitted."""
    import random
    import xgrammar as xgr
    from tp_lora.engine.grammar import tokenizer_info
    info = tokenizer_info(tok, vocab, [2])
    ok = torch.tensor([bool(b) and min(b) >= 0x20 for b in info.decoded_vocab] + [False] * (vocab - len(
        info.decoded_vocab)))
    ok[2] = True
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {}
    for name, (schema, _) in SCHEMAS.items():
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        rng, mask = random.Random(0), xgr.allocate_token_bitmask(1, vocab)
        n = single = saved = jump = 0
        for doc in range(2 * docs):  # the first half token by token, the second with jump-forward strings
            m, run = xgr.GrammarMatcher(compiled), 0
            for _ in range(steps):
                if m.is_terminated():
                    break
                text = m.find_jump_forward_string() if doc >= docs else ""
                if text:  # emitted as the tokenizer spells it, no step
                    jump += len(tok.encode(text).ids)
                    assert m.accept_string(text)
                    continue
                if doc >= docs:
                    m.fill_next_token_bitmask(mask)
                    allowed = (((mask[0][:, None] >> torch.arange(32)) & 1).bool().flatten()[:vocab] & ok).nonzero()
                    m.accept_token(rng.choice(allowed.flatten().tolist()))
                    continue
                m.fill_next_token_bitmask(mask)
                allowed = (((mask[0][:, None] >> torch.arange(32)) & 1).bool().flatten()[:vocab] & ok).nonzero()
                n += 1
                single += len(allowed) == 1
                if len(allowed) == 1:
                    run += 1
                else:
                    saved, run = saved + max(0, run - 1), 0
                m.accept_token(rng.choice(allowed.flatten().tolist()))
            saved += max(0, run - 1)
        out[name] = {"steps": n, "single_token_masks": single, "token_level_saves": saved,
                     "jump_forward_string_tokens": jump}
    return out


def batch_fill(tok, vocab: int, threads: list[int], rows: int = 32, steps: int = 64) -> dict:
    """The engine's per-step grammar work at `rows` rows (mask_process.Matchers.job): one batched accept of the step's
    tokens and one batched fill of the next bitmasks, on each thread count, for each schema compiled by xgrammar and by
    the runtime (tp_lora.engine.mask_process.compile_schema: bounded repetitions written out); the same random walks
    (tokens drawn uniformly from what the mask allows) for every count and compile. Per schema, compile and count: ms
    per step (p50, mean, max) of the fill and of the accept, and whether both compiles drew the same tokens."""
    import random
    import xgrammar as xgr
    from tp_lora.engine.grammar import tokenizer_info
    from tp_lora.engine.mask_process import compile_schema
    info = tokenizer_info(tok, vocab, [2])
    ok = torch.tensor([bool(b) and min(b) >= 0x20 for b in info.decoded_vocab] + [False] * (vocab - len(
        info.decoded_vocab)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {}
    for name in ("flat", "nested", "free_text"):
        text = json.dumps(SCHEMAS[name][0])
        walks = {}
        for how, compiled in (("xgrammar", compiler.compile_json_schema(text, any_whitespace=False,
                                                                        separators=(",", ":"))),
                              ("runtime", compile_schema(compiler, text))):
            for n in threads:
                batch, rng = xgr.BatchGrammarMatcher(n), random.Random(0)
                matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
                mask = xgr.allocate_token_bitmask(rows, vocab)
                fills, accepts, drawn = [], [], []
                for _ in range(steps):
                    live = [i for i, m in enumerate(matchers) if not m.is_terminated()]  # as Grammars._fill
                    if not live:
                        break
                    mask.zero_()
                    t0 = time.perf_counter()
                    batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, indices=live)
                    fills.append(time.perf_counter() - t0)
                    allowed = ((mask[:, :, None] >> torch.arange(32)) & 1).bool().flatten(1)[:, :vocab] & ok
                    toks = [rng.choice(allowed[i].nonzero().flatten().tolist() or [2]) for i in live]
                    drawn.append(toks)
                    t0 = time.perf_counter()
                    xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], toks)
                    accepts.append(time.perf_counter() - t0)
                ms = lambda xs: {"p50": 1e3 * statistics.median(xs), "mean": 1e3 * statistics.mean(xs),
                                 "max": 1e3 * max(xs)}
                walks.setdefault(n, drawn)
                out[f"{name}/{how}@{n}"] = {"fill_ms": ms(fills), "accept_ms": ms(accepts), "steps": len(fills),
                                            "same_tokens": drawn == walks[n]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[320, 32000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--forced", action="store_true", help="what jump-forward could skip (forced_tokens), only")
    ap.add_argument("--batch-fill", action="store_true", help="the engine's batched accept + fill (batch_fill), only")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="fill threads of --batch-fill")
    args = ap.parse_args()
    texts = corpus()
    results = {}
    for vocab in args.vocab:
        tok = byte_level_tokenizer(vocab, texts)
        if args.batch_fill:
            r = results[f"batch_fill@{vocab}"] = batch_fill(tok, tok.get_vocab_size(), args.threads)
            for key, f in r.items():
                print(f"vocab {vocab:6d} {key:20s} same tokens {f['same_tokens']!s:5s} fill ms/step p50 "
                      f"{f['fill_ms']['p50']:.3f} mean "
                      f"{f['fill_ms']['mean']:.3f} max {f['fill_ms']['max']:.3f}  accept ms/step p50 "
                      f"{f['accept_ms']['p50']:.3f} mean {f['accept_ms']['mean']:.3f}  ({f['steps']} steps)")
            continue
        if args.forced:
            r = results[f"forced@{vocab}"] = forced_tokens(tok, tok.get_vocab_size())
            for name, f in r.items():
                print(f"vocab {vocab:6d} {name:10s} steps {f['steps']:5d}  single-token masks "
                      f"{f['single_token_masks']:4d}  steps token-level jump-forward saves {f['token_level_saves']:3d}"
                      f"  jump-forward string tokens {f['jump_forward_string_tokens']:5d}")
            continue
        for lib, fn in (("xgrammar", bench_xgrammar), ("outlines-core", bench_outlines)):
            r = results[f"{lib}@{vocab}"] = fn(tok, tok.get_vocab_size(), args.reps)
            print(f"{lib:14s} vocab {vocab:6d}  tokenizer {r['tokenizer_s'] * 1e3:8.1f} ms")
            for name in (*SCHEMAS, "json_object"):
                s = r[name]
                print(f"    {name:12s} compile {s['compile_s'] * 1e3:8.1f} ms  mask us/token mean "
                      f"{s['mask_us_mean']:7.1f} p50 {s['mask_us_p50']:6.1f} max {s['mask_us_max']:7.1f} "
                      f"({s['tokens']} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
