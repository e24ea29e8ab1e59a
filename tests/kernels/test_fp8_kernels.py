"""The fp8 GEMM kernels against their references on the device under test (CUDA, or the interpreter):

- the grouped GEMM (tp_lora.ops.triton.grouped_mm with fp8 weights; bf16 rows quantized per (row, 128 columns)
  in it, act8) against grouped_mm_ref, which dequantises (and quantizes the rows the same way): per-channel and
  per-block scales (blocks narrower and wider than the kernel's K tile, K not a multiple of the block), empty
  experts, prefill sizes (more rows per expert than a row block), float32 and bf16 activations;
- the base layers' fp8 GEMMs (tp_lora.ops.triton.fp8_gemm) against their references: the weight-only split-K
  w8a16_mm in both tile orientations (splits that do not divide K's tiles, more splits than tiles, ragged N and K,
  block scales narrower than the tile; the split counters back at 0 and a second call equal to the first; 16-bit
  weights without scales), its ACT8 form (each row's K tile quantized to e4m3 in the kernel: against the reference
  that quantizes first, refused for 16-bit weights), W8A8 w8a8_mm with block scales (ragged M, N, K; the
  activation scales token-major or row-major); the ACT8 launch rule's wide tiles keep an 8B layer's programs;
- fp8_linear with the kernels on, at decode rows (w8a16_mm, ACT8 for 16-bit rows up to ACT8_ROWS: which form runs
  is checked) and past them (block scales: per-group quantization +
  cuBLAS's block-scaled GEMM on an sm90 GPU when the rows lie in whole blocks, else w8a8_mm; per-channel: W8A8
  through torch._scaled_mm on CUDA, the dequantised GEMM elsewhere), against x @ dequantize(w)^T;
- the per-token and per-group activation quantization kernels against quantize_per_token / quantize_per_group (rows
  padded to a multiple of 4, token-major scales).
"""
import pytest
import torch

from tp_lora.ops import fused
from tp_lora.ops.fp8 import (ACT8_ROWS, SMALL_ROWS, SMALL_ROWS_DEEP, SMALL_ROWS_WIDE, dequantize, fp8_linear,
                              quantize_fp8_per_channel, quantize_per_group, quantize_per_token, small_rows, w8a8_mm_ref,
                              w8a16_mm_ref)
from tp_lora.ops.grouped_mm import grouped_mm, grouped_mm_ref, grouped_mm_triton


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
    # bf16 rows are quantized per (row, 128 columns) in the kernel where the scales allow (act8): on the CPU rows
    # exact under it (the interpreter rounds some values to fp8 wrongly)
    act8 = dtype == torch.bfloat16 and (block_k is None or block_k % 128 == 0)
    x = representable(gen, used + 2, k, 128) if act8 and device == "cpu" else torch.randn(used + 2, k, generator=gen)
    x = x.to(dtype).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    w, scale = w.to(device), scale.to(device)
    got = grouped_mm(x, w, ends, scale, block_k)
    want = grouped_mm_ref(x if act8 else x.float(), w, ends, scale, block_k, act8)  # float32, dequantised weights
    assert got.shape == (used + 2, n) and got.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[:used].float(), want[:used], **tol)


@pytest.mark.parametrize("block_k", [None, 64, 256])
def test_fp8_grouped_mm_act8_quantizes_each_rows_k_tile(device, block_k):
    """The grouped kernel's act8: each row's K tile (128 columns, or the narrower scale block) rounded to e4m3, the
    fp8 product scaled back: equal to the reference that quantizes first (float32 rows, exact under that rounding on
    the CPU; on CUDA to 1e-3: the warp-group fp8 MMA sums a K tile's products in fewer bits than float32), not to the
    exact product (CUDA's random rows); refused for 16-bit weights."""
    counts, k, n = [3, 0, 9, 4], 320, 40
    gen = torch.Generator().manual_seed(k + (block_k or 0))
    w, scale = fp8_weights(gen, len(counts), n, k, block_k)
    x = representable(gen, 18, k, min(128, block_k or 128)) if device == "cpu" else torch.randn(18, k, generator=gen)
    x, w, scale = x.to(device), w.to(device), scale.to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    got = grouped_mm_triton(x, w, ends, scale, block_k, 4, act8=True)
    want = grouped_mm_ref(x, w, ends, scale, block_k, act8=True)
    assert rel_err(got[:16], want[:16]) < (1e-5 if device == "cpu" else 1e-3)
    if device == "cuda":
        assert rel_err(got[:16], grouped_mm_ref(x, w, ends, scale, block_k)[:16]) > 5e-3
    with pytest.raises(ValueError, match="act8 multiplies fp8 weights with their scales, got torch.float32"):
        grouped_mm_triton(x, w.float(), ends, None, None, 4, act8=True)


@pytest.mark.parametrize("gated", [False, True])
def test_fp8_grouped_mm_reads_rows_quantized_per_token(device, monkeypatch, gated):
    """x8 (the rows quantized per token by their producer) through the plan's gather, gated or not: the grouped
    GEMM's XQ against the reference on the dequantised fp8 rows; rows scaled 2^-8..2^2 apart show a row taking
    another's scale; x8 is what the dispatcher reads for per-channel experts (a different x beside it changes
    nothing), not for block scales."""
    from tp_lora.ops.grouped_mm import experts_take_rows8
    monkeypatch.setattr(fused, "KERNELS", True)
    counts, k, n = [4, 0, 7, 5], 256, 48
    gen = torch.Generator().manual_seed(k + gated)
    w, scale = fp8_weights(gen, len(counts), n, k, None)
    w, scale = w.to(device), scale.to(device)
    q = torch.randn(6, k, generator=gen).mul(64).to(torch.float8_e4m3fn).to(device)
    xs = (2.0 ** torch.randint(-8, 3, (6, 1), generator=gen).float()).to(device)
    rows = torch.randint(0, 6, (sum(counts),), generator=gen).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    x = torch.randn(6, k, generator=gen).to(torch.bfloat16).to(device)  # what x8 stands for: never read
    assert experts_take_rows8(x, w, None) and not experts_take_rows8(x, w, 128)
    got = grouped_mm(x, w, ends, scale, None, rows=rows, gated=gated, x8=(q, xs))
    want = grouped_mm_ref(q.float() * xs, w, ends, scale, None, rows=rows, gated=gated)
    assert got.shape == (sum(counts), n // 2 if gated else n) and got.dtype == torch.bfloat16
    for r in range(sum(counts)):
        assert rel_err(got[r], want[r]) < 2e-2, r
    with pytest.raises(ValueError, match="fp8 rows with their scales"):
        grouped_mm_triton(q, w, ends, scale, 128, 4, True, rows, False, xs, torch.bfloat16)


@pytest.mark.parametrize("block_k", [None, 128])
def test_fp8_grouped_mm_reads_the_plans_rows(device, monkeypatch, block_k):
    """The expert path's gather in the GEMM (rows) over fp8 weights: float32 rows (weight-only) everywhere, and on
    CUDA bf16 rows quantized in the kernel (act8), against the reference that gathers (and quantizes) first."""
    monkeypatch.setattr(fused, "KERNELS", True)
    counts, k, n = [4, 0, 7], 256, 40
    gen = torch.Generator().manual_seed(k + (block_k or 0))
    w, scale = fp8_weights(gen, len(counts), n, k, block_k)
    w, scale = w.to(device), scale.to(device)
    x = torch.randn(6, k, generator=gen)
    rows = torch.randint(0, 6, (sum(counts),), generator=gen).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        xd = x.to(dtype).to(device)
        got = grouped_mm(xd, w, ends, scale, block_k, rows=rows)
        want = grouped_mm_ref(xd, w, ends, scale, block_k, dtype == torch.bfloat16, rows)
        assert got.shape == (sum(counts), n) and got.dtype == dtype
        assert rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,block_k,cfg", [
    (1, 40, 96, None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
    (5, 40, 200, None, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=3)),      # 4 tiles in 2 shares of 2
    (16, 72, 160, 32, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=8)),       # more splits than tiles; blocks < tile
    (33, 48, 320, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
    (64, 24, 96, None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=16))])
def test_w8a16_mm_matches_its_reference(device, dtype, rows, n, k, block_k, cfg, swap):
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton.tickets import tickets
    cfg = dict(cfg, SWAP=swap)
    gen = torch.Generator().manual_seed(rows * n + k + swap)
    w, scale = fp8_weights(gen, 1, n, k, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    got = fp8_gemm.w8a16_mm(x, w, scale, block_k, cfg)
    want = w8a16_mm_ref(x.float(), w, scale, block_k)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert not tickets(x.device, 1).any()  # the last split of each column block reset its counter
    assert torch.equal(fp8_gemm.w8a16_mm(x, w, scale, block_k, cfg), got)  # partials summed in a fixed order


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rows,n,k,split", [(1, 40, 96, 1), (7, 72, 200, 3), (64, 24, 160, 2)])
def test_w8a16_mm_takes_16bit_weights_without_scales(device, rows, n, k, split, swap):
    from tp_lora.ops.triton import fp8_gemm
    gen = torch.Generator().manual_seed(rows * n + k + swap)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(torch.bfloat16).to(device)
    got = fp8_gemm.w8a16_mm(x, w, None, None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split, SWAP=swap))
    want = x.double() @ w.double().t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2
    with pytest.raises(ValueError, match="need scales"):  # fp8 weights without their scales
        fp8_gemm.w8a16_mm(x, w.to(torch.float8_e4m3fn), None, None)


@pytest.mark.parametrize("rows,n,k,block_k,cfg", [
    (1, 40, 96, None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
    (5, 72, 200, None, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=3)),      # ragged K: the last tile 8 columns wide
    (16, 48, 320, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),      # block scales wider than the tile
    (33, 24, 256, 256, dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=16))])   # more splits than tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_mm_act8_quantizes_each_rows_k_tile(device, dtype, rows, n, k, block_k, cfg):
    """ACT8: x quantized per (row, K tile) to e4m3 in the kernel, then the fp8 product: equal to the reference that
    quantizes first (quantize_per_group), and not the weight-only product (random rows on CUDA; on the CPU rows
    exact under that quantization, the interpreter rounding some values wrongly)."""
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton.tickets import tickets
    cfg = dict(cfg, ACT8=True)
    gen = torch.Generator().manual_seed(rows * n + k)
    w, scale = fp8_weights(gen, 1, n, k, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    tile = min(cfg["BLOCK_K"], block_k or k)
    x = representable(gen, rows, k, tile) if device == "cpu" else torch.randn(rows, k, generator=gen) * 3
    x = x.to(dtype).to(device)
    got = fp8_gemm.w8a16_mm(x, w, scale, block_k, cfg)
    want = w8a16_mm_ref(x, w, scale, block_k, cfg)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert not tickets(x.device, 1).any()
    if device == "cuda":  # the e4m3 rounding of random rows shows against the exact product
        assert rel_err(got, w8a16_mm_ref(x, w, scale, block_k)) > 5e-3
    with pytest.raises(ValueError, match=f"ACT8 multiplies fp8 weights with their scales, got {dtype} weights"):
        fp8_gemm.w8a16_mm(x, x.contiguous(), None, None, cfg)


def test_fp8_linear_quantizes_16bit_activations_at_decode_only(device, monkeypatch):
    """Which decode GEMM fp8_linear runs: ACT8 for bf16 rows up to ACT8_ROWS (per-channel scales and 128-column
    blocks), weight-only for float32 rows and for blocks narrower than 128 columns."""
    from tp_lora.ops.triton import fp8_gemm
    monkeypatch.setattr(fused, "KERNELS", True)
    seen = []
    kernel = fp8_gemm.w8a16_mm
    monkeypatch.setattr(fp8_gemm, "w8a16_mm", lambda *a, **k: seen.append(a[4]["ACT8"]) or kernel(*a, **k))
    gen = torch.Generator().manual_seed(3)
    for dtype, block_k, rows, act8 in [(torch.bfloat16, None, ACT8_ROWS, True), (torch.bfloat16, 128, 1, True),
                                       (torch.bfloat16, 64, 4, False), (torch.float32, None, 4, False),
                                       (torch.bfloat16, None, ACT8_ROWS + 1, False)]:  # deep: weight-only rows
        w, scale = fp8_weights(gen, 1, 64, 256, block_k)
        x = representable(gen, rows, 256, 128).to(dtype).to(device)
        fp8_linear(x, w[0].to(device), scale[0].to(device), block_k)
        assert seen[-1] == act8, (dtype, block_k, rows)


@pytest.mark.parametrize("rows,n,k,cfg", [
    (1, 40, 96, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
    (5, 72, 200, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=3)),      # ragged K, shares that do not divide its tiles
    (32, 96, 512, None)])                                         # the XQ rule's own tiles
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_w8a16_mm_xq_multiplies_fp8_rows_and_their_scales(device, rows, n, k, cfg, out_dtype):
    """XQ: rows its producer quantized per token (fp8 + one scale a row) against their dequantised product; a
    scale per row that differs by 2^10 from row to row shows any row taking another's."""
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton.tickets import tickets
    gen = torch.Generator().manual_seed(rows * n + k)
    w, scale = fp8_weights(gen, 1, n, k, None)
    w, scale = w[0].to(device), scale[0].to(device)
    q = torch.randn(rows, k, generator=gen).mul(64).to(torch.float8_e4m3fn).to(device)
    xs = (2.0 ** torch.randint(-10, 1, (rows, 1), generator=gen).float() * torch.rand(rows, 1, generator=gen)
          + 1e-3).to(device)
    cfg = cfg or fp8_gemm.w8a16_config(rows, n, k, xq=True)
    got = fp8_gemm.w8a16_mm(q, w, scale, None, cfg, xs, out_dtype)
    want = w8a16_mm_ref(q, w, scale, None, cfg, xs, torch.float32)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    for r in range(rows):  # each row against its own scale
        assert rel_err(got[r], want[r]) < 1e-2, r
    assert not tickets(q.device, 1).any()
    with pytest.raises(ValueError, match="fp8 rows with their scales"):  # block scales take ACT8, not XQ
        fp8_gemm.w8a16_mm(q, w, scale[:, None], 128, cfg, xs, out_dtype)
    with pytest.raises(ValueError, match="fp8 rows with their scales"):
        fp8_gemm.w8a16_mm(q, w, scale, None, cfg, xs[1:], out_dtype)


# (out, in) -> the XQ form's K shares on a 132-SM H200: the best of a sweep of tiles, stages and shares at the 8B
# layers' tp1 / tp2 / tp4 shapes (or within its noise of the best)
XQ_SHARES = {(6144, 4096): 1, (4096, 4096): 1, (28672, 4096): 1, (4096, 14336): 2, (3072, 4096): 2,
             (4096, 2048): 1, (4096, 1024): 1, (14336, 4096): 1, (4096, 7168): 1, (1536, 4096): 4,
             (7168, 4096): 1, (4096, 3584): 1}


@pytest.mark.parametrize("n,k", list(XQ_SHARES))
def test_xq_decode_config_takes_the_measured_shares(n, k):
    from tp_lora.ops.triton.fp8_gemm import w8a16_config
    cfg = w8a16_config(32, n, k, xq=True)
    assert cfg["SPLIT_K"] == XQ_SHARES[(n, k)] and not cfg["ACT8"], cfg
    assert (cfg["BLOCK_N"], cfg["BLOCK_K"]) == ((128, 128) if n >= 14336 else (64, 256)), cfg
    assert w8a16_config(32, 4096, 14336, xq=True, sms=114)["SPLIT_K"] == 1  # 2 shares would take a second wave


# (out, in) -> the K shares of ACT8 on rows quantized per 128 columns by their producer (G8: o_proj, down_proj),
# best of 48 launch configurations at 32 rows on an H200
G8_SHARES = {(4096, 14336): 4, (4096, 7168): 4, (4096, 4096): 4, (4096, 2048): 2}


@pytest.mark.parametrize("n,k", list(G8_SHARES))
def test_g8_decode_config_takes_the_measured_shares(n, k):
    from tp_lora.ops.triton.fp8_gemm import w8a16_config
    cfg = w8a16_config(32, n, k, g8=True)
    assert cfg["SPLIT_K"] == G8_SHARES[(n, k)] and cfg["ACT8"] and cfg["BLOCK_N"] == 64, cfg


def test_fp8_linear_reads_rows_quantized_by_their_producer(device, monkeypatch):
    """x8 (x quantized per token) is what fp8_linear multiplies where takes_rows8 says so: per-channel weights and
    16-bit rows up to ACT8_ROWS (XQ) and, on CUDA, past the weight-only rows (torch._scaled_mm); not block scales,
    float32 rows or the weight-only rows. Rows x8 made from other values than x show which one was read."""
    from tp_lora.ops.fp8 import takes_rows8
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(11)
    for dtype, block_k, rows, reads in [(torch.bfloat16, None, 1, True), (torch.bfloat16, None, ACT8_ROWS, True),
                                        (torch.float16, None, 3, True), (torch.bfloat16, 128, 4, False),
                                        (torch.float32, None, 4, False),
                                        (torch.bfloat16, None, ACT8_ROWS + 1, False),  # weight-only rows
                                        (torch.bfloat16, None, SMALL_ROWS_DEEP + 1, device == "cuda")]:  # W8A8
        w, scale = fp8_weights(gen, 1, 64, 256, block_k)
        w, scale = w[0].to(device), scale[0].to(device)
        x = representable(gen, rows, 256, 128).to(dtype).to(device)
        other = representable(gen, rows, 256).to(dtype).to(device)
        x8 = quantize_per_token(other)
        assert takes_rows8(x, w, block_k) == reads, (dtype, block_k, rows)
        got = fp8_linear(x, w, scale, block_k, None, x8)
        src = other if reads else x
        want = src.float() @ dequantize(w, scale, block_k).t()
        assert rel_err(got, want) < 0.02, (dtype, block_k, rows)


def test_w8a16_mm_refuses_more_rows_than_one_block(device):
    from tp_lora.ops.triton import fp8_gemm
    w = torch.zeros(16, 32, dtype=torch.float8_e4m3fn, device=device)
    with pytest.raises(ValueError, match="up to 64 rows, got 65"):
        fp8_gemm.w8a16_mm(torch.zeros(65, 32, device=device), w, torch.ones(16, device=device), None)


# Llama-3-8B's layers at tp1 / tp2 / tp4, Qwen3-30B-A3B's attention at tp1 / tp2: (out, in) -> the K shares
# measured best (tune_fp8_gemm.py's ACT8 rows)
ACT8_SHARES = {(6144, 4096): 4, (4096, 4096): 4, (28672, 4096): 1, (4096, 14336): 8,
               (3072, 4096): 4, (4096, 2048): 4, (14336, 4096): 2, (4096, 7168): 8,
               (1536, 4096): 8, (4096, 1024): 2, (7168, 4096): 4, (4096, 3584): 4,
               (5120, 2048): 2, (2048, 4096): 8, (2560, 2048): 4, (2048, 2048): 4}


@pytest.mark.parametrize("n,k", list(ACT8_SHARES))
def test_act8_decode_config_keeps_enough_programs(n, k):
    """The ACT8 rule at the measured layer shapes: the best K shares, and its 256-column tiles (gate_up at tp1 /
    tp2) never leave fewer than 48 programs where 128-column tiles give more (tp4's o, 4096 x 1024, once got 16)."""
    from tp_lora.ops.triton.fp8_gemm import w8a16_config
    cfg = w8a16_config(32, n, k, act8=True)
    programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
    assert programs >= min(48, -(-n // 128)), (cfg, programs)
    assert cfg["SPLIT_K"] == ACT8_SHARES[(n, k)], cfg


@pytest.mark.parametrize("rows,n,k,block_k", [(70, 72, 320, 64), (20, 48, 300, 128), (9, 40, 256, 32)])
def test_w8a8_mm_matches_its_reference(device, rows, n, k, block_k):
    from tp_lora.ops.triton import fp8_gemm
    gen = torch.Generator().manual_seed(rows * n + k)
    w, scale = fp8_weights(gen, 1, n, k, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    x = torch.randn(rows, k, generator=gen).to(device)
    xq, xs = quantize_per_group(x, block_k)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)
    got = fp8_gemm.w8a8_mm(xq, xs, w, scale, block_k, torch.bfloat16, cfg)
    want = w8a8_mm_ref(xq, xs, w, scale, block_k, torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2
    # scales in any layout (row-major here) give the same product
    torch.testing.assert_close(fp8_gemm.w8a8_mm(xq, xs.contiguous(), w, scale, block_k, torch.bfloat16, cfg), got,
                               rtol=0, atol=0)


@pytest.mark.parametrize("rows,n,k", [(1, 96, 320), (5, 96, 320), (SMALL_ROWS_DEEP, 96, 320),
                                      (SMALL_ROWS_DEEP + 1, 96, 320),  # past a deep per-channel layer's last
                                      # weight-only rows
                                      (SMALL_ROWS, 160, 128), (SMALL_ROWS + 1, 160, 128),  # out > in
                                      (SMALL_ROWS_WIDE + 1, 512, 128)])  # a wide layer's W8A8 rows
@pytest.mark.parametrize("block_k,block_n", [(None, None), (128, 128), (128, None)])
def test_fp8_linear_with_kernels_matches_the_dequantised_gemm(device, monkeypatch, rows, n, k, block_k, block_n):
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(rows + (block_k or 1))
    w, scale = fp8_weights(gen, 1, n, k, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    # exact under the activations' quantization per (row, 128 columns) on the CPU, whose interpreter rounds some
    # values to fp8 wrongly (per-channel weights past the decode rows take the dequantised GEMM there)
    x = representable(gen, rows, k, 128) if device == "cpu" else torch.randn(rows, k, generator=gen)
    x = x.to(torch.bfloat16).to(device)
    if block_n is not None:  # the layers' layout of [128, 128] blocks: a block's scale row on each of its rows
        scale = scale[::block_n].repeat_interleave(block_n, 0)[:n]
    got = fp8_linear(x, w, scale, block_k, block_n)
    want = x.float() @ dequantize(w, scale, block_k).t()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    # On CUDA the bf16 activations are quantized to e4m3 (in the decode GEMM up to ACT8_ROWS, W8A8 past the
    # weight-only rows): up to 2^-4 relative per element, a few percent of the output's scale over K terms.
    weight_only = ACT8_ROWS < rows <= small_rows(w, block_k)
    assert rel_err(got, want) < (0.08 if device == "cuda" and not weight_only else 0.02)


@pytest.mark.parametrize("block_k", [None, 128])
def test_fp8_linear_keeps_float32_activations_exact(device, monkeypatch, block_k):
    """Float32 layers past the weight-only GEMM's rows are never quantized to fp8 (no W8A8): the dequantized
    weights' product to float32 rounding."""
    monkeypatch.setattr(fused, "KERNELS", True)
    gen = torch.Generator().manual_seed(7)
    w, scale = fp8_weights(gen, 1, 96, 256, block_k)
    w, scale = w[0].to(device), scale[0].to(device)
    x = torch.randn(SMALL_ROWS_WIDE + 40, 256, generator=gen).to(device)
    got = fp8_linear(x, w, scale, block_k)
    want = x.double() @ dequantize(w, scale, block_k).double().t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def representable(gen, rows, k, group=None):
    """Rows whose per-token (group None) or per-group quantization is exact: e4m3 values times a power of two per
    row or group, each row's or group's |max| at 448 times it (the scale is then that power of two). The interpreter
    rounds fp8 wrongly where the rounding carries into the exponent (1.98 -> 1.0), so on the CPU the kernels are
    checked on values that need no rounding; CUDA rounds in hardware and also gets random rows."""
    group = group or k
    groups = -(-k // group)
    q = (torch.randn(rows, groups * group, generator=gen) * 100).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    q = q.view(rows, groups, group)
    q[:, :, 0] = 448.0
    q = q * 2.0 ** torch.randint(-8, 4, (rows, groups, 1), generator=gen).float()
    return q.view(rows, -1)[:, :k].contiguous()


@pytest.mark.parametrize("rows,k", [(1, 64), (7, 1000), (3, 4096 + 24), (2, 16384 + 40)])  # the last: read twice
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


@pytest.mark.parametrize("rows,k,group,rows_to", [(1, 256, 128, 1), (5, 1000, 128, 4), (3, 320, 64, 1),
                                                   (6, 256, 128, 4), (2, 41 * 128 - 104, 128, 1)])  # 2 programs
def test_per_group_quantization_kernel_matches_the_reference(device, rows, k, group, rows_to):
    from tp_lora.ops.triton.fp8_quant import quantize_per_group as kernel
    gen = torch.Generator().manual_seed(rows * k + group)
    inputs = [representable(gen, rows, k, group).to(torch.bfloat16)]
    if device == "cuda":
        inputs.append(torch.randn(rows, k, generator=gen).to(torch.bfloat16))
    padded = -(-rows // rows_to) * rows_to
    for x in inputs:
        x[0, :group] = 0  # an all-zero group: scale 1e-12, zeros out
        x = x.to(device)
        q, s = kernel(x, group, rows_to)
        want_q, want_s = quantize_per_group(x, group, rows_to)
        assert q.dtype == torch.float8_e4m3fn and q.shape == (padded, k) and s.shape == (padded, -(-k // group))
        if padded > 1:  # token-major, as cuBLAS's block-scaled GEMM takes them
            assert s.stride(0) == 1 and want_s.stride(0) == 1
        torch.testing.assert_close(s, want_s, rtol=0, atol=0)
        assert torch.equal(q.float(), want_q.float())
        assert not q[rows:].float().any() and (s[rows:] == 1).all()  # padding rows: zeros, scale 1


def test_per_channel_quantization_is_the_same_on_every_device(device):
    """quantize_fp8_per_channel (quantization=fp8 at load, fp8 adapters) on the device gives the CPU's bytes: scales
    amax / 448 rounded once (a reciprocal's product is 1 ulp off in half the rows), all-zero rows scale 1."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    w = torch.randn(3, 512, 96, generator=gen) * torch.rand(3, 512, 1, generator=gen) * 4
    w[1, 7] = 0
    q, s = quantize_fp8_per_channel(w.to(device))
    amax = w.abs().amax(dim=-1).double()
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax)).float()
    assert torch.equal(s.cpu(), want), f"{(s.cpu() != want).sum().item()} of {want.numel()} scales differ"
    q_cpu, _ = quantize_fp8_per_channel(w)
    assert torch.equal(q.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
