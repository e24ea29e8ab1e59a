"""Issue #39's serving features on CUDA, graphed and launched ahead, against eager steps read one by one: grammar rows
(their masks filled by the matchers' processes while the device runs the next step) draw what they draw step by
step, and n siblings joining as their prompt ends (their partial block copied on the device) draw what separate
requests seeded like them draw, in the steps of one sequence."""
import json
import os
import sys

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from _json_model import SCHEMAS, write_json_model  # noqa: E402

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs CUDA")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_json_model(str(tmp_path_factory.mktemp("json")))


def _engine(model, graphs: bool, caching: bool = True) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs, cfg.progress = DEVICE, "float32", graphs, False
    cfg.lora.max_loras, cfg.lora.max_rank = 2, 8
    cfg.scheduler.max_batch_size, cfg.scheduler.max_tokens_per_step, cfg.scheduler.kv_block_size = 16, 256, 16
    cfg.scheduler.prefix_caching = caching
    engine = Engine(cfg, comm.single_process(DEVICE), model["model"], model["adapter_dir"])
    engine.run_ahead = graphs
    return engine


def _tokens(results) -> list:
    return [(r.output_token_ids, r.finish_reason, r.error) for r in results]


def test_grammar_rows_launched_ahead_draw_what_steps_read_one_by_one_draw(model):
    def reqs():
        out = [Request(i, id=i, adapter=("alpha", None, "beta")[i % 3], prompt_token_ids=[1, 40 + i, 7, 9 + i],
                       max_new_tokens=48, temperature=1.0, seed=i) for i in range(12)]
        for r in out[:10]:
            r.grammar = ("json_schema", json.dumps(SCHEMAS[r.index % len(SCHEMAS)]))
        return out
    eager, graphed = _engine(model, False), _engine(model, True)
    want, got = _tokens(eager.generate(reqs())), _tokens(graphed.generate(reqs()))
    assert got == want
    assert sum(reason == "stop" for _, reason, _ in want[:10]) >= 5
    st = graphed.stats
    assert st.mask_steps > 0 and st.ahead_steps >= st.steps - 3, st  # steps with grammar rows ran ahead too
    print(f"mask wait {1e3 * st.mask_wait_seconds / st.mask_steps:.3f} ms per step over {st.mask_steps} steps")
    eager.close()
    graphed.close()


@pytest.mark.parametrize("prompt", [40, 48])
def test_n_siblings_draw_what_separate_seeded_requests_draw(model, prompt):
    ids = [(11 * i) % 300 + 3 for i in range(prompt)]
    ask = dict(prompt_token_ids=ids, max_new_tokens=6, temperature=1.0, ignore_eos=True, adapter="alpha")
    graphed = _engine(model, True)
    (one,) = graphed.generate([Request(0, id=0, seed=5, **ask)])
    steps = graphed.stats.steps
    (four,) = graphed.generate([Request(0, id=0, seed=5, n=4, **{**ask, "prompt_token_ids": ids[::-1]})])
    assert graphed.stats.steps == 2 * steps  # no step beyond one sequence's
    alone = _engine(model, True, caching=False)
    for i, choice in enumerate(four.choices):
        (r,) = alone.generate([Request(0, id=0, seed=5 + i, **{**ask, "prompt_token_ids": ids[::-1]})])
        assert choice.output_token_ids == r.output_token_ids, i
        assert choice.logprobs == pytest.approx(r.logprobs, abs=1e-3)
    assert one.output_token_ids and len({tuple(c.output_token_ids) for c in four.choices}) > 1
    graphed.close()
    alone.close()


@pytest.mark.parametrize("sel", [[1, 3, 4], [0, 1, 2, 3, 4, 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_draw_equals_the_host_one(sel, dtype):
    """draw on the device (the race kernel, the bitmask copied from pinned memory) picks what the CPU path picks:
    grammar rows among their bits and the printable tokens only (the padding words' bits past the vocabulary
    ignored; a row allowing none takes a stop token), greedy and hot rows, seeded and not, top-p rows, the model's
    logits left as they were."""
    from tp_lora.engine.grammar import pack
    from tp_lora.engine.sampler import draw
    gen = torch.Generator().manual_seed(len(sel))
    logits = (torch.randn(6, 1003, generator=gen) * 3).to(dtype)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(sel), 32), dtype=torch.int32, generator=gen)
    bits[0] = 0  # a dead end
    allow = torch.stack([pack(list(range(0, 1003, 2)), 1003), pack([5, 7], 1003)])  # even ids printable; 5, 7 stop
    args = ([0.0, 1.0, 0.7, 0.0, 1.3, 1.0], [1.0, 1.0, 0.8, 1.0, 1.0, 0.5])
    seeds, steps = [None, 3, None, 4, 5, None], [0, 2, 0, 7, 1, 0]
    want = draw(logits, *args, torch.Generator().manual_seed(9), seeds, steps, grammar=(sel, bits, allow))
    assert int(want[0, sel[0]]) in (5, 7)
    dev = logits.to(DEVICE)
    got = draw(dev, *args, torch.Generator().manual_seed(9), seeds, steps,
               grammar=(sel, bits.pin_memory().to(DEVICE, non_blocking=True), allow.to(DEVICE)))
    assert torch.equal(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(dev.cpu(), logits)


def test_the_draw_launches_no_host_sync(model):
    """After a request's first token, a step's draw (grammar rows with their masks filled ahead, seeded and unseeded
    rows at temperature 1 with top-p, logit rules) queues its work without waiting for the device: torch's sync
    debug mode raises on any blocking copy or stream sync in it."""
    engine = _engine(model, True)
    sample, calls = engine.sampler.sample, []

    def strict(rows, reqs, stats=None):
        calls.append(len(reqs))
        if len(calls) == 1:  # the first tokens: logit-rule rows are written once per request
            return sample(rows, reqs, stats)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return sample(rows, reqs, stats)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    engine.sampler.sample = strict
    reqs = [Request(i, id=i, prompt_token_ids=[1, 40 + i, 7], max_new_tokens=24, temperature=1.0, top_p=0.9,
                    seed=i if i % 2 else None, presence_penalty=0.5 if i % 4 == 3 else 0.0) for i in range(8)]
    for r in reqs[:4]:
        r.grammar = ("json_schema", json.dumps(SCHEMAS[r.index % len(SCHEMAS)]))
    results = engine.generate(reqs)
    assert all(r.error is None for r in results) and len(calls) > 5
    engine.close()
