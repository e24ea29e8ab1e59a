"""The server at tp=2 (two ranks over gloo under torchrun): rank 0 takes the HTTP requests, both ranks step; the
offline job's tokens, streams, concurrent clients, run-time adapter loads registered on both ranks, a model dir
without a chat template, structured output (every rank masks alike: tp=1's tokens), a SIGTERM-less end: a lost rank
stops the server non-zero within parallel.timeout_s."""
import asyncio
import os
import shutil
import signal
import time

import httpx
import openai
import pytest

from _json_model import SCHEMAS, fmt, valid
from _server import Server, env_for, load_gamma_copy, runtime_lora

TIMEOUT_S = 20


@pytest.fixture(scope="module")
def server(home, default, reference, tmp_path_factory):
    """The default model copied without tokenizer_config.json (a tokenizer, no chat template), at tp=2."""
    root = tmp_path_factory.mktemp("server2")
    shutil.copytree(default["model"], root / "plain")
    os.remove(root / "plain" / "tokenizer_config.json")
    srv = Server([f"model.path={root / 'plain'}", f"lora.adapter_dir={default['adapter_dir']}", "parallel=tp2",
                  f"parallel.timeout_s={TIMEOUT_S}"] + runtime_lora(tmp_path_factory.getbasetemp()), env_for(home),
                 root / "server.log", nproc=2)
    yield srv
    srv.kill()


def model_of(req):
    return req["adapter"] or "plain"


def test_tp2_greedy_completions_and_streams_match_the_offline_job(server, reference):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        picks = reference * 2
        outs = await asyncio.gather(*[c.completions.create(
            model=model_of(q), prompt=q["prompt_token_ids"], max_tokens=q["max_new_tokens"], temperature=0,
            stream=i >= len(reference)) for i, (q, _) in enumerate(picks)])
        for i, ((q, want), out) in enumerate(zip(picks, outs)):
            if i >= len(reference):
                chunks = [ch async for ch in out]
                tokens = sum([ch.choices[0].token_ids for ch in chunks if ch.choices], [])
                assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
            else:
                tokens = out.choices[0].token_ids
                assert out.choices[0].text == want["text"]
            assert tokens == want["output_token_ids"], (i, q["id"])
    asyncio.run(asyncio.wait_for(main(), 240))


def test_tp2_load_use_unload(server, reference, default, tmp_path):
    q, want = load_gamma_copy(server.url, default, reference, tmp_path)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got = c.completions.create(model="g2", prompt=q["prompt_token_ids"], max_tokens=q["max_new_tokens"],
                               temperature=0)
    assert got.choices[0].token_ids == want["output_token_ids"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "g2"}, timeout=60).status_code == 200
    assert [m.id for m in c.models.list().data] == ["plain", "alpha", "beta", "gamma"]


def test_tp2_chat_without_a_template_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "plain", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_tp2_structured_output_is_tp1s(server, default):
    """response_format at tp=2: the documents validate and are the tokens of an engine at tp=1 (each rank samples
    on its own: a rank masking otherwise would feed the other ranks' steps other tokens)."""
    pytest.importorskip("xgrammar")
    from tp_lora import LLM
    asks = [("alpha", "json:", SCHEMAS[5]), ("plain", [1, 40, 41], SCHEMAS[8])]  # plain: the base model
    with LLM(model=default["model"], adapter_dir=default["adapter_dir"]) as llm:
        want = [llm.generate(prompt, adapter=None if m == "plain" else m, max_new_tokens=48, temperature=0,
                             response_format=fmt(schema))[0]["output_token_ids"] for m, prompt, schema in asks]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    for (model, prompt, schema), tokens in zip(asks, want):
        got = c.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0,
                                   extra_body={"response_format": fmt(schema)}).choices[0]
        assert got.finish_reason == "stop" and valid(got.text, schema), (model, got.text)
        assert got.token_ids == tokens, model


def test_tp2_lost_rank_ends_the_server_non_zero(server):
    """Last: ends the module's server."""
    rank1 = server.ranks()[1]
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    code = server.wait(TIMEOUT_S + 30)
    assert code != 0
    assert time.monotonic() - t0 < TIMEOUT_S + 30
    log = server.log()
    assert "lost the other ranks: rank 1 died" in log, log[-2000:]
