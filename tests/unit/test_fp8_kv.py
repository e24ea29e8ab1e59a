"""scheduler.kv_cache_dtype=fp8: K and V stored as float8_e4m3fn (per-tensor scales: 1, or the checkpoint's
self_attn.k_scale / v_scale; saturating at +-448) give the tokens and logprobs of a float32 cache holding the same
values rounded through fp8 with those scales (the reference rounds at the write, tp_lora.ops.fused.write_kv); a
float32 cache ignores the scales; a scale that is not one positive value is refused naming it; the paged attention
references read an fp8 cache as that float32 one; the KV budget counts one byte per element."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora import distributed as comm
from tp_lora.assets import write_random_adapter, write_tiny_llama
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.kv_pool import kv_bytes_per_token
from tp_lora.engine.requests import Request
from tp_lora.ops import fused
from tp_lora.ops.paged_attention import paged_decode_ref, paged_varlen_ref

FP8 = torch.float8_e4m3fn


def _engine(model, adapters, kv: str) -> Engine:
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.cuda_graphs = "cpu", "float32", False
    cfg.scheduler.kv_cache_dtype, cfg.lora.max_rank = kv, 8
    return Engine(cfg, comm.single_process("cpu"), model, adapters)


def with_kv_scales(model: str, scales: dict) -> None:
    """Add self_attn.<name> tensors ({(layer, name): value}) to the tiny model's one safetensors file."""
    path = os.path.join(model, "model.safetensors")
    tensors = load_file(path)
    tensors.update({f"model.layers.{i}.self_attn.{n}": torch.tensor(v) for (i, n), v in scales.items()})
    save_file(tensors, path)


@pytest.mark.parametrize("scales", [{}, {(0, "k_scale"): 0.05, (0, "v_scale"): 0.02, (1, "k_scale"): 0.3,
                                         (1, "v_proj.output_scale"): 0.004}])
def test_fp8_kv_cache_equals_fp8_rounded_float_cache(tmp_path, monkeypatch, scales):
    model = write_tiny_llama(str(tmp_path / "m"), seed=3)
    with_kv_scales(model, scales)
    write_random_adapter(str(tmp_path / "ad" / "a"), model, r=8, seed=4)
    reqs = [Request(i, id=i, adapter=a, prompt_token_ids=list(range(5 + i, 30 + 3 * i)), max_new_tokens=6,
                    ignore_eos=True) for i, a in enumerate(["a", None, "a"])]
    engine = _engine(model, str(tmp_path / "ad"), "fp8")
    got = [(r.output_token_ids, r.logprobs) for r in engine.generate(reqs)]
    assert engine.runner.cache.k[0].dtype == FP8 and engine.runner.cache.v[1].dtype == FP8
    assert kv_bytes_per_token(2, 2, 16, engine.model.kv_dtype) * 4 == kv_bytes_per_token(2, 2, 16, torch.float32)
    per_layer = [(scales.get((i, "k_scale"), 1.0), scales.get((i, "v_scale"), scales.get((i, "v_proj.output_scale"),
                                                                                       1.0))) for i in range(2)]
    write, calls = fused.write_kv, []

    def rounded(k_cache, v_cache, slots, k, v, kv_scales):  # layer by layer, step after step
        assert kv_scales == (1.0, 1.0)  # a float32 cache takes the values unscaled
        ks, vs = per_layer[len(calls) % 2]
        calls.append(1)
        write(k_cache, v_cache, slots, *((x * (1.0 / s)).clamp(-448, 448).to(FP8).to(x.dtype) * s
                                         for x, s in ((k, ks), (v, vs))))

    monkeypatch.setattr(fused, "write_kv", rounded)
    want = [(r.output_token_ids, r.logprobs) for r in _engine(model, str(tmp_path / "ad"), "auto").generate(reqs)]
    for (t, lp), (wt, wlp) in zip(got, want):
        assert t == wt
        assert max(abs(a - b) for a, b in zip(lp, wlp)) < 1e-5


@pytest.mark.parametrize("value, words", [([0.1, 0.2], "expected one value"), (0.0, "positive finite"),
                                          (float("inf"), "positive finite")])
def test_bad_kv_scales_are_refused_naming_them(tmp_path, value, words):
    model = write_tiny_llama(str(tmp_path / "m"), seed=3)
    with_kv_scales(model, {(1, "k_scale"): value})
    with pytest.raises(Exception, match=rf"model.layers.1.self_attn.k_scale.*{words}"):
        _engine(model, None, "fp8")


def test_paged_references_read_fp8_cache():
    g = torch.Generator().manual_seed(0)
    blocks, bs, kv, d, heads = 6, 4, 2, 16, 4
    k = (torch.randn(blocks, bs, kv, d, generator=g) * 3).to(FP8)
    v = (torch.randn(blocks, bs, kv, d, generator=g) * 3).to(FP8)
    table = torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32)
    lens = torch.tensor([11, 7], dtype=torch.int32)
    q = torch.randn(2, heads, d, generator=g)
    torch.testing.assert_close(paged_decode_ref(q, k, v, table, lens, 0.25),
                               paged_decode_ref(q, k.float(), v.float(), table, lens, 0.25), rtol=0, atol=0)
    qv = torch.randn(5, heads, d, generator=g)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    torch.testing.assert_close(paged_varlen_ref(qv, k, v, table, lens, cu, 0.25),
                               paged_varlen_ref(qv, k.float(), v.float(), table, lens, cu, 0.25), rtol=0, atol=0)


def test_fp8_kv_write_saturates():
    cache_k, cache_v = torch.zeros(2, 2, 1, 4, dtype=FP8), torch.zeros(2, 2, 1, 4, dtype=FP8)
    k = torch.tensor([[[1000.0, -1000.0, 1.5, 0.0]]])
    fused.write_kv(cache_k, cache_v, torch.tensor([3]), k, k)
    assert cache_k.view(-1, 1, 4)[3].float().tolist() == [[448.0, -448.0, 1.5, 0.0]]
