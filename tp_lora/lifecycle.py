"""Process lifecycle shared by the front ends (the offline job, the server, the launch scripts): exit codes, the stop
level from SIGINT / SIGTERM, lost-rank detection and report, the Hydra entry, and the log line.

Exit codes: 0 done; 2 bad config or inputs (every rank says why before any collective); 3 lost the other ranks (a
rank died or a collective did not complete within parallel.timeout_s); 130 stopped by a signal before every request
finished.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from tp_lora.config import RunConfig

EXIT_BAD_INPUT, EXIT_LOST_RANKS, EXIT_STOPPED = 2, 3, 130
# A rank's teardown after losing its peers may itself wait on them (NCCL): the process ends this long after, at most.
LOST_RANKS_EXIT_S = 10.0
# Ctrl-C under torchrun reaches every worker twice (the terminal's SIGINT, then torchrun's SIGTERM): signals this close
# together count as one.
SIGNAL_DEBOUNCE_S = 1.0


def log(msg: str) -> None:
    print(f"[tp_lora] {msg}", flush=True)


def hydra_job(cfg, job) -> None:
    """A launch script's Hydra main: the composed DictConfig typed as RunConfig (exit 2 naming a bad key or type),
    job(typed) -> exit code, and the process ends with that code."""
    from omegaconf import OmegaConf
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))
    except Exception as e:  # omegaconf's validation errors name the key and the expected type
        print(f"[tp_lora] rank {os.environ.get('RANK', '0')}: config error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    code = job(typed)
    # The job has closed its output and torn down its process groups. Leaving through os._exit skips interpreter
    # teardown, where torch's C++ threads (gloo's, the rendezvous store's) are at times destroyed while still
    # joinable and abort a finished run ("terminate called without an active exception", exit -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_comm_failure(e: BaseException) -> bool:
    """An error raised by a collective or the rendezvous store: a peer is gone or too slow."""
    import torch.distributed as dist

    from tp_lora.distributed import peer_failure  # torch's import cost stays off this module's import
    if isinstance(e, getattr(dist, "DistError", ())) or peer_failure():  # a peer kernel that gave up failed the device
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in (
        "gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "broken pipe", "store"))


def report_lost_ranks(rank: int, timeout_s: float, e: BaseException, outcome: str,
                      gone: Optional[list[int]] = None) -> None:
    """Say on stderr that this rank lost its peers, and why; `outcome` ends the line with what that means for the
    front end's work (where finished results are, or that the server stops). gone: the ranks known dead
    (gone_ranks)."""
    from tp_lora.distributed import peer_failure
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    who = f"rank {', '.join(map(str, gone))} died" if gone else "a rank died"
    why = peer_failure()
    print(f"[tp_lora] rank {rank}: error: lost the other ranks: {who} or a collective did not complete within "
          f"parallel.timeout_s={timeout_s:g}s ({type(e).__name__}: {first[:300]}"
          f"{'; ' + why if why else ''}){outcome}", file=sys.stderr, flush=True)


def whereabouts() -> tuple[str, int]:
    """This process's (host name, pid): gathered once at start, so a rank that loses its peers can say which died."""
    import socket
    return socket.gethostname(), os.getpid()


def gone_ranks(peers: list[tuple[str, int]], settle_s: float = 1.0) -> list[int]:
    """The ranks (index into peers, from whereabouts()) on this host whose process no longer runs (ended, or a zombie
    its parent has not reaped yet), looked for up to settle_s (a dying process closes its sockets, which is how its
    peers notice, before it is done exiting); ranks on other hosts cannot be checked from here."""
    here, deadline = whereabouts()[0], time.monotonic() + settle_s
    while True:
        out = [rank for rank, (host, pid) in enumerate(peers) if host == here and not _running(pid)]
        if out or time.monotonic() > deadline:
            return out
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def exit_lost_ranks() -> int:
    """EXIT_LOST_RANKS, with the process ending LOST_RANKS_EXIT_S from now whatever its teardown still waits on."""
    timer = threading.Timer(LOST_RANKS_EXIT_S, os._exit, args=(EXIT_LOST_RANKS,))
    timer.daemon = True
    timer.start()
    return EXIT_LOST_RANKS


class StopSignals:
    """SIGINT / SIGTERM handlers for the generation loop, on every rank: the stop level (the engine's RUN 0, DRAIN 1,
    ABORT 2) goes up by one per signal. The first asks the engine to drain (admit nothing more, finish in-flight
    requests), a later one to abort. The engine's ranks agree on the level."""

    def __init__(self, announce: bool):
        self.level, self.announce = 0, announce
        self._last = -1e9
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if now - self._last < SIGNAL_DEBOUNCE_S:
            return
        self._last = now
        self.level = min(2, self.level + 1)
        if self.announce:
            print(f"[tp_lora] {signal.Signals(signum).name}: "
                  + ("admitting no more requests, finishing those in flight (again to stop now)" if self.level == 1
                     else "stopping now"), file=sys.stderr, flush=True)

    def __call__(self) -> int:
        return self.level
