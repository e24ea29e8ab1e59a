"""The collectives module: results on real ranks, counting, and a peer that never joins ends in an error, not a hang."""
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.testing import enough_devices, run_ranks


def _collectives(ps: comm.ParallelState):
    tp, r, dev = ps.tp, ps.tp.rank, ps.device
    comm.STATS.reset()
    summed = comm.all_reduce(torch.full((3,), float(r + 1), device=dev), tp)
    gathered = comm.all_gather(torch.full((2, 1), float(r), device=dev), tp, dim=-1)
    scattered = comm.reduce_scatter(torch.arange(4 * tp.size, dtype=torch.float32, device=dev).reshape(2 * tp.size, 2),
                                    tp)
    calls, nbytes = dict(comm.STATS.calls), dict(comm.STATS.bytes)
    objects = comm.all_gather_object({"rank": r, "pad": "x" * (100 * r)}, tp)  # pickles of different sizes
    sent = comm.broadcast_object(["from", r], tp, src_rank=1)
    agreed = comm.all_true([True, r == 0, r == 1, False, True], tp)
    host = comm.Group("ep", r, tp.size, tp.ranks, tp.pg, host_pg=torch.distributed.new_group(list(tp.ranks),
                                                                                             backend="gloo"))
    counts = [comm.all_gather_counts(n, g, dev, r == 1) for g in (tp, host) for n in (r + 3, 0)]  # device, host
    return summed.cpu(), gathered.cpu(), scattered.cpu(), calls, nbytes, objects, sent, agreed, counts


def test_collectives_on_real_ranks():
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    summed, gathered, scattered, calls, nbytes, objects, sent, agreed, counts = run_ranks(_collectives, 2)
    assert agreed == [True, False, False, False, True]  # what holds on every rank
    assert counts == [([3, 4], True), ([0, 0], True)] * 2  # token counts and the LoRA flag, on the device or host
    assert objects == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 100}]
    assert sent == ["from", 1]
    assert summed.tolist() == [3.0] * 3
    assert gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    assert scattered.tolist() == [[0.0, 2.0], [4.0, 6.0]]  # rank 0's half of the doubled tensor
    assert calls == {"all_reduce:tp": 1, "all_gather:tp": 1, "reduce_scatter:tp": 1}
    assert nbytes == {"all_reduce:tp": 12, "all_gather:tp": 8, "reduce_scatter:tp": 32}


def _layouts_again(ps: comm.ParallelState):
    """init_parallel / init_expert_parallel of every layout, twice: the second round must reuse the first round's
    process groups and peer buffers (each holds device memory until shutdown; a test process builds many layouts)."""
    rounds = []
    for _ in range(2):
        got = []
        for tp in (1, 2):
            p = comm.init_parallel(tp, str(ps.device), timeout_s=60)
            comm.init_expert_parallel(p, 2, "dp" if tp == 1 else "tp", timeout_s=60)
            got.append((p.tp.pg, p.dp.pg, p.ep.pg, p.tp.peer, p.ep.peer, p.ep.host_pg))
            assert comm.all_reduce(torch.ones(1, device=ps.device), p.ep).item() == 2.0
        rounds.append(got)
    other = comm.init_parallel(2, str(ps.device), timeout_s=61)  # another timeout: a group of its own
    return [[tuple(x is y for x, y in zip(a, b)) for a, b in zip(*rounds)],
            other.tp.pg is rounds[0][1][0], rounds[0][0][2] is rounds[0][1][2]]


def test_process_groups_are_made_once_per_ranks_and_timeout():
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    same, other_timeout_shared, ep_shared_across_layouts = run_ranks(_layouts_again, 2)
    assert same == [(True,) * 6] * 2, same
    assert not other_timeout_shared
    assert ep_shared_across_layouts  # the same two ranks and timeout: one ep communicator


def _rank1_never_joins(ps: comm.ParallelState):
    # One collective together first: NCCL sets up a group's communicator on first use, and that setup blocks
    # inside NCCL; the failure under test is a peer lost mid-run.
    comm.all_reduce(torch.ones(1, device=ps.device), ps.tp)
    comm.wait_device(ps.device)
    if ps.rank == 0:
        comm.all_reduce(torch.ones(1, device=ps.device), ps.tp)
        comm.wait_device(ps.device)  # NCCL is asynchronous: the wait is where the timeout shows
    else:
        time.sleep(8)


def test_missing_peer_times_out_with_an_error():
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    t0 = time.time()
    with pytest.raises(RuntimeError, match="rank 0"):
        run_ranks(_rank1_never_joins, 2, timeout_s=3)
    assert time.time() - t0 < 60
