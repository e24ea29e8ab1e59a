"""MoE steps replayed from CUDA graphs give the eager tokens: one GPU (TP layout, Mixtral and Qwen2-MoE with its
shared expert) and, on 2 GPUs over NCCL, TP (tp2), EP over the attention TP group (tp2_ep2) and EP over DP replicas
(ep2: each rank its own requests, uneven counts, a rank idle while the other decodes). Decode steps everywhere; the
prefill steps too (mixed-step graphs, their padded rows routed nowhere) but over EP over DP replicas. Adapters on
attention and every expert, mixed with requests without one. bf16 (torch's grouped GEMM on sm90+)."""
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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs CUDA sm90+")]


def _engine(model, adapters, tp: int, ep: int, attn: str, graphs: bool) -> Engine:
    from tp_lora import distributed as comm
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.lora.backend = "cuda", "bfloat16", graphs, "triton"
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = tp, ep, attn
    cfg.lora.max_loras, cfg.lora.max_rank = 4, 16
    cfg.generation.ignore_eos = True
    ps = comm.single_process("cuda") if tp * ep == 1 else comm.init_parallel(tp, "cuda")
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


def _two_ranks(ps, model, adapters):
    steps = [_compare(model, adapters, 2, ep, attn, 1) for ep, attn in ((1, "dp"), (2, "tp"))]
    # EP over DP replicas: rank r serves requests r, r + 2, ... (the last batch leaves rank 1 idle).
    rank = ps.world.rank
    return steps + [_compare(model, adapters, 1, 2, "dp", 1, lambda reqs: [q for q in reqs if q.index % 2 == rank])]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_graph_decode_matches_eager_tp2_tp2_ep2_and_ep2(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_LORA_TEST_DEVICE", "cuda")  # the spawned ranks run NCCL, one GPU each
    model = write_moe(tmp_path / "mixtral", "mixtral", seed=5, head_dim=HEAD_DIM)
    adapters = write_adapters(tmp_path / "adapters", moe_config("mixtral", HEAD_DIM), seed=15)
    steps = run_ranks(_two_ranks, 2, str(model), str(adapters), tp_size=2, timeout_s=300)
    assert all(s > 0 for s, _ in steps), f"graph steps per layout: {steps}"
    assert [m > 0 for _, m in steps] == [True, True, False], f"mixed graph steps per layout: {steps}"
