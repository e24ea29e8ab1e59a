"""CUDA-graph decode replays the same computation as eager decode, for new batches with other adapter mixes."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(model, adapters, graphs: bool, dtype: str) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs = "cuda", dtype, graphs
    cfg.lora.max_loras, cfg.lora.max_rank = 4, 16
    cfg.generation.ignore_eos = True
    return Engine(cfg, comm.single_process("cuda"), str(model), str(adapters))


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
    graphed.close()
