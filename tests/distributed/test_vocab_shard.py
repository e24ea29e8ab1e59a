"""An engine at tp2 draws plain rows (greedy, seeded and unseeded hot ones) from each rank's vocabulary shard of the
logits, the ranks exchanging four numbers a row, and draws from gathered logits in steps with a row that needs the
whole vocabulary (top_p < 1, top log-probabilities, a logit rule): the tokens of one process either way,
log-probabilities within float32 rounding, and the shard path taken where it should be."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.sampler import Sampler
from tp_lora.testing import device_under_test, enough_devices, run_ranks

PLAIN = [dict(), dict(temperature=0.9, seed=7), dict(temperature=1.3), dict(temperature=0.6, seed=11)]
WHOLE = PLAIN + [dict(temperature=0.8, top_p=0.7, seed=3), dict(logprobs=2), dict(presence_penalty=1.5)]


def _generate(ps: comm.ParallelState, model_dir: str, prompts: list[list[int]]):
    """Per batch (PLAIN, WHOLE): each request's (tokens, logprobs), and the rows drawn from shards."""
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs = device_under_test(), "float32", False
    cfg.generation.ignore_eos = True
    engine = Engine(cfg, ps, model_dir, None)
    drawn = []
    real = Sampler.sample_shard

    def counted(self, rows, *args):
        drawn.append(rows.shape[0])
        return real(self, rows, *args)
    Sampler.sample_shard = counted
    try:
        out = []
        for batch in (PLAIN, WHOLE):
            drawn.clear()
            got = engine.generate([Request(i, id=i, prompt_token_ids=p, max_new_tokens=5, **kw)
                                   for i, (p, kw) in enumerate(zip(prompts, batch))])
            assert all(r.error is None for r in got), [r.error for r in got]
            out.append(([(r.output_token_ids, r.logprobs) for r in got], sum(drawn)))
        return out
    finally:
        Sampler.sample_shard = real
        engine.close()


def test_plain_rows_drawn_from_vocab_shards_match_one_process(tmp_path):
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    model = write_tiny_llama(tmp_path / "model", seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (3, 8, 1, 5, 6, 2, 4)]
    want = _generate(comm.single_process(device_under_test()), model, prompts)
    got = run_ranks(_generate, 2, model, prompts)
    assert want[0][1] == want[1][1] == 0, "one process has no shards"
    assert got[0][1] == 5 * len(PLAIN), "every plain step draws from the shards"
    assert got[1][1] == 0, "a step with a row that needs the whole vocabulary gathers the logits"
    for (rows, _), (ref, _) in zip(got, want):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(rows, ref):
            assert tokens == ref_tokens
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=0, atol=1e-5)
