"""The fp8 decode GEMM's output left as its K shares' partial sums (SplitSums) and summed by the norm that reads it:
on fresh random inputs, for each form of the GEMM (rows quantized by their producer, ACT8, weight-only with
channel or block scales), the norm's outputs (normed rows, residual stream, rows quantized per token) are the bits
it computes from the GEMM's own output; SplitSums.total, the reference of that sum, against the GEMM's output and
against the norm on shares whose order shows; one K share, or float32 outputs, give the output itself; without a
residual the shares are summed before the norm."""
from dataclasses import replace

import pytest
import torch

from tp_lora.ops.fp8 import empty_rows8, quantize_fp8_per_channel, quantize_per_token
from tp_lora.ops.split_sums import SplitSums

FORMS = {  # form -> (cfg, block_k)
    "xq": (dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=4, num_stages=2), None),
    "act8": (dict(BLOCK_N=32, BLOCK_K=32, SPLIT_K=3, ACT8=True, num_stages=2), None),
    "weight-only": (dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, SWAP=True, num_stages=2), None),
    "block": (dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=3, num_stages=2), 64),
}


def _gemm_inputs(gen, form, rows, n, k, dtype, device):
    """(args, kwargs) of w8a16_mm for a form: weights with channel (or block_k) scales, x (fp8 rows + scales for
    xq) whose magnitudes spread over 2^6 so that the shares' sum depends on its order."""
    cfg, block_k = FORMS[form]
    w, scale = quantize_fp8_per_channel(torch.randn(n, k, generator=gen) * k ** -0.5)
    if block_k is not None:
        scale = torch.rand(n, -(-k // block_k), generator=gen) * 0.02 + 0.001
    x = torch.randn(rows, k, generator=gen) * 2.0 ** torch.randint(-3, 4, (1, k), generator=gen)
    x = x.to(dtype).to(device)
    w, scale = w.to(device), scale.to(device)
    if form == "xq":
        q, xs = quantize_per_token(x)
        return (q, w, scale, None, cfg), dict(x_scale=xs, out_dtype=dtype)
    return (x, w, scale, block_k, cfg), {}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k,norm_x", [(5, 72, 200, False), (32, 48, 384, True)])
def test_norm_sums_the_gemms_k_shares_as_the_gemm_would(device, form, dtype, rows, n, k, norm_x):
    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton.fused import add_rms_norm
    gen = torch.Generator().manual_seed(rows * n + k + len(form))
    args, kwargs = _gemm_inputs(gen, form, rows, n, k, dtype, device)
    out = fp8_gemm.w8a16_mm(*args, **kwargs)
    sums = fp8_gemm.w8a16_mm(*args, **kwargs, sums=True)
    split = args[4]["SPLIT_K"]
    assert isinstance(sums, SplitSums) and sums.parts.shape == (split, rows, n) and sums.dtype == dtype
    assert (sums.col is not None) == (FORMS[form][1] is None) and (sums.row is not None) == (form == "xq")
    # the reference sum: the GEMM's own bits on a GPU (the interpreter truncates its 16-bit casts: a step apart)
    tol = {"rtol": 0, "atol": 0} if device == "cuda" else {"rtol": 2 ** -7, "atol": 1e-6}
    torch.testing.assert_close(sums.total(), out, **tol)
    res = (torch.randn(rows, n, generator=gen) * 3).to(dtype).to(device)
    w, xw = ((torch.randn(n, generator=gen) * 0.3 + 1).to(dtype).to(device) for _ in range(2))
    xw = xw if norm_x else None
    want8, got8 = empty_rows8(res), empty_rows8(res)
    want = add_rms_norm(out, res, w, 1e-6, False, xw, want8)
    got = add_rms_norm(sums, res, w, 1e-6, False, xw, got8)
    for g, wnt in zip(got + got8, want + want8):
        assert torch.equal(g.float(), wnt.float())
    assert not torch.equal(got[1], res), "the stream did not take the GEMM's output"


@pytest.mark.parametrize("parts,col,row", [(3, True, True), (4, True, False), (3, False, False)])
def test_norm_adds_the_shares_in_their_order(device, parts, col, row):
    """Shares that cancel (A, -A + B, C, ...: A ~ 2^12, the rest ~ 1) give other float16 bits in any other order
    than the reference's; the norm's outputs equal those of SplitSums.total's rows."""
    from tp_lora.ops.triton.fused import add_rms_norm
    gen = torch.Generator().manual_seed(parts * 4 + col * 2 + row)
    rows, n = 32, 48
    big = torch.randn(rows, n, generator=gen) * 4096
    rest = torch.randn(parts - 1, rows, n, generator=gen)
    p = torch.cat([big[None], rest]).clone()
    p[1] -= big
    sums = SplitSums(p.to(device), (torch.rand(n, generator=gen) + 0.5).to(device) if col else None,
                     (torch.rand(rows, generator=gen) + 0.5).to(device) if row else None, torch.float16)
    res = torch.randn(rows, n, generator=gen).half().to(device)
    w = (torch.randn(n, generator=gen) * 0.3 + 1).half().to(device)
    got = add_rms_norm(sums, res, w, 1e-6)
    want = add_rms_norm(sums.total(), res, w, 1e-6)
    assert all(torch.equal(g, wnt) for g, wnt in zip(got, want))
    backwards = SplitSums(sums.parts.flip(0).contiguous(), sums.col, sums.row, sums.dtype)
    assert not torch.equal(backwards.total(), sums.total()), "the shares' order does not show"


def test_one_k_share_gives_the_output_and_no_residual_sums_first(device):
    from tp_lora.ops import fused
    from tp_lora.ops.triton import fp8_gemm
    gen = torch.Generator().manual_seed(5)
    args, kwargs = _gemm_inputs(gen, "xq", 3, 40, 96, torch.bfloat16, device)
    one = dict(args[4], SPLIT_K=1)
    out = fp8_gemm.w8a16_mm(*args[:4], one, **kwargs, sums=True)
    assert isinstance(out, torch.Tensor) and torch.equal(out, fp8_gemm.w8a16_mm(*args[:4], one, **kwargs))
    x32 = torch.randn(3, 96, generator=gen).to(device)
    w8, scale = args[1], args[2]
    out = fp8_gemm.w8a16_mm(x32, w8, scale, None, dict(args[4], ACT8=False), sums=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    sums = fp8_gemm.w8a16_mm(*args, **kwargs, sums=True)
    w = torch.ones(40, dtype=torch.bfloat16, device=device)
    got, stream = fused.add_rms_norm(sums, None, w, 1e-6)
    want, want_stream = fused.add_rms_norm(sums.total(), None, w, 1e-6)
    assert torch.equal(got, want) and torch.equal(stream, want_stream)
    from tp_lora.ops.triton.fused import add_rms_norm
    with pytest.raises(ValueError, match="SplitSums need a residual"):
        add_rms_norm(sums, None, w, 1e-6)


@pytest.mark.parametrize("form,fp8,norm,r,delta", [
    ("xq", False, False, 16, False), ("weight-only", True, True, 8, False), ("block", False, True, 16, False),
    ("weight-only", False, True, 16, True)])
def test_decode_kernel_sums_the_qkv_gemms_shares(device, form, fp8, norm, r, delta):
    """The decode kernel with RoPE reading q, k and v as views of the qkv GEMM's SplitSums: its output and every
    cache entry (the new K / V at their slots, per-head norms, partial rotary, an fp8 cache with scales) are the
    bits of the same launch on the GEMM's own output; with a delta (a LoRA's), on that output plus the delta."""
    from _paged import poisoned_cache

    from tp_lora.ops.triton import fp8_gemm
    from tp_lora.ops.triton import paged_attention as pa
    gen = torch.Generator().manual_seed(len(form) + r)
    heads, kv, d, bs, lens = 4, 2, 16, 16, [1, 19, 40]
    b = len(lens)
    args, kwargs = _gemm_inputs(gen, form, b, (heads + 2 * kv) * d, 128, torch.bfloat16, device)
    qkv = fp8_gemm.w8a16_mm(*args, **kwargs)
    sums = fp8_gemm.w8a16_mm(*args, **kwargs, sums=True)
    assert isinstance(sums, SplitSums)
    if delta:
        d_rows = torch.randn(qkv.shape, generator=gen).to(device) * qkv.float().abs().mean()
        sums = replace(sums, delta=d_rows)
        qkv = (qkv.float() + d_rows).to(qkv.dtype)  # as the LoRA expand adds into the GEMM's output
    kc, vc, table = poisoned_cache(gen, lens, b, kv, d, bs, torch.bfloat16)
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    kc, vc, table = kc.to(device), vc.to(device), table.to(device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    ang = (ctx.float().cpu() - 1)[:, None] * (1.0 / 500.0 ** (torch.arange(0, r, 2).float() / r))[None]
    cos, sin = (f(torch.cat([ang, ang], -1))[:, None].to(torch.bfloat16).to(device) for f in (torch.cos, torch.sin))
    last = (ctx - 1).long()
    slots = table.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    qw, kw = ((torch.randn(d, generator=gen) + 1).to(torch.bfloat16).to(device) for _ in range(2)) if norm else (
        None, None)
    rope = (slots, qw, kw, 1e-6, False, (2.0, 0.5) if fp8 else (1.0, 1.0))
    outs = []
    for rows, s in ((qkv, None), (sums.parts[0], sums)):
        q, k, v = (x.view(b, -1, d) for x in rows.split([heads * d, kv * d, kv * d], -1))
        caches = kc.clone(), vc.clone()
        out = pa.paged_decode(q, *caches, table, ctx, 0.25, rope=(k, v, cos, sin) + rope, sums=s)
        outs.append((out, *caches))
    assert outs[1][0].dtype == torch.bfloat16
    # with a delta on the CPU, the interpreter's casts truncate where torch's reference rounds: a step apart
    tol = {"rtol": 0, "atol": 0} if device == "cuda" or not delta else {"rtol": 0.05, "atol": 0.05}
    for got, want in zip(*outs):
        torch.testing.assert_close(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0), **tol)


def test_a_delta_the_readers_cannot_place_is_refused(device):
    """A SplitSums' delta is float32 at its parts' row strides (the readers find it at the parts' offsets)."""
    parts = torch.zeros(2, 4, 8, device=device)
    SplitSums(parts, None, None, torch.bfloat16, torch.zeros(4, 8, device=device))
    for bad in (torch.zeros(4, 8, device=device, dtype=torch.bfloat16), torch.zeros(8, 4, device=device).t(),
                torch.zeros(4, 9, device=device)[:, :8], torch.zeros(3, 8, device=device)):
        with pytest.raises(ValueError, match="SplitSums' delta needs float32 \\(4, 8\\) at strides \\(8, 1\\)"):
            SplitSums(parts, None, None, torch.bfloat16, bad)
