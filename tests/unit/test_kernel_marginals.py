"""scripts/kernel_marginals.py: the critical-path share of each kernel of a step whose kernels overlap."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
from kernel_marginals import GAP_US, marginals, role_table, roles  # noqa: E402


def test_marginals_sum_to_the_span_and_charge_short_gaps_only():
    # overlapped, hidden under the one before, a long idle (between replays), a short gap (a launch)
    spans = [(0.0, 10.0), (8.0, 15.0), (14.0, 14.5), (15.0 + GAP_US + 5, 60.0), (45.0, 48.0), (62.0, 70.0)]
    assert marginals(spans) == [10.0, 5.0, 0.0, 20.0, 0.0, 10.0]


def test_marginals_of_random_overlapping_kernels_sum_to_their_span():
    gen = random.Random(3)
    for _ in range(50):
        spans, start = [], 0.0
        for _ in range(gen.randint(1, 40)):
            start += gen.uniform(-5.0, GAP_US)  # overlapping the kernel before, or after a short gap
            spans.append((start, start + gen.uniform(0.1, 30.0)))
        spans.sort()
        assert abs(sum(marginals(spans)) - (max(e for _, e in spans) - spans[0][0])) < 1e-9


def test_gemms_are_named_by_their_neighbours():
    layer = ["add + RMSNorm", "GEMM", "attention", "GEMM", "add + RMSNorm", "GEMM", "act * mul", "GEMM"]
    assert roles(layer + ["add + RMSNorm", "GEMM", "other"]) == [
        "add + RMSNorm", "GEMM qkv", "attention", "GEMM o", "add + RMSNorm", "GEMM gate_up", "act * mul",
        "GEMM down", "add + RMSNorm", "GEMM other", "other"]


def test_role_table_per_step():
    kinds = {"n": "add + RMSNorm", "g": "GEMM", "a": "attention"}
    events = []
    for step in range(2):  # two replays 100 us apart; the second GEMM starts under the attention kernel
        t = 100.0 * step
        events += [("n", t, t + 4), ("g", t + 3, t + 13), ("a", t + 12, t + 20), ("g", t + 19, t + 27)]
    table = role_table(events[::-1], kinds.get, steps=2)
    assert table["GEMM qkv"] == dict(calls=1.0, us=10.0, marginal_us=9.0)
    assert table["GEMM o"] == dict(calls=1.0, us=8.0, marginal_us=7.0)
    assert sum(r["marginal_us"] for r in table.values()) == 27.0
