"""The OpenAI request surface through the official client at tp=1: n with seeds (each choice that seed's single
request), best_of, logit_bias, penalties, min_tokens, stop_token_ids, chat logprobs / top_logprobs / n /
max_completion_tokens / include_usage, echo; every refused or mistyped field a 400 naming it; fuzzed bodies never
a 5xx."""
import json
import random

import httpx
import openai
import pytest

from _server import BASE, Server, env_for
from tp_lora.server.openai_models import ACCEPTED_WITHOUT_EFFECT

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(home, default, tmp_path_factory):
    root = tmp_path_factory.mktemp("surface")
    srv = Server([f"lora.adapter_dir={default['adapter_dir']}", "scheduler.max_batch_size=8",
                  "server.max_queue=64"], env_for(home), root / "server.log")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def c(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def ids(out) -> list[list[int]]:
    return [ch.token_ids for ch in out.choices]


def test_n_with_a_seed_is_n_single_requests_with_seed_plus_i(c):
    kw = dict(model="alpha", prompt=[1, 9, 4], max_tokens=8, temperature=1.0)
    many = c.completions.create(n=4, seed=11, **kw)
    singles = [c.completions.create(seed=11 + i, **kw).choices[0].token_ids for i in range(4)]
    assert ids(many) == singles and len({tuple(x) for x in singles}) > 1
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
    assert ids(c.completions.create(n=4, seed=11, **kw)) == singles  # reproducible
    streamed = list(c.completions.create(n=4, seed=11, stream=True, **kw))
    got = [[] for _ in range(4)]
    for ch in streamed:
        for choice in ch.choices:
            got[choice.index] += choice.token_ids
    assert got == singles
    greedy = c.completions.create(model="beta", prompt=[1, 9, 4], max_tokens=6, temperature=0, n=3)
    assert len({tuple(x) for x in ids(greedy)}) == 1 and len(greedy.choices) == 3
    two = c.completions.create(model="beta", prompt=[[1, 2], [1, 3]], max_tokens=3, temperature=0, n=2)
    assert len(two.choices) == 4 and ids(two)[0] == ids(two)[1]


def _metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_n_siblings_share_the_first_ones_prompt_blocks(server, c):
    """40 prompt tokens computed once by the first sequence; the 3 others join as it ends, sharing all 40 (two full
    blocks of 16 and a copy of the partial third)."""
    before = _metric(server, "tp_lora_engine_prefix_hit_tokens")
    out = c.completions.create(model="gamma", prompt=list(range(50, 90)), max_tokens=3, temperature=1.0, n=4, seed=1)
    assert len(out.choices) == 4
    assert _metric(server, "tp_lora_engine_prefix_hit_tokens") == before + 3 * 40


def test_best_of_keeps_the_highest_cumulative_logprob(c):
    kw = dict(model="gamma", prompt=[1, 5, 6], max_tokens=6, temperature=1.0, seed=3)
    out = c.completions.create(best_of=4, n=2, logprobs=0, **kw)
    cands = c.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(cands.choices, key=lambda ch: -sum(ch.logprobs.token_logprobs))
    assert ids(out) == [ch.token_ids for ch in ranked[:2]]
    assert out.usage.completion_tokens == cands.usage.completion_tokens  # every candidate counts


def test_logit_bias_penalties_min_tokens_and_stop_token_ids(c):
    out = c.completions.create(model="alpha", prompt=[1, 2, 3], max_tokens=5, temperature=0,
                               logit_bias={"77": 100})
    assert out.choices[0].token_ids == [77] * 5
    out = c.completions.create(model="alpha", prompt=[1, 2, 3], max_tokens=5, temperature=0,
                               logit_bias={"77": 100}, presence_penalty=2.0, frequency_penalty=2.0)
    assert out.choices[0].token_ids == [77] * 5  # a bias of 100 beats penalties of at most 4
    plain = c.completions.create(model="beta", prompt=[1, 2, 3], max_tokens=12, temperature=0).choices[0].token_ids
    rep = c.completions.create(model="beta", prompt=[1, 2, 3], max_tokens=12, temperature=0,
                               extra_body={"repetition_penalty": 2.0}).choices[0].token_ids
    assert rep != plain or len(set(plain)) == len(plain)
    # Penalties alone, on a greedy run that repeats a token: the same up to that repeat (penalised tokens were not
    # the argmax before it), then different.
    kw = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    runs = ((m, p, c.completions.create(model=m, prompt=p, **kw).choices[0].token_ids)
            for m, p in [("alpha", [1, 2, 3]), ("gamma", [1, 9, 4]), ("beta", [1, 9, 4]), ("gamma", [1, 2, 3])])
    model, prompt, greedy = next((r for r in runs if len(set(r[2])) < len(r[2])), (None, None, None))
    assert greedy is not None, "no greedy run repeats a token: the penalties would change nothing"
    first_repeat = next(i for i, t in enumerate(greedy) if t in greedy[:i])
    pen = c.completions.create(model=model, prompt=prompt, presence_penalty=2.0, frequency_penalty=2.0,
                               **kw).choices[0].token_ids
    assert pen[:first_repeat] == greedy[:first_repeat] and pen != greedy, (pen, greedy)
    # stop_token_ids end the sequence at the token; min_tokens holds it back until then
    stop = plain[2]
    first = plain.index(stop)
    got = c.completions.create(model="beta", prompt=[1, 2, 3], max_tokens=12, temperature=0,
                               extra_body={"stop_token_ids": [stop]}).choices[0]
    assert got.token_ids == plain[:first + 1] and got.finish_reason == "stop"
    held = c.completions.create(model="beta", prompt=[1, 2, 3], max_tokens=12, temperature=0,
                                extra_body={"stop_token_ids": [stop], "min_tokens": first + 2}).choices[0]
    assert stop not in held.token_ids[:first + 2] and len(held.token_ids) >= first + 2


def test_chat_logprobs_n_max_completion_tokens_and_usage(c):
    out = c.chat.completions.create(model="gamma", messages=MSG, max_completion_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=3, n=2)
    assert len(out.choices) == 2 and out.usage.completion_tokens == 10
    for ch in out.choices:
        content = ch.logprobs.content
        assert len(content) == len(ch.token_ids) == 5
        for e in content:
            assert len(e.top_logprobs) == 3 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
    streamed = list(c.chat.completions.create(model="gamma", messages=MSG, max_completion_tokens=5, temperature=0,
                                              logprobs=True, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 5
    lps = [e.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
           for e in ch.choices[0].logprobs.content]
    assert lps == pytest.approx([e.logprob for e in out.choices[0].logprobs.content], abs=1e-5)


def test_echo_prepends_the_prompt(c):
    plain = c.completions.create(model=BASE, prompt="hello world", max_tokens=4, temperature=0)
    echoed = c.completions.create(model=BASE, prompt="hello world", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "hello world" + plain.choices[0].text
    streamed = list(c.completions.create(model=BASE, prompt="hello world", max_tokens=4, temperature=0, echo=True,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == echoed.choices[0].text


@pytest.mark.parametrize("path, extra, param", [
    ("completions", {"best_of": 2, "n": 3}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"999999": 1}}, None),  # the engine names the vocabulary
    ("completions", {"presence_penalty": 3}, "presence_penalty"),
    ("completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("completions", {"stop_token_ids": [1.5]}, "stop_token_ids"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"other": True}}, "stream_options"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, "response_format"),
    ("completions", {"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"max_tokens": 2.0}, "max_tokens"),
    ("completions", {"user": 5}, "user"),
    ("completions", {"nonsense": 1}, "nonsense"),
    ("completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"audio": {"voice": "x"}}, "audio"),
    ("chat/completions", {"modalities": ["audio"]}, "modalities"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"max_tokens": 3, "max_completion_tokens": 3}, "max_tokens"),
    ("chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"metadata": {"a": 1}}, "metadata"),
])
def test_each_refused_or_mistyped_field_gets_a_400_naming_it(server, path, extra, param):
    body = {"model": "alpha", "max_tokens": 4} if "max_completion_tokens" not in extra else {"model": "alpha"}
    body.update({"prompt": [1, 2]} if path == "completions" else {"messages": MSG})
    body.update(extra)
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    else:
        assert "vocabulary" in err["message"], err


def test_fields_accepted_without_effect(c):
    out = c.chat.completions.create(model="alpha", messages=MSG, max_tokens=2, user="u", metadata={"k": "v"},
                                    store=False, service_tier="auto", parallel_tool_calls=True, tool_choice="none")
    assert len(out.choices[0].token_ids) >= 1
    assert set(ACCEPTED_WITHOUT_EFFECT) >= {"user", "metadata", "store"}


def _mutations(rng: random.Random):
    values = [None, True, False, 0, -1, 1, 2 ** 70, 1.5, -1e300, "", "x", [], [1], ["a"], [[]], {}, {"a": 1},
              [None], "\u0000", [1.5], {"1": "x"}]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "best_of", "logprobs",
              "top_logprobs", "stop", "seed", "stream", "stream_options", "logit_bias", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "echo", "suffix", "user",
              "response_format", "ignore_eos", "max_completion_tokens", "tools", "metadata"]
    for _ in range(120):
        body = {"model": rng.choice(["alpha", BASE]), "max_tokens": 3}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields)] = rng.choice(values)
        yield rng.choice(["completions", "chat/completions"]), body


def test_fuzzed_bodies_never_get_a_5xx(server):
    rng = random.Random(0)
    with httpx.Client(timeout=60) as h:
        for path, body in _mutations(rng):
            body.setdefault("prompt" if path == "completions" else "messages", [1, 2] if path == "completions"
                            else MSG)
            r = h.post(f"{server.url}/v1/{path}", content=json.dumps(body), headers={"content-type":
                                                                                     "application/json"})
            assert r.status_code < 500, (path, body, r.text)
            if r.status_code != 200:
                assert "error" in r.json(), r.text
        for raw in (b"[]", b"1", b'"x"', b"null", b"{", b'{"model": NaN}'):
            r = h.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)


def test_per_adapter_metrics_and_residency(server, c):
    def value(name: str) -> float:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    before = value('tp_lora_adapter_requests_total{adapter="beta"}')
    tokens = value('tp_lora_adapter_generation_tokens_total{adapter="beta"}')
    c.completions.create(model="beta", prompt=[1, 2, 3], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    c.completions.create(model=BASE, prompt=[1, 2], max_tokens=2, temperature=0)
    assert value('tp_lora_adapter_requests_total{adapter="beta"}') == before + 1
    assert value('tp_lora_adapter_generation_tokens_total{adapter="beta"}') == tokens + 4
    assert value('tp_lora_adapter_requests_total{adapter="base"}') >= 1
    assert value('tp_lora_adapter_time_to_first_token_seconds_count{adapter="beta"}') >= 1
    assert value('tp_lora_adapter_resident{adapter="beta",tier="device"}') == 1
    assert value('tp_lora_adapter_resident{adapter="beta",tier="host"}') == 1
    used, free = value('tp_lora_adapter_slots{state="used"}'), value('tp_lora_adapter_slots{state="free"}')
    assert used >= 1 and used + free >= 1 and value("tp_lora_adapters_in_host_memory") >= 1


def test_adapter_labels_are_capped():
    from tp_lora.server.metrics import AdapterLabels
    label = AdapterLabels(cap=2)
    assert [label(x) for x in ("a", None, "b", "c", "a", "d")] == ["a", "base", "b", "other", "a", "other"]
