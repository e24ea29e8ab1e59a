"""One command on one node: a launch script run without torchrun starts its layout's ranks itself (torch
multiprocessing, spawned), each with the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT). The launching process only waits: SIGINT / SIGTERM to it go on to
every rank (which drain as under torchrun), a rank that ends badly is named, and its exit code is the first bad rank
code (0 when every rank ended with 0). A rank that loses the launcher (killed) is ended by the kernel.

The layout's world size: parallel.dp_size (or the EP group when ep_attention=dp) x parallel.tp_size
(tp_lora.config.world_size_of); under torchrun (WORLD_SIZE set) or for one rank the job runs in this process.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from typing import Callable

from tp_lora.config import RunConfig, world_size_of
from tp_lora.lifecycle import LOST_RANKS_EXIT_S

Job = Callable[[RunConfig], int]
POLL_S = 0.2
PR_SET_PDEATHSIG = 1


def launch(cfg: RunConfig, job: Job) -> int:
    """job(cfg) on this process, or on the layout's ranks started here: the exit code."""
    world = world_size_of(cfg.parallel)
    if "WORLD_SIZE" in os.environ or world == 1:
        return job(cfg)
    import torch.multiprocessing as mp
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_rank, args=(rank, world, port, job, cfg), name=f"rank{rank}")
             for rank in range(world)]
    for p in ranks:
        p.start()

    def forward(signum, frame):
        for p in ranks:
            if p.exitcode is None:
                os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _wait(ranks, cfg.parallel.timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(ranks: list, timeout_s: float) -> int:
    """Wait for every rank; after the first bad exit the others have timeout_s (their collectives fail) and the lost
    ranks' exit delay to end, then are killed. The first bad exit code, else 0."""
    bad, deadline = None, None
    while any(p.exitcode is None for p in ranks):
        for rank, p in enumerate(ranks):
            if p.exitcode not in (None, 0) and bad is None:
                why = f"signal {-p.exitcode}" if p.exitcode < 0 else f"code {p.exitcode}"
                print(f"[tp_lora] launcher: rank {rank} (pid {p.pid}) exited with {why}; the other ranks stop "
                      f"within parallel.timeout_s={timeout_s:g}s", file=sys.stderr, flush=True)
                bad, deadline = p.exitcode, time.monotonic() + timeout_s + LOST_RANKS_EXIT_S + 5
        if deadline is not None and time.monotonic() > deadline:
            for rank, p in enumerate(ranks):
                if p.exitcode is None:
                    print(f"[tp_lora] launcher: rank {rank} (pid {p.pid}) did not stop: killed", file=sys.stderr,
                          flush=True)
                    p.kill()
        time.sleep(POLL_S)
    for p in ranks:
        p.join()
        if bad is None and p.exitcode != 0:
            bad = p.exitcode
    return 0 if bad is None else (bad if bad > 0 else 128 - bad)


def _rank(rank: int, world: int, port: int, job: Job, cfg: RunConfig) -> None:
    try:  # end with the launcher (Linux): a killed launcher leaves no rank behind
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = job(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as lifecycle.hydra_job: no interpreter teardown racing torch's threads
