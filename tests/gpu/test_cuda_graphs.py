"""CUDA-graph steps replay the same computation as eager steps: decode steps for new batches with other adapter mixes,
and mixed steps (prefill chunks beside decodes), with every step of such a run replaying a graph. The graphed
engines launch steps ahead of reading the previous step's tokens (run_ahead: their ids fed on the device inside the
graphs), the eager ones read every step before the next."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(model, adapters, graphs: bool, dtype: str, chunked: bool = False) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs = "cuda", dtype, graphs
    cfg.lora.max_loras, cfg.lora.max_rank = 4, 16
    cfg.generation.ignore_eos = True
    if chunked:  # few sequences and a small token budget: prompts are cut into chunks that run beside other
        # sequences' decodes, and requests are admitted one by one as sequences finish
        cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step, cfg.scheduler.admit_batch = 4, 64, 1
    engine = Engine(cfg, comm.single_process("cuda"), str(model), str(adapters))
    engine.run_ahead = graphs
    return engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_matches_eager(tmp_path, dtype):
    write_tiny_llama(tmp_path / "m", num_hidden_layers=2, seed=1)
    for i, r in enumerate((4, 8, 16)):
        write_random_adapter(tmp_path / "a" / f"a{i}", tmp_path / "m", r=r, seed=i)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for mix in (["a0", None, "a1", "a2", "a0"], [None] * 3, ["a2"] * 7, ["a1", "a0", None]):
        batches.append([Request(i, id=i, adapter=a, max_new_tokens=8,
                                prompt_token_ids=torch.randint(0, 256, (3 + i,), generator=gen).tolist())
                        for i, a in enumerate(mix)])
    eager, graphed = _engine(tmp_path / "m", tmp_path / "a", False, dtype), \
        _engine(tmp_path / "m", tmp_path / "a", True, dtype)
    for reqs in batches:
        want = eager.generate(reqs)
        got = graphed.generate(reqs)
        for w, g in zip(want, got):
            assert g.output_token_ids == w.output_token_ids
            assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < (1e-3 if dtype == "float32" else 5e-2)
    assert graphed.runner.graphs, "no CUDA graph was captured"
    assert graphed.stats.ahead_steps > 0
    graphed.close()


def _requests(seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    lens = [3, 90, 17, 1, 150, 40, 64, 5, 33]  # a chunk over several blocks, a one-token prompt, a full budget
    mix = ["a0", None, "a1", "a2", "a0", None, "a2", "a1", None]
    return [Request(i, id=i, adapter=a, max_new_tokens=5 + i % 4,
                    prompt_token_ids=torch.randint(0, 256, (n,), generator=gen).tolist())
            for i, (n, a) in enumerate(zip(lens, mix))]


@pytest.mark.parametrize("dtype, heads, kv", [("float32", 4, 2), ("float32", 8, 2), ("bfloat16", 8, 2)])
def test_mixed_graphs_match_eager(tmp_path, dtype, heads, kv):
    write_tiny_llama(tmp_path / "m", num_hidden_layers=2, seed=1, hidden_size=16 * heads, num_attention_heads=heads,
                     num_key_value_heads=kv)
    for i, r in enumerate((4, 8, 16)):
        write_random_adapter(tmp_path / "a" / f"a{i}", tmp_path / "m", r=r, seed=i)
    eager, graphed = _engine(tmp_path / "m", tmp_path / "a", False, dtype, chunked=True), \
        _engine(tmp_path / "m", tmp_path / "a", True, dtype, chunked=True)
    assert graphed.runner.mixed_sizes == [(64, 4)]
    same = total = 0
    for seed in (0, 1):
        reqs = _requests(seed)
        for w, g in zip(eager.generate(reqs), graphed.generate(reqs)):
            assert not w.error and not g.error
            if dtype == "float32":  # eager chunks attend through SDPA, graphed ones through the varlen kernel
                assert g.output_token_ids == w.output_token_ids, f"request {w.request.id}"
                assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < 1e-3
            same += sum(a == b for a, b in zip(w.output_token_ids, g.output_token_ids))
            total += len(w.output_token_ids)
    if dtype == "bfloat16":  # rounding may flip a near-tie, after which a sequence goes its own way
        assert same >= 0.9 * total, f"{same} of {total} tokens as eager"
    keys = set(graphed.runner.graphs)
    assert ("mixed", 64, True) in keys, keys
    assert graphed.stats.graph_steps == graphed.stats.steps, \
        f"{graphed.stats.steps - graphed.stats.graph_steps} of {graphed.stats.steps} steps ran eagerly"
    assert any(k[0] == "decode" for k in keys), "decode-only steps keep their own graphs"
    assert graphed.stats.ahead_steps > 0
    eager.close()
    graphed.close()
