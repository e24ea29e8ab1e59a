"""Prefix caching (scheduler.prefix_caching): KV blocks of a prompt's prefix reused by later requests of the same
adapter give the tokens and log-probabilities of computing everything (float32, 1e-5), within and across adapters
and the base model, for conversations that resend their history, under preemption with a KV budget of a few
blocks, with a sliding window, at tp=2 in both LoRA modes, and counted: a request whose prefix is cached computes
only the rest."""
import json
import os
import shutil

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine
from tp_lora.engine.kv_pool import BlockPool
from tp_lora.engine.requests import Request
from tp_lora.testing import run_ranks

from _serving import serving_cfg

BS = 4  # KV block size: many blocks per prompt of the tiny model


def _engine(bundle, caching: bool, model=None, **kw) -> Engine:
    cfg = serving_cfg(kv_block_size=BS, prefix_caching=caching, **kw)
    return Engine(cfg, comm.single_process(), model or bundle[0], bundle[1])


def _shared_prefix_requests(seed: int, n: int = 18) -> list[Request]:
    """Prompts made of one of two system prompts + a user part, over two adapters and the base; some prompts are a
    whole block count long, some are another prompt plus more."""
    g = torch.Generator().manual_seed(seed)
    systems = [torch.randint(3, 256, (17,), generator=g).tolist(), torch.randint(3, 256, (9,), generator=g).tolist()]
    out = []
    for i in range(n):
        adapter = ("r8", "a7", None)[i % 3]
        user = torch.randint(3, 256, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        prompt = systems[i % 2] + user if i % 5 else systems[i % 2][:16]
        out.append(Request(i, id=i, adapter=adapter, prompt_token_ids=prompt, max_new_tokens=5, ignore_eos=True))
    return out


def _same(got, want, what):
    for g, w in zip(got, want):
        assert g.error is None and w.error is None, (what, g.error, w.error)
        assert g.output_token_ids == w.output_token_ids, (what, g.request.index)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)


def test_pool_caches_full_blocks_by_adapter_and_evicts_unheld_ones_lru():
    pool = BlockPool(6, BS, caching=True)
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks + 1
    table, hashes = [], []
    pool.grow(table, 14)
    pool.commit(table, tokens, 13, hashes, root=1)
    assert len(hashes) == 3 and pool.cached == 0  # held: cached, not evictable
    assert pool.match(tokens, root=1)[0] == table[:3]
    assert pool.match(tokens, root=2) == ([], [])  # another adapter's blocks never match
    assert pool.match(tokens[:12], root=1)[0] == table[:2]  # the last token is always computed
    other = [], []
    pool.grow(other[0], 4)
    pool.commit(other[0], tokens[:4], 4, other[1], root=1)  # the same contents again: the first holder stays cached
    assert pool.match(tokens, root=1)[0][0] == table[0]
    pool.release(other[0])
    first = list(table)
    pool.release(table)
    assert pool.cached == 3 and pool.available == 6  # cached blocks count as available
    matched, _ = pool.match(tokens, root=1)
    assert matched == first[:3] and pool.evictable_in(matched) == 3
    pool.take(matched[:1])
    assert pool.cached == 2
    grown = []
    pool.grow(grown, 4 * 4)  # 3 free blocks, then the least recently used cached one: the chain's tail first
    assert pool.match(tokens, root=1)[0] == first[:2] and pool.cached == 1
    with pytest.raises(RuntimeError, match="KV blocks wanted"):
        pool.grow(grown, 4 * 7)  # the held (taken) block is never evicted
    pending = [], []
    pool.release(grown)
    pool.grow(pending[0], 8)
    pool.commit(pending[0], [5, 6, -1, 7, 8, 9, 10, 11], 8, pending[1], root=3)  # a token not read yet: stop there
    assert pending[1] == []


def test_cached_prefixes_give_the_tokens_of_computing_them(bundle):
    reqs = _shared_prefix_requests(0)
    arrivals = [0.02 * i for i in range(len(reqs))]  # later requests find earlier ones' blocks
    want = _engine(bundle, False).generate(reqs, arrival_times=arrivals)
    engine = _engine(bundle, True)
    got = engine.generate(reqs, arrival_times=arrivals)
    _same(got, want, "shared prefixes")
    s = engine.stats
    assert s.prefix_hit_tokens > 0 and s.prompt_tokens == sum(len(r.prompt_token_ids) for r in reqs)
    assert 0 < s.prefix_hit_rate < 1


def _count_computed(engine) -> list[int]:
    """[tokens the model computed so far] (the runner's steps, watched)."""
    seen, execute = [0], engine.runner.execute

    def watch(step, cache):
        seen[0] += len(step.ids)
        return execute(step, cache)
    engine.runner.execute = watch
    return seen


def test_a_request_whose_prefix_is_cached_computes_only_the_rest(bundle):
    """A conversation resending its history: turn 2 = turn 1's prompt + a reply + more. Turn 2 finds turn 1's full
    blocks (prompt and generated tokens whose KV was computed) and computes the rest; other adapters find none."""
    first = Request(0, id=0, adapter="r8", prompt_token_ids=list(range(20, 31)), max_new_tokens=6, ignore_eos=True)
    engine = _engine(bundle, True)
    turn1 = engine.generate([first])[0]
    history = first.prompt_token_ids + turn1.output_token_ids  # 17 tokens; KV computed for 16 of them
    reqs = [first, Request(1, id=1, adapter="r8", prompt_token_ids=history + [40, 41], max_new_tokens=3,
                           ignore_eos=True),
            Request(2, id=2, adapter="a7", prompt_token_ids=history + [40, 41], max_new_tokens=3, ignore_eos=True)]
    engine = _engine(bundle, True)
    computed = _count_computed(engine)
    got = engine.generate(reqs, arrival_times=[0.0, 0.5, 0.5])
    assert got[0].output_token_ids == turn1.output_token_ids
    assert engine.stats.prefix_hit_tokens == 16  # 4 full blocks of turn 1; nothing for the other adapter
    # every prompt token but the cached ones, then one token per decode step
    assert computed[0] == sum(len(r.prompt_token_ids) + r.max_new_tokens - 1 for r in reqs) - 16
    _same(got, _engine(bundle, False).generate(reqs, arrival_times=[0.0, 0.5, 0.5]), "turns")
    whole = Request(3, id=3, adapter="r8", prompt_token_ids=list(range(20, 28)), max_new_tokens=2, ignore_eos=True)
    engine = _engine(bundle, True)
    engine.generate([first, whole], arrival_times=[0.0, 0.5])  # 8 tokens, both blocks cached: the last is computed
    assert engine.stats.prefix_hit_tokens == 4


def test_preemption_under_a_small_kv_budget(bundle):
    """Sequences sharing cached blocks preempted for want of blocks, and readmitted onto what is left cached."""
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 256, (16,), generator=g).tolist()
    reqs = [Request(i, id=i, adapter=("r8", None)[i % 2], max_new_tokens=14, ignore_eos=True,
                    prompt_token_ids=system + torch.randint(3, 256, (1 + i % 6,), generator=g).tolist())
            for i in range(12)]
    kw = dict(batch=4, budget=16)
    want = _engine(bundle, False, **kw).generate(reqs)
    engine = _engine(bundle, True, **kw)
    m = engine.model
    block = BS * 2 * len(m.layers) * m.kv_heads * m.head_dim * 4
    engine.cfg.scheduler.kv_cache_mb = 17.5 * block / 2 ** 20  # 16 blocks and the scratch one
    got = engine.generate(reqs, arrival_times=[0.01 * i for i in range(12)])
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    _same(got, want, "preemption")


def test_sliding_window_model(bundle, tmp_path):
    model = str(tmp_path / "mistral")
    shutil.copytree(bundle[0], model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(model_type="mistral", sliding_window=6)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f)
    reqs = _shared_prefix_requests(2)
    arrivals = [0.02 * i for i in range(len(reqs))]
    want = _engine(bundle, False, model=model).generate(reqs, arrival_times=arrivals)
    engine = _engine(bundle, True, model=model)
    _same(engine.generate(reqs, arrival_times=arrivals), want, "sliding window")
    assert engine.stats.prefix_hit_tokens > 0


def _tp2(ps, bundle, fully):
    out = {}
    for caching in (False, True):
        cfg = serving_cfg(tp=2, kv_block_size=BS, prefix_caching=caching)
        cfg.lora.fully_sharded = fully
        engine = Engine(cfg, ps, *bundle)
        reqs = _shared_prefix_requests(3)
        res = engine.generate(reqs, arrival_times=[0.02 * i for i in range(len(reqs))])
        out[caching] = ([(r.output_token_ids, r.logprobs) for r in res], engine.stats.prefix_hit_tokens)
        engine.close()
    return out


@pytest.mark.parametrize("fully", [False, True])
def test_tp2_both_lora_modes(bundle, fully):
    out = run_ranks(_tp2, 2, bundle, fully)
    (want, _), (got, hits) = out[False], out[True]
    assert hits > 0
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), rtol=0, atol=1e-5)


def test_the_cache_outlives_a_run_on_the_same_kv_cache(bundle):
    """generate() calls one after another (LLM.generate's turns) reuse the blocks the last call cached, while the KV
    cache they index stays the same; a reloaded adapter does not."""
    first = Request(0, id=0, adapter="r8", prompt_token_ids=list(range(20, 33)), max_new_tokens=4, ignore_eos=True)
    engine = _engine(bundle, True)
    want = engine.generate([first])[0]
    assert engine.stats.prefix_hit_tokens == 0
    again = engine.generate([first])[0]
    assert engine.stats.prefix_hit_tokens == 12  # 3 full blocks of the 13-token prompt
    assert again.output_token_ids == want.output_token_ids
    path = engine.adapters["r8"].path
    assert engine.unload_adapter("r8") is None and engine.load_adapter("r8", path) is None
    engine.generate([first])
    assert engine.stats.prefix_hit_tokens == 12  # the reload's identity is new
