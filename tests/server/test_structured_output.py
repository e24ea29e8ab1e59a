"""Structured output on the random tiny model (with a tokenizer that can spell JSON): `response_format` json_schema
outputs parse and validate (jsonschema) for 20 schemas through the official `openai` client, on both endpoints,
streamed and not, with an adapter and with the base; json_object outputs parse; a bad schema is a 400 naming
response_format; LLM.generate(response_format=...) the same. The same prompts without a response_format do not
give valid JSON: a mask not applied fails these tests."""
import concurrent.futures as cf
import json

import httpx
import openai
import pytest

from _json_model import SCHEMAS, fmt, valid, write_json_model
from _server import Server, env_for

BASE = "model"  # the model dir's name
MAX_TOKENS = 64  # every schema's document closes well within it on this model
pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_json_model(tmp_path_factory.mktemp("json_model"))


@pytest.fixture(scope="module")
def server(home, paths, tmp_path_factory):
    srv = Server([f"model.path={paths['model']}", f"lora.adapter_dir={paths['adapter_dir']}",
                  "scheduler.max_batch_size=16", "server.max_queue=128"], env_for(home),
                 tmp_path_factory.mktemp("structured") / "server.log")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def c(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(c, schema: dict, model: str, chat: bool, stream: bool, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one request with that schema."""
    common = dict(model=model, stream=stream, **{"max_tokens": MAX_TOKENS, **kw})
    if schema is not None:
        common["response_format"] = fmt(schema) if schema != "object" else {"type": "json_object"}
    if chat:
        out = c.chat.completions.create(messages=[{"role": "user", "content": "reply in json"}], **common)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [ch.choices[0] for ch in out if ch.choices]
        return "".join(ch.delta.content or "" for ch in chunks), chunks[-1].finish_reason
    # the client's completions take no response_format (OpenAI's legacy endpoint has none; vLLM's has)
    rf = common.pop("response_format", None)
    out = c.completions.create(prompt="json:", **common, **({"extra_body": {"response_format": rf}} if rf else {}))
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = [ch.choices[0] for ch in out if ch.choices]
    return "".join(ch.text for ch in chunks), chunks[-1].finish_reason


def test_json_schema_outputs_validate_streamed_and_not_adapter_and_base(c):
    cases = [(i, model, chat, stream) for i in range(len(SCHEMAS)) for model, chat, stream in
             (("alpha", False, False), (BASE, True, True), (BASE, False, True), ("beta", True, False))]
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda case: ask(c, SCHEMAS[case[0]], case[1], case[2], case[3], temperature=0),
                             cases))
    bad = [(case, text, why) for case, (text, why) in zip(cases, outs) if why != "stop" or not valid(
        text, SCHEMAS[case[0]])]
    assert not bad, bad
    # sampled too, with seeds: different documents, each valid
    with cf.ThreadPoolExecutor(16) as pool:
        sampled = list(pool.map(lambda i: ask(c, SCHEMAS[i % 4], "alpha", False, False, temperature=1.0, seed=i),
                                range(8)))
    assert all(why == "stop" and valid(text, SCHEMAS[i % 4]) for i, (text, why) in enumerate(sampled)), sampled
    assert len({text for text, _ in sampled}) > 4


def test_without_response_format_the_same_requests_are_not_json(c):
    """The control: a mask not applied gives text that does not validate."""
    outs = [ask(c, None, model, False, False, temperature=0, extra_body={"ignore_eos": True})[0]
            for model in ("alpha", BASE)]
    assert not any(valid(text, SCHEMAS[0]) for text in outs), outs


def test_json_object_outputs_parse(c):
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: ask(c, "object", ("alpha", BASE)[i % 2], i % 3 == 0, i % 2 == 0,
                                           temperature=1.0, seed=i, max_tokens=120), range(8)))
    stopped = [text for text, why in outs if why == "stop"]
    assert len(stopped) >= 4, outs  # the others were cut by max_tokens ("length"): expected, documented
    assert all(isinstance(json.loads(text), dict) for text in stopped), stopped


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("response_format, words", [
    (fmt({"type": "objectx"}), "json_schema.schema"),
    (fmt({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_bad_schema_is_a_400_naming_it(server, path, response_format, words):
    body = {"model": "alpha", "max_tokens": 4, "response_format": response_format}
    body.update({"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    for stream in (False, True):
        r = httpx.post(f"{server.url}/v1/{path}", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and words in err["message"], err


def test_llm_generate_and_request_rules(paths):
    from tp_lora import LLM
    with LLM(model=paths["model"], adapter_dir=paths["adapter_dir"], **{"lora.max_loras": 2}) as llm:
        for schema in SCHEMAS[5:9]:
            outs = llm.generate(["json:", [1, 40, 41]], adapter=["alpha", None], max_new_tokens=MAX_TOKENS,
                                temperature=0, response_format=fmt(schema))
            assert all(o["finish_reason"] == "stop" and valid(o["text"], schema) for o in outs), outs
        # steps launched ahead of the host's read (the CUDA default), forced on here: a grammar row's step waits
        # for the read (its matcher takes the token first), so the outputs are the same
        llm.engine.run_ahead = True
        again = llm.generate(["json:", [1, 40, 41]], adapter=["alpha", None], max_new_tokens=MAX_TOKENS,
                             temperature=0, response_format=fmt(SCHEMAS[8]))
        assert [o["output_token_ids"] for o in again] == [o["output_token_ids"] for o in outs]
        llm.engine.run_ahead = False
        plain = llm.generate("json:", adapter="alpha", max_new_tokens=MAX_TOKENS, temperature=0)
        assert not valid(plain[0]["text"], SCHEMAS[5])
        bad = llm.generate("json:", response_format=fmt({"type": "objectx"}))[0]
        assert "response_format.json_schema.schema" in bad["error"] and "objectx" in bad["error"], bad
        held = llm.generate("json:", min_tokens=2, response_format={"type": "json_object"})[0]
        assert "min_tokens" in held["error"], held
