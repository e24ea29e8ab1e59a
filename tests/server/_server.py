"""Helpers of the server tests: start launch/serve.py (one process, or ranks under torchrun) on a free port, wait
for /health, stop it; the offline job's answers to compare against."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from tp_lora.testing import listen_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = os.path.join(ROOT, "launch", "serve.py")
GENERATE = os.path.join(ROOT, "launch", "generate.py")
START_S = 180  # model load + first import on a loaded 2-core runner
BASE = "tiny-llama"


def env_for(home) -> dict:
    """The server's environment: this checkout first on the path, the caller's entries after it (packages some hosts
    carry on PYTHONPATH)."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, TP_LORA_HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=path)


def proc_stats():
    """(pid, the fields of /proc/PID/stat after the command: state, ppid, pgrp, ...) of every live process."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    yield int(d), f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (torchrun's ranks)."""
    return sorted(p for p, fields in proc_stats() if int(fields[1]) == pid)


class Server:
    """launch/serve.py in a process group of its own (so a failed test can end every rank it started)."""

    def __init__(self, args, env, log_path, nproc: int = 1):
        self.port = listen_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = list(args) + [f"server.port={self.port}"]
        if nproc == 1:
            cmd = [sys.executable, SERVE] + args
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={listen_port()}", SERVE] + args
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.nproc = nproc
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} at start:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server did not answer /health within {START_S}s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def ranks(self) -> list[int]:
        return [self.proc.pid] if self.nproc == 1 else children(self.proc.pid)

    def terminate(self) -> None:
        """SIGTERM to every rank (as a container stop reaches each worker)."""
        for pid in self.ranks():
            os.kill(pid, signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL to the launch's process group and to each rank (torchrun starts its ranks in sessions of their
        own: they would outlive it)."""
        if self.proc.poll() is None:
            ranks = self.ranks() if self.nproc > 1 else []
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(10)


def offline_reference(home, out_path) -> list[dict]:
    """launch/generate.py's answers to the embedded default requests: (request line, output line) pairs."""
    from tp_lora.assets import ensure_default_assets
    old = os.environ.get("TP_LORA_HOME")
    os.environ["TP_LORA_HOME"] = str(home)
    try:
        paths = ensure_default_assets()
    finally:
        os.environ.pop("TP_LORA_HOME") if old is None else os.environ.update(TP_LORA_HOME=old)
    r = subprocess.run([sys.executable, GENERATE, f"output={out_path}", "progress=false"], capture_output=True,
                       text=True, timeout=300, env=env_for(home))
    assert r.returncode == 0, r.stderr
    with open(paths["requests"]) as f:
        reqs = [json.loads(x) for x in f.read().splitlines()]
    with open(out_path) as f:
        outs = [json.loads(x) for x in f.read().splitlines()]
    assert [o["id"] for o in outs] == [q["id"] for q in reqs]
    return list(zip(reqs, outs))


def runtime_lora(root) -> list[str]:
    """Server overrides allowing run-time adapter loads from under `root`."""
    return ["server.allow_runtime_lora=true", f"server.lora_roots=['{root}']"]


def load_gamma_copy(url: str, default: dict, reference: list, tmp_path) -> tuple[dict, dict]:
    """Copy the default bundle's gamma adapter to tmp_path/g2 and load it as "g2" at run time (asserting a 200):
    a gamma request line and its offline output, to compare g2's answers with."""
    import shutil
    shutil.copytree(os.path.join(default["adapter_dir"], "gamma"), tmp_path / "g2")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "g2", "lora_path": str(tmp_path / "g2")},
                   timeout=60)
    assert r.status_code == 200, r.text
    return next((q, o) for q, o in reference if q["adapter"] == "gamma")


def model_of(req: dict) -> str:
    return req["adapter"] or BASE
