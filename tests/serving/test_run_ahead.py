"""Steps launched before the previous step's tokens are read (Engine.run_ahead, the CUDA default) give the tokens of
reading every step before the next: on the CPU here with run_ahead forced on, through finishes the host sees one step
late (EOS, and lengths ending among longer ones), seeded sampling, adapters, preemption under a KV budget of a few
blocks, arrivals over time, and a cancellation while a step is in flight."""
from collections import Counter

import pytest

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine

from _serving import ADAPTERS, make_requests, serving_cfg


def _engine(bundle, run_ahead: bool, kv_blocks: int = 0) -> Engine:
    model, adapters = bundle
    cfg = serving_cfg(batch=6)
    if kv_blocks:
        cfg.scheduler.kv_block_size = 4
    engine = Engine(cfg, comm.single_process(), model, adapters)
    if kv_blocks:
        m = engine.model
        block_bytes = 4 * 2 * len(m.layers) * m.kv_heads * m.head_dim * 4
        engine.cfg.scheduler.kv_cache_mb = (kv_blocks + 1.5) * block_bytes / 2**20  # + the scratch block
    engine.run_ahead = run_ahead
    return engine


def _requests():
    reqs = make_requests(24, seed=5, new=(1, 12))
    for r in reqs:
        r.ignore_eos = False
    for r in reqs[1::5]:
        r.temperature, r.seed = 0.8, 100 + r.index  # a generator of its own: its draws do not depend on the batch
    return reqs


def _run(engine: Engine, eos: set, arrivals=None):
    engine.sampler.eos = eos
    res = engine.generate(_requests(), arrival_times=arrivals)
    return [(r.output_token_ids, r.logprobs, r.finish_reason, r.error) for r in res]


@pytest.fixture(scope="module")
def eos(bundle):
    """Two tokens the tiny model emits often, as its EOS: several requests end on them, at different steps."""
    first = _run(_engine(bundle, False), set())
    return {t for t, _ in Counter(t for toks, *_ in first for t in toks[1:]).most_common(2)}


@pytest.mark.parametrize("case", ["plain", "kv_budget", "arrivals"])
def test_run_ahead_matches_step_by_step(bundle, eos, case):
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in _requests())
    kv = -(-(longest + 1) // 4) if case == "kv_budget" else 0  # blocks for the longest request alone
    arrivals = [0.01 * i for i in range(24)] if case == "arrivals" else None
    eos = set() if kv else eos  # requests long enough to need preemption
    want = _run(_engine(bundle, False, kv), eos, arrivals)
    engine = _engine(bundle, True, kv)
    got = _run(engine, eos, arrivals)
    assert kv or sum(reason == "stop" for _, _, reason, _ in want) >= 2
    for i, (g, w) in enumerate(zip(got, want)):
        assert g[0] == w[0] and g[2:] == w[2:], f"request {i}: {g} != {w}"
        assert g[1] == pytest.approx(w[1], abs=1e-5)
    st = engine.stats
    assert st.ahead_steps > 0
    assert sum(n for n, _ in st.decode_by_rows.values()) == st.decode_steps and max(st.decode_by_rows) <= 6
    if kv:
        assert engine.stats.preemptions > 0
    assert engine.sched is None and engine.inflight is None  # the run closed with nothing in flight


def _open_run(bundle, eos):
    """A run-ahead engine with _requests() queued through the serving API (open / add, stepped by the test) ->
    (engine, requests, its free KV blocks before any step)."""
    engine = _engine(bundle, True)
    engine.sampler.eos = eos
    reqs = _requests()
    engine.open(*engine.plan_kv([len(r.prompt_token_ids) + r.max_new_tokens for r in reqs]))
    total = engine.sched.blocks.available
    for r in reqs:
        engine.add(r, 0.0)
    return engine, reqs, total


def test_cancel_while_a_step_is_in_flight(bundle, eos):
    """A request cancelled between steps, while a launched step holds its row: that row's token is dropped, the
    others run to their step-by-step tokens, and every KV block comes back."""
    want = _run(_engine(bundle, False), eos)
    engine, reqs, total = _open_run(bundle, eos)
    done, victim, cancelled = {}, reqs[3], None
    while engine.busy:
        out = engine.step()
        done.update((res.request.index, res) for res in out.finished)
        if cancelled is None and engine.inflight is not None and any(
                seq.request is victim for seq, _ in engine.inflight.sampled):
            cancelled = engine.cancel(victim.index)
            frozen = list(cancelled.output_token_ids)
    assert cancelled is not None and cancelled.finish_reason == "cancelled"
    assert cancelled.output_token_ids == frozen == want[victim.index][0][:len(frozen)]
    assert victim.index not in done
    for r in reqs:
        if r is not victim:
            assert done[r.index].output_token_ids == want[r.index][0], f"request {r.index}"
    assert engine.sched.blocks.available == total
    engine.close_run()


def test_abort_while_a_step_is_in_flight(bundle, eos):
    """Dropping every running sequence (a server's stop past its grace: it ends them itself) while a launched step
    holds their rows: reading that step advances and finishes none of them, and every KV block comes back."""
    engine, reqs, total = _open_run(bundle, eos)
    while engine.inflight is None or not engine.inflight.sampled or engine.stats.ahead_steps < 3:
        engine.step()
    dropped = {seq.request.index for seq in engine.sched.abort()}
    assert dropped and any(seq.request.index in dropped for seq, _ in engine.inflight.sampled)
    while engine.busy:
        out = engine.step()
        assert not {r.request.index for r in out.advanced + out.finished} & dropped
    assert engine.sched.blocks.available == total
    engine.close_run()


@pytest.mark.parametrize("resident", [True, False])
def test_a_step_launched_ahead_admits_requests_unless_an_adapter_must_be_copied(bundle, resident):
    """A request arriving while a step is in flight joins the step launched ahead of the read when its adapter is in
    a slot (or it has none); one whose adapter must be copied into a slot waits for the read (the copy could
    overwrite a slot the step in flight reads) and is admitted in the step after it. Tokens as step by step."""
    a, b = sorted(ADAPTERS)[:2]
    first = make_requests(2, seed=7, adapters=(a,), new=(12, 12))
    late = make_requests(3, seed=8, adapters=(a if resident else b,), new=(4, 4))[2]
    late.index = 2
    want = {r.request.index: r.output_token_ids for r in _engine(bundle, False).generate(first + [late])}
    engine = _engine(bundle, True)
    engine.sampler.eos = set()
    engine.open(*engine.plan_kv([len(r.prompt_token_ids) + r.max_new_tokens for r in first + [late]]))
    for r in first:
        engine.add(r, 0.0)
    done = {}
    while engine.stats.ahead_steps < 2:
        done.update((res.request.index, res) for res in engine.step().finished)
    engine.add(late, 0.0)
    ahead = engine.stats.ahead_steps
    done.update((res.request.index, res) for res in engine.step().finished)
    admitted = any(seq.request is late for seq in engine.sched.running)
    assert admitted and engine.stats.ahead_steps == ahead + resident  # read first when its adapter is copied in
    while engine.busy:
        done.update((res.request.index, res) for res in engine.step().finished)
    assert {i: r.output_token_ids for i, r in done.items()} == want
    engine.close_run()
