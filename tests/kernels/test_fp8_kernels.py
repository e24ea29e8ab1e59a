"""The fp8 GEMM kernels against their references on the device under test (CUDA, or the interpreter):

- the weight-only grouped GEMM (tp_lora.ops.triton.grouped_mm with fp8 weights) against grouped_mm_ref, which
  dequantises: per-channel and per-block scales (blocks narrower and wider than the kernel's K tile, K not a
  multiple of the block), empty experts, prefill sizes (more rows per expert than a row block), float32 and bf16
  activations;
- fp8_linear with the kernels on, at decode rows (the weight-only kernel as a one-expert grouped GEMM) and past them
  (block scales: the same kernel; per-channel: W8A8 through torch._scaled_mm on CUDA, the dequantised GEMM
  elsewhere), against x @ dequantize(w)^T;
- the per-token activation quantization kernel against quantize_per_token.
"""
import pytest
import torch

from tp_lora.ops import fused
from tp_lora.ops.fp8 import SMALL_ROWS, dequantize, fp8_linear, quantize_fp8_per_channel, quantize_per_token
from tp_lora.ops.grouped_mm import grouped_mm, grouped_mm_ref


def fp8_weights(gen, experts, n, k, block_k):
    w, scale = quantize_fp8_per_channel(torch.randn(experts, n, k, generator=gen) * k ** -0.5)
    if block_k is not None:  # per-block scales: any positive values (the dequantised weights are the reference)
        scale = torch.rand(experts, n, -(-k // block_k), generator=gen) * 0.02 + 0.001
    return w, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,k,n,block_k", [([3, 0, 9, 4], 96, 40, None), ([3, 0, 9, 4], 96, 40, 32),
                                                ([0, 7, 0], 200, 24, 64), ([5, 2], 512, 48, 256),
                                                ([16, 1, 0, 30], 160, 136, 128),
                                                ([70, 0, 190], 96, 40, None), ([70, 0, 190], 96, 40, 32)])
def test_fp8_grouped_mm_matches_the_dequantised_loop(device, monkeypatch, dtype, counts, k, n, block_k):
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(sum(counts) * 7 + k + (block_k or 0))
    w, scale = fp8_weights(gen, len(counts), n, k, block_k)
    used = sum(counts)
    x = torch.randn(used + 2, k, generator=gen).to(dtype).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    w, scale = w.to(device), scale.to(device)
    got = grouped_mm(x, w, ends, scale, block_k)
    want = grouped_mm_ref(x.float(), w, ends, scale, block_k)  # float32 over the dequantised weights
    assert got.shape == (used + 2, n) and got.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:used].float(), want[:used], **tol)


@pytest.mark.parametrize("rows", [1, 5, SMALL_ROWS, SMALL_ROWS + 31])
@pytest.mark.parametrize("block_k", [None, 128])
def test_fp8_linear_with_kernels_matches_the_dequantised_gemm(device, monkeypatch, rows, block_k):
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(rows + (block_k or 1))
    n, k = 96, 320
    w, scale = fp8_weights(gen, 1, n, k, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(device)
    got = fp8_linear(x, w, scale, block_k)
    want = x.float() @ dequantize(w, scale, block_k).t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # Past SMALL_ROWS with per-channel scales on CUDA the activations are quantized too (W8A8): e4m3 rounding of
    # x adds up to 2^-4 relative per element, a few percent of the output's scale over K terms.
    w8a8 = device == "cuda" and block_k is None and rows > SMALL_ROWS
    tol = 0.08 if w8a8 else 0.02
    assert ((got.float() - want).norm() / want.norm()).item() < tol


def representable(gen, rows, k):
    """Rows whose per-token quantization is exact: e4m3 values times a power of two, each row's |max| at 448 times
    it (the scale is then that power of two). The interpreter rounds fp8 wrongly where the rounding carries into the
    exponent (1.98 -> 1.0), so on the CPU the kernel is checked on values that need no rounding; CUDA rounds in
    hardware and also gets random rows."""
    q = (torch.randn(rows, k, generator=gen) * 100).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    q[:, 0] = 448.0
    return q * 2.0 ** torch.randint(-8, 4, (rows, 1), generator=gen).float()


@pytest.mark.parametrize("rows,k", [(1, 64), (7, 1000), (3, 4096 + 24)])
def test_per_token_quantization_kernel_matches_the_reference(device, rows, k):
    from tp_lora.ops.triton.fp8_quant import quantize_per_token as kernel
    gen = torch.Generator().manual_seed(rows * k)
    inputs = [representable(gen, rows, k).to(torch.bfloat16)]
    if device == "cuda":
        inputs.append(torch.randn(rows, k, generator=gen).to(torch.bfloat16))
    for x in inputs:
        x[0] = 0  # an all-zero row: scale 1e-12, zeros out
        x = x.to(device)
        q, s = kernel(x)
        want_q, want_s = quantize_per_token(x)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
        torch.testing.assert_close(s, want_s, rtol=0, atol=0)
        assert torch.equal(q.float(), want_q.float())
