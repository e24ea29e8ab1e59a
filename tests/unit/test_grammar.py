"""Structured output's pieces without a model: response_format parsed from request lines and API values; the bitmask
applied to a step's grammar rows only (as xgrammar's own kernel does); the sampler drawing only what the grammar
allows and ending the sequence when the document is complete (EOS or not); compile errors, the compile cache, a
tokenizer that cannot spell JSON, a dead end, and the grammar library missing (named in the error)."""
import json
import sys

import pytest
import torch

from tp_lora.config import GenerationConfig
from tp_lora.engine.grammar import Grammars, apply_mask, pack
from tp_lora.engine.requests import Request, Result, set_rules
from tp_lora.engine.response_format import ANY_OBJECT, parse_response_format, schema_error
from tp_lora.engine.sampler import Sampler
from tp_lora.engine.tokenizer import TextTokenizer
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


def test_the_mask_applies_to_grammar_rows_only_as_xgrammars_kernel():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, (VOCAB + 31) // 32), dtype=torch.int32, generator=g)
    out = apply_mask(logits, [1, 3], bits)
    want = logits.clone()
    full = torch.full((4, bits.shape[1]), -1, dtype=torch.int32)
    full[[1, 3]] = bits
    xgr.apply_token_bitmask_inplace(want, full)
    assert torch.equal(out, want) and torch.equal(out[[0, 2]], logits[[0, 2]])
    assert not torch.equal(out, logits)  # the model's logits stay (reported log-probabilities)
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
    from tp_lora.assets import write_tiny_tokenizer  # the embedded default's: no '{' nor '"'
    from tp_lora.engine.tokenizer import load_tokenizer
    tiny = load_tokenizer(write_tiny_tokenizer(str(tmp_path)))
    assert "cannot spell" in Grammars(tiny, {EOS}).check(a, 256)


def test_a_dead_end_allows_only_the_stop_tokens(tokenizer):
    g = Grammars(tokenizer, {EOS})
    r = req(0, ("json_object", ANY_OBJECT))
    assert g.check(r, VOCAB) is None

    class Nothing:  # a matcher state whose next character no token spells
        def batch_fill_next_token_bitmask(self, matchers, bits):
            bits.zero_()
    g.batch = Nothing()
    sel, bits = g.fill([req(1), r], pin=False)
    assert sel == [1] and torch.equal(bits[0], pack([EOS], VOCAB))


def test_without_the_library_the_error_names_the_extra(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    assert "pip install 'tp_lora[structured]'" in schema_error(("json_object", ANY_OBJECT))
    assert "tp_lora[structured]" in Grammars(tokenizer, {EOS}).check(req(0, ("json_object", ANY_OBJECT)), VOCAB)
    from tp_lora.server.errors import APIError
    from tp_lora.server.openai_models import CompletionRequest, parse
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}})
    assert e.value.status == 400 and e.value.param == "response_format" and "tp_lora[structured]" in e.value.message
