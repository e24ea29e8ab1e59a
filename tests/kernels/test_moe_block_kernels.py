"""One MoE block with every MoE Triton kernel forced on (router top-k, pair sort, LoRA block table, grouped expert
GEMMs, combine, and the Triton MoE LoRA ops; the interpreter on CPU) against the torch path (references, torch LoRA
ops), on tokens with and without adapters (an adapter slot unused), at top-2 over few tokens (experts no token
reaches) and top-4: the composition of the kernels through the routing plan, which the per-kernel tests do not
see. Also with fp8 experts (per-channel and per-block scales): the weight-only grouped GEMM against the dequantised
loop."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.layers.quant import FP8Scheme, QuantConfig
from tp_lora.lora.layers import LoRARuntime
from tp_lora.models.moe import SparseMoE
from tp_lora.models.moe_step import MoEStep, prepare_step, validate_moe
from tp_lora.ops import fused, get_backend
from tp_lora.ops.batch import build_lora_batch

HF = {"model_type": "qwen3_moe", "hidden_size": 64, "num_experts": 8, "moe_intermediate_size": 48,
      "norm_topk_prob": True, "num_hidden_layers": 1, "hidden_act": "silu"}


@pytest.mark.parametrize("top_k, tokens, quant", [(2, 5, None), (4, 13, None), (2, 5, "channel"), (4, 13, "block")])
def test_moe_block_with_kernels_matches_torch_path(device, monkeypatch, top_k, tokens, quant):
    hf = dict(HF, num_experts_per_tok=top_k)
    ps = comm.single_process(device)
    rt = LoRARuntime(3, 8, False, get_backend("torch"))
    scheme = {None: None, "channel": FP8Scheme(), "block": FP8Scheme(block=(16, 16))}[quant]
    block = SparseMoE(hf, validate_moe(hf, ps), 0, ps, MoEStep(), torch.float32, device, rt, None,
                      None if scheme is None else QuantConfig(scheme, source="test"))
    gen = torch.Generator().manual_seed(top_k * 100 + tokens)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * (0.3 if "lora_" in name else 1.0))
        for name, b in block.named_buffers():
            if name.endswith("scales"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith("_scale"):  # fp8 experts' scales
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1 + 0.05)
    x = torch.randn(tokens, hf["hidden_size"], generator=gen).to(device)
    reached = block.gate(x)[0].unique().numel()
    assert reached < hf["num_experts"] or tokens > 5, "the small case should leave an expert without tokens"
    slots = [(-1, 0, 2)[i % 3] for i in range(tokens)]
    outs = []
    for kernels in (False, True):
        monkeypatch.setattr(fused, "KERNELS", kernels)
        rt.ops = get_backend("triton" if kernels else "torch")
        rt.batch = build_lora_batch(slots, rt.max_loras, device)
        prepare_step(block.step, ps, rt, tokens, device)
        with torch.no_grad():
            outs.append(block(x))
    want, got = outs
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_experts_read_rows_quantized_per_token(device, monkeypatch):
    """A bf16 block with per-channel fp8 experts, kernels on: it takes x8 (x quantized per token) in a step without
    adapters and the experts read it (a step's x8 of other rows changes the output; x8 of x's own rows, exact under
    that quantization, gives the kernels' output without it); with adapters it does not take it."""
    from tp_lora.ops.fp8 import quantize_per_token
    hf = dict(HF, num_experts_per_tok=2, hidden_size=128)
    ps = comm.single_process(device)
    rt = LoRARuntime(3, 8, False, get_backend("triton"))
    block = SparseMoE(hf, validate_moe(hf, ps), 0, ps, MoEStep(), torch.bfloat16, device, rt, None,
                      QuantConfig(FP8Scheme(), source="test"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in block.named_buffers():
            if name.endswith("_scale"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1 + 0.05)
    tokens = 7
    # rows exact under per-token e4m3: e4m3 values, |max| 448, times a power of two per row
    q = (torch.randn(tokens, 128, generator=gen) * 100).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    q[:, 0] = 448.0
    x = (q * 2.0 ** torch.randint(-12, -6, (tokens, 1), generator=gen).float()).to(torch.bfloat16).to(device)
    outs = []
    cases = ((False, None), (True, quantize_per_token(x)), (True, quantize_per_token(x.flip(0))), (True, None))
    for kernels, x8 in cases:
        monkeypatch.setattr(fused, "KERNELS", kernels)
        rt.batch = build_lora_batch([-1] * tokens, rt.max_loras, device)
        prepare_step(block.step, ps, rt, tokens, device)
        assert block.takes_rows8(x) == kernels
        with torch.no_grad():
            outs.append(block(x, x8=x8).float())
    want, got, other, act8 = outs
    rel = [((o - ref).norm() / ref.norm()).item() for o, ref in ((got, act8), (got, want), (other, want))]
    # the same rows quantized in the kernel (act8) to float32 rounding; the torch path (bf16 products of the
    # dequantised weights rounded to bf16) a few percent off; x8 of other rows far off: x8 was read
    assert rel[0] < 1e-3 and rel[1] < 0.05 and rel[2] > 0.3, rel
    rt.batch = build_lora_batch([0] * tokens, rt.max_loras, device)
    assert not block.takes_rows8(x)
