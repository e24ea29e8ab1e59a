"""A whole model forward with the fused Triton ops forced on (the interpreter on CPU) against the torch path: final
hidden states and the K/V written into the cache, for a mixed step (decodes and prefill chunks) of the families
whose layers differ: Llama, partial rotary, Qwen3's q/k norm, Gemma 3's (1 + w) norms, extra norms and GeLU; per-channel
fp8 layers reading the rows their producers quantized per token, in a decode step."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.models.attention import build_attn_meta
from tp_lora.models.llama import CausalLM
from tp_lora.ops import fused

COMMON = dict(vocab_size=64, hidden_size=80, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": dict(model_type="llama"),  # head_dim 20: not a power of two
    "partial": dict(model_type="llama", partial_rotary_factor=0.5),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
                        hidden_activation="gelu_pytorch_tanh", sliding_window_pattern=2, rope_local_base_freq=100.0),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_with_fused_kernels_matches_torch_path(family, device, monkeypatch):
    hf = {**COMMON, **FAMILIES[family]}
    gen = torch.Generator().manual_seed(len(family))
    model = CausalLM(hf, comm.single_process(device).tp, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else p.shape[-1] ** -0.5)
                    + (0.2 if "norm" in name else 0.0))
    bs, lengths, starts = 4, [1, 5, 1, 3], [6, 0, 9, 2]  # decodes over history, prefill chunks
    need = [-(-(s + n) // bs) for s, n in zip(starts, lengths)]
    ids = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    meta = build_attn_meta(tables, starts, lengths, bs, device)
    input_ids = torch.randint(0, hf["vocab_size"], (sum(lengths),), generator=gen).to(device)
    from tp_lora.ops.triton import fused as kernels
    calls = []
    for name in ("add_rms_norm", "rope_write_kv", "act_mul"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    history = model.new_cache(sum(need) + 2, bs)
    for t in history.k + history.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(device))
    outs = []
    for use in (False, True):
        monkeypatch.setattr(fused, "KERNELS", use)
        cache = model.new_cache(sum(need) + 2, bs)
        for t, h in zip(cache.k + cache.v, history.k + history.v):
            t.copy_(h)
        with torch.no_grad():
            outs.append((model(input_ids, cache, meta), cache))
    (want, want_cache), (got, got_cache) = outs
    layers = hf["num_hidden_layers"]
    norms = (3 if family == "gemma3_text" else 2) * layers + 1  # Gemma: post-attention norm, add, norm in one
    assert sorted(calls) == sorted(["add_rms_norm"] * norms + ["rope_write_kv", "act_mul"] * layers), calls
    tol = 1e-5 if device == "cpu" else 1e-4  # GPU kernels may sum in another order
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w, h in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, history.k + history.v):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
        assert not torch.equal(g.flatten(0, 1)[meta.slots], h.flatten(0, 1)[meta.slots]), "K/V were not written"


def _fp8_model(family, device, block=False, rt=None, **config):
    """A bf16 model of the family with per-channel (block: [128, 128]-block) fp8 layers (random weights, and random
    adapters in every slot with rt; config.json overrides), and a decode step's inputs."""
    from tp_lora.layers.linear import ParallelLinear
    from tp_lora.layers.quant import FP8Scheme, QuantConfig
    from tp_lora.ops.fp8 import quantize_fp8_per_channel
    hf = {**COMMON, **FAMILIES[family], "hidden_size": 128, "intermediate_size": 192, **config}
    gen = torch.Generator().manual_seed(3)
    model = CausalLM(hf, comm.single_process(device).tp, dtype=torch.bfloat16, device=device, rt=rt,
                     quant=QuantConfig(FP8Scheme(block=(128, 128)) if block else FP8Scheme(at_load=True)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype != torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else p.shape[-1] ** -0.5)
                        + (0.2 if "norm" in name else 0.0))
        for m in model.modules():
            if isinstance(m, ParallelLinear) and m.quant is not None:
                q, s = quantize_fp8_per_channel(torch.randn(m.weight.shape, generator=gen) * m.weight.shape[1] ** -0.5)
                m.weight.copy_(q)
                m.weight_scale.copy_(s if not block else  # a scale per block about the row's
                                     s[:, None] * (0.5 + torch.rand(m.weight_scale.shape, generator=gen)))
        for name, b in model.named_buffers():
            if name.endswith("scales") and b.dtype == torch.float32:  # the adapters' scales
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    tokens, bs = 6, 4
    meta = build_attn_meta([[i] for i in range(tokens)], [2] * tokens, [1] * tokens, bs, device)
    input_ids = torch.randint(0, hf["vocab_size"], (tokens,), generator=gen).to(device)
    return model, input_ids, meta, lambda: model.new_cache(tokens + 2, bs)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fp8_layers_take_their_rows_quantized_by_norms_and_act_mul(family, device, monkeypatch):
    """A bf16 model with per-channel fp8 layers, kernels forced on, a decode step: qkv_proj, gate_up_proj and
    down_proj multiply the rows their producers (the norms, act_mul) quantized per token (XQ), o_proj those decode
    attention quantized per head on CUDA (G8), else its own (ACT8); the hidden states near the dequantised weights'
    torch path (fp8 activations: a few percent)."""
    from tp_lora.ops.triton import fp8_gemm
    model, input_ids, meta, new_cache = _fp8_model(family, device)
    calls = []
    kernel = fp8_gemm.w8a16_mm
    kind = lambda a: ("g8" if a[4]["ACT8"] else "xq") if len(a) > 5 and a[5] is not None else (  # noqa: E731
        "act8" if a[4]["ACT8"] else "weight-only")
    monkeypatch.setattr(fp8_gemm, "w8a16_mm", lambda *a, **k: calls.append(kind(a)) or kernel(*a, **k))
    outs = []
    for use in (False, True):
        monkeypatch.setattr(fused, "KERNELS", use)
        with torch.no_grad():
            outs.append(model(input_ids, new_cache(), meta).float())
    layers = len(model.layers)
    assert sorted(calls) == sorted(["xq"] * 3 * layers + ["act8"] * layers), calls
    want, got = outs
    # Gemma's extra norms and scaled embeddings make it more sensitive: 0.17 with every layer on ACT8 too
    assert ((got - want).norm() / want.norm()).item() < (0.25 if family == "gemma3_text" else 0.1)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_block_scaled_layers_take_rows_their_producers_quantized_per_group(family, device, monkeypatch):
    """[128, 128]-block fp8 layers in a decode step, kernels forced on: qkv_proj, gate_up_proj and down_proj multiply
    the rows the norms and act_mul quantized per 128 columns in their pass (G8), o_proj quantizes its own (ACT8:
    heads narrower than 128); the hidden states are the bits of the same step with every GEMM quantizing its own
    rows (ACT8), near the dequantised weights' torch path."""
    from tp_lora.models import llama
    from tp_lora.ops.triton import fp8_gemm
    model, input_ids, meta, new_cache = _fp8_model(family, device, block=True, hidden_size=256, intermediate_size=384)
    calls, kernel, rows8_for = [], fp8_gemm.w8a16_mm, llama.rows8_for
    kind = lambda a: ("g8" if a[4]["ACT8"] else "xq") if len(a) > 5 and a[5] is not None else (  # noqa: E731
        "act8" if a[4]["ACT8"] else "weight-only")
    monkeypatch.setattr(fp8_gemm, "w8a16_mm", lambda *a, **k: calls.append(kind(a)) or kernel(*a, **k))
    outs = []
    for use, groups in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(fused, "KERNELS", use)
        monkeypatch.setattr(llama, "rows8_for",
                            lambda layer, rows, g=True, _on=groups: rows8_for(layer, rows, g and _on))
        calls.clear()
        with torch.no_grad():
            outs.append(model(input_ids, new_cache(), meta).float())
        layers = len(model.layers)
        want_calls = (["g8"] * 3 + ["act8"] if groups else ["act8"] * 4) * layers if use else []
        assert sorted(calls) == sorted(want_calls), (groups, calls)
    want, got, act8 = outs
    assert torch.equal(got, act8)
    # Gemma's extra norms and scaled embeddings make it more sensitive
    assert ((got - want).norm() / want.norm()).item() < (0.25 if family == "gemma3_text" else 0.2)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fp8_decode_gemms_leave_their_k_shares_to_the_next_norm(family, device, monkeypatch):
    """One rank, kernels on, every K in two shares or more: o_proj and (but Gemma's, whose post-feedforward norm is
    its own) down_proj hand their shares to the next norm (SplitSums), on CUDA qkv_proj to the decode kernel, and
    Llama's heads of 128 come to o_proj quantized by decode attention (G8); the step's hidden states and K / V are
    the bits of the same step with every GEMM summing its own shares and o_proj quantizing its own rows (ACT8)."""
    from tp_lora.layers import linear
    from tp_lora.ops.split_sums import SplitSums
    from tp_lora.ops.triton import fp8_gemm
    model, input_ids, meta, new_cache = _fp8_model(family, device, hidden_size=256, intermediate_size=384,
                                                   head_dim=64 if family == "gemma3_text" else 128)
    config, kernel, rows8 = fp8_gemm.w8a16_config, fp8_gemm.w8a16_mm, linear.takes_rows8
    monkeypatch.setattr(fp8_gemm, "w8a16_config", lambda *a, **k: dict(config(*a, **k), SPLIT_K=2, BLOCK_K=128))
    monkeypatch.setattr(fused, "KERNELS", True)
    outs, left, heads8 = [], [], []
    for fast in (True, False):
        def gemm(*a, sums=False, _fast=fast, **k):
            out = kernel(*a, sums=sums and _fast, **k)
            left.append(isinstance(out, SplitSums))
            heads8.append(a[4]["ACT8"] and len(a) > 5 and a[5] is not None)
            return out
        monkeypatch.setattr(fp8_gemm, "w8a16_mm", gemm)
        monkeypatch.setattr(linear, "takes_rows8", lambda *a, _fast=fast: rows8(*a) and (_fast or a[3] is None))
        cache = new_cache()
        with torch.no_grad():
            outs.append((model(input_ids, cache, meta), cache))
    layers = len(model.layers)
    per_layer = (1 if family == "gemma3_text" else 2) + (device == "cuda")
    assert left.count(True) == per_layer * layers and len(left) == 8 * layers, left
    assert heads8.count(True) == (layers if device == "cuda" and family == "llama" else 0), heads8
    (got, got_cache), (want, want_cache) = outs
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v))


@pytest.mark.parametrize("split", [1, 2])
def test_lora_expands_beside_the_fp8_gemm_into_the_delta_of_its_shares(device, monkeypatch, split):
    """An adapter step (tokens of three adapters and none), one rank, kernels on, every K in `split` shares: o_proj's
    and down_proj's LoRA (and on CUDA qkv_proj's, into the decode kernel) is expanded beside the GEMM into the delta
    of its SplitSums (one share: the GEMM's output), which the reader adds; the step's hidden states and K / V are
    the bits of the same step with every GEMM summing its own shares and the LoRA expanded into its output."""
    from tp_lora.lora import layers
    from tp_lora.ops import get_backend
    from tp_lora.ops.batch import build_lora_batch
    from tp_lora.ops.split_sums import SplitSums
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton import fused as kernels
    rt = layers.LoRARuntime(3, 8, False, get_backend("triton"))
    model, input_ids, meta, new_cache = _fp8_model("llama", device, rt=rt, hidden_size=256, intermediate_size=384,
                                                   head_dim=128)
    rt.batch = build_lora_batch([0, -1, 2, 1, 0, 2], 3, device)
    config = fp8_gemm.w8a16_config
    monkeypatch.setattr(fp8_gemm, "w8a16_config", lambda *a, **k: dict(config(*a, **k), SPLIT_K=split, BLOCK_K=128))
    monkeypatch.setattr(fused, "KERNELS", True)
    norm, deltas = kernels.add_rms_norm, []
    monkeypatch.setattr(kernels, "add_rms_norm", lambda x, *a: deltas.append(
        isinstance(x, SplitSums) and x.delta is not None) or norm(x, *a))
    outs = []
    for beside in (True, False):
        monkeypatch.setattr(layers, "DELTA_MAX_ROWS", 64 if beside else 0)
        cache = new_cache()
        with torch.no_grad():
            outs.append((model(input_ids, cache, meta), cache))
    layers_n = len(model.layers)
    assert deltas.count(True) == 2 * layers_n and len(deltas) == 2 * (2 * layers_n + 1), deltas
    (got, got_cache), (want, want_cache) = outs
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v))
