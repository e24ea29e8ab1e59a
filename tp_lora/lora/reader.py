"""Adapter reads in a process of their own (`lora.reader_processes`).

A reader thread shares the GIL with the step loop (see tp_lora.lora.pacing). A worker process reads and checks the
file with a GIL of its own and hands the weights back as one file in shared memory (/dev/shm where it has room); the
engine's reader thread then only maps it and builds the slot image. Since in-process reads were cut to a few
GIL-light stages this measured no faster on a 2x H200 host (BENCHMARKS.md), hence off by default: an option for
hosts whose step loop suffers more from a reader thread.

The worker is `python -m tp_lora.lora.reader`, talking pickles over its stdin / stdout, rather than a
multiprocessing pool: spawn would re-run the user's main script in every worker.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import threading
import uuid

import torch

import tp_lora

SHM = "/dev/shm"


def scratch_dir(nbytes: int) -> str:
    """/dev/shm when it has room for a few adapters of this size (containers often give it 64 MB), else the temp dir."""
    try:
        st = os.statvfs(SHM)
        if st.f_bavail * st.f_frsize > 4 * nbytes and os.access(SHM, os.W_OK):
            return SHM
    except OSError:
        pass
    return tempfile.gettempdir()


class ReaderProcess:
    """One worker; read() is one request at a time (callers on several threads take turns)."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(tp_lora.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tp_lora.lora.reader"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()

    def read(self, info, dtype: torch.dtype, module_shapes, max_rank, size_hint: int):
        """-> (adapter with its weights, None) or (None, why), as cache._read_safely. Raises OSError / EOFError when
        the worker is gone."""
        with self.lock:
            pickle.dump((info, dtype, module_shapes, max_rank, scratch_dir(size_hint)), self.proc.stdin)
            self.proc.stdin.flush()
            reply = pickle.load(self.proc.stdout)
        if reply[0] == "err":
            return None, reply[1]
        _, adapter, shapes, path, nbytes = reply
        try:
            flat = torch.from_file(path, shared=False, size=nbytes // dtype.itemsize, dtype=dtype)
        finally:
            os.unlink(path)
        views = flat.split([s[0] * s[1] for s in shapes])
        for i, m in enumerate(adapter.modules.values()):
            m.a, m.b = views[2 * i].view(shapes[2 * i]), views[2 * i + 1].view(shapes[2 * i + 1])
        return adapter, None

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def _serve(request) -> tuple:
    from tp_lora.lora.cache import _safely, load_checked
    info, dtype, module_shapes, max_rank, out_dir = request
    adapter, err = _safely(info.name, lambda: load_checked(info, dtype, module_shapes, max_rank))
    if err:
        return "err", err
    tensors = [t for m in adapter.modules.values() for t in (m.a, m.b)]
    flat = torch.cat([t.reshape(-1) for t in tensors]).view(torch.uint8)
    path = os.path.join(out_dir, f"tp_lora-adapter-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.truncate(flat.numel())
    torch.from_file(path, shared=True, size=flat.numel(), dtype=torch.uint8).copy_(flat)
    for m in adapter.modules.values():
        m.a = m.b = None
    return "ok", adapter, [tuple(t.shape) for t in tensors], path, flat.numel()


def main() -> None:
    torch.set_num_threads(1)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a stray print must not corrupt the reply stream
    while True:
        try:
            request = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        pickle.dump(_serve(request), replies)
        replies.flush()


if __name__ == "__main__":
    main()
