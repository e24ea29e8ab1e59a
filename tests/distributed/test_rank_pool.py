"""The ranks every distributed test runs on (tp_lora.testing.run_ranks): started once and reused, each task in a
state of its own, and a task that fails, hangs or loses a rank ends in an error naming the rank, within a bound,
after which the next task runs on new ranks."""
import os
import sys
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora import testing
from tp_lora.testing import device_under_test, enough_devices, run_ranks


def _pids(ps: comm.ParallelState):
    return comm.all_gather_object(os.getpid(), ps.world)


def _state(ps: comm.ParallelState, tag: str):
    """What a task finds, then changes: the next task must find the same."""
    found = (ps.tp.name, ps.tp.size, ps.dp.size, comm.all_gather_object(torch.rand(2).tolist(), ps.world),
             os.environ.get("TP_LORA_TEST_TAG"), os.environ.get("LEFT_BY_A_TASK"))
    summed = comm.all_reduce(torch.full((2,), float(ps.rank + 1), device=ps.device), ps.tp)
    ps.tp.name, ps.tp.peer = "changed", object()
    os.environ["LEFT_BY_A_TASK"] = tag
    return found, summed.tolist()


def test_ranks_are_started_once_and_tasks_do_not_see_each_other(monkeypatch):
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    first = run_ranks(_pids, 2)
    monkeypatch.setenv("TP_LORA_TEST_TAG", "one")
    (name, size, dp, draws, tag, left), summed = run_ranks(_state, 2, "x")
    assert (name, size, dp, tag, left, summed) == ("tp", 2, 1, "one", None, [3.0, 3.0])
    monkeypatch.setenv("TP_LORA_TEST_TAG", "two")
    (name, size, dp, redrawn, tag, left), summed = run_ranks(_state, 2, "y")
    assert (name, size, dp, tag, left, summed) == ("tp", 2, 1, "two", None, [3.0, 3.0])
    assert redrawn[0] != draws[0] and redrawn[1] != draws[1], "torch's generators are seeded afresh per task"
    (name, size, dp, _, _, _), summed = run_ranks(_state, 2, "z", tp_size=1)  # dp over the same ranks
    assert (name, size, dp, summed) == ("tp", 1, 2, [1.0, 1.0])
    assert run_ranks(_pids, 2) == first, "the same processes ran every task"


def _fails_on_rank_1(ps: comm.ParallelState):
    comm.all_reduce(torch.ones(3, 5, device=ps.device), ps.tp)  # the report lists it among the rank's last calls
    if ps.rank == 1:
        raise ValueError("planted failure")
    return "rank 0 done"


def _sleeps_forever(ps: comm.ParallelState):
    if ps.rank == 1:
        time.sleep(3600)


def _leaves(ps: comm.ParallelState):
    if ps.rank == 1:
        os._exit(3)


def _device_failed(ps: comm.ParallelState):
    """As a peer kernel that gave up waiting fails the device: its words recorded, then some CUDA call raises."""
    if ps.rank == 1:
        comm.peer_failure = lambda: "planted: rank 1 waited for rank 0's data in call 7"
        raise RuntimeError("CUDA error: an illegal instruction was encountered")


def _aborts(ps: comm.ParallelState):
    """As NCCL's watchdog ends a rank: last words on stderr, then SIGABRT."""
    if ps.rank == 1:
        sys.stderr.write("planted last words\n")
        sys.stderr.flush()
        os.abort()


@pytest.mark.skipif(device_under_test() == "cuda", reason="the harness's handling, the same on CUDA: restarts cost more")
@pytest.mark.parametrize("fn, message", [
    (_fails_on_rank_1, r"rank 1:\n(.|\n)*ValueError: planted failure\nlast collectives of this rank: (.|\n)*"
                       r"#\d+ all_reduce:tp \(\S+\) \[3, 5\] float32\n"),
    (_sleeps_forever, r"ranks \[1\]: no result within 3 s\nrank 1 stack:\n(.|\n)*_sleeps_forever(.|\n)*"
                      r"ranks \[0\]: finished the task, then waited"),
    (_leaves, r"rank 1: exited with code 3 before reporting"),
    (_device_failed, r"rank 1:\n(.|\n)*illegal instruction(.|\n)*the device failed: planted: rank 1 waited"),
    (_aborts, r"rank 1: exited with code -6 before reporting\nrank 1 stderr \(its end\):\n(.|\n)*"
              r"planted last words(.|\n)*rank 1 stacks at its end:\n(.|\n)*_aborts"),
], ids=["raises", "hangs", "exits", "device_failed", "aborts"])
def test_a_failed_task_names_its_rank_and_the_next_runs_on_new_ranks(monkeypatch, fn, message):
    before = run_ranks(_pids, 2)
    monkeypatch.setattr(testing, "LATE_S", 2.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=message) as err:
        run_ranks(fn, 2, timeout_s=1.0)
    assert time.monotonic() - t0 < 15
    assert "the next run starts new ones" in str(err.value)
    after = run_ranks(_pids, 2)
    assert not set(after) & set(before)
    assert run_ranks(_state, 2, "after")[1] == [3.0, 3.0]


def test_parallel_workers_see_the_gpus_in_rotated_orders(monkeypatch):
    assert [testing.rotated_gpus(k, 4, 4) for k in range(4)] == ["0,1,2,3", "1,2,3,0", "2,3,0,1", "3,0,1,2"]
    assert [testing.rotated_gpus(k, 4, 2) for k in range(4)] == ["0,1", "0,1", "1,0", "1,0"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    testing.spread_gpus()  # one pytest process: the GPUs as they are
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setenv("TP_LORA_TEST_DEVICE", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    testing.spread_gpus()  # a set order is kept
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
