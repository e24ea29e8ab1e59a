"""Run a function on N real processes and get rank 0's result: the harness of the distributed tests.

The ranks are a pool started once per (world size, device) and kept for the whole test session: each holds an
initialised process group, and a test sends it a picklable function (run_ranks). Starting ranks (process, torch
import, process group, CUDA context) costs far more than most tests, so it happens once; a test that fails, hangs or
loses a rank ends the pool, and the next test starts a fresh one.

CPU and gloo by default; TP_LORA_TEST_DEVICE=cuda runs the same tests over NCCL, one GPU per rank, and
TP_LORA_TEST_BACKEND=triton switches the LoRA kernels (tests read both through device_under_test() /
backend_under_test(); each call hands the ranks the caller's TP_LORA_* environment)."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import faulthandler
import gc
import os
import pickle
import queue as queue_mod
import shutil
import random
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

START_TIMEOUT_S = 300.0  # the world process group's collective timeout (a test's own groups take its timeout_s)
LATE_S = 60.0  # past a task's collective timeout, how long its ranks get to report (their collectives failing)
STACKS_S = 10.0  # how long a hung rank gets to write its stacks (faulthandler, on SIGUSR1)
GRACE_S = 2.0  # after one rank fails, how long the others get to report (their own failures) before the pool ends
PR_SET_PDEATHSIG = 1


def listen_port() -> int:
    """A free port for a server or a rendezvous to listen on, below the system's ephemeral range: the ports bind(0)
    hands out (gloo's and NCCL's sockets, other processes' connections) come from that range, so none of them can take
    this one before it is bound (a port from bind(0) could be, and the rank pool's rendezvous then failed with
    'address already in use' beside other test workers)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


def device_under_test() -> str:
    return os.environ.get("TP_LORA_TEST_DEVICE", "cpu")


def backend_under_test() -> str:
    return os.environ.get("TP_LORA_TEST_BACKEND", "torch")


def enough_devices(world_size: int) -> bool:
    return device_under_test() == "cpu" or torch.cuda.device_count() >= world_size


GPU_SHARE = 0.2  # of each GPU's memory, per test process, when parallel pytest workers share the GPUs


def workers_share_gpus() -> bool:
    """Whether parallel pytest workers (pytest-xdist) run the CUDA tests side by side on the same GPUs."""
    return "PYTEST_XDIST_WORKER_COUNT" in os.environ and device_under_test() == "cuda"


def rotated_gpus(worker: int, workers: int, gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for pytest worker `worker` of `workers`: every GPU, starting at the worker's share."""
    start = worker * gpus // workers
    return ",".join(str((start + i) % gpus) for i in range(gpus))


def spread_gpus() -> None:
    """Under parallel workers on CUDA, before the process touches CUDA: show it (and the ranks and jobs it starts)
    every GPU in an order rotated to start at its share (rotated_gpus), so that tests running side by side put their
    first ranks on different GPUs, not all on GPU 0 (a spinning collective loses its GPU's time slices to the
    processes beside it). Where CUDA_VISIBLE_DEVICES is set already, or no NVIDIA driver lists its GPUs, nothing."""
    if not workers_share_gpus() or os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return
    try:
        gpus = len(os.listdir("/proc/driver/nvidia/gpus"))  # counted without initialising CUDA
    except OSError:
        return
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = rotated_gpus(worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), gpus)


def share_gpus() -> None:
    """Under parallel pytest workers on CUDA, limit this process's allocator to GPU_SHARE of its current GPU: an
    engine sizes its KV cache from what is free (80% by default), which would leave nothing to the processes of the
    other workers on the same GPUs. Called by every test process and by every rank it spawns once the rank has its
    GPU (jobs launched as subprocesses cap their KV cache instead: scheduler.kv_cache_mb)."""
    if workers_share_gpus():
        torch.cuda.set_per_process_memory_fraction(GPU_SHARE, torch.cuda.current_device())


def _test_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("TP_LORA_")}


class RankPool:
    """world_size spawned ranks on `device` with one process group, running tasks one at a time.

    run(fn, *args) runs fn(parallel_state, *args) on every rank and returns rank 0's result. parallel_state has
    tp_size-rank tp groups (created on a rank's first task of that (tp_size, timeout_s), then reused) in Group
    objects of the task's own, so a task may change them (use_allreduce, init_expert_parallel) without the next
    seeing it. Each task starts with torch's generators seeded afresh (as in a new process) and the caller's TP_LORA_*
    environment; after it each rank restores its environment and frees memory, and the ranks check they ran the
    same task (a world all-gather). A rank's host waits on the device (distributed.wait_device) keep the timeout of
    the groups it set up last."""

    def __init__(self, world_size: int, device: str):
        self.world_size, self.device = world_size, device
        self.procs, self.task = [], 0

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.stacks = tempfile.mkdtemp(prefix="tp_lora_ranks_")  # where a hung rank's stack is dumped
        self.outbox, self.inboxes = ctx.Queue(), [ctx.Queue() for _ in range(self.world_size)]
        port = listen_port()
        self.procs = [ctx.Process(target=_pool_rank, name=f"rank{r}",
                                  args=(r, self.world_size, port, self.device, self.stacks, self.inboxes[r],
                                        self.outbox)) for r in range(self.world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.exitcode is None for p in self.procs)

    def run(self, fn, *args, tp_size: int | None = None, timeout_s: float = 120.0):
        """fn(parallel_state, *args) on every rank; rank 0's return value. Raises RuntimeError with the failing
        ranks' tracebacks (a hung rank's stack) within timeout_s + LATE_S, and then ends the pool."""
        if not self.alive():
            self.close()
            self.start()
        self.task += 1
        payload = pickle.dumps((fn, args, tp_size or self.world_size, timeout_s))
        for inbox in self.inboxes:
            inbox.put((self.task, list(sys.path), _test_env(), payload))
        result, errors = self._collect(timeout_s + LATE_S)
        if errors:
            self.close(kill=True)
            raise RuntimeError("\n".join(errors) + "\n(the ranks were ended; the next run starts new ones)")
        return result

    def _collect(self, limit_s: float):
        result, errors, reported, finished = None, [], set(), set()
        deadline = time.monotonic() + limit_s
        while len(reported) < self.world_size and time.monotonic() < deadline:
            try:
                rank, task, status, payload = self.outbox.get(timeout=0.5)
            except queue_mod.Empty:
                # Poll rather than block: a rank killed from outside (NCCL's watchdog aborts it) never reports.
                dead = [r for r, p in enumerate(self.procs) if r not in reported and p.exitcode is not None]
                if dead and self.outbox.empty():
                    errors += [f"rank {r}: exited with code {self.procs[r].exitcode} before reporting"
                               + self._last_words(r) for r in dead]
                    reported.update(dead)
                continue
            if task not in (self.task, None):  # None: the rank failed to start
                continue
            if status == "finished":  # fn returned; the check that every rank ran this task follows
                finished.add(rank)
                continue
            reported.add(rank)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                deadline = min(deadline, time.monotonic() + GRACE_S)
            elif rank == 0:
                result = pickle.loads(payload)
        missing = sorted(set(range(self.world_size)) - reported - finished)
        waiting = sorted(finished - reported)
        if errors and missing:
            errors.append(f"ranks {missing}: no result {GRACE_S:g} s after the first failure")
        elif missing:
            errors.append(f"ranks {missing}: no result within {limit_s:.0f} s" + self._stacks(missing))
        if waiting:
            errors.append(f"ranks {waiting}: finished the task, then waited for the other ranks")
        return result, errors

    def _stacks(self, ranks: list[int]) -> str:
        """The Python stacks of the given ranks (faulthandler, on SIGUSR1), to show where they hang."""
        paths = {r: os.path.join(self.stacks, f"rank{r}.txt") for r in ranks}  # made as each rank starts
        for r in ranks:
            if self.procs[r].exitcode is None:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + STACKS_S
        while time.monotonic() < deadline and not all(os.path.exists(p) and os.path.getsize(p) for p in paths.values()):
            time.sleep(0.2)
        out = ""
        for r, path in paths.items():
            text = _tail(path)
            out += f"\nrank {r} stack:\n{text or '(none written: the rank did not take SIGUSR1)'}"
            out += self._last_words(r, stacks=False)
        return out

    def _last_words(self, rank: int, stacks: bool = True) -> str:
        """The tail of a rank's stderr and, with `stacks`, the stacks it wrote at a fatal signal (where it was when
        NCCL's watchdog or a CUDA error aborted it)."""
        out = ""
        err = _tail(os.path.join(self.stacks, f"rank{rank}.err"))
        if err:
            out += f"\nrank {rank} stderr (its end):\n{err}"
        text = _tail(os.path.join(self.stacks, f"rank{rank}.txt")) if stacks else ""
        if text:
            out += f"\nrank {rank} stacks at its end:\n{text}"
        return out

    def close(self, kill: bool = False) -> None:
        """End the ranks: asked to leave (destroying the process group), or killed (a failed pool)."""
        if not self.procs:
            return
        if not kill and self.alive():
            for inbox in self.inboxes:
                inbox.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.pid is None:  # start() failed before this rank
                continue
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
        for q in [self.outbox, *self.inboxes]:
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.stacks, ignore_errors=True)
        self.procs = []


def _tail(path: str, chars: int = 4000) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-chars:].strip()


def _pool_rank(rank, world_size, port, device, stacks, inbox, outbox):
    try:  # end with the test process (Linux): a killed pytest leaves no rank behind
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    stack_file = open(os.path.join(stacks, f"rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a fatal signal (NCCL's watchdog aborts) writes them too
    # stderr (NCCL's watchdog, CUDA's errors, warnings) goes to a file whose tail a failure report carries
    err_file = open(os.path.join(stacks, f"rank{rank}.err"), "w")
    os.dup2(err_file.fileno(), 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks share two cores in CI
    from tp_lora import distributed
    states = {}  # (tp_size, timeout_s) -> ParallelState
    try:
        states[(1, START_TIMEOUT_S)] = distributed.init_parallel(1, device, START_TIMEOUT_S)
        share_gpus()  # init_parallel set this rank's GPU
    except BaseException:
        outbox.put((rank, None, "error", "starting the rank: " + traceback.format_exc()))
        return
    while (msg := inbox.get()) is not None:
        task, path, env, payload = msg
        sys.path[:0] = [p for p in path if p not in sys.path]  # the caller's test directories
        saved = dict(os.environ)
        for k in [k for k in os.environ if k.startswith("TP_LORA_")]:
            del os.environ[k]
        os.environ.update(env)
        torch.seed()  # every device's generator, as a new process would have them
        torch.set_num_threads(1)
        distributed.STATS.reset()
        try:
            fn, args, tp_size, timeout_s = pickle.loads(payload)
            key = (tp_size, timeout_s)
            if key not in states:
                states[key] = distributed.init_parallel(tp_size, device, timeout_s)
            ps = _own_copy(states[key])
            # The stacks on SIGUSR1 (registered again: process group set-up may install handlers of its own), and
            # written unasked once the task outlives its timeout, where a rank stuck in the driver takes no signal.
            faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
            faulthandler.dump_traceback_later(timeout_s + LATE_S / 2, file=stack_file)
            out = fn(ps, *args)
            outbox.put((rank, task, "finished", None))
            # Pickled by value: torch's queue would share tensors through file descriptors that vanish when this
            # process ends, before the parent reads them.
            reply = (rank, task, "ok", pickle.dumps(out) if rank == 0 else None)
            del out
            ran = distributed.all_gather_object(task, ps.world)
            if ran != [task] * world_size:
                raise RuntimeError(f"the ranks ran different tasks: {ran}")
        except BaseException:  # report every failure to the parent, which re-raises it
            why = distributed.peer_failure()  # whatever CUDA call surfaced the failed device
            calls = "" if isinstance(sys.exc_info()[1], distributed.CollectiveTimeout) else (  # it lists them itself
                distributed.last_calls() + "\n")
            reply = (rank, task, "error", traceback.format_exc() + (f"the device failed: {why}\n" if why else "")
                     + calls)
        finally:
            faulthandler.cancel_dump_traceback_later()
            os.environ.clear()
            os.environ.update(saved)
        outbox.put(reply)
        if reply[2] == "error":  # the pool ends every rank after a failure; a failed device would abort this one in
            continue  # the cleanup below (C++ terminate) before the queue's thread has sent the report
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown racing torch's threads


def _own_copy(ps):
    """ps with Group objects of its own (same process groups): what a task sets on them stays with the task."""
    return dataclasses.replace(ps, world=dataclasses.replace(ps.world), tp=dataclasses.replace(ps.tp),
                               dp=dataclasses.replace(ps.dp), ep=None, moe_tp=None, ep_attention="dp")


_POOLS: dict[tuple[int, str], RankPool] = {}


def rank_pool(world_size: int) -> RankPool:
    """The session's pool of world_size ranks on device_under_test() (started on its first run)."""
    key = (world_size, device_under_test())
    if key not in _POOLS:
        _POOLS[key] = RankPool(*key)
    return _POOLS[key]


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)


def run_ranks(fn, world_size: int, *args, tp_size: int | None = None, timeout_s: float = 120.0):
    """fn(parallel_state, *args) on world_size ranks (the session's pool); returns rank 0's return value.
    Raises RuntimeError with the failing ranks' tracebacks. fn must be importable (module level); its tp groups
    have tp_size ranks (default: all) and collectives that time out after timeout_s."""
    return rank_pool(world_size).run(fn, *args, tp_size=tp_size, timeout_s=timeout_s)


_RECORDED = ("all_reduce", "all_gather", "reduce_scatter", "fused_peer")


@contextlib.contextmanager
def recorded_collectives():
    """The collectives this process asks for inside the block, in order, as (primitive, group name, group's ranks,
    shape, options) over groups of more than one rank; a reduce fused into the kernel that consumes it
    (tp_lora.distributed.fused_peer) is named apart from a plain one, even where it falls back to the plain one
    (gloo). On GPUs the two are different peer kernels, which never meet: same_collectives checks for that."""
    from tp_lora import distributed as comm  # noqa: PLC0415 - the ranks' module, patched for the block only
    calls, saved = [], {name: getattr(comm, name) for name in _RECORDED}

    def spy(name):
        def call(t, group, *args, **kw):
            if group.size > 1:
                calls.append((name, group.name, tuple(group.ranks), tuple(t.shape), args, sorted(kw.items())))
            return saved[name](t, group, *args, **kw)
        return call
    for name in saved:
        setattr(comm, name, spy(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


def same_collectives(calls: list, world, what: str = "") -> None:
    """AssertionError where two ranks of one group asked for different sequences of its collectives. calls: this
    rank's recorded_collectives() list (every rank of `world` calls this with its own)."""
    from tp_lora import distributed as comm  # noqa: PLC0415
    everyone = comm.all_gather_object(calls, world)
    for group in sorted({(c[1], c[2]) for mine in everyone for c in mine}):
        seqs = {r: [c for c in everyone[r] if (c[1], c[2]) == group] for r in group[1]}
        first = seqs[group[1][0]]
        for r, seq in seqs.items():
            if seq != first:
                at = next((i for i, (a, b) in enumerate(zip(first, seq)) if a != b), min(len(first), len(seq)))
                raise AssertionError(f"{what}: ranks {group[1][0]} and {r} of group {group[0]} {list(group[1])} "
                                     f"part at their collective {at}: {first[at:at + 2]} against {seq[at:at + 2]}")
