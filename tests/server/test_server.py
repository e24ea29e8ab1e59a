"""The OpenAI-compatible server at tp=1, driven by the official `openai` client: the offline job's tokens for each
adapter and the base, streamed and not, under 32 concurrent clients; adapters loaded and unloaded at run time;
every bad input answered OpenAI-style; a client leaving mid-stream; SIGTERM while loaded (last: it stops the
module's server)."""
import asyncio
import os
import shutil
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from _server import BASE, Server, env_for, model_of, runtime_lora
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.engine.tokenizer import load_tokenizer

BATCH, QUEUE = 8, 40


@pytest.fixture(scope="module")
def server(home, default, reference, tmp_path_factory):
    """The default model and adapters, plus `broken` (NaN weights: registered at start, fails at its first read)."""
    root = tmp_path_factory.mktemp("server1")
    adapters = root / "adapters"
    shutil.copytree(default["adapter_dir"], adapters)
    shutil.copytree(adapters / "alpha", adapters / "broken")
    st = adapters / "broken" / "adapter_model.safetensors"
    tensors = load_file(str(st))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(st), metadata={"format": "pt"})
    srv = Server([f"lora.adapter_dir={adapters}", f"scheduler.max_batch_size={BATCH}",
                  f"server.max_queue={QUEUE}", "scheduler.stop_grace_s=60"]
                 + runtime_lora(tmp_path_factory.getbasetemp()), env_for(home), root / "server.log")
    yield srv
    srv.kill()


def client(srv, **kw):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)


def complete(c, req, **kw):
    return c.completions.create(model=model_of(req), prompt=req["prompt_token_ids"], max_tokens=req["max_new_tokens"],
                                temperature=0, **kw)


def test_greedy_completions_match_the_offline_job(server, reference):
    c = client(server)
    for req, want in reference:  # every default adapter and the base
        got = complete(c, req)
        ch = got.choices[0]
        assert ch.token_ids == want["output_token_ids"], req["id"]
        assert ch.text == want["text"] and ch.finish_reason == want["finish_reason"], req["id"]
        assert got.usage.completion_tokens == len(want["output_token_ids"])
        assert got.usage.prompt_tokens == len(req["prompt_token_ids"])
        chunks = list(complete(c, req, stream=True))
        assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == want["output_token_ids"]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
        assert chunks[-1].choices[0].finish_reason == want["finish_reason"]
        assert chunks[-1].usage.completion_tokens == len(want["output_token_ids"])


def test_text_prompt_stop_string_logprobs_and_chat(server, reference, default):
    c = client(server)
    req, want = reference[1]
    text = want["text"]
    stop = text[3:5]
    got = complete(c, req, stop=[stop, "\u00e9\u00e9\u00e9"]).choices[0]
    assert got.finish_reason == "stop" and got.text == text[:text.find(stop)]
    chunks = list(complete(c, req, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a text prompt is the tokenizer's ids (with <s>); greedy logprobs are the top ones
    ids = load_tokenizer(default["model"]).encode("hello world")
    by_text = c.completions.create(model="beta", prompt="hello world", max_tokens=5, temperature=0, logprobs=2)
    by_ids = c.completions.create(model="beta", prompt=ids, max_tokens=5, temperature=0)
    assert ids[0] == 1 and by_text.choices[0].token_ids == by_ids.choices[0].token_ids
    lp = by_text.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)  # tokens may decode alike
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    chat = c.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                     temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    streamed = list(c.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == chat.choices[0].message.content


def test_32_concurrent_clients_mixing_adapters(server, reference):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        picks = [reference[i % len(reference)] for i in range(32)]
        outs = await asyncio.gather(*[c.completions.create(
            model=model_of(req), prompt=req["prompt_token_ids"], max_tokens=req["max_new_tokens"], temperature=0,
            stream=i % 2 == 1) for i, (req, _) in enumerate(picks)])
        for i, ((req, want), out) in enumerate(zip(picks, outs)):
            if i % 2:
                tokens = sum([ch.choices[0].token_ids async for ch in out if ch.choices], [])
            else:
                tokens = out.choices[0].token_ids
            assert tokens == want["output_token_ids"], (i, req["id"])
    asyncio.run(asyncio.wait_for(main(), 240))


def test_load_use_unload_an_adapter_at_run_time(server, reference, default, tmp_path):
    c = client(server)
    shutil.copytree(os.path.join(default["adapter_dir"], "alpha"), tmp_path / "alpha2")
    req, want = next((q, o) for q, o in reference if q["adapter"] == "alpha")
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="alpha2", prompt=[1, 2], max_tokens=2)
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "alpha2", "lora_path": str(tmp_path /
                                                                                                      "alpha2")})
    assert r.status_code == 200, r.text
    assert "alpha2" in [m.id for m in c.models.list().data]
    got = c.completions.create(model="alpha2", prompt=req["prompt_token_ids"], max_tokens=req["max_new_tokens"],
                               temperature=0)
    assert got.choices[0].token_ids == want["output_token_ids"]
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "alpha2", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha2"})
    assert r.status_code == 200, r.text
    assert "alpha2" not in [m.id for m in c.models.list().data]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="alpha2", prompt=[1, 2], max_tokens=2)
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "alpha2"}).status_code == 404


def test_a_reloaded_adapter_never_meets_its_old_kv_blocks(server, default, tmp_path):
    """Prefix caching through the server: a prompt sent twice reuses its blocks; an adapter unloaded and loaded
    again under its name with other weights answers as those weights do (its old cached blocks are never hit)."""
    c = client(server)
    prompt = list(range(3, 43))  # 40 tokens: two full blocks of 16 can be cached

    def answer(model):
        return c.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].token_ids

    def load(path):
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "swap", "lora_path": str(path)})
        assert r.status_code == 200, r.text

    load(os.path.join(default["adapter_dir"], "alpha"))
    first = answer("swap")
    hits = _metric(server, "tp_lora_engine_prefix_hit_tokens")
    assert answer("swap") == first
    assert _metric(server, "tp_lora_engine_prefix_hit_tokens") == hits + 32
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "swap"}).status_code == 200
    load(os.path.join(default["adapter_dir"], "beta"))
    swapped = answer("swap")
    assert _metric(server, "tp_lora_engine_prefix_hit_tokens") == hits + 32
    beta = answer("beta")
    assert swapped == beta != first
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "swap"}).status_code == 200


def test_adapters_that_do_not_fit_are_refused(server, default, tmp_path):
    model = os.path.join(default["model"])
    write_random_adapter(tmp_path / "r32", model, r=32, lora_alpha=32)
    write_tiny_llama(tmp_path / "other", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    write_random_adapter(tmp_path / "foreign", str(tmp_path / "other"), r=4, lora_alpha=8)
    for name, path, words in (("r32", tmp_path / "r32", "lora.max_rank=16"),
                              ("foreign", tmp_path / "foreign", "another model"),
                              ("missing", tmp_path / "nowhere", "nowhere"),
                              (BASE, tmp_path / "r32", "base model")):
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (name, r.text)
    assert {m.id for m in client(server).models.list().data} == {BASE, "alpha", "beta", "gamma", "broken"}


def test_an_adapter_failing_to_load_fails_only_its_requests(server, reference):
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        good = reference[:4]
        calls = [c.completions.create(model=model_of(q), prompt=q["prompt_token_ids"], max_tokens=q["max_new_tokens"],
                                      temperature=0) for q, _ in good]
        calls.insert(2, c.completions.create(model="broken", prompt=[1, 2, 3], max_tokens=4))
        outs = await asyncio.gather(*calls, return_exceptions=True)
        bad = outs.pop(2)
        assert isinstance(bad, openai.InternalServerError) and "NaN" in str(bad), bad
        for (q, want), out in zip(good, outs):
            assert out.choices[0].token_ids == want["output_token_ids"], q["id"]
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi"}, 400, "'model'"),
    ({"model": BASE}, 400, "'prompt'"),
    ({"model": BASE, "prompt": []}, 400, "'prompt'"),
    ({"model": BASE, "prompt": [1, "x"]}, 400, "prompt"),
    ({"model": BASE, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": BASE, "prompt": "hi", "max_tokens": 5000}, 400, "exceeds the context of 2048"),
    ({"model": BASE, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": BASE, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": BASE, "prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ({"model": BASE, "prompt": "hi", "n": 99}, 400, "'n'"),
    ({"model": BASE, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"model": BASE, "prompt": "hi", "seed": -1}, 400, "seed"),
    ({"model": BASE, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"model": BASE, "prompt": [[1, 2]] * (BATCH + QUEUE + 1)}, 400, "can ever hold"),
])
def test_bad_input_gets_an_openai_error(server, body, status, words):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status
    if status == 429:
        assert r.headers["retry-after"]


def test_malformed_bodies_and_chat_errors(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": BASE, "messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model="alpha", prompt=[1] * 2000, max_tokens=100)


def _metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_leaving_mid_stream_frees_its_sequence(server):
    before = _metric(server, 'tp_lora_requests_total{status="cancelled"}')
    body = {"model": "beta", "prompt": [1, 5], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
    deadline = time.monotonic() + 30
    while _metric(server, 'tp_lora_requests_total{status="cancelled"}') < before + 1 or \
            _metric(server, "tp_lora_running") != 0:
        assert time.monotonic() < deadline, "the cancelled stream still runs"
        time.sleep(0.05)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("tp_lora_time_to_first_token_seconds_bucket", "tp_lora_time_per_output_token_seconds_count",
                 "tp_lora_queue_length", "tp_lora_slot_hit_rate", "tp_lora_adapter_reads",
                 "tp_lora_generation_tokens_total"):
        assert name in metrics


def test_metrics_carry_the_engines_step_stats(server):
    before = [_metric(server, "tp_lora_engine_steps"), _metric(server, "tp_lora_engine_decode_steps")]
    for tokens in (3, 6):
        httpx.post(server.url + "/v1/completions", json={"model": BASE, "prompt": [1, 4], "max_tokens": tokens,
                                                        "ignore_eos": True}, timeout=30).raise_for_status()
        steps, decode = _metric(server, "tp_lora_engine_steps"), _metric(server, "tp_lora_engine_decode_steps")
        # At least this request's steps: a prefill, then tokens - 1 decode-only ones.
        assert steps - before[0] >= tokens and decode - before[1] >= tokens - 1, (before, steps, decode)
        before = [steps, decode]
    graphs, captures = _metric(server, "tp_lora_engine_graph_steps"), _metric(server, "tp_lora_engine_graph_captures")
    assert captures <= graphs <= steps  # graphs on CUDA only
    assert _metric(server, "tp_lora_engine_eager_seconds") + _metric(server, "tp_lora_engine_graph_seconds") > 0


def test_sigterm_while_loaded_delivers_every_admitted_request_and_exits_0(server):
    """Last: stops the module's server."""
    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        calls = [asyncio.ensure_future(c.completions.create(
            model=["alpha", "beta", BASE][i % 3], prompt=[1, 7 + i], max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True})) for i in range(BATCH + 4)]
        deadline = time.monotonic() + 60
        while _metric(server, "tp_lora_running") < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        server.terminate()
        return await asyncio.gather(*calls, return_exceptions=True)
    outs = asyncio.run(asyncio.wait_for(main(), 180))
    assert server.wait(90) == 0, server.log()
    done = [o for o in outs if not isinstance(o, Exception)]
    refused = [o for o in outs if isinstance(o, Exception)]
    assert done, server.log()
    for o in done:
        assert len(o.choices[0].token_ids) == 48 and o.choices[0].finish_reason == "length"
    for e in refused:  # waiting when the signal came: never started, told so
        assert isinstance(e, openai.APIStatusError) and e.status_code == 503 and "shutting down" in str(e), e
    assert "SIGTERM" in server.log()
