"""The HTTP front end's own process: 32 concurrent streams get every token through the per-step frames (behind an API
key, which /v1/* then need); its connections with Nagle's algorithm off; a port in use ends the server at start with a message and no process left; a dead front
end stops the server with exit 1; the front end ends within seconds of rank 0's SIGKILL (last: it kills the module's
server)."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from _server import BASE, SERVE, Server, env_for, proc_stats

STREAMS, TOKENS = 32, 24
KEY = "sesame"


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    return [p for p, fields in proc_stats() if int(fields[2]) == pgid and fields[0] != "Z"]


@pytest.fixture(scope="module")
def server(home, default, tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    srv = Server(["scheduler.max_batch_size=16", f"server.api_key={KEY}"], env_for(home), root / "server.log")
    yield srv
    srv.kill()


def test_32_concurrent_streams_get_every_token(server):
    prompts = [[1, 3 + i, 40 + i] for i in range(STREAMS)]

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        kw = dict(max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
        whole = await asyncio.gather(*[c.completions.create(model=["alpha", BASE][i % 2], prompt=p, **kw)
                                       for i, p in enumerate(prompts)])
        streams = await asyncio.gather(*[c.completions.create(model=["alpha", BASE][i % 2], prompt=p, stream=True,
                                                              **kw) for i, p in enumerate(prompts)])

        async def collect(s):
            return [ch async for ch in s]
        return whole, await asyncio.gather(*[collect(s) for s in streams])

    whole, chunked = asyncio.run(asyncio.wait_for(main(), 240))
    for i, (w, chunks) in enumerate(zip(whole, chunked)):
        ids = sum((ch.choices[0].token_ids for ch in chunks), [])
        assert len(ids) == TOKENS and ids == w.choices[0].token_ids, i
        assert "".join(ch.choices[0].text for ch in chunks) == w.choices[0].text, i
        assert [ch.choices[0].finish_reason for ch in chunks][-1] == "length"


def test_the_api_key_is_needed_on_v1_only(server):
    for headers in ({}, {"authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/v1/completions", json={"model": BASE, "prompt": [1, 2], "stream": True},
                       headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_accepted_connections_have_nagle_off():
    """Streamed tokens are small writes on a kept-alive connection: with Nagle's algorithm on, each waits for the
    client's delayed ACK (~40 ms), so the front end's listening socket hands TCP_NODELAY to what it accepts."""
    from tp_lora.server.frontend_process import bind_listener
    listen = bind_listener("127.0.0.1", 0)
    with listen, socket.create_connection(listen.getsockname()):
        conn, _ = listen.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_port_in_use_ends_the_server_at_start(home, default, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.Popen([sys.executable, SERVE, f"server.port={port}"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env_for(home), start_new_session=True)
        try:
            _, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
    assert proc.returncode == 2, err[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in err, err[-2000:]
    assert group_alive(proc.pid) == []  # the front end ended with it


def test_a_dead_front_end_stops_the_server_non_zero(home, default, tmp_path):
    srv = Server([], env_for(home), tmp_path / "server.log")
    try:
        front = [p for p in group_alive(srv.proc.pid) if p != srv.proc.pid]
        assert len(front) == 1
        os.kill(front[0], signal.SIGKILL)
        assert srv.wait(30) == 1
        assert "the HTTP front-end process exited" in srv.log()
    finally:
        srv.kill()


def test_rank0_sigkill_ends_the_front_end(server):
    """Last: kills the module's server."""
    rank0 = server.proc.pid
    assert len(group_alive(rank0)) == 2  # rank 0 and its front end (the group is the server's session)
    os.kill(rank0, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while group_alive(rank0):
        assert time.monotonic() < deadline, f"still alive 5 s after rank 0's SIGKILL: {group_alive(rank0)}"
        time.sleep(0.05)
