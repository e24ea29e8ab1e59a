"""FP8 base weights as published (HF fp8 with block scales, compressed-tensors float-quantized per channel and per
tensor) and quantized at load (quantization=fp8), under LoRA: greedy tokens and logprobs equal the engine on the
dequantized float32 weights (tests/distributed/_fp8_checkpoints.py writes both), at tp1, tp2 and ep2 (both LoRA modes)
and tp4 fully sharded; and the refusals: a missing scale, a scale of the wrong shape, a shard that splits a scale
block, fp8 tensors without a quantization_config, an unsupported quant_method."""
import pytest
import torch
from _fp8_checkpoints import edit, write_fp8
from test_moe import write_adapters, write_moe

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import ConfigError, RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.models import registry
from tp_lora.models.checkpoint import CheckpointReader, load_hf_config
from tp_lora.models.loader import load_weights
from tp_lora.testing import device_under_test, enough_devices, recorded_collectives, run_ranks, same_collectives

FORMATS = ("block", "channel", "tensor")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    src = write_tiny_llama(str(root / "llama"), seed=seed)
    adapters = root / "llama-adapters"
    write_random_adapter(str(adapters / "a"), src, r=8, seed=seed + 1)
    write_random_adapter(str(adapters / "b"), src, r=4, seed=seed + 2, target_modules=("v_proj", "down_proj"))
    # name -> (model dir, quantization option, dequantized reference dir, adapter dir)
    cases = {}
    for fmt in FORMATS:
        write_fp8(src, str(root / fmt), str(root / f"{fmt}-ref"), fmt)
        cases[fmt] = (str(root / fmt), None, str(root / f"{fmt}-ref"), str(adapters))
    # Quantized at load per channel: the compressed-tensors per-channel reference is the same quantization.
    cases["at_load"] = (src, "fp8", str(root / "channel-ref"), str(adapters))
    moe = write_moe(root / "mixtral", "mixtral", seed)
    moe_adapters = write_adapters(root / "mixtral-adapters", load_hf_config(moe), seed + 10)
    for fmt in ("block", "channel"):
        write_fp8(moe, str(root / f"moe-{fmt}"), str(root / f"moe-{fmt}-ref"), fmt, block=8)
        cases[f"moe-{fmt}"] = (str(root / f"moe-{fmt}"), None, str(root / f"moe-{fmt}-ref"), moe_adapters)
    cases["moe-at_load"] = (moe, "fp8", str(root / "moe-channel-ref"), moe_adapters)
    gen = torch.Generator().manual_seed(seed)
    names = {"llama": ["a", None, "b", "a"], "moe": ["pe", "tp", None, "w2"]}
    requests = {kind: [Request(i, id=i, adapter=a, prompt_token_ids=torch.randint(3, 120, (3 + 2 * i,),
                                                                                  generator=gen).tolist(),
                               max_new_tokens=5, ignore_eos=True) for i, a in enumerate(adapters)]
                for kind, adapters in names.items()}
    ps = comm.single_process(device_under_test())
    refs = {name: _run(ps, _cfg(1, 1, False, None), ref, ad, requests[_kind(name)])
            for name, (_, _, ref, ad) in cases.items()}
    return cases, requests, refs, root


def _kind(name: str) -> str:
    return "moe" if name.startswith("moe") else "llama"


def _cfg(tp: int, ep: int, fully: bool, quantization) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp_size, cfg.parallel.ep_size = tp, ep
    cfg.lora.fully_sharded, cfg.lora.max_loras, cfg.lora.max_rank = fully, 4, 16
    cfg.device, cfg.dtype, cfg.quantization, cfg.cuda_graphs = device_under_test(), "float32", quantization, False
    cfg.scheduler.kv_cache_mb = 64  # a few blocks hold these runs (on CUDA the default is 80% of the free memory)
    return cfg


def _run(ps, cfg, model, adapters, requests):
    mine = [r for r in requests if r.index % ps.dp.size == ps.dp.rank]
    with recorded_collectives() as calls:  # every rank of a group asks for the same ones (GPUs: the same kernels)
        results = Engine(cfg, ps, model, adapters).generate(mine)
    same_collectives(calls, ps.world, f"tp{cfg.parallel.tp_size} ep{cfg.parallel.ep_size}")
    return {r.request.index: (r.output_token_ids, r.logprobs) for r in results}


def _check(got: dict, want: dict, what: str, tol: float) -> None:
    for i, (tokens, logprobs) in got.items():
        assert tokens == want[i][0], f"{what}: request {i} tokens {tokens} != {want[i][0]}"
        err = max(abs(a - b) for a, b in zip(logprobs, want[i][1]))
        assert err <= tol, f"{what}: request {i} logprobs differ by {err:.2e}"


def _layouts(ps_world, world, layouts, cases, requests, refs):
    checked = []
    for tp, ep, modes, names in layouts:
        ps = comm.init_parallel(tp, str(ps_world.device))  # the Engine sets up the expert layout (ep)
        for fully in modes:
            for name in names:
                model, quantization, _, adapters = cases[name]
                got = _run(ps, _cfg(tp, ep, fully, quantization), model, adapters, requests[_kind(name)])
                what = f"{name} tp{tp} ep{ep} fully_sharded={fully}"
                _check(got, refs[name], what, 1e-4)
                checked.append(what)
    return checked


def test_fp8_one_process_equals_dequantized(bundle):
    """tp1: every format (and quantize-at-load) gives the dequantized float32 model's tokens and logprobs."""
    cases, requests, refs, _ = bundle
    ps = comm.single_process(device_under_test())
    for name, (model, quantization, _, adapters) in cases.items():
        got = _run(ps, _cfg(1, 1, False, quantization), model, adapters, requests[_kind(name)])
        # float32 throughout; on CUDA the kernels sum in other orders (4x H200: 1.05e-5 on the MoE's at_load case)
        _check(got, refs[name], name, 1e-5 if device_under_test() == "cpu" else 3e-5)


def test_fp8_tp2_and_ep2(bundle):
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    cases, requests, refs, _ = bundle
    llama = [n for n in cases if _kind(n) == "llama"]
    moe = [n for n in cases if _kind(n) == "moe"]
    layouts = [(2, 1, (False, True), llama), (1, 2, (False, True), moe)]
    checked = run_ranks(_layouts, 2, 2, layouts, cases, requests, refs, tp_size=1, timeout_s=240)
    assert len(checked) == 2 * len(llama) + 2 * len(moe)


def test_fp8_tp4_fully_sharded(bundle):
    if not enough_devices(4):
        pytest.skip("4 ranks need 4 GPUs")
    cases, requests, refs, _ = bundle
    llama = [n for n in cases if _kind(n) == "llama"]
    checked = run_ranks(_layouts, 4, 4, [(4, 1, (True,), llama)], cases, requests, refs, tp_size=4, timeout_s=240)
    assert len(checked) == len(llama)


def _load(model: str, rank: int = 0, size: int = 1, quantization=None) -> None:
    hf = load_hf_config(model)
    m = registry.build(hf, comm.Group("tp", rank, size), torch.float32, torch.device("cpu"), None, None,
                       quantization)
    load_weights(m, CheckpointReader(model))


def test_fp8_refusals(bundle):
    """Each bad checkpoint ends the load with a message naming the tensor and what was expected."""
    cases, _, _, root = bundle
    block = cases["block"][0]
    q = "model.layers.1.self_attn.q_proj"
    with pytest.raises(ValueError, match=rf"{q}.weight: float8_e4m3fn weight without its scale .*{q}.weight_scale_inv"):
        _load(edit(block, str(root / "no-scale"), drop=q + ".weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"{q}.weight: scale of shape \(16,\), expected \(4, 4\)"):
        _load(edit(block, str(root / "bad-shape"), reshape=q + ".weight_scale_inv"))
    # Blocks of 32 at tp2: rank 1 holds k_proj rows [16, 32) (one of the 2 KV heads of 16), half a block.
    write_fp8(cases["at_load"][0], str(root / "block32"), str(root / "block32-ref"), "block", block=32)
    with pytest.raises(ValueError, match=r"k_proj.weight rows: this rank's part \[16, 32\) of 32 would split a "
                                         r"scale block of 32"):
        _load(str(root / "block32"), 1, 2)
    with pytest.raises(ValueError, match=r"float8_e4m3fn weights, but config.json's quantization_config leaves"):
        _load(edit(block, str(root / "no-config"), config={"quantization_config": None}))
    with pytest.raises(ConfigError, match=r"quant_method='gptq' is not supported"):
        _load(edit(block, str(root / "gptq"), config={"quantization_config": {"quant_method": "gptq"}}))
