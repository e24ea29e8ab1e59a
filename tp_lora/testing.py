"""Run a function on N real processes and get rank 0's result: the harness of the distributed tests.

CPU and gloo by default; TP_LORA_TEST_DEVICE=cuda runs the same tests over NCCL, one GPU per rank, and
TP_LORA_TEST_BACKEND=triton switches the LoRA kernels (tests read both through device_under_test() / backend_under_test())."""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_under_test() -> str:
    return os.environ.get("TP_LORA_TEST_DEVICE", "cpu")


def backend_under_test() -> str:
    return os.environ.get("TP_LORA_TEST_BACKEND", "torch")


def enough_devices(world_size: int) -> bool:
    return device_under_test() == "cpu" or torch.cuda.device_count() >= world_size


def _worker(rank, world_size, port, tp_size, timeout_s, fn, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share two cores in CI
    from tp_lora import distributed
    try:
        ps = distributed.init_parallel(tp_size, device_under_test(), timeout_s)
        result = fn(ps, *args)
        # Pickled by value: torch's queue would share tensors through file descriptors that vanish when this
        # process exits, before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result) if rank == 0 else None))
    except BaseException:  # report every failure to the parent, which re-raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        distributed.shutdown()


def run_ranks(fn, world_size: int, *args, tp_size: int | None = None, timeout_s: float = 120.0):
    """fn(parallel_state, *args) on world_size spawned ranks; returns rank 0's return value.
    Raises RuntimeError with the failing ranks' tracebacks. fn must be importable (module level)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, tp_size or world_size, timeout_s, fn, args,
                                                queue), daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, reported = None, [], set()
    deadline = time.monotonic() + timeout_s + 60
    try:
        # Poll rather than block: a rank killed from outside (NCCL's watchdog aborts the process) never reports.
        while len(reported) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
                if dead and queue.empty():
                    errors += [f"rank {r}: exited with code {procs[r].exitcode} before reporting" for r in dead]
                    reported.update(dead)
                continue
            reported.add(rank)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
            elif rank == 0:
                results = pickle.loads(payload)
        if len(reported) < world_size:
            errors.append(f"ranks {sorted(set(range(world_size)) - reported)}: no result within {timeout_s + 60:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
