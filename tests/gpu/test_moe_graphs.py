"""MoE steps replayed from CUDA graphs give the eager tokens: one GPU (TP layout, Mixtral and Qwen2-MoE with its
shared expert) and, over NCCL, on 2 GPUs TP (tp2), EP over the attention TP group (tp2_ep2) and EP over DP replicas
(ep2: each rank its own requests, uneven counts, a rank idle while the other decodes), on 4 GPUs tp4, tp4_ep4, ep4
and the 2D mesh ep2_tp2 (EP over 2 DP replicas of tp2 attention). Decode and prefill steps (mixed-step graphs, their
padded rows routed nowhere; over EP over DP replicas every rank replays the EP group's agreed rows) in every layout.
Adapters on attention and every expert, mixed with requests without one. bf16 (torch's grouped GEMM on sm90+)."""
import os
import sys

import pytest
import torch

from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.testing import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))
from test_moe import V, moe_config, write_adapters, write_moe  # noqa: E402  (the tiny MoE checkpoints)

HEAD_DIM = 16  # the smallest the Triton attention kernels (and so the mixed-step graphs) take
# The engines' collective timeout, so the peer kernels' deadline: a stalled collective fails naming its call and
# program well before the rank pool gives up on the task (run_ranks' timeout_s + LATE_S)
STALL_S = 60.0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs CUDA sm90+")]


def _engine(model, adapters, tp: int, ep: int, attn: str, graphs: bool) -> Engine:
    from tp_lora import distributed as comm
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.lora.backend = "cuda", "bfloat16", graphs, "triton"
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = tp, ep, attn
    cfg.lora.max_loras, cfg.lora.max_rank = 4, 16
    cfg.generation.ignore_eos = True
    # A few blocks hold these runs: the default budget (80% of the free memory, all of it the prefix cache's) had
    # each of the test's engines allocate and free ~100 GB
    cfg.scheduler.kv_cache_mb = 64
    cfg.parallel.timeout_s = STALL_S
    ps = comm.single_process("cuda") if tp * ep == 1 else comm.init_parallel(tp, "cuda", STALL_S)
    return Engine(cfg, ps, model, adapters)


def _requests(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for mix in (["pe", None, "tp", "w2", "pe"], [None] * 3, ["tp"] * 7, ["w2"]):
        batches.append([Request(i, id=i, adapter=a, max_new_tokens=6, ignore_eos=True,
                                prompt_token_ids=torch.randint(2, V, (3 + i,), generator=gen).tolist())
                        for i, a in enumerate(mix)])
    return batches


def _compare(model, adapters, tp, ep, attn, seed, mine=lambda reqs: reqs):
    """Eager vs graphed tokens for every batch (this rank's share: `mine`); returns the graphed engine's graph step
    count and how many of them were mixed (prefill) steps."""
    eager = _engine(model, adapters, tp, ep, attn, False)
    graphed = _engine(model, adapters, tp, ep, attn, True)
    assert graphed.runner.use_graphs, f"tp={tp} ep={ep} {attn}: CUDA graphs not enabled for this MoE layout"
    for reqs in map(mine, _requests(seed)):
        for w, g in zip(eager.generate(reqs), graphed.generate(reqs)):
            assert g.output_token_ids == w.output_token_ids, (f"tp={tp} ep={ep} {attn}: request {w.request.id} "
                                                              f"errors: eager {w.error}, graphed {g.error}")
    steps = graphed.stats.graph_steps
    mixed = steps - graphed.stats.decode_steps  # every decode step replays a graph here
    eager.close()
    graphed.close()
    return steps, mixed


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_graph_decode_matches_eager_one_gpu(tmp_path, kind):
    model = write_moe(tmp_path / kind, kind, seed=3, fused=kind == "qwen2_moe", head_dim=HEAD_DIM)
    adapters = write_adapters(tmp_path / "adapters", moe_config(kind, HEAD_DIM), seed=13)
    steps, mixed = _compare(model, adapters, 1, 1, "dp", 0)
    assert steps > 0 and mixed > 0, f"graph steps {steps}, of them mixed {mixed}"


# (tp_size, ep_size, ep_attention) per world size, as configs/parallel names them
LAYOUTS = {2: {"tp2": (2, 1, "dp"), "tp2_ep2": (2, 2, "tp"), "ep2": (1, 2, "dp")},
           4: {"tp4": (4, 1, "dp"), "tp4_ep4": (4, 4, "tp"), "ep4": (1, 4, "dp"), "ep2_tp2": (2, 2, "dp")}}


CASES = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


def _layout(ps, world, name, model, adapters):
    """One layout of this world size: (graph steps, mixed ones) of its graphed engine; DP replica d of D serves
    requests d, d + D, ... (the last batches leave replicas idle)."""
    from tp_lora import distributed as comm
    tp, ep, attn = LAYOUTS[world][name]
    dp = comm.init_parallel(tp, "cuda", STALL_S).dp
    return _compare(model, adapters, tp, ep, attn, 1, lambda reqs: [q for q in reqs if q.index % dp.size == dp.rank])


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """The tiny Mixtral checkpoint and its adapters, written once for every layout."""
    root = tmp_path_factory.mktemp("mixtral")
    return (str(write_moe(root / "model", "mixtral", seed=5, head_dim=HEAD_DIM)),
            str(write_adapters(root / "adapters", moe_config("mixtral", HEAD_DIM), seed=15)))


@pytest.mark.parametrize("world, layout", CASES, ids=[name for _, name in CASES])
def test_moe_graph_steps_match_eager(mixtral, monkeypatch, world, layout):
    """Each layout a test of its own (one task on the world size's ranks): a failure names its layout, and one
    layout runs alone with -k."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    monkeypatch.setenv("TP_LORA_TEST_DEVICE", "cuda")  # the spawned ranks run NCCL, one GPU each
    steps, mixed = run_ranks(_layout, world, world, layout, *mixtral, tp_size=world, timeout_s=120)
    assert steps > 0 and mixed > 0, f"{layout}: graph steps {steps}, of them mixed {mixed}"


def _ep_collectives(ps, hidden: int):
    """EP over 2 DP replicas on the peer path (parallel.allreduce=auto): the dispatch all-gather of packed rows
    (ids of padding rows are -1: a NaN's bits as float32; packed by the Triton kernel, checked against the reference)
    and the combine reduce-scatter, eagerly and replayed from a CUDA graph with new inputs, against the same
    collectives on NCCL (the group without its peer buffers)."""
    import dataclasses

    from tp_lora import distributed as comm
    from tp_lora.ops.moe_pack import pack_tokens, pack_tokens_ref
    ps = comm.init_expert_parallel(comm.init_parallel(1, "cuda"), 2, "dp")
    ep, dev = ps.ep, ps.device
    assert ep.peer is not None, "no peer memory between the 2 GPUs: the EP collectives stayed on NCCL"
    nccl = dataclasses.replace(ep, peer=None)
    gen = torch.Generator(device=dev).manual_seed(ep.rank)
    checked = []
    for n, rows in ((3, 4), (32, 32), (543, 640)):
        def inputs():
            x = torch.randn(n, hidden, generator=gen, device=dev).to(torch.bfloat16)
            ids = torch.randint(-1, 64, (n, 8), generator=gen, device=dev)
            w = torch.rand(n, 8, generator=gen, device=dev)
            tags = torch.randint(-1, 4, (n,), generator=gen, device=dev, dtype=torch.int32)
            y = torch.randn(2 * rows, hidden, generator=gen, device=dev).to(torch.bfloat16)
            packed = pack_tokens(x, ids, w, tags, rows)  # the Triton kernel on CUDA
            want = pack_tokens_ref(*(t.cpu() for t in (x, ids, w, tags)), rows)
            assert torch.equal(packed.cpu().view(torch.int32), want.view(torch.int32)), "pack kernel != reference"
            return packed, y

        def peer(packed, y):
            return comm.all_gather(packed, ep, dim=0), comm.reduce_scatter(y.clone(), ep)

        def check(packed, y, got, what):
            want = comm.all_gather(packed, nccl, dim=0), comm.reduce_scatter(y.clone(), nccl)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), f"{what}: dispatch bytes differ"
            torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-2, msg=f"{what}: combine differs")
            checked.append(what)

        packed, y = inputs()
        check(packed, y, peer(packed, y), f"eager {n}/{rows}")
        static = inputs()
        peer(*static)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = peer(*static)
        for _ in range(2):
            new = inputs()
            for s, t in zip(static, new):
                s.copy_(t)
            graph.replay()
            check(*static, [o.clone() for o in out], f"graph {n}/{rows}")
    return checked


def test_ep_peer_collectives_match_nccl(monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setenv("TP_LORA_TEST_DEVICE", "cuda")
    checked = run_ranks(_ep_collectives, 2, 2048, tp_size=1, timeout_s=200)
    assert len(checked) == 9, checked
