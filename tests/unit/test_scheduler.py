"""The continuous-batching scheduler without a model: admission order, batch / KV-block / token-budget limits,
chunked prefill, growth across blocks and preemption, adapter slots (never more distinct adapters than slots, loads
before use, victims: lookahead, the recent half, popularity),
bounded overtaking (no starvation), failing adapters, stopping."""
import random

import pytest

from tp_lora.engine.kv_pool import BlockPool, plan_blocks
from tp_lora.engine.requests import Request
from tp_lora.engine.scheduler import Scheduler
from tp_lora.engine.slot_state import SLOT_HALF_LIFE, SlotState
from tp_lora.lora.popularity import Popularity


def req(i, adapter=None, prompt=4, new=3):
    return Request(i, id=i, adapter=adapter, prompt_token_ids=[1] * prompt, max_new_tokens=new)


def make(slots=2, rows=8, batch=8, budget=64, overtakes=16, admit_batch=1, block_size=8):
    """rows: KV blocks; of 8 positions by default, one holds a whole default request (4 prompt + 3 new)."""
    return Scheduler(SlotState(slots), BlockPool(rows, block_size), batch, budget, overtakes, admit_batch=admit_batch)


def step(s: Scheduler, finished: list | None = None, loadable: set | None = None):
    """Run one planned step as the engine would: the plan's copies land before its step, a sequence that consumed
    all its tokens samples one, and one that has max_new_tokens finishes."""
    plan = s.schedule(loadable)
    assert loadable is None or {name for _, name in plan.loads} <= loadable, "loaded an adapter not read yet"
    for slot, _ in plan.loads:
        s.loaded(slot)
    for seq, n in plan.work:
        assert n >= 1
        seq.computed += n
        if seq.computed == len(seq.tokens):
            seq.tokens.append(7)
            if seq.generated >= seq.request.max_new_tokens:
                s.finish(seq)
                if finished is not None:
                    finished.append(seq.request.index)
    return plan


def check_invariants(s: Scheduler, plan):
    running_adapters = {q.request.adapter for q in s.running if q.request.adapter is not None}
    assert len(running_adapters) <= len(s.slots)
    assert len(s.running) <= s.max_batch_size
    assert plan.num_tokens <= s.max_tokens_per_step
    held = [b for q in s.running for b in q.blocks]
    assert len(set(held)) == len(held) and len(held) + s.blocks.available == s.blocks.blocks
    for q in s.running:  # after the step: every computed position has its block
        assert len(q.blocks) * s.blocks.block_size >= q.computed, "a step wrote past a sequence's blocks"
    for q in s.running:
        if q.slot >= 0:
            assert s.slots.names[q.slot] == q.request.adapter
    for q, _ in plan.work:  # copied in before this step, or by an earlier plan
        assert q.slot < 0 or s.slots.names[q.slot] == q.request.adapter and s.slots.ready[q.slot], \
            "a sequence ran without its adapter in its slot"


def test_fcfs_admission_bounded_by_rows_and_batch():
    s = make(rows=3, batch=8)
    for i in range(5):
        s.add(req(i))
    plan = s.schedule()
    assert [q.request.index for q in plan.admitted] == [0, 1, 2]
    assert [q.blocks for q in plan.admitted] == [[0], [1], [2]]
    s.finish(plan.admitted[1])
    plan = s.schedule()
    assert [q.request.index for q in plan.admitted] == [3]
    assert plan.admitted[0].blocks == [1]  # the freed block
    s2 = make(rows=8, batch=2)
    for i in range(4):
        s2.add(req(i))
    assert len(s2.schedule().admitted) == 2


def test_budget_decodes_first_then_chunked_prefill():
    s = make(budget=8, batch=4, rows=8)
    s.add(req(0, prompt=3, new=10))
    s.add(req(1, prompt=3, new=10))
    plan = step(s)
    assert [(q.request.index, n) for q, n in plan.work] == [(0, 3), (1, 3)]
    s.add(req(2, prompt=20, new=2))
    plan = step(s)  # two decodes, then 6 of the long prompt
    assert [(q.request.index, n) for q, n in plan.work] == [(0, 1), (1, 1), (2, 6)]
    plan = step(s)
    assert [(q.request.index, n) for q, n in plan.work] == [(0, 1), (1, 1), (2, 6)]
    plan = step(s)
    assert [(q.request.index, n) for q, n in plan.work] == [(0, 1), (1, 1), (2, 6)]
    plan = step(s)  # the last 2 prompt tokens, then the sequence samples
    assert [(q.request.index, n) for q, n in plan.work] == [(0, 1), (1, 1), (2, 2)]
    assert s.running[2].generated == 1
    with pytest.raises(ValueError, match="max_tokens_per_step=4 < max_batch_size=8"):
        make(budget=4, batch=8)


def test_slots_limit_distinct_adapters_and_loads_precede_use():
    s = make(slots=2)
    for i, a in enumerate(["a", "b", "c", "a", None]):
        s.add(req(i, a))
    plan = s.schedule()
    assert sorted(plan.loads) == [(0, "a"), (1, "b")]
    assert [q.request.index for q in plan.admitted] == [0, 1, 3, 4]  # c waits; a resident one and no-adapter pass
    # a and b are copied in before this step, so their requests prefill in it (3 shares a's new slot)
    assert [q.request.index for q, _ in plan.work] == [0, 1, 3, 4]
    assert not s.slots.ready[0] and not s.slots.ready[1]  # until the engine has issued the copies
    for slot, _ in plan.loads:
        s.loaded(slot)
    plan = s.schedule()
    assert sorted(q.request.index for q, _ in plan.work) == [0, 1, 3, 4]
    assert not plan.loads and [r.index for r in s.waiting] == [2]


def test_victim_is_empty_then_lru_not_wanted_soon():
    st = SlotState(3)
    for slot, name in enumerate(["a", "b", None]):
        if name:
            st.assign(slot, name)
            st.loaded(slot)
    assert st.victim(set()) == 2  # empty first
    st.assign(2, "c")
    st.loaded(2)
    for slot in (1, 0, 2):  # use order: b, a, c -> b least recently used
        st.acquire(slot)
        st.release(slot)
    assert st.victim(set()) == 1
    assert st.victim({"b"}) == 0  # b is wanted soon: evict a (next LRU)
    assert st.victim({"a", "b", "c"}) == 1  # everything wanted: plain LRU
    st.acquire(1)
    assert st.victim(set()) == 0  # a used slot is never a victim
    st.pinned = True
    assert st.victim(set()) is None


def test_victim_keeps_the_adapter_admitted_most_often_lately():
    """Outside the most recently used half of the slots a hot adapter keeps its slot against more recent one-off
    adapters; once it stops being admitted its count decays (half-life SLOT_HALF_LIFE x slots admissions) and
    recency decides again."""
    st = SlotState(4)
    for slot, name in enumerate(["hot", "x", "y", "once"]):
        st.assign(slot, name)
        st.loaded(slot)
    for slot in [0] * 5 + [1, 2, 3]:  # "hot" the most often; then x, y, once: each once, in that order
        st.acquire(slot)
        st.release(slot)
    assert st.victim(set()) == 1  # y and once are the recent half; x, more recent than hot, is used less
    for _ in range(SLOT_HALF_LIFE * 4 * 6):  # six half-lives of "x" alone: now it is the hot one
        st.acquire(1)
        st.release(1)
    for slot in (2, 3):  # the recent half: y and once
        st.acquire(slot)
        st.release(slot)
    assert st.victim(set()) == 0
    st.assign(0, "new")  # a slot's new adapter starts from its own count
    st.loaded(0)
    st.acquire(0)
    st.release(0)  # the recent half: new and once
    assert st.victim(set()) == 2


def test_victim_spares_the_recent_half_for_conversations_between_turns():
    """Chat: each conversation has its own adapter and comes back after a pause. Adapters of finished conversations
    (admitted four times) must not push out those of running conversations (admitted once so far, the most recent):
    with more slots than twice the conversations running at once, each adapter is copied in exactly once."""
    st = SlotState(16)
    held, loads, clock, events = {}, 0, 0.0, []
    for c in range(40):  # a conversation every 0.5 s, 4 turns of 0.1 s, 0.5 s apart: ~5 running at once
        at = c * 0.5
        for turn in range(4):
            events += [(at, 1, c, turn), (at + 0.1, 0, c, turn)]
            at += 0.6
    for _, start, c, turn in sorted(events):
        if start:
            slot = st.slot_of(f"c{c}")
            if slot is None:
                slot = st.victim(set())
                st.assign(slot, f"c{c}")
                st.loaded(slot)
                loads += 1
            st.acquire(slot)
            held[c, turn] = slot
        else:
            st.release(held.pop((c, turn)))
    assert loads == 40


def test_popularity_halves_over_its_half_life_and_renormalizes():
    p = Popularity(half_life=4)
    p.use("a")
    for _ in range(4):
        p.use("b")
    assert p["a"] == pytest.approx(0.5) and p["c"] == 0.0
    for _ in range(3000):  # weights past RENORMALIZE_AT: rescaled, the order kept
        p.use("b")
    assert p.weight < 1e100 and 0 < p["a"] < p["b"]
    assert p["b"] == pytest.approx(sum(0.5 ** (i / 4) for i in range(3004)), rel=1e-9)
    p.forget("b")
    assert p["b"] == 0.0


def test_overtaking_is_bounded():
    """One slot held by a long 'a' sequence; 'b' at the head is blocked. Later 'a' requests may pass it only
    max_overtakes times; then they wait behind it, the slot drains, and 'b' runs."""
    k = 3
    s = make(slots=1, rows=16, batch=16, overtakes=k)
    s.add(req(0, "a", new=6))
    step(s)
    s.add(req(1, "b"))
    for i in range(2, 12):
        s.add(req(i, "a", new=6))
    finished = []
    admitted = []
    for _ in range(200):
        plan = step(s, finished)
        check_invariants(s, plan)
        admitted += [q.request.index for q in plan.admitted]
        if not s.has_work:
            break
    assert admitted.index(1) == k  # three 'a' requests passed 'b', then nobody did
    assert sorted(admitted) == list(range(1, 12)) and sorted(finished) == list(range(12))
    assert s.slot_misses == 3  # a, b, a again


def test_zero_overtakes_is_strict_fcfs():
    s = make(slots=1, overtakes=0)
    s.add(req(0, "a", new=4))
    step(s)
    s.add(req(1, "b"))
    s.add(req(2, "a"))
    plan = s.schedule()
    assert not plan.admitted  # 'a' is resident, but passing 'b' is not allowed


def test_fail_adapter_drops_its_requests_and_frees_the_slot():
    s = make(slots=1)
    for i, a in enumerate(["x", "x", "y", None]):
        s.add(req(i, a))
    plan = s.schedule()
    assert plan.loads == [(0, "x")]
    dropped = s.fail_adapter("x")
    assert [r.index for r in dropped] == [0, 1]
    assert s.slots.names == [None] and s.blocks.available == 8 - 1  # the no-adapter request kept its block
    plan = s.schedule()
    assert plan.loads == [(0, "y")] and [q.request.index for q in plan.admitted] == [2]


def test_stop_admitting_and_abort():
    s = make(rows=2)
    for i in range(4):
        s.add(req(i, "a"))
    step(s)
    left = s.stop_admitting()
    assert [r.index for r in left] == [2, 3]
    assert not s.schedule().admitted
    dropped = s.abort()
    assert [q.request.index for q in dropped] == [0, 1]
    assert s.blocks.available == 2 and s.slots.users == [0, 0] and not s.has_work


def test_admit_batch_groups_admissions_while_decoding():
    s = make(rows=8, batch=4, admit_batch=3)
    for i in range(10):
        s.add(req(i, prompt=2, new=50))
    assert len(s.schedule().admitted) == 4  # nothing decodes yet: admit at once
    step(s)
    running = list(s.running)
    for q in running[:2]:
        s.finish(q)
    assert s.schedule().admitted == []  # 2 blocks free, 3 wanted together, the others decode
    s.finish(running[2])
    assert [q.request.index for q in s.schedule().admitted] == [4, 5, 6]  # first come, first served, as a group
    s2 = make(rows=8, batch=4, admit_batch=3)
    for i in range(5):
        s2.add(req(i, prompt=2, new=50))
    s2.schedule()
    step(s2)
    s2.finish(s2.running[0])
    assert [q.request.index for q in s2.schedule().admitted] == [4]  # only one waits: no reason to hold it
    assert make(batch=4, admit_batch=5).admit_batch == 4  # never more than a batch
    with pytest.raises(ValueError, match="admit_batch=0"):
        make(batch=4, admit_batch=0)


def test_requests_wait_for_their_adapters_reads():
    """An adapter not read yet (not loadable) blocks its requests like a full slot table: later ones pass them,
    at most max_overtakes times; an admission group counts only requests that could enter now."""
    s = make(slots=4, rows=16, batch=16, overtakes=4, admit_batch=2)
    for i, name in enumerate(["a", "b", "b", "a"]):
        s.add(req(i, name, prompt=2, new=50))
    plan = s.schedule({"b"})
    assert [q.request.index for q in plan.admitted] == [1, 2] and [n for _, n in plan.loads] == ["b"]
    for slot, _ in plan.loads:
        s.loaded(slot)
    for q, n in plan.work:
        q.computed += n
    s.add(req(4, "c", prompt=2))
    s.add(req(5, "b", prompt=2))
    assert s.schedule(set()).admitted == []  # b's request 5 alone is not a group of 2 while others decode
    plan = s.schedule({"c"})  # c and the resident b: a group, passing 'a' twice more (4 times: the limit)
    assert [q.request.index for q in plan.admitted] == [4, 5]
    s.add(req(6, "b", prompt=2))
    s.add(req(7, "b", prompt=2))
    assert s.schedule({"c"}).admitted == []  # 'a' was passed max_overtakes times: nobody passes it now
    assert [q.request.index for q in s.schedule({"a"}).admitted] == [0, 3, 6, 7]


@pytest.mark.parametrize("reads", [False, True])
@pytest.mark.parametrize("admit_batch", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_every_request_finishes_within_bound(seed, admit_batch, reads):
    """Many adapters over few slots, power-law popularity, random lengths (and, with `reads`, each adapter
    loadable only after a random read time, again after each eviction): invariants hold every step and no request
    waits unboundedly (each is admitted after at most max_overtakes passes)."""
    rng = random.Random(seed)
    k = 4
    s = make(slots=3, rows=6, batch=6, budget=24, overtakes=k, admit_batch=admit_batch)
    names = [f"ad{i}" for i in range(12)]
    weights = [1 / (i + 1) ** 1.2 for i in range(len(names))]
    n = 150
    reqs = [req(i, rng.choices(names + [None], weights + [0.5])[0], prompt=rng.randint(1, 30),
                new=rng.randint(1, 12)) for i in range(n)]
    arrivals = sorted(rng.randint(0, 300) for _ in range(n))
    finished, order, t = [], [], 0
    read_at = {name: rng.randint(0, 20) for name in names}
    while len(finished) < n:
        while reqs and arrivals[0] <= t:
            arrivals.pop(0)
            s.add(reqs.pop(0))
        loadable = {name for name, at in read_at.items() if at <= t} if reads else None
        plan = step(s, finished, loadable)
        for _, name in plan.loads:  # read again the next time it is evicted and wanted
            read_at[name] = t + rng.randint(0, 20)
        check_invariants(s, plan)
        order += [q.request.index for q in plan.admitted]
        t += 1
        assert t < 10_000, "the scheduler stopped making progress"
    # Bounded overtaking: a request is passed by at most k later ones.
    for pos, idx in enumerate(order):
        passed_by = sum(1 for j in order[:pos] if j > idx)
        assert passed_by <= k, f"request {idx} was passed {passed_by} times"
    assert sorted(finished) == list(range(n))
    assert s.blocks.available == 6 and s.slots.users == [0, 0, 0]


def test_kv_block_planning_and_pool():
    assert plan_blocks(10 * 16 * 8, block_size=16, bytes_per_token=8, wanted=32) == 9  # one block is scratch
    assert plan_blocks(10 * 16 * 8, block_size=16, bytes_per_token=8, wanted=4) == 4
    assert plan_blocks(16 * 8, block_size=16, bytes_per_token=8, wanted=4) == 0
    pool = BlockPool(4, 16)
    a, b = [], []
    pool.grow(a, 16)  # exactly one block
    pool.grow(b, 17)  # one position over: two
    assert (a, b) == ([0], [1, 2])
    pool.grow(a, 16)  # already held
    assert a == [0]
    pool.release(b)
    assert b == [] and pool.available == 3
    pool.grow(a, 33)  # grows across two boundaries, lowest free first
    assert a == [0, 1, 2]
    with pytest.raises(RuntimeError, match="2 KV blocks wanted, 1 of 4 free"):
        pool.grow(b, 20)
    with pytest.raises(ValueError, match="not in use"):
        pool.release([3])



def test_a_cuda_prefix_cache_keeps_its_blocks_across_runs(monkeypatch):
    """With prefix caching on CUDA, a run opened after another keeps the cache there (its cached prefixes with it)
    even where the budget now says fewer blocks (later allocations took memory); it grows only when the batch
    needs more; without an old cache it takes the whole budget. (No device is touched: the budget is stubbed.)"""
    from types import SimpleNamespace

    import torch

    from tp_lora.config import SchedulerConfig
    from tp_lora.engine import kv_pool
    bpt = kv_pool.kv_bytes_per_token(2, 1, 4, torch.float32)  # 64 bytes a position
    budget = {"blocks": 50}
    monkeypatch.setattr(kv_pool, "kv_budget_bytes", lambda *a: (budget["blocks"] + 1) * 16 * bpt)
    model = SimpleNamespace(layers=[0, 0], kv_heads=1, head_dim=4, kv_dtype=torch.float32)
    runner = SimpleNamespace(model=model, cache=None)
    ps = SimpleNamespace(device=torch.device("cuda"), tp=SimpleNamespace(size=1))
    sc = SchedulerConfig()
    sc.kv_block_size, sc.prefix_caching, sc.max_batch_size = 16, True, 4
    assert kv_pool.plan_kv(runner, ps, sc, [40] * 4)[0] == 50  # the whole budget
    runner.cache = SimpleNamespace(num_blocks=50, block_size=16)
    budget["blocks"] = 30  # memory taken since: the cache stays whole
    assert kv_pool.plan_kv(runner, ps, sc, [40] * 4) == (50, 50 * 16 - 1)
    runner.cache = SimpleNamespace(num_blocks=8, block_size=16)  # smaller than 4 sequences of 41 positions need
    assert kv_pool.plan_kv(runner, ps, sc, [40] * 4)[0] == 30
    sc.prefix_caching = False  # the batch's blocks alone
    assert kv_pool.plan_kv(runner, ps, sc, [40] * 4)[0] == 12

def _run(s: Scheduler, reqs) -> dict:
    """Drive the scheduler to the end with a deterministic fake model (next token = f(tokens so far)); returns
    request index -> generated tokens, checking the invariants every step."""
    for r in reqs:
        s.add(r)
    out, steps = {}, 0
    while s.has_work:
        plan = s.schedule()
        check_invariants(s, plan)
        for slot, _ in plan.loads:
            s.loaded(slot)
        for seq, n in plan.work:
            seq.computed += n
            if seq.computed == len(seq.tokens):
                seq.tokens.append(sum(seq.tokens) % 97)
                if seq.generated >= seq.request.max_new_tokens:
                    s.finish(seq)
                    out[seq.request.index] = seq.tokens[seq.prompt_len:]
        steps += 1
        assert steps < 10_000, "no progress"
    return out


def test_growth_and_preemption_keep_outputs_and_free_every_block():
    """A pool far smaller than the requests' total need: sequences grow block by block, the newest are preempted and
    recomputed, and every request still gets the tokens it gets with room to spare; every block comes back."""
    rng = random.Random(5)
    reqs = lambda: [Request(i, id=i, adapter=None, prompt_token_ids=[rng.randrange(90) for _ in range(rng.randrange(1, 9))],  # noqa: E731
                            max_new_tokens=rng.randrange(1, 14)) for i in range(12)]
    state = rng.getstate()
    roomy = _run(make(rows=64, batch=8, block_size=4), reqs())
    rng.setstate(state)
    tight = make(rows=6, batch=8, block_size=4)  # 24 positions; a lone request needs at most 8 + 13 + 1
    got = _run(tight, reqs())
    assert got == roomy
    assert tight.preemptions > 0
    assert tight.blocks.available == 6 and not tight.preempted


def test_preempted_request_can_be_cancelled_or_abandoned():
    s = make(rows=2, batch=4, block_size=4)
    a, b = req(0, prompt=3, new=8), req(1, prompt=3, new=8)
    s.add(a)
    s.add(b)
    for _ in range(3):  # both admitted (one block each); then a needs a second block: b (newest) is preempted
        step(s)
    assert s.preemptions == 1 and [q.request.index for q in s.running] == [0] and s.waiting == [b]
    seq = s.remove(1)
    assert seq.request is b and seq.generated >= 1 and not s.preempted  # its tokens so far come back
    assert s.stop_admitting() == [] and [q.request.index for q in s.abort()] == [0]
    assert s.blocks.available == 2


def cached_first(k: int, budget: int, rows: int = 64) -> Scheduler:
    """A scheduler with max_prefix_overtakes=k whose prefix cache holds the 32-token prompt WARM (blocks of 4)."""
    s = Scheduler(SlotState(2), BlockPool(rows, 4, caching=True), 8, budget, admit_batch=1, max_prefix_overtakes=k)
    s.add(Request(0, id=0, prompt_token_ids=WARM + [9], max_new_tokens=1))
    while s.has_work:
        for seq, n in s.schedule().work:
            seq.computed += n
            s.cache_blocks(seq)
            if seq.computed == len(seq.tokens):
                s.finish(seq)
    return s


WARM = list(range(100, 132))


def test_cached_prefixes_first_when_the_budget_is_short():
    """Longest cached prefix first, arrival order among equals (the cold ones); arrival order when the budget starts
    every waiting prefill, or with max_prefix_overtakes=0."""
    def admitted(k: int, budget: int) -> list[int]:
        s = cached_first(k, budget)
        for i, prompt in enumerate([[5] * 20, WARM[:16] + [6] * 8, [7] * 12, WARM + [8] * 4], 1):
            s.add(Request(i, id=i, prompt_token_ids=prompt, max_new_tokens=4))
        plan = s.schedule()
        assert [r.index for r in s.waiting] == sorted(r.index for r in s.waiting)  # back in arrival order
        return [seq.request.index for seq in plan.admitted]
    assert admitted(8, 24) == [4, 2, 1]  # 4 (32 cached), 2 (16 cached), then 1 cold: its chunk ends the budget
    assert admitted(0, 24) == [1, 2]
    assert admitted(8, 64) == [1, 2, 3, 4]  # 20 + 8 + 12 + 4 uncached tokens fit the budget: arrival order


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_cold_request_is_passed_over_at_most_max_prefix_overtakes_steps(k):
    """A cold request behind a stream of cached ones that take the whole budget each step: passed in k steps, then
    admitted first."""
    s = cached_first(k, budget=8)
    s.add(Request(1, id=1, prompt_token_ids=[5] * 20, max_new_tokens=4))
    for t in range(k + 1):
        s.add(Request(10 + t, id=10 + t, prompt_token_ids=WARM + [t] * 8, max_new_tokens=1))  # 8 uncached tokens
        plan = s.schedule()
        firsts = [seq.request.index for seq in plan.admitted]
        assert firsts == ([1] if t == k else [10 + t]), (t, firsts)
        for seq, n in plan.work:
            seq.computed += n
            s.cache_blocks(seq)
            if seq.computed == len(seq.tokens):
                s.finish(seq)
    assert 1 not in s.cached_first.passed
    with pytest.raises(ValueError, match="max_prefix_overtakes=-1"):
        Scheduler(SlotState(1), BlockPool(4, 4), 2, 8, max_prefix_overtakes=-1)
