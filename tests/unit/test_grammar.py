"""Structured output's pieces without a model: response_format parsed from request lines and API values; the bitmask
applied to a step's grammar rows only (as xgrammar's own kernel does); the sampler drawing only what the grammar
allows and ending the sequence when the document is complete (EOS or not); compile errors, the compile cache, a
tokenizer that cannot spell JSON, a dead end, and the grammar library missing (named in the error)."""
import json
import sys

import pytest
import torch

from tp_lora.config import GenerationConfig
from tp_lora.engine.ebnf import expand_repetitions
from tp_lora.engine.grammar import Grammars, pack, tokenizer_info
from tp_lora.engine.mask_process import compile_schema
from tp_lora.engine.requests import Request, Result, set_rules
from tp_lora.engine.response_format import ANY_OBJECT, parse_response_format, schema_error
from tp_lora.engine.sampler import Sampler, draw
from tp_lora.engine.tokenizer import TextTokenizer
from tp_lora.ops.sampling import grammar_allowed, unpack
from tp_lora.request_files import parse_request

xgr = pytest.importorskip("xgrammar")
EOS, VOCAB = 2, 296  # a model vocabulary wider than the tokenizer's (padding rows are never allowed)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "s": {"type": "string", "maxLength": 3}}, "required": ["n", "s"]}


def fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE over every byte (<unk>, <s>, </s>, 256 bytes, a few merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"n":1,"s":"ab"}'] * 4, trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return TextTokenizer(str(path))


def req(index: int, grammar=None, **kw) -> Request:
    r = Request(index, id=index, prompt_token_ids=[1, 5], max_new_tokens=40, **kw)
    r.grammar = grammar
    return r


def test_response_format_from_request_lines_and_api_values():
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}) == ("json_object", ANY_OBJECT)
    assert parse_response_format(fmt(SCHEMA)) == ("json_schema", json.dumps(SCHEMA))
    line = parse_request(0, json.dumps({"prompt_token_ids": [1], "response_format": fmt(SCHEMA)}), 8)
    assert line.error is None and line.grammar == ("json_schema", json.dumps(SCHEMA))
    for bad, words in (({"type": "xml"}, "'type' one of"), ({"type": "json_schema"}, "'schema' object"),
                       ({"type": "json_object", "json_schema": {}}, "goes with"),
                       ({"type": "json_object", "extra": 1}, "unknown field(s) ['extra']"),
                       (fmt(SCHEMA) | {"json_schema": {"schema": {}, "nom": 1}}, "['nom']"), ("json", "an object")):
        line = parse_request(0, json.dumps({"prompt_token_ids": [1], "response_format": bad}), 8)
        assert "'response_format" in line.error and words in line.error, (bad, line.error)
    r = Request(0, id=0)
    set_rules(r, {"response_format": {"type": "json_object"}})  # LLM.generate(response_format=...)
    assert r.grammar == ("json_object", ANY_OBJECT)


def test_the_draw_masks_grammar_rows_only_as_xgrammars_kernel():
    """The draw's grammar rows choose among the tokens xgrammar's own masking kernel leaves; the other rows (and the
    reported log-probabilities) see the model's logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, (VOCAB + 31) // 32), dtype=torch.int32, generator=g)
    for k, row in enumerate((1, 3)):  # each grammar row's argmax forbidden
        top = int(logits[row].argmax())
        word = int(bits[k, top // 32]) & 0xFFFFFFFF & ~(1 << (top % 32))
        bits[k, top // 32] = word - (1 << 32) if word >= 1 << 31 else word
    full = torch.full((4, bits.shape[1]), -1, dtype=torch.int32)
    full[[1, 3]] = bits
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full)
    every = torch.stack([pack(list(range(VOCAB)), VOCAB), pack([EOS], VOCAB)])  # every token printable; EOS stops
    toks, lps = draw(logits, [0.0] * 4, 1.0, None, grammar=([1, 3], bits, every))
    assert toks.tolist() == want.argmax(-1).double().tolist() and toks[1] != logits[1].argmax()
    torch.testing.assert_close(lps, torch.log_softmax(logits, -1).gather(-1, toks.long()[:, None]).flatten().double())
    hot, _ = draw(logits, [1.0] * 4, 1.0, torch.Generator().manual_seed(1), grammar=([1, 3], bits, every))
    assert all(want[i, int(t)] > -float("inf") for i, t in enumerate(hot.tolist()))
    assert pack([0, 31, 32, 295], VOCAB).tolist()[:2] == [-2 ** 31 + 1, 1]


def test_the_sampler_draws_what_the_grammar_allows_and_ends_at_the_document(tokenizer):
    for ignore_eos in (False, True):
        s = Sampler(GenerationConfig(), {EOS}, tokenizer)
        reqs = [req(0, ("json_schema", json.dumps(SCHEMA)), ignore_eos=ignore_eos), req(1)]
        assert all(s.check(r, VOCAB) is None for r in reqs)
        results = [Result(r) for r in reqs]
        g = torch.Generator().manual_seed(1)
        for step in range(30):
            logits = torch.randn(2, VOCAB, generator=g) * 4
            toks = [int(t) for t in s.sample(logits, reqs)[0].tolist()]
            for res, t in zip(results, toks):
                res.output_token_ids.append(t)
            if s.finished(results[0], toks[0], step + 1):
                break
        out = results[0].output_token_ids
        assert results[0].finish_reason == "stop" and out[-1] == EOS, out
        doc = json.loads(tokenizer.decode(out))
        assert set(doc) == {"n", "s"} and 0 <= doc["n"] <= 9 and len(doc["s"]) <= 3, doc
        assert not all(t < 270 and tokenizer.decode([t]).isprintable() for t in results[1].output_token_ids)


def test_compile_errors_cache_and_tokenizers_that_cannot_spell_json(tokenizer, tmp_path):
    g = Grammars(tokenizer, {EOS})
    a, b = req(0, ("json_schema", json.dumps(SCHEMA))), req(1, ("json_schema", json.dumps(SCHEMA)))
    assert g.check(a, VOCAB) is None and g.check(b, VOCAB) is None and len(g.compiled) == 1  # once per schema
    bad = g.check(req(2, ("json_schema", '{"type": "objectx"}')), VOCAB)
    assert "'response_format.json_schema.schema'" in bad and "objectx" in bad
    assert "min_tokens" in g.check(req(3, ("json_object", ANY_OBJECT), min_tokens=1), VOCAB)
    assert "tokenizer" in Grammars(None, {EOS}).check(a, VOCAB)
    assert "eos_token_id" in Grammars(tokenizer, set()).check(a, VOCAB)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tiny = Tokenizer(models.BPE())  # byte-level, but only the bytes of its text: no '{' nor '"'
    tiny.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tiny.train_from_iterator(["hello world"], trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>"],
                                                                  show_progress=False))
    tiny.save(str(tmp_path / "tokenizer.json"))
    assert "cannot spell" in Grammars(TextTokenizer(str(tmp_path / "tokenizer.json")), {EOS}).check(a, 64)


def test_a_dead_end_allows_only_the_stop_tokens(tokenizer):
    g = Grammars(tokenizer, {EOS})
    r = req(0, ("json_object", ANY_OBJECT))
    assert g.check(r, VOCAB) is None
    sel, bits = g.fill([req(1), r], pin=False)
    assert sel == [1] and bool(bits.any())
    # a matcher state whose next character no token spells: a row of no bits
    _, words, allow = g.on_device((sel, torch.zeros_like(bits), None), torch.device("cpu"))
    stops = unpack(pack([EOS], VOCAB)[None], VOCAB)[0]
    assert torch.equal(grammar_allowed(words, allow, VOCAB)[0], stops)


def test_bounded_repetitions_are_written_out_as_rules_and_nothing_else_changes():
    grammar = ('root ::= (("[" item{0, 2} "]") | ("x{0, 2}" [{}]{1, 2}) | (item{2, 2} item{1, 3} digit{1, -1}))\n'
               'item ::= (("a"))\nbig ::= ((item{0, 65}))\ndigit ::= (([0-9\\]{0, 1}]))\n')
    got = expand_repetitions(grammar)
    assert got.splitlines()[:4] == [
        'root ::= (("[" (item__then0_2)) | ("x{0, 2}" [{}]{1, 2}) | ((item item) (item item__upto_2) digit{1, -1}))',
        'item ::= (("a"))', 'big ::= ((item{0, 65}))', 'digit ::= (([0-9\\]{0, 1}]))']
    assert got.splitlines()[4:] == [  # "]" after item{0, 2} folded into its chain; item{1, 3} followed by a rule
        'item__then0_0 ::= ("]")', 'item__then0_1 ::= (("]") | (item item__then0_0))',
        'item__then0_2 ::= (("]") | (item item__then0_1))',
        'item__upto_1 ::= ("" | (item))', 'item__upto_2 ::= ("" | (item item__upto_1))']
    assert expand_repetitions("root ::= (a{0, 0} a{3, 1})\n") == 'root ::= ("" a{3, 1})\n'
    assert expand_repetitions('root ::= (a{1, 1} "x" | a{0, 1} ) "y"\n') == (  # a literal of another sequence stays
        'root ::= ((a a__then0_0) | (a__upto_1) ) "y"\na__then0_0 ::= ("x")\na__upto_1 ::= ("" | (a))\n')
    assert expand_repetitions('root ::= (a{1, 1} "x"* "z")\n') == 'root ::= ((a) "x"* "z")\n'  # "x" repeats: kept


# Bounded strings, arrays, an exact length, an integer range and a free string: the bounds xgrammar writes as rule{lo,
# hi}, and what it does not.
BOUNDED = [SCHEMA, {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}, "minItems": 1,
                    "maxItems": 3},
           {"type": "object", "properties": {"k": {"type": "string", "minLength": 2, "maxLength": 2},
                                             "t": {"type": "string"}}, "required": ["k", "t"]},
           {"type": "string", "format": "date-time"}, {"type": "integer", "minimum": -5, "maximum": 12345},
           {"type": "object", "minProperties": 1, "maxProperties": 3, "additionalProperties": {"type": "string"}}]


def test_literals_holding_braces_are_left_alone():
    """A schema whose strings spell repetitions: its grammar text comes back unchanged."""
    schema = {"type": "object", "properties": {"t": {"const": 'a{1, 2}"[x]'}, "e": {"enum": ["x{0, 3}", "[y]"]}},
              "required": ["t", "e"]}
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
    assert "{1, 2}" in ebnf and expand_repetitions(ebnf) == ebnf


@pytest.mark.parametrize("schema", BOUNDED, ids=["object", "array", "exact", "date-time", "range", "properties"])
def test_written_out_repetitions_give_xgrammars_masks_on_random_walks(tokenizer, schema):
    """The runtime's compiled schema (compile_schema) against xgrammar's own compile of it: the same next-token mask
    at every step of 24 random walks (tokens drawn from what the mask allows, the stop token once allowed)."""
    import random
    info = tokenizer_info(tokenizer.tok, VOCAB, [EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    text = json.dumps(schema)
    ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=(",", ":")))
    assert expand_repetitions(ebnf) != ebnf  # the schema has bounds to write out
    theirs = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
    ours = compile_schema(compiler, text)
    rng, steps = random.Random(0), 0
    for _ in range(24):
        a, b = xgr.GrammarMatcher(theirs), xgr.GrammarMatcher(ours)
        for _ in range(200):  # a walk inside an unbounded string may run on: it stops here
            ma, mb = xgr.allocate_token_bitmask(1, VOCAB), xgr.allocate_token_bitmask(1, VOCAB)
            a.fill_next_token_bitmask(ma)
            b.fill_next_token_bitmask(mb)
            # the vocabulary's bits only: the last word's bits past VOCAB are xgrammar's padding (0.2.9 sets them on
            # some compiled grammars and not on others)
            allowed = [t for t in range(VOCAB) if (ma[0, t // 32] >> (t % 32)) & 1]
            assert allowed == [t for t in range(VOCAB) if (mb[0, t // 32] >> (t % 32)) & 1], (
                f"masks differ after {steps} steps of a walk over {text}")
            tok = EOS if EOS in allowed else rng.choice(allowed)
            assert a.accept_token(tok) and b.accept_token(tok)
            steps += 1
            if a.is_terminated():
                break
        assert a.is_terminated() == b.is_terminated()
    assert steps > 2 * 24  # every walk took steps


def test_without_the_library_the_error_names_the_extra(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    assert "pip install 'tp_lora[structured]'" in schema_error(("json_object", ANY_OBJECT))
    assert "tp_lora[structured]" in Grammars(tokenizer, {EOS}).check(req(0, ("json_object", ANY_OBJECT)), VOCAB)
    from tp_lora.server.errors import APIError
    from tp_lora.server.openai_models import CompletionRequest, parse
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert e.value.status == 400 and e.value.param == "response_format" and "tp_lora[structured]" in e.value.message


SCHEMAS = [SCHEMA, {"type": "object", "properties": {"k": {"enum": ["ab", "cd", "e"]}}, "required": ["k"]},
           {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}]


def _logits(index: int, number: int) -> torch.Tensor:
    """Request `index`'s logits for its token after `number` drawn: the same whatever else shares the step."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1000 * index + number)) * 3


def _run_sampler(tokenizer, ahead: bool, processes=None):
    """Six concurrent grammar requests (three schemas, seeded draws) and a free one through a Sampler (its matchers in
    `processes` processes; None: the host's count), stepped as
    the engine does: in line (each step's tokens read before the next step samples) or ahead (the next step samples
    before the last one's tokens are read; follow() registers them, hand_on() sends them once their step's 2 ms have
    passed, as a device's would).
    -> (each request's tokens, every mask the sampler applied by (request, tokens drawn), bitmask fills on the
    calling thread)."""
    import time
    s = Sampler(GenerationConfig(), {EOS}, tokenizer)
    if processes is not None:
        s.grammars = Grammars(tokenizer, {EOS}, processes=processes)
    reqs = [req(i, ("json_schema", json.dumps(SCHEMAS[i % 3])), temperature=1.0, seed=i) for i in range(6)]
    reqs.append(req(6, temperature=1.0, seed=6))
    assert all(s.check(r, VOCAB) is None for r in reqs)
    results = {r.index: Result(r) for r in reqs}
    masks, fills = {}, []
    g = s.grammars
    take, fill, send = g.masks, g.fill, g._send

    def masks_seen(rs, drawn, pin):
        got, waited = take(rs, drawn, pin)
        for j, i in enumerate(got[0] if got else []):
            masks[(rs[i].index, drawn[i])] = got[1][j].clone()
        return got, waited

    def fill_counted(rs, pin):  # in line, on the calling thread
        fills.append(True)
        return fill(rs, pin)

    def send_counted(job):  # ahead: a step's tokens sent on
        fills.append(False)
        return send(job)
    g.masks, g.fill, g._send = masks_seen, fill_counted, send_counted

    class Later:  # a step's event: passed 2 ms after its launch, as a device's would
        def __init__(self):
            self.at = time.perf_counter() + 0.002

        def query(self):
            return time.perf_counter() >= self.at

        def synchronize(self):
            time.sleep(max(0.0, self.at - time.perf_counter()))

    def read(batch, out):
        for r, tok in zip(batch, out[0].tolist()):
            res = results[r.index]
            if r.index in ended:  # a row of a finished request, launched ahead: dropped
                continue
            res.output_token_ids.append(int(tok))
            if s.finished(res, int(tok), len(res.output_token_ids)):
                s.final_text(res)
                ended.add(r.index)
    draws, last, ended = {r.index: 0 for r in reqs}, None, set()
    while batch := [r for r in reqs if r.index not in ended]:
        out = s.sample(torch.stack([_logits(r.index, draws[r.index]) for r in batch]), batch)
        for r in batch:
            draws[r.index] += 1
        if ahead:
            s.follow(out.clone(), Later())
            if last is not None:
                s.hand_on()
                read(*last)
            last = (batch, out)
        else:
            read(batch, out)
    if last is not None:
        read(*last)
    return {i: r.output_token_ids for i, r in results.items()}, masks, fills


def test_masks_filled_ahead_equal_masks_filled_in_line(tokenizer):
    """The same seeded requests give the same tokens, and every mask applied in line is applied ahead too, bit for
    bit; ahead, only the first tokens' masks are filled in line (the process fills every later one ahead)."""
    want, want_masks, _ = _run_sampler(tokenizer, ahead=False)
    got, got_masks, fills = _run_sampler(tokenizer, ahead=True)
    assert got == want
    assert all(want[i][-1] == EOS for i in range(6)) and len(set(map(tuple, want.values()))) == 7
    assert set(want_masks) <= set(got_masks) and len(want_masks) > 40
    for key, bits in want_masks.items():
        assert torch.equal(got_masks[key], bits), key
    assert fills.count(True) == 1 and fills.count(False) >= max(len(want[i]) for i in range(6)) - 1


@pytest.mark.parametrize("kv_blocks, ignore_eos", [(0, False), (6, False), (0, True)])
def test_engine_run_ahead_with_grammar_rows_matches_step_by_step(tokenizer, tmp_path, kv_blocks, ignore_eos):
    """Through the engine on the CPU: grammar rows no longer make it read each step before launching the next
    (run_ahead forced on, as on CUDA), and give the tokens of reading every step; with a KV budget of a few blocks
    too (preempted grammar rows resume with masks filled in line); with ignore_eos, a complete document still ends
    its sequence (the grammar's end, known from the token the worker's mask allowed)."""
    from tp_lora import distributed as comm
    from tp_lora.assets import write_tiny_llama
    from tp_lora.config import RunConfig
    from tp_lora.engine.engine import Engine
    model = tmp_path / "model"
    write_tiny_llama(str(model), vocab_size=VOCAB, seed=3)
    with open(model / "config.json") as f:
        hf = json.load(f)
    with open(model / "config.json", "w") as f:
        json.dump(hf | {"eos_token_id": EOS}, f)
    tokenizer.tok.save(str(model / "tokenizer.json"))

    def run(run_ahead: bool):
        cfg = RunConfig()
        cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = "cpu", "float32", False, False
        cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step = 8, 32
        cfg.scheduler.kv_block_size = 4
        engine = Engine(cfg, comm.single_process(), str(model), None)
        if kv_blocks:
            m = engine.model
            block_bytes = 4 * 2 * len(m.layers) * m.kv_heads * m.head_dim * 4
            engine.cfg.scheduler.kv_cache_mb = (kv_blocks + 1.5) * block_bytes / 2**20  # + the scratch block
        engine.run_ahead = run_ahead
        reqs = [Request(i, id=i, prompt_token_ids=[1, 5 + i, 9], max_new_tokens=12 if kv_blocks else 40,
                        temperature=1.0, seed=i, ignore_eos=ignore_eos) for i in range(8)]
        for r in reqs:  # every row a grammar row: steps launched ahead are steps with grammar rows
            r.grammar = ("json_schema", json.dumps(SCHEMAS[r.index % 3]))
        out = engine.generate(reqs)
        return [(r.output_token_ids, r.finish_reason, r.error) for r in out], engine.stats
    want, _ = run(False)
    got, st = run(True)
    assert got == want
    assert sum(reason == "stop" for _, reason, _ in want) >= 3
    assert st.ahead_steps > 0 and st.mask_steps > 0 and st.mask_wait_seconds >= 0
    assert not kv_blocks or st.preemptions > 0


def test_the_matchers_process_ends_with_its_owner_and_its_end_is_an_error_not_a_hang(tokenizer, monkeypatch):
    """The matchers' process of a Grammars ends once the Grammars is dropped (an engine per test must not leave one
    behind); a process that died, or stopped answering, makes the next call raise, naming it, for work on its socket
    and on the board alike; a board job that fails raises its error, and the process goes on."""
    import gc
    import os
    import signal
    from tp_lora.engine import mask_process
    r = req(0, ("json_schema", json.dumps(SCHEMA)))
    g = Grammars(tokenizer, {EOS}, processes=1)
    assert g.check(r, VOCAB) is None and g.fill([r], pin=False)[0] == [0]
    proc = g.procs.procs[0].proc
    del g
    gc.collect()
    assert proc.wait(timeout=10) == 0
    g = Grammars(tokenizer, {EOS}, processes=1)
    assert g.check(r, VOCAB) is None
    g.procs.procs[0].proc.kill()
    g.procs.procs[0].proc.wait()
    with pytest.raises(RuntimeError, match="grammar process ended"):
        g.fill([r], pin=False)
    g = Grammars(tokenizer, {EOS}, processes=2)  # polling the board
    assert g.check(r, VOCAB) is None and g.fill([r], pin=False)[0] == [0]
    brace = tokenizer.tok.token_to_id("{")
    no = g.procs.post(0, mask_process.SLOTS + 7, 1, [0], [brace])  # a slot past the region: the job fails
    with pytest.raises(RuntimeError, match="grammar: "):
        g.procs.done(no, g.procs.procs, block=True)
    assert g.fill([r], pin=False)[0] == [0]
    monkeypatch.setattr(mask_process, "REPLY_TIMEOUT_S", 0.5)
    pid = g.procs.procs[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match="did not answer in 0.5 s"):
            g.fill([r], pin=False)
        no = g.procs.post(0, 0, 1, [0], [brace])
        with pytest.raises(RuntimeError, match="did not answer in 0.5 s"):
            g.procs.done(no, g.procs.procs, block=True)
    finally:
        os.kill(pid, signal.SIGCONT)
    g.procs.procs[0].proc.kill()
    g.procs.procs[0].proc.wait()
    tokens = torch.tensor([[float(brace)], [0.0]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="grammar process ended"):  # found by the next step's look, not a wait
        g.follow([r], [2], tokens, None, torch.device("cpu"))
        g.follow([r], [3], tokens, None, torch.device("cpu"))


def test_a_job_fills_its_rows_and_zeros_for_a_forgotten_request_and_its_tokens_advance_the_others(tokenizer):
    """A step's board job read by one of two processes: its rows (the requests it holds, at their places in the
    step's slot) take their tokens, a request it forgot meanwhile gets zeros, the other process's rows are left alone,
    and its flag alone is raised (the process's code, run here in line)."""
    import mmap
    from tp_lora.engine import mask_process
    words = (VOCAB + 31) // 32
    shared = mask_process.Shared(mmap.mmap(-1, mask_process.Shared.size(words, 4)), words, 4)
    state = mask_process.Matchers(tokenizer_info(tokenizer.tok, VOCAB, [EOS]).serialize_json(), shared, 1, 2)
    key = ("json_schema", json.dumps(SCHEMA))
    ms = [state.matcher(i, key) for i in (1, 3)]
    brace = tokenizer.tok.token_to_id("{")
    shared.slot(1, 4).fill_(5)
    shared.board[7 % mask_process.BOARD, :mask_process.FIELDS] = (7, 9, 1, 4, 4)
    shared.board[7 % mask_process.BOARD, mask_process.FIELDS:mask_process.FIELDS + 4] = (1, 2, 5, 3)
    shared.board[7 % mask_process.BOARD, mask_process.FIELDS + 4:mask_process.FIELDS + 8] = (brace,) * 4
    state.board_job(7)
    bits = shared.slot(1, 4)
    assert int(shared.w32[mask_process.LINE]) == 9 and int(shared.w32[0]) == 0
    assert (bits[1] == 5).all() and not bits[2].any() and bits[0].any() and torch.equal(bits[0], bits[3])
    assert all(m.accept_string('"n"') for m in ms)
    with pytest.raises(RuntimeError, match="holds job 7, expected 11"):
        state.board_job(11)


@pytest.mark.parametrize("ahead", [False, True])
def test_masks_of_three_processes_equal_one_processs(tokenizer, ahead):
    """Requests spread over three matcher processes (a host with cores to spare) get the tokens and, bit for bit, the
    masks of one process, filled ahead and in line."""
    want, want_masks, _ = _run_sampler(tokenizer, ahead=ahead, processes=1)
    got, got_masks, _ = _run_sampler(tokenizer, ahead=ahead, processes=3)
    assert got == want and set(got_masks) == set(want_masks) and len(want_masks) > 40
    for key, bits in want_masks.items():
        assert torch.equal(got_masks[key], bits), key
