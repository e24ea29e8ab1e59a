"""The embedded default's tokenizer is lossless: fresh random Unicode (seeded; ASCII punctuation alone, controls,
combining marks, CJK, emoji, any code point but surrogates) decodes back to itself, whole and streamed; so
`response_format` json_schema and json_object run on the default server (`launch/serve.py` with no model given),
through the official `openai` client, and the outputs validate (jsonschema) / parse; without the
response_format the same request's output does not validate."""
import json
import random
import string

import openai
import pytest

from _json_model import fmt, valid
from _server import BASE, Server, env_for
from tp_lora.assets import SPECIAL_TOKENS
from tp_lora.engine.tokenizer import Detokenizer, load_tokenizer

pytest.importorskip("xgrammar")
MAX_TOKENS = 96
PROMPT = '{"key": [1, 2.5]} na\u00efve \u2014 \u65e5\u672c\u8a9e'  # characters the old default dropped
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "ok", "tags"]}

RANGES = [(0x00, 0x7F), (0x80, 0x7FF), (0x300, 0x36F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x800, 0xD7FF),
          (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]  # surrogates (0xD800..0xDFFF) are no text: left out


def random_text(rng: random.Random) -> str:
    """A few characters: lone ASCII punctuation, or a mix drawn from RANGES."""
    if rng.random() < 0.2:
        return rng.choice(string.punctuation) * rng.randint(1, 3)
    return "".join(chr(rng.randint(*rng.choice(RANGES))) for _ in range(rng.randint(1, 24)))


@pytest.fixture(scope="module")
def tok(default):
    return load_tokenizer(default["model"])


@pytest.mark.parametrize("seed", range(2))
def test_random_unicode_decodes_back_to_itself_whole_and_streamed(tok, seed):
    rng = random.Random(seed)
    texts = [random_text(rng) for _ in range(1500)]
    texts = [t for t in texts if not any(s in t for s in SPECIAL_TOKENS)]  # read as those tokens, as HF does
    for text in texts:
        ids = tok.encode(text)
        assert ids[0] == 1 and tok.decode(ids) == text, (text, ids)
        d = Detokenizer(tok)
        pieces = [d.add([i]) for i in ids[1:]] + [d.flush()]
        assert "".join(pieces) == text, (text, pieces)  # no piece splits a character (U+FFFD) or drops one
    assert all(tok.decode(tok.encode(c)) == c for c in string.printable)


@pytest.fixture(scope="module")
def c(home, default, tmp_path_factory):
    srv = Server(["scheduler.max_batch_size=8"], env_for(home), tmp_path_factory.mktemp("default_tok") / "server.log")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    srv.kill()


def ask(c, kind: str, model: str, chat: bool, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one request asking for SCHEMA (kind json_schema) or any object (json_object)."""
    kw = {"model": model, "max_tokens": MAX_TOKENS, **kw}
    rf = fmt(SCHEMA) if kind == "json_schema" else {"type": "json_object"}
    if chat:
        out = c.chat.completions.create(messages=[{"role": "user", "content": "Describe a person in JSON."}],
                                        response_format=rf, **kw)
        return out.choices[0].message.content, out.choices[0].finish_reason
    out = c.completions.create(prompt=PROMPT, extra_body={"response_format": rf}, **kw)
    return out.choices[0].text, out.choices[0].finish_reason


def test_json_schema_on_the_default_server_validates(c):
    outs = [ask(c, "json_schema", model, chat, temperature=t, seed=s)
            for model, chat, t, s in ((BASE, True, 0, None), ("alpha", False, 0, None), ("gamma", True, 1.0, 1),
                                      ("beta", False, 1.0, 2))]
    assert all(why == "stop" and valid(text, SCHEMA) for text, why in outs), outs
    # the control: the same request without response_format is no JSON (the mask is what makes it so)
    plain = c.completions.create(model="alpha", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert not valid(plain, SCHEMA), plain


def test_json_object_on_the_default_server_parses(c):
    outs = [ask(c, "json_object", model, chat, temperature=1.0, seed=s, max_tokens=200)
            for s, (model, chat) in enumerate([(BASE, True), ("alpha", False), ("beta", True), (BASE, False),
                                              ("gamma", True), ("alpha", True)])]
    stopped = [text for text, why in outs if why == "stop"]
    assert len(stopped) >= 2, outs  # others cut by max_tokens ("length") are expected on a random model
    assert all(isinstance(json.loads(text), dict) for text in stopped), stopped
