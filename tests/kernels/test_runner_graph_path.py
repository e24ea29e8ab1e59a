"""The runner's graph path without a GPU: capture replaced by a stand-in that reruns the captured forward on each
replay, so every step goes through the static buffers, their refresh (inputs, the tokens' and the logits rows' LoRA
batches) and the padded layout, with the varlen reference attending. Its tokens must be the eager engine's. The
stand-in's capture and replays refuse host reads of tensor values, as a CUDA capture does."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.runner import mixed_sizes


# What reads a tensor's values on the host (a device sync, which a CUDA graph capture refuses); indexing with a
# boolean mask too (its output size is the mask's count).
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.nonzero,
               torch.Tensor.nonzero, torch.unique, torch.masked_select}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _masked(index) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
               for i in (index if isinstance(index, tuple) else (index,)))


class NoHostReads(TorchFunctionMode):
    """The CPU analogue of torch.cuda.set_sync_debug_mode("error") over a capture: a host read of a tensor's
    values raises (the Triton interpreter's launches read theirs through numpy, not through torch)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS or (func in _INDEXING and _masked(args[1])):
            raise RuntimeError(f"host read ({func.__name__}) of device data during a graph capture")
        return func(*args, **(kwargs or {}))


class Rerun:
    """Stands in for a captured graph: a warm-up forward (this step's result, as the runner's _record), the
    forward again as the "capture", and replay() runs it again over the static buffers; capture and replays
    refuse host reads."""

    def __init__(self, forward):
        self.forward, self.warm = forward, forward()
        self.out = self._run()

    def _run(self) -> torch.Tensor:
        with NoHostReads():
            return self.forward()

    def replay(self):
        self.out.copy_(self._run())


def _engine(model, adapters, graphs: bool, device: str) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = device, "float32", False, False
    cfg.lora.backend, cfg.lora.max_loras, cfg.lora.max_rank = "triton", 3, 8
    cfg.generation.ignore_eos = True
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step, cfg.scheduler.admit_batch = 3, 16, 1
    engine = Engine(cfg, comm.single_process(device), str(model), adapters and str(adapters))
    if graphs:
        r = engine.runner
        r.use_graphs, r.mixed_sizes = True, mixed_sizes(16, 3)
        r._record = lambda forward: (lambda g: (g, g.out, g.warm))(Rerun(forward))
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


@pytest.mark.parametrize("read", [lambda x: x.sum().item(), lambda x: x[0].tolist(), lambda x: x.cpu(),
                                  lambda x: bool(x.isfinite().all()), lambda x: int(x.argmax()),
                                  lambda x: x[x > 0], lambda x: x.nonzero()],
                         ids=["item", "tolist", "cpu", "bool", "int", "mask", "nonzero"])
def test_the_capture_stand_in_refuses_host_reads(read):
    x = torch.randn(4, 8)
    read(x)  # fine outside a capture
    with pytest.raises(RuntimeError, match="host read"):
        Rerun(lambda: (read(x), x * 2)[1])


def test_a_host_read_in_the_graphed_forward_fails(tmp_path, device, monkeypatch):
    write_tiny_llama(tmp_path / "m", num_hidden_layers=1, seed=2, hidden_size=32, intermediate_size=64)
    engine = _engine(tmp_path / "m", None, True, device)
    logits = engine.model.logits

    def checked(hidden, gather=True):  # a planted sync: a finiteness check on the host
        assert bool(hidden.isfinite().all())
        return logits(hidden, gather)

    monkeypatch.setattr(engine.model, "logits", checked)
    with pytest.raises(RuntimeError, match=r"host read \(__bool__\)"):
        engine.generate([Request(0, id=0, max_new_tokens=1, prompt_token_ids=[1, 2, 3])])
