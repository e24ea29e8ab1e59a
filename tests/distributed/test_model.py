"""A whole model at tp=2 and tp=4, both LoRA sharding modes, against one process: logits within 1e-4 relative,
greedy tokens identical, the exact number of collectives per forward pass, and the same collectives asked for by
every rank while generating."""
from dataclasses import replace

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.scoring import prompt_logits
from tp_lora.testing import (backend_under_test, device_under_test, enough_devices, recorded_collectives, run_ranks,
                             same_collectives)

LAYERS = 2


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("model")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh weights every run
    out = {}
    for name, kw in {"llama": dict(model_type="llama"),
                     "qwen2": dict(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)}.items():
        model = root / name
        write_tiny_llama(model, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         seed=seed, **kw)
        adapters = root / f"{name}-adapters"
        write_random_adapter(adapters / "a8", model, r=8, lora_alpha=16, seed=seed + 1)
        write_random_adapter(adapters / "b4", model, r=4, lora_alpha=8, use_rslora=True, seed=seed + 2,
                             target_modules=("q_proj", "v_proj", "down_proj"))
        write_random_adapter(adapters / "c16", model, r=16, lora_alpha=32, seed=seed + 3, include_embedding=True,
                             include_lm_head=True, rank_pattern={"o_proj": 4}, alpha_pattern={"gate_proj": 5})
        out[name] = (str(model), str(adapters))
    gen = torch.Generator().manual_seed(seed)
    adapters = ["a8", None, "b4", "c16", "a8", None, "c16"]
    out["requests"] = [
        Request(i, id=i, adapter=a, prompt_token_ids=torch.randint(0, 256, (int(n),), generator=gen).tolist(),
                max_new_tokens=6)
        for i, (a, n) in enumerate(zip(adapters, torch.randint(1, 12, (len(adapters),), generator=gen)))]
    return out


def _cfg(fully_sharded: bool, tp: int) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp_size = tp
    cfg.lora.fully_sharded = fully_sharded
    cfg.lora.max_loras, cfg.lora.max_rank = 4, 16
    cfg.generation.ignore_eos = True
    cfg.device, cfg.dtype, cfg.lora.backend = device_under_test(), "float32", backend_under_test()
    cfg.cuda_graphs = False  # eager here; tests/gpu compares graphs with eager
    return cfg


def _run(ps: comm.ParallelState, cases, requests):
    """cases: (model_dir, adapter_dir, fully_sharded). Per case: prompt logits, greedy outputs, collectives."""
    out = []
    for model_dir, adapter_dir, fully in cases:
        engine = Engine(_cfg(fully, ps.tp.size), ps, model_dir, adapter_dir)
        comm.STATS.reset()
        logits = prompt_logits(engine, requests[:4])  # every slot used: a8, none, b4, c16
        calls = dict(comm.STATS.calls)
        with recorded_collectives() as asked:  # every rank asks for the same ones (GPUs: the same peer kernels)
            results = engine.generate(requests)
        same_collectives(asked, ps.world, f"tp{ps.tp.size} fully_sharded={fully}")
        out.append((logits, [r.output_token_ids for r in results], calls))
    return out


def _cases(bundle):
    return [(bundle[m][0], bundle[m][1], fully) for m in ("llama", "qwen2") for fully in (False, True)]


def _relerr(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_process(bundle, tp):
    if not enough_devices(tp):
        pytest.skip(f"{tp} ranks need {tp} GPUs")
    cases = _cases(bundle)
    ref = _run(comm.single_process(device_under_test()), cases, bundle["requests"])
    got = run_ranks(_run, tp, cases, bundle["requests"])
    for (model, _, fully), (rl, rt, _), (gl, gt, calls) in zip(cases, ref, got):
        for a, b in zip(gl, rl):
            a, b = a.cpu(), b.cpu()
            assert _relerr(a, b) < 1e-4, f"{model} fully_sharded={fully}: logits differ by {_relerr(a, b):.2e}"
        assert gt == rt, f"{model} fully_sharded={fully}: greedy tokens differ"
        # Base model: one all-reduce for the embedding and two per layer, one all-gather for the logits.
        # Fully sharded LoRA adds one collective per LoRA-wrapped linear layer (qkv and gate_up gather, o and down
        # reduce), plus the LM head's gather; the embedding's LoRA needs none.
        extra_gather = (2 * LAYERS + 1) if fully else 0
        extra_reduce = 2 * LAYERS if fully else 0
        assert calls == {"all_reduce:tp": 1 + 2 * LAYERS + extra_reduce, "all_gather:tp": 1 + extra_gather}, calls


def test_adapters_change_outputs_and_none_matches_base(bundle):
    """Guards against a test that passes because LoRA does nothing: each adapter moves the logits, and a request
    with no adapter gives exactly the model without LoRA."""
    model_dir, adapter_dir = bundle["llama"]
    reqs = [Request(i, id=i, adapter=a, prompt_token_ids=[5, 17, 42, 7]) for i, a in
            enumerate([None, "a8", "b4", "c16"])]
    ps = comm.single_process(device_under_test())
    with_lora = prompt_logits(Engine(_cfg(False, 1), ps, model_dir, adapter_dir), reqs)
    # The same batch without adapters: the no-adapter row must match bit for bit (a batch of a different size may
    # take another GEMM kernel, whose rounding differs).
    base = prompt_logits(Engine(_cfg(False, 1), ps, model_dir, None), [replace(r, adapter=None) for r in reqs])[0]
    torch.testing.assert_close(with_lora[0], base, rtol=0, atol=0)
    for i in (1, 2, 3):
        assert _relerr(with_lora[i], base) > 1e-3, f"adapter {reqs[i].adapter} did not change the logits"
