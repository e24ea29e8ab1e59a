"""No lost work under faults, through launch/generate.py as users run it:
- a rank killed mid-run: the other exits non-zero, naming the cause, within parallel.timeout_s (never hangs), and
  the output file holds valid lines for what finished;
- a rank that stalls (SIGSTOP): the other times out after parallel.timeout_s and exits the same way;
- Ctrl-C on a torchrun job (SIGINT to the whole process group; torchrun forwards another signal): every rank stops
  admitting, finishes what is in flight, the file is valid and in request order; resume=true then runs only the
  rest, and the final file equals an uninterrupted run;
- resume keeps lines verbatim and skips a line torn by a crash."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine
from tp_lora.testing import listen_port

from _serving import SCRIPT, launch_cmd, make_requests, read_lines, serving_cfg, write_requests

TIMEOUT_S = 8


def _long_requests(n=96, new=(24, 40)):
    return make_requests(n, seed=3, new=new, prompt=(4, 40))


def _args(bundle, req, out, *extra):
    model, adapters = bundle
    return [f"model.path={model}", f"lora.adapter_dir={adapters}", f"requests={req}", f"output={out}",
            "device=cpu", "dtype=float32", "lora.max_loras=2", "lora.max_cpu_loras=3", "scheduler.max_batch_size=4",
            "scheduler.max_tokens_per_step=64", f"parallel.timeout_s={TIMEOUT_S}", "progress=false", *extra]


def _spawn_ranks(args, n=2):
    """Ranks as torchrun would start them, without torchrun (which would tear the survivors down itself)."""
    port = listen_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, SCRIPT] + args + [f"parallel.tp_size={n}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait_lines(path, n, procs, limit=90):
    t0 = time.time()
    while time.time() - t0 < limit:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= n:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank ended before writing {n} lines: "
                                 + "\n".join(p.communicate()[1][-2000:] for p in procs))
        time.sleep(0.05)
    raise AssertionError(f"no {n} lines in {path} after {limit}s")


def _valid_lines(path):
    lines = read_lines(path)  # every line parses
    for ln in lines:
        assert ln.get("error") is None and len(ln["output_token_ids"]) == len(ln["logprobs"]) > 0, ln
    return lines


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_lost_rank_ends_the_others_within_the_timeout(bundle, tmp_path, fault):
    req = write_requests(tmp_path / "req.jsonl", _long_requests())
    out = tmp_path / "out.jsonl"
    procs = _spawn_ranks(_args(bundle, req, out))
    try:
        _wait_lines(out, 3, procs)
        os.kill(procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=TIMEOUT_S + 30)
        took = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 3, err[-3000:]
    assert "lost the other ranks" in err and f"parallel.timeout_s={TIMEOUT_S}" in err, err[-3000:]
    assert took < TIMEOUT_S + 15, f"rank 0 took {took:.1f}s to give up"
    assert len(_valid_lines(out)) >= 3


def test_ctrl_c_under_torchrun_drains_then_resume_finishes(bundle, tmp_path):
    reqs = _long_requests(48, new=(16, 24))
    req = write_requests(tmp_path / "req.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(launch_cmd(_args(bundle, req, out, "parallel=tp2", "scheduler.stop_grace_s=30"), nproc=2),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _wait_lines(out, 2, [proc])
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "admitting no more requests" in stderr and "rerun with resume=true" in stdout, stdout + stderr
    partial = _valid_lines(out)
    order = {r.id: r.index for r in reqs}
    assert [order[ln["id"]] for ln in partial] == sorted(order[ln["id"]] for ln in partial)
    assert 2 <= len(partial) < len(reqs)
    kept = open(out).read().splitlines()
    with open(out, "a") as f:
        f.write('{"id": "q47", "adapter"')  # a line torn by a crash is not an answer
    proc = subprocess.run(launch_cmd(_args(bundle, req, out, "resume=true", "scheduler.max_batch_size=32")),
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    assert f"resume: {len(partial)} of {len(reqs)} requests already answered" in proc.stdout
    final = open(out).read().splitlines()
    assert [json.loads(x)["id"] for x in final] == [r.id for r in reqs]
    assert set(kept) <= set(final), "resume rewrote a kept line"
    engine = Engine(serving_cfg(max_loras=4, batch=32, budget=256), comm.single_process(), *bundle)
    for ln, res in zip(map(json.loads, final), engine.generate(reqs)):
        assert ln["output_token_ids"] == res.output_token_ids, ln["id"]
        torch.testing.assert_close(torch.tensor(ln["logprobs"]), torch.tensor(res.logprobs), rtol=0, atol=1e-4)
