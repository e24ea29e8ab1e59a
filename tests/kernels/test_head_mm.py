"""The LM head's GEMM (tp_lora.ops.head_mm, called by ParallelLMHead.partial): with the kernels on, decode rows over
a large enough 16-bit vocabulary shard run the split-K Triton GEMM (w8a16_mm without scales) and match torch's
product; more rows, float32 layers and smaller shards take torch's matmul itself."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.layers.embedding import ParallelLMHead
from tp_lora.ops import fused, head_mm


@pytest.fixture
def kernel_calls(monkeypatch):
    """Kernels on, a shard of 200 rows counted as large, and the launches of w8a16_mm counted."""
    from tp_lora.ops.triton import fp8_gemm
    monkeypatch.setattr(fused, "KERNELS", True)
    monkeypatch.setattr(head_mm, "HEAD_MIN_ROWS", 200)
    calls = []
    kernel = fp8_gemm.w8a16_mm
    monkeypatch.setattr(fp8_gemm, "w8a16_mm", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    return calls


def lm_head(device, vocab, hidden, dtype, gen):
    head = ParallelLMHead(vocab, hidden, comm.single_process(device).tp, dtype=dtype, device=device)
    head.load((torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(dtype))
    return head


@pytest.mark.parametrize("rows", [1, 13, 64])
def test_lm_head_decode_rows_run_the_kernel(device, kernel_calls, rows):
    gen = torch.Generator().manual_seed(rows)
    head = lm_head(device, 203, 96, torch.bfloat16, gen)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16).to(device)
    got = head.partial(x)
    want = x.double() @ head.weight.double().t()
    assert kernel_calls == [rows] and got.shape == (rows, 203) and got.dtype == torch.bfloat16
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("rows,vocab,dtype", [(65, 203, torch.bfloat16), (8, 199, torch.bfloat16),
                                              (8, 203, torch.float32)])
def test_lm_head_takes_torch_past_the_kernel(device, kernel_calls, rows, vocab, dtype):
    """More rows than the kernel takes, a shard under HEAD_MIN_ROWS, float32: torch's matmul, bit for bit."""
    gen = torch.Generator().manual_seed(rows + vocab)
    head = lm_head(device, vocab, 96, dtype, gen)
    x = torch.randn(rows, 96, generator=gen).to(dtype).to(device)
    assert torch.equal(head.partial(x), x @ head.weight.t()) and kernel_calls == []
