"""server.routing's policies (tp_lora.server.router), pure: affinity prefers a replica with the adapter in a slot
(or running requests of it), then in host memory, then the least loaded, bounded by server.max_imbalance; the
others ignore adapters; requests leave the load and the users when they end."""
import zlib

import pytest

from tp_lora.server.router import Router


def test_affinity_prefers_slot_then_host_then_least_loaded():
    r = Router(3, "affinity", batch=4, max_imbalance=0)
    r.report(0, ("x", None), ())
    r.report(1, (None,), ("y",))
    assert r.route(0, "x") == 0  # in a slot
    assert r.route(1, "y") == 1  # in host memory
    home = zlib.crc32(b"z") % 3
    assert r.route(2, "z") == home  # nowhere: its home replica
    assert r.route(3, "z") == home  # running there now: affine
    assert r.route(4, None) != home  # the base model: a least loaded replica (home has two)


def test_a_cold_adapter_leaves_its_home_only_past_the_bound():
    r = Router(2, "affinity", batch=1, max_imbalance=0)
    names = [f"a{i}" for i in range(40)]
    home = {n: zlib.crc32(n.encode()) % 2 for n in names}
    first = next(n for n in names if home[n] == 0)
    assert r.route(0, first) == 0  # its home, idle
    other = next(n for n in names if home[n] == 0 and n != first)
    assert r.route(1, other) == 1  # home 0 is full (batch 1) and would queue while 1 idles


def test_affinity_spreads_a_hot_adapter_past_the_imbalance_bound():
    r = Router(2, "affinity", batch=2, max_imbalance=1)
    r.report(0, ("hot",), ())
    got = [r.route(i, "hot") for i in range(8)]
    # replica 0 takes its batch (2) plus the imbalance (1), then the other replica joins; neither queues more than
    # one request beyond the other
    assert got[:3] == [0, 0, 0] and 1 in got
    queue = [max(0, n - 2) for n in r.load]
    assert abs(queue[0] - queue[1]) <= 1, r.load


def test_a_replica_whose_scheduler_holds_requests_back_counts_them_as_queued():
    """Replica 0 holds "a" in a slot and is under its batch, but reports requests waiting (for slots): "a" goes to
    the idle replica instead of queueing there; once replica 0 reports none waiting it is affine again."""
    r = Router(2, "affinity", batch=8, max_imbalance=2)
    r.report(0, ("a",), ())
    for i in range(3):
        r.route(i, "b" * (i + 2))
    r.report_waiting(0, 3)
    assert r.route(10, "a") == 1
    r.report_waiting(0, 0)
    assert r.route(11, "a") == 0


def test_ended_requests_leave_the_load_and_the_users():
    r = Router(2, "affinity", batch=4, max_imbalance=0)
    d = r.route(7, "a")
    assert r.load[d] == 1 and r.users[d] == {"a": 1}
    r.ended(7)
    r.ended(7)  # twice (an end after a cancel): once counted
    assert r.load == [0, 0] and r.users == [{}, {}]


def test_round_robin_and_least_loaded_ignore_adapters():
    rr = Router(3, "round_robin", batch=4, max_imbalance=0)
    rr.report(2, ("a",), ())
    assert [rr.route(i, "a") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router(2, "least_loaded", batch=4, max_imbalance=0)
    ll.report(1, ("a",), ())
    ll.route(0, "b")
    ll.route(1, "b")
    assert sorted(ll.load) == [1, 1]


def test_unknown_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match="server.routing='sticky'"):
        Router(2, "sticky", batch=4, max_imbalance=0)
