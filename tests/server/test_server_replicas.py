"""The server over data-parallel replicas, launched as users do: `python launch/serve.py parallel=dp2` (the launch
starts its two ranks itself) and `torchrun ... parallel=ep2` (a tiny MoE model, experts split over two replicas in
lockstep, per-expert and PEFT 3D adapters). Greedy completions equal the offline job's under 32 concurrent clients
mixing adapters, a run-time adapter reaches and serves on both replicas, /metrics labels each replica, SIGTERM
drains and exits 0 (to the self-spawning launcher; to torchrun's workers), a killed rank ends the server non-zero
within parallel.timeout_s naming it, Ctrl-C to a self-spawned tp2 drains and exits 0, and a bad layout is refused
before any collective. dp2_tp2 and ep2_tp2 (4 ranks, self-spawned): the offline job's tokens and a SIGTERM drain."""
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from _server import (GENERATE, ROOT, SERVE, Server, children, env_for, load_gamma_copy, model_of,
                     runtime_lora)

sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
from test_moe import moe_config, write_adapters, write_moe  # noqa: E402

TIMEOUT_S = 20
CLIENTS = 32


def spawned_ranks(server: Server) -> list[int]:
    """The ranks a self-spawning launch started (its children but multiprocessing's resource tracker)."""
    out = []
    for pid in children(server.proc.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(pid)
    return out


def metric(text: str, name: str) -> dict[str, float]:
    """Series of one metric: label text (or '') -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


async def completions(url: str, picks: list, model_of) -> list[list[int]]:
    """Greedy completions of (request line, expected) pairs by concurrent clients, every other one streamed."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(CLIENTS)

    async def one(i, q):
        async with sem:
            extra = {"ignore_eos": True} if q.get("ignore_eos") else {}
            out = await c.completions.create(model=model_of(q), prompt=q["prompt_token_ids"],
                                             max_tokens=q["max_new_tokens"], temperature=0, stream=i % 2 == 1,
                                             extra_body=extra)
            if i % 2:
                return sum([ch.choices[0].token_ids async for ch in out if ch.choices], [])
            return out.choices[0].token_ids
    return await asyncio.gather(*[one(i, q) for i, (q, _) in enumerate(picks)])


# ---- dp2, self-spawned ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp2(home, default, reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2")
    srv = Server(["parallel=dp2", f"parallel.timeout_s={TIMEOUT_S}", "scheduler.max_batch_size=4",
                  "server.max_imbalance=0"] + runtime_lora(tmp_path_factory.getbasetemp()), env_for(home),
                 root / "server.log")
    yield srv
    srv.kill()


def test_dp2_completions_from_concurrent_clients_match_the_offline_job(dp2, reference):
    picks = (reference * 8)[:CLIENTS * 2]
    got = asyncio.run(asyncio.wait_for(completions(dp2.url, picks, model_of), 300))
    for (q, want), tokens in zip(picks, got):
        assert tokens == want["output_token_ids"], q["id"]
    text = httpx.get(dp2.url + "/metrics", timeout=10).text
    for name in ("queue_length", "running", "slot_hit_rate", "adapter_reads", "adapter_loads"):
        per = metric(text, "tp_lora_replica_" + name)
        assert set(per) == {'{replica="0"}', '{replica="1"}'}, (name, per)
    loads = metric(text, "tp_lora_replica_adapter_loads")
    assert metric(text, "tp_lora_adapter_loads")[""] == sum(loads.values())
    assert sum(metric(text, "tp_lora_requests_total").values()) >= len(picks)


def test_dp2_runtime_adapter_reaches_and_serves_on_both_replicas(dp2, reference, default, tmp_path):
    q, want = load_gamma_copy(dp2.url, default, reference, tmp_path)
    picks = [(dict(q, adapter="g2"), want)] * 12  # more than one replica's batch: both serve g2
    got = asyncio.run(asyncio.wait_for(completions(dp2.url, picks, model_of), 300))
    assert all(tokens == want["output_token_ids"] for tokens in got)
    resident = metric(httpx.get(dp2.url + "/metrics", timeout=10).text, "tp_lora_adapter_resident")
    assert resident.get('{adapter="g2",tier="device"}') == 2, resident
    r = httpx.post(dp2.url + "/v1/unload_lora_adapter", json={"lora_name": "g2"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "g2" not in [m["id"] for m in httpx.get(dp2.url + "/v1/models", timeout=10).json()["data"]]
    r = httpx.post(dp2.url + "/v1/completions", json={"model": "g2", "prompt": [1, 2], "max_tokens": 2}, timeout=30)
    assert r.status_code == 404


def test_dp2_sigterm_to_the_launcher_drains_and_exits_0(dp2, reference):
    """Last: ends the module's server. A stream in flight on each replica finishes after the signal."""
    async def main():
        c = openai.AsyncOpenAI(base_url=dp2.url + "/v1", api_key="none", max_retries=0, timeout=120)
        streams = [await c.completions.create(model=a, prompt=[5, 6, 7], max_tokens=60, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
                   for a in ("alpha", "beta", "gamma", "tiny-llama", "alpha", "beta")]
        first = [await s.__anext__() for s in streams]  # every stream running
        os.kill(dp2.proc.pid, 15)
        rest = [[ch async for ch in s] for s in streams]
        return [sum([ch.choices[0].token_ids for ch in [f] + r if ch.choices], []) for f, r in zip(first, rest)]
    got = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(len(t) == 60 for t in got), [len(t) for t in got]
    assert dp2.wait(60) == 0, dp2.log()[-2000:]


def test_dp2_killed_rank_ends_the_server_non_zero_naming_it(home, default, tmp_path):
    srv = Server(["parallel=dp2", f"parallel.timeout_s={TIMEOUT_S}"], env_for(home), tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 30  # /health answers before the ranks have met: wait for every rank serving
        while "serving '" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        rank1 = spawned_ranks(srv)[1]
        os.kill(rank1, 9)
        t0 = time.monotonic()
        code = srv.wait(TIMEOUT_S + 40)
        assert code != 0 and time.monotonic() - t0 < TIMEOUT_S + 40
        log = srv.log()
        assert "launcher: rank 1 (pid" in log and "signal 9" in log, log[-2000:]
        assert "rank 0: error: lost the other ranks: rank 1 died" in log, log[-2000:]
    finally:
        srv.kill()


def test_tp2_self_spawned_ctrl_c_drains_and_exits_0(home, default, reference, tmp_path):
    """Ctrl-C in a terminal: SIGINT to the launcher and its ranks at once (the launcher forwards it again: one
    stop). A stream in flight finishes."""
    srv = Server(["parallel=tp2", f"parallel.timeout_s={TIMEOUT_S}"], env_for(home), tmp_path / "server.log")
    try:
        assert len(spawned_ranks(srv)) == 2

        async def main():
            c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
            s = await c.completions.create(model="beta", prompt=[5, 6, 7], max_tokens=40, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
            first = await s.__anext__()
            os.killpg(srv.proc.pid, 2)
            return sum([ch.choices[0].token_ids for ch in [first] + [ch async for ch in s] if ch.choices], [])
        assert len(asyncio.run(asyncio.wait_for(main(), 120))) == 40
        assert srv.wait(60) == 0, srv.log()[-2000:]
        assert "SIGINT: admitting no more requests" in srv.log()
    finally:
        srv.kill()


def test_dp2_tp2_self_spawned_matches_the_offline_job_and_drains_on_sigterm(home, reference, tmp_path):
    """4 ranks of the dense default: two replicas of tp=2, every adapter and the base, fully sharded LoRA."""
    srv = Server(["parallel=dp2_tp2", "lora=fully_sharded", f"parallel.timeout_s={TIMEOUT_S}",
                  "scheduler.max_batch_size=4"], env_for(home), tmp_path / "server.log")
    try:
        assert len(spawned_ranks(srv)) == 4
        picks = reference * 2
        got = asyncio.run(asyncio.wait_for(completions(srv.url, picks, model_of), 300))
        for (q, want), tokens in zip(picks, got):
            assert tokens == want["output_token_ids"], q["id"]
        os.kill(srv.proc.pid, 15)
        assert srv.wait(60) == 0, srv.log()[-2000:]
    finally:
        srv.kill()


def test_ep_over_a_dense_model_is_refused_before_any_collective(home, default):
    r = subprocess.run([sys.executable, SERVE, "parallel=ep2", "server.port=0"], capture_output=True, text=True,
                       timeout=120, env=env_for(home))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "not an MoE model" in r.stderr and "parallel.ep_size=2" in r.stderr


# ---- ep2 under torchrun: a tiny MoE model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory, home):
    """A tiny Qwen2-MoE (fused experts, a shared expert) with per-expert and target_parameters adapters, requests,
    and the offline job's answers (one process)."""
    root = tmp_path_factory.mktemp("moe")
    model = write_moe(root / "qwen2_moe", "qwen2_moe", 7, fused=True)
    adapters = write_adapters(root / "adapters", moe_config("qwen2_moe"), 17)
    reqs = [{"id": i, "adapter": a, "prompt_token_ids": [3 + i, 40 + 2 * i, 9, 77 - i], "max_new_tokens": 5,
             "ignore_eos": True} for i, a in enumerate(["pe", None, "tp", "w2", "pe", None, "tp", "w2"])]
    with open(root / "in.jsonl", "w") as f:
        f.write("".join(json.dumps(q) + "\n" for q in reqs))
    args = [f"model.path={model}", f"lora.adapter_dir={adapters}"]
    r = subprocess.run([sys.executable, GENERATE] + args + [f"requests={root / 'in.jsonl'}",
                        f"output={root / 'out.jsonl'}", "progress=false"], capture_output=True, text=True,
                       timeout=300, env=env_for(home))
    assert r.returncode == 0, r.stderr
    with open(root / "out.jsonl") as f:
        outs = [json.loads(x) for x in f.read().splitlines()]
    return root, args, list(zip(reqs, outs))


def test_ep2_under_torchrun_matches_the_offline_job_and_drains_on_sigterm(moe, home):
    root, args, ref = moe
    srv = Server(args + ["parallel=ep2", f"parallel.timeout_s={TIMEOUT_S}"] + runtime_lora(root), env_for(home),
                 root / "server.log", nproc=2)
    try:
        picks = ref * 4
        got = asyncio.run(asyncio.wait_for(completions(srv.url, picks, lambda q: q["adapter"] or "qwen2_moe"), 300))
        for (q, want), tokens in zip(picks, got):
            assert tokens == want["output_token_ids"], q["id"]
        # every adapter is pinned in a slot on every rank: refused by both replicas
        r = httpx.post(srv.url + "/v1/load_lora_adapter",
                       json={"lora_name": "pe2", "lora_path": str(root / "adapters" / "pe")}, timeout=60)
        assert r.status_code == 400 and "pinned" in r.text, r.text
        srv.terminate()  # SIGTERM to each worker, as a container stop
        assert srv.wait(60) == 0, srv.log()[-2000:]
    finally:
        srv.kill()


def test_ep2_tp2_self_spawned_matches_the_offline_job_and_drains_on_sigterm(moe, home):
    """4 ranks: two replicas of tp=2 attention, experts over the replicas and each expert over tp."""
    root, args, ref = moe
    srv = Server(args + ["parallel=ep2_tp2", f"parallel.timeout_s={TIMEOUT_S}"], env_for(home),
                 root / "server4.log")
    try:
        assert len(spawned_ranks(srv)) == 4
        got = asyncio.run(asyncio.wait_for(completions(srv.url, ref * 2, lambda q: q["adapter"] or "qwen2_moe"),
                                           300))
        for (q, want), tokens in zip(ref * 2, got):
            assert tokens == want["output_token_ids"], q["id"]
        os.kill(srv.proc.pid, 15)
        assert srv.wait(60) == 0, srv.log()[-2000:]
    finally:
        srv.kill()


def test_generate_self_spawned_ep2_matches_one_process(moe, home):
    """launch/generate.py parallel=ep2 without torchrun: the launch starts both ranks (LLM over two replicas with
    their experts in lockstep); the output file equals the one-process job's."""
    root, args, ref = moe
    out = root / "ep2.jsonl"
    r = subprocess.run([sys.executable, GENERATE] + args + ["parallel=ep2", f"requests={root / 'in.jsonl'}",
                        f"output={out}", "progress=false"], capture_output=True, text=True, timeout=300,
                       env=env_for(home))
    assert r.returncode == 0, r.stderr[-2000:]
    with open(out) as f:
        got = [json.loads(x) for x in f.read().splitlines()]
    assert [g["output_token_ids"] for g in got] == [want["output_token_ids"] for _, want in ref]
