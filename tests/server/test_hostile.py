"""The server against hostile but legal clients, each case on a real server process: bodies past the size limit,
trickled or never finished; idle and half-open connections; malformed JSON of every kind; lists past their bounds;
run-time adapter loads off by default and confined to their roots; a client that leaves a non-streamed request;
streams that must never be cut after their 200; and a seeded fuzz of body shapes. After each, a normal completion
still answers with the offline job's tokens."""
import asyncio
import json
import os
import random
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from _server import Server, env_for, runtime_lora
from tp_lora.server.openai_models import MAX_LOGPROB_ENTRIES

BATCH, QUEUE = 8, 24
BODY_MB, READING_MB, BODY_S, HEADER_S = 1, 2, 3, 3


@pytest.fixture(scope="module")
def guarded(home, default, tmp_path_factory):
    """Small bounds (1 MB bodies, 2 MB being read, 3 s for a body or headers) and run-time loads from roots/."""
    root = tmp_path_factory.mktemp("hostile")
    roots = root / "roots"
    shutil.copytree(os.path.join(default["adapter_dir"], "alpha"), roots / "alpha2")
    os.symlink("/etc", roots / "escape")
    srv = Server([f"scheduler.max_batch_size={BATCH}", f"server.max_queue={QUEUE}", f"server.max_body_mb={BODY_MB}",
                  f"server.max_reading_mb={READING_MB}", f"server.body_timeout_s={BODY_S}",
                  f"server.header_timeout_s={HEADER_S}"] + runtime_lora(roots), env_for(home), root / "server.log")
    srv.roots = roots
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def plain(home, default, tmp_path_factory):
    """The server as `python launch/serve.py` starts it: the defaults."""
    srv = Server([], env_for(home), tmp_path_factory.mktemp("plain") / "server.log")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def healthy(reference):
    """healthy(srv): a normal greedy completion answers with the offline job's tokens."""
    req, want = next((q, o) for q, o in reference if q["adapter"] == "alpha")

    def check(srv):
        r = httpx.post(srv.url + "/v1/completions", json={"model": "alpha", "prompt": req["prompt_token_ids"],
                                                          "max_tokens": req["max_new_tokens"], "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want["output_token_ids"]
    return check


def post(srv, path: str, body, **kw) -> httpx.Response:
    """POST `body` (bytes / str sent as is, else as JSON) with a JSON Content-Type."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    return s


def head(path: str, length=None, chunked=False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += ["Transfer-Encoding: chunked"] if chunked else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_of_reply(s: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        part = s.recv(4096)
        if not part:
            raise AssertionError(f"closed before a status line: {data!r}")
        data += part
    return int(data.split(b" ")[1])


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(4096) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def metric(srv, name: str) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def frontend_rss_mb(srv) -> float:
    """Resident memory of the server's HTTP front-end process (rank 0's child)."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"tp_lora.server.frontend_process" in cmd and ppid == srv.proc.pid:
            with open(f"/proc/{pid}/status") as f:
                return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024
    raise AssertionError("no front-end process found")


# ---- size, time and connection bounds --------------------------------------------------------------------------
def test_a_declared_oversize_body_is_413_before_it_is_read(plain, healthy):
    s = connect(plain)
    s.sendall(head("/v1/completions", length=300 * 2 ** 20) + b"{" * 65536)  # 300 MB announced, 64 KB sent
    t0 = time.monotonic()
    assert status_of_reply(s) == 413
    assert time.monotonic() - t0 < 10
    s.close()
    healthy(plain)


def test_a_chunked_body_past_the_limit_is_413(guarded, healthy):
    s = connect(guarded)
    chunk = b"[" * (BODY_MB * 2 ** 20 + 4096)
    s.sendall(head("/v1/completions", chunked=True) + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    assert status_of_reply(s) == 413
    s.close()
    healthy(guarded)


def test_bodies_at_the_limit_leave_the_front_end_small(plain, healthy):
    """20 bodies of 16 MB (the default limit), each a text prompt that cannot fit the context (a 400 decided without
    tokenizing it), then 4 at once: the front end's resident memory grows by less than 32 MB in all, once it has
    closed their connections (a body can outlive its reply by a moment: 16-18 MB seen just after the replies, gone
    a second later)."""
    healthy(plain)
    before = frontend_rss_mb(plain)
    body = json.dumps({"model": "alpha", "prompt": "a" * (16 * 2 ** 20 - 64)})
    for _ in range(20):
        t0 = time.monotonic()
        r = post(plain, "/v1/completions", body)
        assert r.status_code == 400 and "exceeds the context" in r.text, r.text[:300]
        assert time.monotonic() - t0 < 20
    with ThreadPoolExecutor(4) as pool:
        assert {r.status_code for r in pool.map(lambda _: post(plain, "/v1/completions", body), range(4))} == {400}
    deadline = time.monotonic() + 10  # kept bodies would never be freed: 24 x 16 MB
    while (grown := frontend_rss_mb(plain) - before) >= 32 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert grown < 32, (before, grown)
    healthy(plain)


def test_bodies_being_read_at_once_are_capped(guarded, healthy):
    """Two 1 MB bodies announced and trickling hold the 2 MB being read: a third is a 503 with Retry-After, and
    once those clients leave a body is read again."""
    slow = [connect(guarded) for _ in range(2)]
    for s in slow:
        s.sendall(head("/v1/completions", length=BODY_MB * 2 ** 20) + b"{")
    time.sleep(0.5)  # both are being read (reserved as soon as their headers are in)
    r = post(guarded, "/v1/completions", {"model": "alpha", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 503 and r.headers.get("retry-after") and "max_reading_mb" in r.text, r.text
    for s in slow:
        s.close()
    deadline = time.monotonic() + 10
    while post(guarded, "/v1/completions", {"model": "alpha", "prompt": [1], "max_tokens": 1}).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    healthy(guarded)


def test_a_trickled_body_times_out_while_others_are_served(guarded, healthy):
    s = connect(guarded)
    s.sendall(head("/v1/completions", length=1000))
    t0 = time.monotonic()
    healthy(guarded)
    s.settimeout(0.5)
    got = b""
    while not got and time.monotonic() - t0 < BODY_S + 10:
        s.send(b" ")  # one byte every half second
        try:
            got = s.recv(4096)
        except socket.timeout:
            pass
    assert got.split(b" ")[1] == b"408", got
    assert BODY_S - 0.5 < time.monotonic() - t0 < BODY_S + 5
    s.close()


def test_idle_and_half_sent_connections_are_closed_and_do_not_starve_others(guarded, healthy):
    idle = [connect(guarded) for _ in range(200)]
    half = [connect(guarded) for _ in range(20)]
    for s in half:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    healthy(guarded)
    t0 = time.monotonic()
    assert all(closed_by_server(s, max(0.1, HEADER_S + 5 - (time.monotonic() - t0))) for s in idle + half)
    for s in idle + half:
        s.close()
    healthy(guarded)


def test_only_json_bodies_are_taken(guarded, healthy):
    """A web page can POST text/plain cross-origin without a preflight: such bodies never reach the routes."""
    for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
        r = httpx.post(guarded.url + "/v1/completions", content='{"model": "alpha", "prompt": "hi"}',
                       headers={"content-type": kind})
        assert r.status_code == 415 and "application/json" in r.text, (kind, r.text)
    r = post(guarded, "/v1/completions", {"model": "alpha", "prompt": [1], "max_tokens": 1},
             headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    healthy(guarded)


# ---- malformed bodies: each a 400 naming what is wrong ---------------------------------------------------------
SURROGATE = '"x\\ud800"'
MALFORMED = [
    ("/v1/completions", "[" * 200000 + "]" * 200000, "deeper than"),
    ("/v1/completions", '{"model": "alpha", "prompt": ' + "[" * 70 + "1" + "]" * 70 + "}", "deeper than"),
    ("/v1/completions", '{"model": "alpha", "prompt": [1], "max_tokens": ' + "9" * 5000 + "}", "digits"),
    ("/v1/completions", '{"model": "alpha", "prompt": ' + SURROGATE + "}", "prompt"),
    ("/v1/completions", '{"model": "alpha", "prompt": "hi", "user": ' + SURROGATE + "}", "user"),
    ("/v1/completions", '{"model": "alpha", "prompt": "hi", ' + SURROGATE + ": 1}", "surrogate"),
    ("/v1/chat/completions", '{"model": "alpha", "messages": [{"role": "user", "content": ' + SURROGATE + "}]}",
     "messages[0].content"),
    ("/v1/completions", '{"model": "alpha", "prompt": [1, 2', "not valid JSON"),
    ("/v1/completions", b'{"model": "alpha", "prompt": "\xff"}', "not valid JSON"),
    ("/v1/completions", "[]", "JSON object"),
    ("/v1/completions", '"x"', "JSON object"),
    ("/v1/load_lora_adapter", "[]", "JSON object"),
    ("/v1/load_lora_adapter", '"x"', "JSON object"),
    ("/v1/load_lora_adapter", "5", "JSON object"),
    ("/v1/unload_lora_adapter", "[]", "JSON object"),
    ("/v1/unload_lora_adapter", "null", "JSON object"),
    ("/v1/completions", {"model": "alpha", "prompt": [-1], "echo": True}, "greater than or equal to 0"),
    ("/v1/completions", {"model": "alpha", "prompt": [2 ** 64 + 1], "echo": True}, "less than"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "logit_bias": {"--5": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}},
     "at most 1024"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "stop_token_ids": [3] * 2000}, "stop_token_ids"),
    ("/v1/completions", {"model": "alpha", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
]


@pytest.mark.parametrize("path,body,words", MALFORMED, ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_bodies_are_400_naming_the_fault(guarded, healthy, path, body, words):
    r = post(guarded, path, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"] + str(r.json()["error"]["param"]), \
        r.text[:400]
    healthy(guarded)


def test_work_that_cannot_fit_is_refused_before_it_is_done(guarded, plain, healthy):
    # a text prompt past the context, by its bytes alone: at once, and /health answers meanwhile
    t0 = time.monotonic()
    r = post(plain, "/v1/completions", {"model": "alpha", "prompt": "word " * 3_000_000})
    assert r.status_code == 400 and "bytes of text" in r.text and "context of 2048" in r.text, r.text
    assert time.monotonic() - t0 < 10
    # so many sequences the server can never hold them at once: a 400, not 429 + retry
    r = post(guarded, "/v1/completions", {"model": "alpha", "prompt": ["hi"] * 3, "n": 16, "max_tokens": 2})
    assert r.status_code == 400 and "can ever hold" in r.text and "48" in r.text, r.text
    # a response too large to build: the product named
    r = post(guarded, "/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}],
                                               "n": 16, "logprobs": True, "top_logprobs": 20, "max_tokens": 2020})
    assert r.status_code == 400 and str(16 * 2020 * 21) in r.text and str(MAX_LOGPROB_ENTRIES) in r.text, r.text
    healthy(guarded)


# ---- run-time adapters -----------------------------------------------------------------------------------------
def test_run_time_adapter_loads_are_off_by_default(plain, default, healthy):
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": default["adapter_dir"]}),
                       ("/v1/unload_lora_adapter", {"lora_name": "alpha"})):
        r = post(plain, path, body)
        assert r.status_code == 403 and "server.allow_runtime_lora" in r.text, r.text
    assert "alpha" in [m["id"] for m in httpx.get(plain.url + "/v1/models").json()["data"]]
    healthy(plain)


def test_loads_are_confined_to_the_roots_with_one_refusal(guarded, healthy):
    roots = guarded.roots
    outside = ["/etc", "/root/.ssh", "/nonexistent/adapter", str(roots / "escape"), str(roots / ".." / ".."),
               f"{roots}/../../etc", "../../../../etc", str(roots) + "x"]
    answers = {post(guarded, "/v1/load_lora_adapter", {"lora_name": "probe", "lora_path": p}).text for p in outside}
    assert len(answers) == 1, answers
    assert '"code":403' in answers.pop()
    r = post(guarded, "/v1/load_lora_adapter", {"lora_name": "alpha2", "lora_path": str(roots / "alpha2")})
    assert r.status_code == 200, r.text
    r = post(guarded, "/v1/completions", {"model": "alpha2", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert post(guarded, "/v1/unload_lora_adapter", {"lora_name": "alpha2"}).status_code == 200
    healthy(guarded)


@pytest.mark.parametrize("name", ["x\ud800", "x" * 200_000, "x" * 129, "a\nb", " padded", ""])
def test_adapter_names_are_bounded_and_printable(guarded, healthy, name):
    r = post(guarded, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(guarded.roots / "alpha2")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text[:300]
    assert httpx.get(guarded.url + "/v1/models").status_code == 200
    m = httpx.get(guarded.url + "/metrics")
    assert m.status_code == 200 and len(m.text) < 200_000
    healthy(guarded)


# ---- clients that leave, streams that must not be cut ----------------------------------------------------------
def test_a_client_leaving_a_non_streamed_request_cancels_it(guarded, healthy):
    """32 sequences of 1000 tokens fill the server (another request meanwhile: 429); the client then closes its
    connection: every one is cancelled at once, not run to its end, and the next request is answered."""
    before = metric(guarded, 'tp_lora_requests_total{status="cancelled"}')
    body = json.dumps({"model": "alpha", "prompt": ["hello", "there"], "n": 16, "max_tokens": 1000,
                       "ignore_eos": True, "temperature": 1}).encode()
    s = connect(guarded)
    s.sendall(head("/v1/completions", length=len(body)) + body)
    deadline = time.monotonic() + 30
    while metric(guarded, "tp_lora_running") + metric(guarded, "tp_lora_queue_length") < BATCH + QUEUE:
        assert time.monotonic() < deadline, "the request never filled the server"
        time.sleep(0.05)
    r = post(guarded, "/v1/completions", {"model": "alpha", "prompt": [1], "max_tokens": 1})
    assert r.status_code == 429 and "queue is full" in r.text and r.headers.get("retry-after"), r.text
    s.close()
    deadline = time.monotonic() + 20
    while metric(guarded, 'tp_lora_requests_total{status="cancelled"}') < before + 32:
        assert time.monotonic() < deadline, "the left requests were not cancelled"
        time.sleep(0.2)
    t0 = time.monotonic()
    healthy(guarded)
    assert time.monotonic() - t0 < 20


def test_a_stream_is_refused_before_its_200_or_runs_to_its_end(guarded, healthy):
    """More concurrent n=2 streams than the server holds: each is a 429 before any byte of a 200, or a whole
    stream ending in [DONE]; none is cut after its headers."""
    async def one(client):
        async with client.stream("POST", guarded.url + "/v1/completions",
                                 json={"model": "alpha", "prompt": [1, 2, 3], "n": 2, "max_tokens": 8,
                                       "stream": True, "temperature": 1, "seed": 1}) as r:
            text = (await r.aread()).decode()
            return r.status_code, text

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*[one(client) for _ in range(60)])
    results = asyncio.run(main())
    assert {s for s, _ in results} <= {200, 429}
    assert any(s == 200 for s, _ in results)
    for status, text in results:
        if status == 200:
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
    healthy(guarded)


# ---- fuzz ------------------------------------------------------------------------------------------------------
def hostile_values(rng: random.Random) -> list:
    return [None, True, False, 0, -1, 1, 3, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 30, 1e308, -0.5, 0.5, 1e-300, "",
            "x" * rng.randint(1, 3000), "\ud800", "\udc00a", "naïve — 日本語 🙂", [], [[]], {}, [1, 2, 3],
            [rng.randint(-5, 10 ** 6) for _ in range(rng.randint(1, 3000))], ["a"] * rng.randint(1, 50),
            {str(i): 1 for i in range(rng.randint(1, 1500))}, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            [{"role": "user", "content": "hi"}], [{"role": "bogus"}], nested(rng.randint(1, 90)), "NaN", BIG_INT]


BIG_INT = "<an integer literal of 5000 digits>"  # json.dumps cannot write one: put in the body's text after


def nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "best_of", "temperature", "top_p", "seed", "stop",
          "stream", "logprobs", "top_logprobs", "echo", "logit_bias", "stop_token_ids", "min_tokens",
          "presence_penalty", "response_format", "ignore_eos", "user", "lora_name", "lora_path", "unknown_field"]


def fuzz_body(rng: random.Random) -> tuple[str, object]:
    path = rng.choice(["/v1/completions"] * 4 + ["/v1/chat/completions"] * 3 + ["/v1/load_lora_adapter",
                                                                                 "/v1/unload_lora_adapter"])
    if rng.random() < 0.08:
        return path, rng.choice([[], "x", 5, None, [{"model": "alpha"}], 1.5])
    body = {"model": rng.choice(["alpha", "tiny-llama", "beta", "nope"]), "max_tokens": rng.randint(1, 4)}
    if path == "/v1/completions":
        body["prompt"] = rng.choice(["hello", [1, 2, 3], ["a", "b"], [[5, 6]]])
    elif path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body = {"lora_name": "fz", "lora_path": "/nonexistent"}
    values = hostile_values(rng)
    for _ in range(rng.randint(0, 3)):  # 0: a valid body, mostly
        body[rng.choice(FIELDS)] = rng.choice(values)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4 and body["max_tokens"] < 2 ** 31:
        body["max_tokens"] = 4  # valid but long generations only slow the fuzz
    return path, body


def test_seeded_fuzz_of_bodies_never_gets_a_5xx(guarded, healthy):
    rng = random.Random(20261126)
    cases = [fuzz_body(rng) for _ in range(1000)]

    def send(case):
        path, body = case
        raw = json.dumps(body).replace(json.dumps(BIG_INT), "9" * 5000)  # lone surrogates go as \ud800 escapes
        with httpx.Client(timeout=120) as c:
            r = c.post(guarded.url + path, content=raw, headers={"content-type": "application/json"})
            return r.status_code, path, raw[:200], r.text[:300]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, cases))
    bad = [x for x in results if x[0] >= 500 and x[0] != 503]
    assert not bad, bad[:5]
    assert sum(1 for x in results if x[0] == 200) > 100  # the fuzz also reaches the engine
    healthy(guarded)
