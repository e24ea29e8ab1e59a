"""More adapters than device slots and than host-cache entries in one run: continuous batching gives each request
exactly the tokens it gets alone (static batching, one request at a time), at one rank and at two; the same when
requests arrive over time, when the KV memory fits only a few rows, and when a stop signal drains the run."""
import threading
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.engine.control import ABORT, DRAIN, RUN
from tp_lora.engine.engine import Engine
from tp_lora.testing import run_ranks

from _serving import ADAPTERS, make_requests, serving_cfg

N = 30


@pytest.fixture(scope="module")
def alone(bundle):
    """Reference: every request alone, one engine (so its slots and host cache churn as well)."""
    model, adapters = bundle
    engine = Engine(serving_cfg(), comm.single_process(), model, adapters)
    return {r.index: engine.generate([r])[0] for r in make_requests(N)}


def _check_same(results, alone, what):
    for res in results:
        ref = alone[res.request.index]
        assert res.error is None, (what, res.error)
        assert res.output_token_ids == ref.output_token_ids, f"{what}: request {res.request.index} differs"
        torch.testing.assert_close(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)


def test_continuous_batching_equals_alone_with_slot_and_host_churn(bundle, alone):
    model, adapters = bundle
    engine = Engine(serving_cfg(max_loras=2, max_cpu_loras=3), comm.single_process(), model, adapters)
    assert len(engine.adapters) == len(ADAPTERS) and not engine.bad_adapters
    assert not engine.registry.cache.host, "registration must not read weights"
    reqs = make_requests(N)
    results = engine.generate(reqs)
    _check_same(results, alone, "tp=1 continuous")
    s, cs = engine.stats, engine.registry.cache.stats
    assert s.adapter_loads > 2 and cs.host_misses > 3 and cs.host_evictions > 0, (s, cs)
    assert len(engine.registry.cache.host) == 3
    assert 0 < s.slot_hit_rate < 1
    # More slots than adapters: each adapter is read and copied once.
    engine = Engine(serving_cfg(max_loras=12, max_cpu_loras=64, batch=12, budget=64), comm.single_process(), model,
                    adapters)
    _check_same(engine.generate(reqs), alone, "tp=1 all resident")
    used = len({r.adapter for r in reqs} - {None})
    assert engine.stats.adapter_loads == engine.registry.cache.stats.host_misses == used
    # Grouped admissions (scheduler.admit_batch) change when requests join, never what they produce; nor does a
    # warm-up (the compile pass CUDA engines run at start) through a slot that holds an adapter.
    engine = Engine(serving_cfg(max_loras=2, max_cpu_loras=3, admit_batch=4), comm.single_process(), model, adapters)
    engine.generate(reqs[:1])
    engine.runner.warm_up([3, 17], 16)
    _check_same(engine.generate(reqs), alone, "tp=1 admit_batch=4, after a warm-up")


def _tp2(ps, model, adapters):
    out = {}
    for fully in (False, True):
        cfg = serving_cfg(tp=2, max_loras=3, max_cpu_loras=2)
        cfg.lora.fully_sharded = fully
        engine = Engine(cfg, ps, model, adapters)
        arrivals = [0.3 * i / N for i in range(N)] if fully else None  # ranks agree on what has arrived
        res = engine.generate(make_requests(N), arrival_times=arrivals)
        out[fully] = [(r.request.index, r.output_token_ids, r.error) for r in res], engine.stats.adapter_loads
    return out


def test_two_ranks_match_alone(bundle, alone):
    model, adapters = bundle
    for fully, (got, loads) in run_ranks(_tp2, 2, model, adapters, timeout_s=60).items():
        assert loads > 3
        for idx, tokens, err in got:
            assert err is None and tokens == alone[idx].output_token_ids, (fully, idx, err)


def test_arrivals_over_time(bundle, alone):
    model, adapters = bundle
    engine = Engine(serving_cfg(), comm.single_process(), model, adapters)
    reqs = make_requests(N)
    arrivals = [0.4 * i / N for i in range(N)][::-1]  # the last request arrives first
    t0 = time.perf_counter()
    results = engine.generate(reqs, arrival_times=arrivals)
    _check_same(results, alone, "arrivals")
    for res, at in zip(results, arrivals):
        m = res.metrics
        assert m["admitted"] >= t0 + at, f"request {res.request.index} admitted {t0 + at - m['admitted']:.3f} s early"
        assert m["arrival"] <= m["admitted"] <= m["first_token"] <= m["finished"]


def test_kv_memory_bounds_the_batch(bundle, alone):
    """A KV budget of a few blocks: requests queue for blocks, running ones are preempted and recomputed when they
    cannot grow, with the same tokens; one that cannot fit at all fails alone."""
    model, adapters = bundle
    reqs = make_requests(N)
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in reqs)
    cfg = serving_cfg(batch=6)
    cfg.scheduler.kv_block_size = 4
    engine = Engine(cfg, comm.single_process(), model, adapters)
    m = engine.model
    block_bytes = 4 * 2 * len(m.layers) * m.kv_heads * m.head_dim * 4
    blocks = -(-(longest + 1) // 4) + 2  # the longest request and two blocks more
    engine.cfg.scheduler.kv_cache_mb = (blocks + 1.5) * block_bytes / 2**20  # + the scratch block
    _check_same(engine.generate(reqs), alone, f"{blocks} blocks")
    assert engine.runner.cache.num_blocks == blocks
    assert engine.stats.preemptions > 0
    engine.cfg.scheduler.kv_cache_mb = (7 + 1.5) * block_bytes / 2**20  # 7 blocks: the longest fitting need is 27
    res = engine.generate(reqs)
    for r, ref in zip(res, (alone[i] for i in range(N))):
        need = len(r.request.prompt_token_ids) + r.request.max_new_tokens
        if need > 27:
            assert "do not fit" in r.error, r.error
        else:
            assert r.output_token_ids == ref.output_token_ids


@pytest.mark.parametrize("level", [DRAIN, ABORT])
def test_stop_drains_or_aborts(bundle, alone, level):
    model, adapters = bundle
    engine = Engine(serving_cfg(stop_check_steps=1), comm.single_process(), model, adapters)
    calls = []

    def stop():
        calls.append(1)
        return level if len(calls) > 5 else RUN

    seen = []
    results = engine.generate(make_requests(N), on_result=seen.append, stop=stop)
    done = [r for r in results if not r.interrupted]
    stopped = [r for r in results if r.interrupted]
    assert done and stopped and len(done) + len(stopped) == N
    assert {r.request.index for r in seen} == {r.request.index for r in done}
    _check_same(done, alone, "drained")
    if level == ABORT:
        assert engine.stats.interrupted == len(stopped)


SLOW = "r8"
BEFORE = 3  # requests that must finish while SLOW is read
HOLD_S = 20  # the longest SLOW's read waits for them


def _slowed(engine, others: threading.Event) -> list[float]:
    """SLOW's reads on this engine end only once `others` is set (or after HOLD_S); returns the list their end
    times go to."""
    ended, read = [], engine.registry.cache._read_safely

    def slow_read(info, *threads):
        if info.name != SLOW:
            return read(info, *threads)
        others.wait(HOLD_S)
        out = read(info, *threads)
        ended.append(time.perf_counter())
        return out

    engine.registry.cache._read_safely = slow_read
    return ended


def _slow_first(reqs):
    first = next(r for r in reqs if r.adapter == SLOW)
    return [first] + [r for r in reqs if r is not first]


def _run_with_slow_read(ps, model, adapters):
    """Rank 0 reads SLOW late (a slow disk on one rank): the ranks must agree on when it is in, and meanwhile run
    the rest of the batch."""
    engine = Engine(serving_cfg(tp=ps.tp.size, max_loras=4, max_cpu_loras=8, batch=8, budget=64), ps, model,
                    adapters)
    engine.registry.overlap_reads = True  # as on CUDA
    others, done = threading.Event(), []

    def on_result(res):  # SLOW's read ends once BEFORE others have finished (a step loop blocked on it fails)
        done.append(res)
        if sum(r.request.adapter != SLOW for r in done) >= BEFORE:
            others.set()

    ended = _slowed(engine, others) if ps.tp.rank == 0 else []
    results = engine.generate(_slow_first(make_requests(N)), on_result=on_result)
    engine.close()
    return results, ended


@pytest.mark.parametrize("tp", [1, 2])
def test_a_slow_adapter_read_holds_only_its_requests(bundle, alone, tp):
    model, adapters = bundle
    if tp == 1:
        results, ended = _run_with_slow_read(comm.single_process(), model, adapters)
    else:
        results, ended = run_ranks(_run_with_slow_read, 2, model, adapters, timeout_s=60)
    _check_same(results, alone, f"tp={tp}, a slow read")
    assert len(ended) == 1, ended
    before = [r for r in results if r.metrics["finished"] < ended[0]]
    assert len(before) >= BEFORE and all(r.request.adapter != SLOW for r in before), \
        f"{len(before)} requests finished while {SLOW} was read (its request came first)"
