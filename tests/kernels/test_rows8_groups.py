"""o_proj's rows quantized by decode attention, a head a group (Rows8 with scales [T, H]): the decode kernel's out8
is what the per-group quantization kernel makes of its output (every partition count, the merged store too), its
output unchanged by it; the ACT8 GEMM on those rows (G8) gives the bits of ACT8 on the 16-bit rows (channel and
block scales, K shares summed by the GEMM or left as SplitSums); fp8_linear reads them where takes_rows8(group)
says so, and the rule's edges."""
import pytest
import torch
from _paged import poisoned_cache

from tp_lora.ops import fused
from tp_lora.ops.fp8 import (ACT8_GROUP, ACT8_ROWS, fp8_linear, quantize_fp8_per_channel, takes_rows8)


def _weights(gen, n, k, block_k, device):
    w, scale = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * k ** -0.5)
    if block_k is not None:
        scale = torch.rand(n, k // block_k, generator=gen) * 0.02 + 0.001
    return w.to(device), scale.to(device)


def _groups8(x):
    """x [T, K] quantized per (row, ACT8_GROUP columns) by the Triton kernel, its scales row-major."""
    from tp_lora.ops.triton.fp8_quant import quantize_per_group
    q, s = quantize_per_group(x, ACT8_GROUP)
    return q, s.contiguous()


@pytest.mark.parametrize("lens,min_part", [([1, 19, 40], 128), ([200, 3, 77], 64)])
def test_decode_kernel_writes_its_output_quantized_per_head(device, monkeypatch, lens, min_part):
    from tp_lora.ops.triton import paged_attention as pa
    monkeypatch.setattr(pa, "MIN_PART", min_part)  # 64: partitions merged by the last one
    gen = torch.Generator().manual_seed(sum(lens))
    heads, kv, d, bs, b = 4, 2, ACT8_GROUP, 16, len(lens)
    kc, vc, table = (t.to(device) for t in poisoned_cache(gen, lens, b, kv, d, bs, torch.bfloat16, width=16))
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = (torch.randn(b, heads, d, generator=gen) * 2.0 ** torch.randint(-4, 4, (1, heads, 1), generator=gen))
    q = q.bfloat16().to(device)
    out8 = (torch.empty(b, heads * d, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(b, heads, dtype=torch.float32, device=device))
    got = pa.paged_decode(q, kc, vc, table, ctx, 0.1, out8=out8)
    plain = pa.paged_decode(q, kc, vc, table, ctx, 0.1)
    assert torch.equal(got, plain)
    want_q, want_s = _groups8(got.view(b, -1))
    assert torch.equal(out8[1], want_s) and torch.equal(out8[0].float(), want_q.float())
    with pytest.raises(ValueError, match="out8 needs q"):
        pa.paged_decode(q, kc, vc, table, ctx, 0.1, out8=(out8[0], out8[1][:, 1:]))


@pytest.mark.parametrize("block_k", [None, 128, 256])
@pytest.mark.parametrize("rows,split", [(5, 2), (32, 3)])
def test_act8_of_rows_quantized_by_their_producer_is_act8(device, block_k, rows, split):
    from tp_lora.ops.split_sums import SplitSums
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton.fused import add_rms_norm
    gen = torch.Generator().manual_seed(rows + split + (block_k or 0))
    n, k = 48, 512
    w, scale = _weights(gen, n, k, block_k, device)
    x = (torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-6, 6, (1, k), generator=gen)).bfloat16()
    x = x.to(device)
    cfg = dict(fp8_gemm.W8A16_DEFAULT, BLOCK_N=16, BLOCK_K=ACT8_GROUP, SPLIT_K=split, ACT8=True, num_stages=2)
    q, s = _groups8(x)
    want = fp8_gemm.w8a16_mm(x, w, scale, block_k, cfg)
    assert torch.equal(fp8_gemm.w8a16_mm(q, w, scale, block_k, cfg, s, torch.bfloat16), want)
    sums = fp8_gemm.w8a16_mm(q, w, scale, block_k, cfg, s, torch.bfloat16, sums=True)
    assert isinstance(sums, SplitSums) and sums.row is None
    res, nw = torch.zeros_like(want), torch.ones(n, dtype=torch.bfloat16, device=device)
    assert torch.equal(add_rms_norm(sums, res, nw, 1e-6)[1], want)
    with pytest.raises(ValueError, match="ACT8 of fp8 rows takes their scales"):
        fp8_gemm.w8a16_mm(q, w, scale, block_k, cfg, s[:, 1:], torch.bfloat16)


def test_fp8_linear_reads_rows_quantized_per_head_where_act8_runs(device, monkeypatch):
    """Rows quantized per 128 columns from other values than x show which rows fp8_linear multiplies: those rows
    where takes_rows8(x, w, block_k, 128) (up to ACT8_ROWS 16-bit rows, channel or 128-multiple block scales), x
    elsewhere (more rows, blocks of 64 columns, groups of 64)."""
    from tp_lora.ops.fp8 import dequantize
    from tp_lora.ops.triton.fp8_gemm import w8a16_config
    assert all(w8a16_config(32, n, k, g8=True)["BLOCK_K"] == ACT8_GROUP for n, k in ((4096, 4096), (2048, 4096)))
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(7)
    k = 256
    for rows, block_k, group, reads in [(1, None, 128, True), (ACT8_ROWS, 128, 128, True), (3, None, 64, False),
                                        (ACT8_ROWS + 1, None, 128, False), (4, 64, 128, False)]:
        w, scale = _weights(gen, 64, k, block_k, device)
        x = torch.randn(rows, k, generator=gen).bfloat16().to(device)
        other = torch.randn(rows, k, generator=gen).bfloat16().to(device)
        assert takes_rows8(x, w, block_k, group) == reads, (rows, block_k, group)
        if group != ACT8_GROUP:
            continue
        got = fp8_linear(x, w, scale, block_k, None, _groups8(other))
        want = (other if reads else x).float() @ dequantize(w, scale, block_k).t()
        assert ((got.float() - want).norm() / want.norm()).item() < 0.2, (rows, block_k)  # the wrong rows: ~1.4
    assert not takes_rows8(torch.zeros(2, k, device=device), w, None, 128)  # float32 rows: never quantized
