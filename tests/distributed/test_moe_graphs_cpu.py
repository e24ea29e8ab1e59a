"""EP over DP replicas through the runner's graph path on 2 gloo ranks, without a GPU: capture replaced by the stand-in
of tests/kernels/test_runner_graph_path.py (reruns the captured forward on each replay, refuses host reads; here its
capture runs the forward once), so every
graphed step goes through the static buffers, their padding to the EP group's agreed rows and the masked routing.

Mixed steps (prefill chunks beside decodes) and decode steps, with adapters on attention and every expert and
without, ranks with different token counts and mixes, one rank idle: the graphed engine's tokens and logprobs are the
eager engine's, and every step replays a graph (mixed ones included). The overflow rule: a step whose largest rank
has more tokens than the largest graph runs eagerly on every rank of the group, and gives the eager logits. And the
dispatch's bookkeeping (prepare_step: rows, owned tokens, the agreed LoRA flag, count exchanges) on the same ranks.
One run on the ranks for both (~50 s on 2 cores). Gloo only: with TP_LORA_TEST_DEVICE=cuda tests/gpu/test_moe_graphs.py
runs the real graphs.
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before tp_lora.ops.triton is imported (here and in the ranks)

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402
from tp_lora.engine.runner import GRAPH_BATCH_SIZES, ModelRunner, StepBatch  # noqa: E402
from tp_lora.lora.layers import LoRARuntime  # noqa: E402
from tp_lora.models.moe_step import MoEStep, prepare_step  # noqa: E402
from tp_lora.ops import get_backend  # noqa: E402
from tp_lora.ops.batch import build_lora_batch  # noqa: E402
from tp_lora.testing import device_under_test, recorded_collectives, run_ranks, same_collectives  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "kernels")]
from test_moe import V, moe_config, write_adapters, write_moe  # noqa: E402  (the tiny MoE checkpoints)
from test_runner_graph_path import Rerun  # noqa: E402  (the capture stand-in)

class Once(Rerun):
    """The stand-in with its capture step's forward run once, checked for host reads (its result the step's): a
    real capture runs nothing, so each step runs the EP group's collectives exactly once on every rank. A capture
    also bakes in the host's decisions (`baked()`: here whether the experts run LoRA): each replay must find them
    as they were (the stand-in reruns the Python forward, which would decide afresh)."""

    def __init__(self, forward, baked):
        self.forward, self.baked = forward, baked
        self.host = baked()
        self.out = self._run()
        self.warm = self.out.clone()

    def replay(self):
        assert self.baked() == self.host, f"a graph captured with {self.host} replayed with {self.baked()}"
        super().replay()


pytestmark = pytest.mark.skipif(device_under_test() == "cuda", reason="gloo ranks and CPU tensors: the stand-in of "
                                "tests/gpu/test_moe_graphs.py")

HEAD_DIM = 16  # the smallest the varlen attention kernel (and so the mixed-step graphs) takes
MAX_SEQS, MAX_TOKENS = 3, 16


def _engine(model: str, adapters: str, ps, graphs: bool) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = "cpu", "float32", False, False
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = 1, 2, "dp"
    cfg.lora.backend, cfg.lora.max_loras, cfg.lora.max_rank = "triton", 4, 16
    cfg.generation.ignore_eos = True
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step, cfg.scheduler.admit_batch = \
        MAX_SEQS, MAX_TOKENS, 1
    engine = Engine(cfg, ps, model, adapters)
    if graphs:
        r = engine.runner
        r.use_graphs = True
        r.plan_graphs(MAX_TOKENS, MAX_SEQS)
        r._record = lambda forward: (lambda g: (g, g.out, g.warm))(Once(forward, lambda: engine.model.step.lora))
    return engine


def _requests(rank: int) -> list[list[Request]]:
    """Per rank, batches of requests: with adapters (rank 1 fewer and shorter: it idles while rank 0 steps), then
    without (rank 1 none at all)."""
    gen = torch.Generator().manual_seed(11)
    spec = [[(13, "pe", 3), (6, None, 4), (2, "tp", 5)], [(5, "w2", 2)]], [[(9, None, 3), (4, None, 2)], []]
    return [[Request(i, id=i, adapter=a, max_new_tokens=m, ignore_eos=True,
                     prompt_token_ids=torch.randint(2, V, (n,), generator=gen).tolist())
             for i, (n, a, m) in enumerate(batch[rank])] for batch in spec]


def _generate_cases(ps, model: str, adapters: str) -> list[str]:
    rank = ps.world.rank
    eager, graphed = _engine(model, adapters, ps, False), _engine(model, adapters, ps, True)
    checked = []
    for reqs in _requests(rank):
        with recorded_collectives() as calls:
            want = eager.generate(reqs)
            got = graphed.generate(reqs)
        same_collectives(calls, ps.world, f"rank {rank}: {len(reqs)} requests")
        for w, g in zip(want, got, strict=True):
            assert g.output_token_ids == w.output_token_ids, f"rank {rank} request {w.request.id}"
            assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < 1e-4, f"rank {rank} {w.request.id}"
        checked.append(f"rank {rank}: {len(reqs)} requests")
    keys = set(graphed.runner.graphs)
    s = graphed.stats
    assert s.graph_steps == s.steps, f"rank {rank}: {s.graph_steps} of {s.steps} steps graphed"
    mixed = {k for k in keys if k[0] == "mixed"}
    if rank == 0:  # its prefill chunks, with and without adapters in the group
        assert {k[2] for k in mixed} == {True, False} and any(k[0] == "decode" for k in keys), keys
    checked.append(f"rank {rank}: graphs {sorted(keys)}")
    checked += _overflow_case(ps, graphed)
    return checked


def _overflow_case(ps, engine: Engine) -> list[str]:
    """Hand-made steps through a graphed runner and an eager one over the same model and adapters: per step, this
    rank's step (None: idle), and whether the graphed runner replays. Past the largest graph (rank 0's prompt of
    more tokens than it) both ranks step eagerly, every token computed; after it both replay again."""
    model, rank = engine.model, ps.world.rank
    big = max(t for t, _ in engine.runner.mixed_sizes) + 5
    assert big > GRAPH_BATCH_SIZES[-1]
    # (rank 0's step, rank 1's step, graphed?): a step is [(prompt length or 1 for a decode, start, slot)]
    plan = [([(7, 0, 0), (1, 20, -1)], [(1, 30, 1)], True),  # mixed beside a decode: one agreed size (8)
            ([(big, 0, 2)], [(1, 31, 1), (1, 40, -1)], False),  # overflow: eager on both ranks
            (None, [(1, 32, 1), (1, 41, 0), (1, 50, -1)], True),  # rank 0 idle
            ([(3, 0, -1), (1, 21, -1)], [(4, 0, -1)], True),  # no adapters: mixed on both ranks
            ([(1, 22, -1)], [(1, 33, -1)], True),  # no adapters: decode graphs of 1 row without LoRA
            ([(1, 23, 0)], [(1, 34, -1)], True)]  # rank 0's adapter: rank 1's graph too runs the experts' LoRA
    gen = torch.Generator().manual_seed(5)
    block = 16
    width = -(-(big + 8) // block)
    graphed = engine.runner
    eager = ModelRunner(model, engine.runner.rt, "cpu", False)
    cache = graphed.kv_cache(3 * width + 1, block, big + 8)  # both runners' (the graphed one replays over its own)
    steps = []
    for mine in (p[rank] for p in plan):
        if mine is None:
            steps.append(None)
            continue
        step = StepBatch()
        for seq, (n, start, slot) in enumerate(mine):
            step.add(torch.randint(2, V, (n,), generator=gen).tolist(), list(range(seq * width, (seq + 1) * width)),
                     start, slot)
        steps.append(step)
    out = {}
    with recorded_collectives() as calls:  # an idle rank asks for the busy one's (GPUs: the same peer kernels)
        for runner in (graphed, eager):
            for t in cache.k + cache.v:  # each run from the same (zero) K/V: decodes attend over unwritten positions
                t.zero_()
            out[runner] = []
            for step in steps:
                if step is None:
                    model.lockstep(0)  # idle: serves the peer's tokens
                    out[runner].append((None, False))
                    continue
                model.lockstep(len(step.ids), any(s >= 0 for s in step.slots))
                out[runner].append((runner.execute(step, cache).clone(), runner.replayed))
    same_collectives(calls, ps.world, f"rank {rank}: overflow plan")
    for i, ((got, replayed), (want, _), p) in enumerate(zip(out[graphed], out[eager], plan)):
        if got is None:
            continue
        assert replayed == p[2], f"rank {rank} step {i}: replayed {replayed}, expected {p[2]}"
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-4, f"rank {rank} step {i}: logits differ by {err:.2e}"
    return [f"rank {rank}: overflow plan"]


def _all(ps, model: str, adapters: str) -> tuple[list[str], list[str]]:
    return _bookkeeping_cases(ps), _generate_cases(comm.init_parallel(1, "cpu"), model, adapters)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both tests' cases in one run on 2 ranks (a rank's failed assertion fails both)."""
    root = tmp_path_factory.mktemp("moe_graphs")
    model = write_moe(root / "mixtral", "mixtral", seed=3, head_dim=HEAD_DIM)
    adapters = write_adapters(root / "adapters", moe_config("mixtral", HEAD_DIM), seed=13)
    return run_ranks(_all, 2, str(model), str(adapters), tp_size=1, timeout_s=240)


def test_ep_dp_mixed_and_decode_graphs_match_eager(ranks):
    assert len(ranks[1]) == 4, ranks[1]


def _bookkeeping_cases(ps) -> list[str]:
    """prepare_step over EP over DP replicas on real ranks: rank 0 has 5 tokens (one with an adapter), rank 1 has 2
    (or none); expectations written out per case, not computed with capacity()."""
    rank = ps.world.rank
    comm.init_expert_parallel(ps, 2, "dp")
    rt = LoRARuntime(2, 4, False, get_backend("torch", "cpu"))
    mine = {0: [-1, -1, 0, -1, -1], 1: [-1, -1]}[rank]
    checked = []

    def prepared(slots: list[int], buckets=(), stash=None, valid=None) -> MoEStep:
        step = MoEStep(buckets=buckets, valid=valid)
        if stash is not None:  # what lockstep() leaves for the forward
            step.counts, step.lora = stash
        rt.batch = build_lora_batch(slots, 2, "cpu")
        before = comm.STATS.total("counts")
        prepare_step(step, ps, rt, len(slots), "cpu")
        exchanged = comm.STATS.total("counts") - before
        assert step.counts is None, "the counts are spent by the forward"
        return step, exchanged

    for buckets, rows in (((), 5), ((1, 2, 4, 8, 16), 8), ((1, 2, 4), 5)):  # last: past the largest bucket
        step, exchanged = prepared(mine, buckets)
        assert (step.rows, step.owned, step.lora, exchanged) == (rows, (0, len(mine)), True, 1), \
            (buckets, step.rows, step.owned, step.lora, exchanged)
        assert step.slots.tolist() == mine and step.batch is rt.batch
        checked.append(f"buckets {buckets}: rows {rows}")
    step, exchanged = prepared([-1] * len(mine), (1, 2, 4, 8))  # no adapter on any rank: the experts skip LoRA
    assert (step.rows, step.lora, exchanged) == (8, False, 1)
    step, exchanged = prepared(mine if rank == 0 else [], (1, 2, 4, 8))  # rank 1 idle: still dispatches 8 rows
    assert (step.rows, step.owned, step.lora, exchanged) == (8, (0, len(mine) if rank == 0 else 0), True, 1)
    step, exchanged = prepared(mine, (1, 2, 4, 8), stash=([5, 2], True))  # counts stashed: no exchange
    assert (step.rows, exchanged) == (8, 0)
    with pytest.raises(RuntimeError, match="lockstep announced"):  # a forward of another size
        prepared(mine + [-1], (1, 2, 4, 8), stash=([5, 2], True))
    step, exchanged = prepared(mine + [-1] * (8 - len(mine)), (1, 2, 4, 8), valid=torch.tensor([len(mine)]))
    assert (step.rows, step.owned, exchanged) == (8, (0, 8), 0)  # a graph's padded rows: the agreed capacity
    checked.append("no adapters, idle rank, stashed counts, mismatch, graph rows")
    # EP over the attention TP group: replicated tokens, each rank owns its ceil(T / 2) chunk (its shared expert)
    # and routes every token, with every token's slot; no exchange, no dispatch rows.
    ps2 = comm.init_expert_parallel(comm.init_parallel(2, "cpu"), 2, "tp")
    step = MoEStep()
    slots = [0, -1, 1, -1, 0]
    rt.batch = build_lora_batch(slots, 2, "cpu")
    before = comm.STATS.total("counts")
    prepare_step(step, ps2, rt, 5, "cpu")
    assert (step.owned, step.rows, comm.STATS.total("counts") - before) == ([(0, 3), (3, 5)][rank], 0, 0)
    assert step.slots.tolist() == slots
    checked.append("tp attention chunks")
    return checked


def test_ep_dp_dispatch_bookkeeping(ranks):
    """prepare_step's rows, owned tokens, agreed LoRA flag and count exchanges on 2 gloo ranks."""
    assert len(ranks[0]) == 5, ranks[0]
