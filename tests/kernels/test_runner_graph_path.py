"""The runner's graph path without a GPU: capture replaced by a stand-in that reruns the captured forward on each
replay, so every step goes through the static buffers, their refresh (inputs, the tokens' and the logits rows' LoRA
batches) and the padded layout, with the varlen reference attending. Its tokens must be the eager engine's."""
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.runner import mixed_sizes


class _Rerun:
    """Stands in for a captured graph: replay() runs the forward again over the static buffers."""

    def __init__(self, forward):
        self.forward, self.out = forward, forward()

    def replay(self):
        self.out.copy_(self.forward())


def _engine(model, adapters, graphs: bool, device: str) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = device, "float32", False, False
    cfg.lora.backend, cfg.lora.max_loras, cfg.lora.max_rank = "triton", 3, 8
    cfg.generation.ignore_eos = True
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step, cfg.scheduler.admit_batch = 3, 16, 1
    engine = Engine(cfg, comm.single_process(device), str(model), str(adapters))
    if graphs:
        r = engine.runner
        r.use_graphs, r.mixed_sizes = True, mixed_sizes(16, 3)
        r._record = lambda forward: (lambda g: (g, g.out, g.out.clone()))(_Rerun(forward))
    return engine


def test_mixed_and_decode_graph_path_matches_eager(tmp_path, device):
    write_tiny_llama(tmp_path / "m", num_hidden_layers=1, seed=2, hidden_size=32, intermediate_size=64)
    # Few target modules (the interpreter's kernels are slow); a1 on the embedding and the LM head too: the logits
    # rows take their own LoRA batch.
    write_random_adapter(tmp_path / "a" / "a0", tmp_path / "m", r=4, seed=0, target_modules=("o_proj",))
    write_random_adapter(tmp_path / "a" / "a1", tmp_path / "m", r=8, seed=1, target_modules=("v_proj",),
                         include_embedding=True, include_lm_head=True)
    gen = torch.Generator().manual_seed(0)
    reqs = [Request(i, id=i, adapter=a, max_new_tokens=2 + i % 2,
                    prompt_token_ids=torch.randint(0, 256, (n,), generator=gen).tolist())
            for i, (n, a) in enumerate(zip([5, 19, 1, 7], ["a0", None, "a1", "a1"]))]
    eager, graphed = (_engine(tmp_path / "m", tmp_path / "a", graphs, device) for graphs in (False, True))
    assert graphed.runner.mixed_sizes == [(16, 3)]
    for w, g in zip(eager.generate(reqs), graphed.generate(reqs)):
        assert g.output_token_ids == w.output_token_ids, f"request {w.request.id}"
        assert max(abs(a - b) for a, b in zip(w.logprobs, g.logprobs)) < 1e-4
    keys = set(graphed.runner.graphs)
    assert ("mixed", 16, True) in keys and any(k[0] == "decode" for k in keys), keys
    assert graphed.stats.graph_steps == graphed.stats.steps
