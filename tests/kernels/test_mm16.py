"""GEMMs over 16-bit weights (tp_lora.ops.mm16, called by ParallelLinear.partial and ParallelLMHead.partial): with
the kernels on, decode rows of a large enough vocabulary shard, and of a layer whose reader takes its K shares' sums,
run the split-K Triton GEMM (w8a16_mm without scales) at the launch w16_config picks and match the float64 product;
other layers, more rows and float32 take torch's matmul itself, bit for bit."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.layers.embedding import ParallelLMHead
from tp_lora.layers.linear import ParallelLinear, column_spec, row_spec
from tp_lora.ops import fused, mm16
from tp_lora.ops.split_sums import SplitSums


@pytest.fixture
def kernel_calls(monkeypatch):
    """Kernels on, a shard of 200 rows counted as large, and the launches of w8a16_mm counted: (rows, SPLIT_K)."""
    from tp_lora.ops.triton import fp8_gemm
    monkeypatch.setattr(fused, "KERNELS", True)
    monkeypatch.setattr(mm16, "HEAD_MIN_ROWS", 200)
    calls = []
    kernel = fp8_gemm.w8a16_mm

    def counted(x, w, scale, block_k, cfg=None, *a, **k):
        calls.append((x.shape[0], cfg["SPLIT_K"]))
        return kernel(x, w, scale, block_k, cfg, *a, **k)
    monkeypatch.setattr(fp8_gemm, "w8a16_mm", counted)
    return calls


def lm_head(device, vocab, hidden, dtype, gen):
    head = ParallelLMHead(vocab, hidden, comm.single_process(device).tp, dtype=dtype, device=device)
    head.load((torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(dtype))
    return head


def linear(device, spec, dtype, gen):
    layer = ParallelLinear(spec, comm.single_process(device).tp, dtype=dtype, device=device)
    for s, sl in enumerate(spec.slices):
        layer.load_slice(s, (torch.randn(sl.width, spec.in_features, generator=gen) * spec.in_features ** -0.5)
                         .to(dtype))
    return layer


def rel_err(got, x, w):
    want = x.double() @ w.double().t()
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows", [1, 13, 64])
def test_lm_head_decode_rows_run_the_kernel(device, kernel_calls, rows):
    gen = torch.Generator().manual_seed(rows)
    head = lm_head(device, 203, 96, torch.bfloat16, gen)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16).to(device)
    got = head.partial(x)
    assert kernel_calls == [(rows, 1)]
    assert got.shape == (rows, 203) and got.dtype == torch.bfloat16 and rel_err(got, x, head.weight) < 1e-2


@pytest.mark.parametrize("rows,spec,split", [(1, column_spec(256, 80, 80), 1), (32, column_spec(2048, 96), 4),
                                             (64, row_spec(4096, 64), 4), (17, column_spec(64, 320), 1),
                                             (32, column_spec(2048, 192), 4)])
def test_layer_k_shares_run_the_kernel(device, kernel_calls, rows, spec, split):
    """partial(sums=True) on one rank: packed, short and deep layers (K split in shares of 1024+ bytes within a wave of
    programs; layers of up to two 64-column blocks, as MoE routers, in 512-wide shares, at most 4) at 1 to 64 rows;
    split K leaves the shares' float32 sums (SplitSums), whose total is the product the kernel writes when asked for
    the output (to an ulp: the interpreter rounds float32 to bf16 its own way)."""
    gen = torch.Generator().manual_seed(rows + spec.in_features)
    layer = linear(device, spec, torch.bfloat16, gen)
    x = torch.randn(rows, spec.in_features, generator=gen).to(torch.bfloat16).to(device)
    got = layer.partial(x, sums=True)
    assert kernel_calls == [(rows, split)]
    if split > 1:
        assert isinstance(got, SplitSums) and got.parts.shape == (split, rows, spec.out_features)
        got = got.total()
        from tp_lora.ops.triton import fp8_gemm
        whole = fp8_gemm.w8a16_mm(x, layer.weight, None, None, fp8_gemm.w16_config(*layer.weight.shape))
        torch.testing.assert_close(got, whole, rtol=8e-3, atol=0)
    assert got.shape == (rows, spec.out_features) and got.dtype == torch.bfloat16
    assert rel_err(got, x, layer.weight) < 1e-2


def test_a_row_layer_under_tp_leaves_its_shares_to_the_fused_all_reduce(device, kernel_calls):
    """Under tp a 16-bit row layer's decode GEMM (o_proj, down_proj) leaves its K shares too: the fused all-reduce +
    norm sums them before the exchange. Their total is this rank's partial product (its half of K); no collective
    runs here."""
    gen = torch.Generator().manual_seed(5)
    spec = row_spec(4096, 256)
    layer = ParallelLinear(spec, comm.Group("tp", rank=1, size=2, ranks=(0, 1)), dtype=torch.bfloat16, device=device)
    layer.load_slice(0, (torch.randn(256, 4096, generator=gen) * 4096 ** -0.5).to(torch.bfloat16))
    x = torch.randn(32, 2048, generator=gen).to(torch.bfloat16).to(device)
    got = layer.partial(x, sums=True)
    assert kernel_calls == [(32, 4)] and isinstance(got, SplitSums) and got.parts.shape == (4, 32, 256)
    assert rel_err(got.total(), x, layer.weight) < 1e-2


@pytest.mark.parametrize("rows,dtype,sums", [(8, torch.bfloat16, False), (65, torch.bfloat16, True),
                                             (8, torch.float32, True)])
def test_other_gemms_take_torch(device, kernel_calls, rows, dtype, sums):
    """A layer without sums (cuBLAS is as fast alone), more rows than the kernel takes, float32: torch's matmul, bit
    for bit; a vocabulary shard under HEAD_MIN_ROWS too."""
    gen = torch.Generator().manual_seed(rows)
    layer = linear(device, row_spec(2048, 40), dtype, gen)
    small = lm_head(device, 199, 96, dtype, gen)
    x = torch.randn(rows, 2048, generator=gen).to(dtype).to(device)
    h = torch.randn(rows, 96, generator=gen).to(dtype).to(device)
    assert torch.equal(layer.partial(x, sums=sums), x @ layer.weight.t())
    assert torch.equal(small.partial(h), h @ small.weight.t()) and kernel_calls == []


def test_moe_router_takes_the_kernels_shares(device, kernel_calls):
    """A MoE router at decode rows (128 experts x 2048): its logits as the split-K kernel's 4 K shares, which the top-k
    kernel sums; the experts it picks carry the top logits of the float64 product (to a 16-bit rounding), their
    weights those of moe_topk_ref over the shares' total. (float16 under the interpreter, which rounds bfloat16 by
    truncation.)"""
    from tp_lora.layers.moe import Router
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(5)
    router = Router(2048, 128, 8, False, True, dtype=dtype, device=device)
    router.weight.data.copy_((torch.randn(128, 2048, generator=gen) * 2048 ** -0.5).to(dtype))
    x = torch.randn(24, 2048, generator=gen).to(dtype).to(device)
    ids, w = router(x)
    assert kernel_calls == [(24, 4)]
    exact = (x.double() @ router.weight.double().t())
    picked, best = exact.gather(1, ids), exact.topk(8, dim=1).values
    assert (picked.sort(1, descending=True).values - best).abs().max().item() < 0.03
    want_ids, want_w = fused.moe_topk_ref(mm16.mm16(x, router.weight, sums=True).total(), 8, False, True)
    assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)
    torch.testing.assert_close(w.sort(1).values, want_w.sort(1).values, rtol=0, atol=0)
