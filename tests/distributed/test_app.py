"""The main job as users launch it: the embedded default runs on a fresh machine; bad configs end every rank with a
message naming the value (no hang); bad requests and unusable adapters fail alone."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tp_lora.assets import ensure_default_assets, write_random_adapter
from tp_lora.testing import listen_port, workers_share_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "launch", "generate.py")


def _launch(args, home, nproc=1, timeout=180):
    env = dict(os.environ, TP_LORA_HOME=str(home), OMP_NUM_THREADS="1")
    cmd = [sys.executable, SCRIPT] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={listen_port()}",
         SCRIPT]
    if workers_share_gpus():  # side by side with other workers' tests: a small cache, not 80% of the free memory
        args = [*args, "scheduler.kv_cache_mb=1024"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_lora_home")


def _bundle(home):
    from tp_lora.assets import default_root
    os.environ["TP_LORA_HOME"], old = str(home), os.environ.get("TP_LORA_HOME")
    try:
        return pathlib.Path(default_root())
    finally:
        os.environ.pop("TP_LORA_HOME") if old is None else os.environ.update(TP_LORA_HOME=old)


def test_default_job_runs_on_a_fresh_machine(home, tmp_path):
    out = tmp_path / "out.jsonl"
    proc = _launch([f"output={out}"], home)
    assert proc.returncode == 0, proc.stderr
    assert "requests (0 failed)" in proc.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    requests = [json.loads(x) for x in (_bundle(home) / "requests.jsonl").read_text().splitlines()]
    assert [ln["id"] for ln in lines] == [r["id"] for r in requests]
    assert all(len(ln["output_token_ids"]) == len(ln["logprobs"]) > 0 for ln in lines)


@pytest.mark.parametrize("args, message", [
    (["parallel=tp2", "lora.fully_sharded=true", "lora.max_rank=3"], "lora.max_rank=3 must be divisible"),
    (["parallel.tp_size=2", "model.max_seq_len=abc"], "model.max_seq_len"),
    (["parallel=tp4"], "parallel.tp_size=4 does not divide the 2 launched processes"),
])
def test_bad_config_fails_every_rank_fast(home, args, message):
    proc = _launch(args, home, nproc=2, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_model_that_cannot_split_is_named(home, tmp_path):
    home = _bundle(home)
    ensure_default_assets(str(home))  # in this process: what the job writes on a fresh machine
    cfg = json.loads((home / "model" / "config.json").read_text())
    bad = tmp_path / "model"
    bad.mkdir()
    for f in os.listdir(home / "model"):
        os.symlink(home / "model" / f, bad / f)
    os.unlink(bad / "config.json")
    (bad / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=3, head_dim=cfg["hidden_size"] // 4)))
    proc = _launch([f"model.path={bad}", f"requests={home / 'requests.jsonl'}", "parallel=tp2"], home.parent,
                   nproc=2)
    assert proc.returncode != 0
    assert "num_attention_heads=3" in proc.stdout + proc.stderr


def test_bad_requests_and_adapters_fail_alone(home, tmp_path):
    bundle = _bundle(home)
    ensure_default_assets(str(bundle))
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    for name in os.listdir(bundle / "adapters"):
        os.symlink(bundle / "adapters" / name, adapters / name)
    write_random_adapter(adapters / "too_big", bundle / "model", r=32, seed=3)  # rank 32 > max_rank 16
    broken = adapters / "broken"
    write_random_adapter(broken, bundle / "model", r=4, seed=4)
    data = (broken / "adapter_model.safetensors").read_bytes()
    (broken / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])  # truncated file
    lines = [
        {"id": "ok", "adapter": "alpha", "prompt_token_ids": [1, 2, 3], "max_new_tokens": 3},
        {"id": "unknown", "adapter": "nope", "prompt_token_ids": [1, 2], "max_new_tokens": 3},
        {"id": "empty", "adapter": None, "prompt_token_ids": [], "max_new_tokens": 3},
        {"id": "big", "adapter": "too_big", "prompt_token_ids": [1], "max_new_tokens": 3},
        {"id": "broken", "adapter": "broken", "prompt_token_ids": [1], "max_new_tokens": 3},
        {"id": "long", "adapter": None, "prompt_token_ids": [1] * 10, "max_new_tokens": 10_000_000},
        {"id": "vocab", "adapter": None, "prompt_token_ids": [10_000_000], "max_new_tokens": 2},
        {"id": "ok2", "adapter": None, "prompt_token_ids": [4, 5], "max_new_tokens": 3},
    ]
    req = tmp_path / "req.jsonl"
    req.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken json\n")
    out = tmp_path / "out.jsonl"
    proc = _launch([f"model.path={bundle / 'model'}", f"lora.adapter_dir={adapters}", f"requests={req}",
                    f"output={out}", "parallel=tp2", "generation.ignore_eos=true"], home, nproc=2)
    assert proc.returncode == 0, proc.stderr
    got = {ln["id"]: ln for ln in map(json.loads, out.read_text().splitlines())}
    assert len(got["ok"]["output_token_ids"]) == 3 and len(got["ok2"]["output_token_ids"]) == 3
    expect = {"unknown": "unknown adapter 'nope'", "empty": "empty prompt", "big": "rank 32 > lora.max_rank=16",
              "broken": "broken", "long": "exceeds the context", "vocab": "outside the vocabulary",
              "line-9": "malformed JSON"}
    for rid, text in expect.items():
        assert text in got[rid].get("error", ""), (rid, got[rid])


def test_a_failed_device_is_reported_as_lost_ranks_naming_the_peer_kernels_words(monkeypatch, capsys):
    """A peer kernel that gave up waiting fails the device; whichever CUDA call then raises (here a kernel's load),
    the rank counts it as a lost peer and says what the kernel recorded."""
    from tp_lora import distributed, lifecycle
    error = RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered")
    assert not lifecycle.is_comm_failure(error)
    monkeypatch.setattr(distributed, "peer_failure", lambda: "rank 0 of the group waited for rank 1's data in call 7")
    assert lifecycle.is_comm_failure(error)
    lifecycle.report_lost_ranks(0, 60.0, error, ": the server stops")
    line = capsys.readouterr().err
    assert "illegal instruction" in line and "waited for rank 1's data in call 7" in line and "server stops" in line
