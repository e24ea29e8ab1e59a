"""The decoder layer's fused Triton kernels (add + RMSNorm, qk-norm + RoPE + K/V cache write, act * up, the MoE
router's top-k and combine, the sampler's race) against
their torch references, on fresh random inputs at odd sizes; the references against independent formulas."""
import math

import pytest
import torch

from tp_lora.ops import fused as ref
from tp_lora.ops import sampling

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(device, dtype):
    """float32: summation order only; 16-bit: one rounding step of the dtype apart (an rsqrt a hair off). The Triton
    interpreter rounds bfloat16 by truncation (torch and compiled Triton: to nearest even): a step or two more."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    loose = dtype == torch.bfloat16 and device != "cuda"
    return {"rtol": 4e-2, "atol": 4e-2} if loose else {"rtol": 1e-2, "atol": 1e-2}


def _exact(device, dtype):
    """Tolerance zero for results of one rounding of the same float32 value (but the interpreter's bfloat16)."""
    return {"rtol": 0, "atol": 0} if device == "cuda" or dtype != torch.bfloat16 else _tol(device, dtype)


def _randn(gen, *shape, dtype=torch.float32, device="cpu", std=1.0, mean=0.0):
    return (torch.randn(*shape, generator=gen) * std + mean).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden, residual, offset, norm_x", [
    (1, 80, False, False, False),  # one token, the first layer's plain norm, hidden not a power of two
    (37, 80, True, False, False),  # add + norm (Llama)
    (37, 64, True, True, False),  # Gemma's (1 + w)
    (37, 80, True, True, True),  # Gemma's post-attention norm, add, pre-feedforward norm
    (5, 1000, True, False, False),  # a wide row
])
def test_add_rms_norm(device, dtype, tokens, hidden, residual, offset, norm_x):
    from tp_lora.ops.triton.fused import add_rms_norm
    gen = torch.Generator().manual_seed(tokens * 7 + hidden + residual + offset + norm_x * 3)
    wide = _randn(gen, tokens, hidden + 3, dtype=dtype, device=device)
    x = wide[:, :hidden]  # rows with a stride != hidden
    res = _randn(gen, tokens, hidden, dtype=dtype, device=device, std=3.0) if residual else None
    w, xw = (_randn(gen, hidden, dtype=dtype, device=device, std=0.3, mean=0.2 if offset else 1.0) for _ in range(2))
    xw = xw if norm_x else None
    got, got_sum = add_rms_norm(x, res, w, 1e-6, offset, xw)
    want, want_sum = ref.add_rms_norm_ref(x, res, w, 1e-6, offset, xw)
    if norm_x:
        assert not torch.allclose(want_sum, ref.add_rms_norm_ref(x, res, w, 1e-6, offset)[1]), "x was not normed"
    # one rounding of the same float32 sum (but a normed x: an rsqrt apart)
    torch.testing.assert_close(got_sum, want_sum, **(_tol(device, dtype) if norm_x else _exact(device, dtype)))
    torch.testing.assert_close(got, want, **_tol(device, dtype))
    assert got.dtype == dtype and got.shape == (tokens, hidden)


def _per_token(device, out):
    """out quantized per token by the standalone kernel (itself checked against quantize_per_token in
    tests/kernels/test_fp8_kernels.py): what a norm's or act_mul's out8 must hold."""
    from tp_lora.ops.triton.fp8_quant import quantize_per_token
    return quantize_per_token(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, hidden, residual, norm_x", [(1, 80, False, False), (37, 1000, True, False),
                                                              (5, 64, True, True)])
def test_add_rms_norm_writes_its_rows_quantized_per_token(device, dtype, tokens, hidden, residual, norm_x):
    """out8: the normed rows quantized per token in the same pass, equal to quantizing the output afterwards; the
    output and the stream unchanged by it; a row of zeros (scale 1e-12) stays zeros."""
    from tp_lora.ops.fp8 import empty_rows8
    from tp_lora.ops.triton.fused import add_rms_norm
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = _randn(gen, tokens, hidden, dtype=dtype, device=device, std=4.0)
    res = _randn(gen, tokens, hidden, dtype=dtype, device=device) if residual else None
    w, xw = (_randn(gen, hidden, dtype=dtype, device=device, std=0.3, mean=1.0) for _ in range(2))
    if not residual:
        x[0] = 0
    out8 = empty_rows8(x)
    got = add_rms_norm(x, res, w, 1e-6, False, xw if norm_x else None, out8)
    plain = add_rms_norm(x, res, w, 1e-6, False, xw if norm_x else None)
    assert all(torch.equal(g, p) for g, p in zip(got, plain))
    want_q, want_s = _per_token(device, got[0])
    assert torch.equal(out8[1], want_s) and torch.equal(out8[0].float(), want_q.float())
    if not residual:
        assert out8[1][0].item() == pytest.approx(1e-12) and not out8[0][0].float().any()
    with pytest.raises(ValueError, match=r"out8 needs q \[%d, %d\]" % (tokens, hidden)):
        add_rms_norm(x, res, w, 1e-6, False, None, (out8[0][:, 1:], out8[1]))


def test_rms_norm_reference_matches_formula():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 12, generator=gen, dtype=torch.float64), torch.randn(12, generator=gen, dtype=torch.float64)
    rms = (x.pow(2).sum(-1, keepdim=True) / 12 + 1e-5).sqrt()
    torch.testing.assert_close(ref.rms_norm_ref(x, w, 1e-5), x / rms * w)
    torch.testing.assert_close(ref.rms_norm_ref(x, w, 1e-5, offset=True), x / rms * (1 + w))


def _rope_case(gen, tokens, heads, kv, d, r, dtype, device, blocks=6, bs=8):
    """q / k / v as views of one packed qkv output (row stride (heads + 2 kv) d), cos / sin of random positions,
    NaN-poisoned caches and distinct random slots (the untouched ones must stay NaN)."""
    qkv = _randn(gen, tokens, (heads + 2 * kv) * d, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * d, kv * d, kv * d], -1)
    q, k, v = q.view(tokens, heads, d), k.view(tokens, kv, d), v.view(tokens, kv, d)
    pos = torch.randint(0, 4096, (tokens, 1), generator=gen).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r))
    emb = torch.cat([pos * inv, pos * inv], -1)
    cos, sin = (f(emb).to(dtype)[:, None].to(device) for f in (torch.cos, torch.sin))
    caches = [torch.full((blocks, bs, kv, d), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens].to(device)
    return q, k, v, cos, sin, caches, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, kv, d, partial, norm, offset", [
    (1, 4, 2, 16, False, False, False),  # one token (a decode)
    (37, 6, 3, 24, False, False, False),  # head count and head_dim not powers of two
    (37, 4, 1, 32, True, False, False),  # partial rotary (Phi-3), one KV head
    (9, 4, 2, 16, False, True, False),  # q/k per-head RMSNorm (Qwen3)
    (9, 8, 2, 32, True, True, True),  # Gemma 3's (1 + w) q/k norm, and partial rotary on top
])
def test_rope_write_kv(device, dtype, tokens, heads, kv, d, partial, norm, offset):
    from tp_lora.ops.triton.fused import rope_write_kv
    gen = torch.Generator().manual_seed(tokens + heads * 3 + d + partial + norm * 5 + offset)
    r = d // 2 if partial else d
    q, k, v, cos, sin, (kc, vc), slots = _rope_case(gen, tokens, heads, kv, d, r, dtype, device)
    weights = [_randn(gen, d, dtype=dtype, device=device, std=0.3, mean=0.5) for _ in range(2)] if norm else [None] * 2
    want_kc, want_vc = kc.clone(), vc.clone()
    got = rope_write_kv(q, k, v, cos, sin, kc, vc, slots, *weights, 1e-6, offset)
    want = ref.rope_write_kv_ref(q, k, v, cos, sin, want_kc, want_vc, slots, *weights, 1e-6, offset)
    torch.testing.assert_close(got, want, **_tol(device, dtype))
    torch.testing.assert_close(kc, want_kc, equal_nan=True, **_tol(device, dtype))
    torch.testing.assert_close(vc, want_vc, equal_nan=True, rtol=0, atol=0)
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=device)
    untouched[slots] = False
    assert kc.flatten(0, 1)[untouched].isnan().all() and vc.flatten(0, 1)[untouched].isnan().all()
    assert not kc.flatten(0, 1)[slots].isnan().any()
    if partial:  # the dims past the rotary ones pass through (normed where the family norms)
        torch.testing.assert_close(got[..., r:], want[..., r:], **_tol(device, dtype))
        if not norm:
            torch.testing.assert_close(got[..., r:], q[..., r:], rtol=0, atol=0)


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 4.0)])
def test_rope_write_kv_into_an_fp8_cache_with_scales(device, scales):
    """An fp8 cache takes k / k_scale and v / v_scale, as the reference writes them. No rotation (rotary dim 0) and
    K / V that are e4m3 values times their scale: the interpreter rounds fp8 wrongly where rounding carries into the
    exponent, so on the CPU the values need none; CUDA also gets rotated random ones."""
    from tp_lora.ops.triton.fused import rope_write_kv
    gen = torch.Generator().manual_seed(int(scales[0] * 8))
    tokens, heads, kv, d = 7, 4, 2, 16
    cases = []
    for rotary in ([0, d] if device == "cuda" else [0]):
        q = torch.randn(tokens, heads, d, generator=gen)
        kv_vals = [(torch.randn(tokens, kv, d, generator=gen) * 40).to(FP8).float() * s for s in scales]
        if rotary:
            kv_vals = [torch.randn(tokens, kv, d, generator=gen) * 40 * s for s in scales]
        pos = torch.arange(tokens).float()[:, None] * 0.37
        emb = torch.cat([pos] * max(rotary, 1), -1)[:, :rotary]
        cos, sin = torch.cos(emb)[:, None], torch.sin(emb)[:, None]
        cases.append([x.to(device) for x in (q, *kv_vals, cos, sin)])
    for q, k, v, cos, sin in cases:
        slots = torch.randperm(4 * 4, generator=gen)[:tokens].to(device)
        kc, vc = (torch.zeros(4, 4, kv, d, dtype=FP8, device=device) for _ in range(2))
        want_kc, want_vc = kc.clone(), vc.clone()
        got = rope_write_kv(q, k, v, cos, sin, kc, vc, slots, None, None, 0.0, False, scales)
        want = ref.rope_write_kv_ref(q, k, v, cos, sin, want_kc, want_vc, slots, None, None, 0.0, False, scales)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(kc.float(), want_kc.float()) and torch.equal(vc.float(), want_vc.float())
        assert kc.float().abs().max() > 0


def test_rope_reference_is_a_rotation_of_pairs():
    """rotate-half RoPE: dims (i, i + r/2) rotate by angle pos * inv_freq[i], as a complex product."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, cos, sin, (kc, vc), slots = _rope_case(gen, 3, 2, 1, 12, 8, torch.float64, "cpu")
    got = ref.rope_write_kv_ref(q, k, v, cos, sin, kc, vc, slots)
    z = torch.complex(q[..., :4], q[..., 4:8]) * torch.complex(cos[..., :4], sin[..., :4])
    torch.testing.assert_close(got[..., :4], z.real)
    torch.testing.assert_close(got[..., 4:8], z.imag)
    torch.testing.assert_close(got[..., 8:], q[..., 8:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n, act", [(1, 80, "silu"), (37, 80, "gelu_pytorch_tanh"), (3, 1100, "silu"),
                                            (3, 1100, "gelu_pytorch_tanh")])  # 1100: two column programs
def test_act_mul(device, dtype, tokens, n, act):
    from tp_lora.ops.triton.fused import act_mul
    gen = torch.Generator().manual_seed(tokens + n + len(act))
    x = _randn(gen, tokens, 2 * n, dtype=dtype, device=device, std=3.0)
    got = act_mul(x, act)
    torch.testing.assert_close(got, ref.act_mul_ref(x, act), **_tol(device, dtype))
    assert got.shape == (tokens, n)


@pytest.mark.parametrize("tokens, n, act", [(1, 80, "silu"), (5, 1100, "gelu_pytorch_tanh"), (3, 4100, "silu")])
def test_act_mul_writes_its_rows_quantized_per_token(device, tokens, n, act):
    """out8: act(gate) * up quantized per token over the whole row (one program a row), equal to quantizing the
    output afterwards; the output unchanged by it."""
    from tp_lora.ops.fp8 import empty_rows8
    from tp_lora.ops.triton.fused import act_mul
    gen = torch.Generator().manual_seed(tokens + n)
    x = _randn(gen, tokens, 2 * n, dtype=torch.bfloat16, device=device, std=3.0)
    out8 = empty_rows8(x, n)
    got = act_mul(x, act, out8)
    assert torch.equal(got, act_mul(x, act))
    want_q, want_s = _per_token(device, got)
    assert torch.equal(out8[1], want_s) and torch.equal(out8[0].float(), want_q.float())


def _poisoned8(rows, n, groups, device):
    """out8 buffers full of NaN (e4m3's 0x7f): a value the kernel does not write stays NaN."""
    q = torch.full((rows, n), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return q, torch.full((rows, groups), float("nan"), device=device)


@pytest.mark.parametrize("tokens, n, group", [(3, 384, 128), (5, 2176, 128), (2, 1024, 64)])
def test_norm_and_act_mul_write_their_rows_quantized_per_group(device, tokens, n, group):
    """out8 with scales [T, n / G]: the rows quantized per G columns (what block-scaled layers' ACT8 GEMM takes)
    in the same pass, equal to the per-group quantization kernel's (every value written: poisoned buffers); the
    outputs unchanged by it; act_mul's groups over its column tiles (2176: a last tile of one group). Refused:
    groups of a width that is not a power of two or does not divide the row."""
    from tp_lora.ops.triton.fp8_quant import quantize_per_group
    from tp_lora.ops.triton.fused import act_mul, add_rms_norm
    gen = torch.Generator().manual_seed(tokens + n + group)
    x = _randn(gen, tokens, 2 * n, dtype=torch.bfloat16, device=device, std=3.0)
    res = _randn(gen, tokens, n, dtype=torch.bfloat16, device=device)
    w = _randn(gen, n, dtype=torch.bfloat16, device=device, std=0.3, mean=1.0)
    for name, run in (("norm", lambda o8: add_rms_norm(x[:, :n], res, w, 1e-6, False, None, o8)[0]),
                      ("act_mul", lambda o8: act_mul(x, "silu", o8))):
        out8 = _poisoned8(tokens, n, n // group, device)
        got = run(out8)
        assert torch.equal(got, run(None)), name
        want_q, want_s = quantize_per_group(got, group)
        assert torch.equal(out8[1], want_s.contiguous()), name
        assert torch.equal(out8[0].float(), want_q.float()), name
    with pytest.raises(ValueError, match="a power of two"):  # groups of 192 / 1088 columns, or not dividing n
        act_mul(x, "silu", (out8[0], torch.zeros(tokens, 3 if n == 1024 else 2, device=device)))


def test_act_mul_reference_matches_formulas():
    gen = torch.Generator().manual_seed(5)
    g, u = torch.randn(2, 4, 10, generator=gen, dtype=torch.float64)
    x = torch.cat([g, u], -1)
    torch.testing.assert_close(ref.act_mul_ref(x, "silu"), g / (1 + torch.exp(-g)) * u)
    gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    torch.testing.assert_close(ref.act_mul_ref(x, "gelu_pytorch_tanh"), gelu * u)


def test_unknown_activation_is_refused_by_name():
    from tp_lora.ops.triton.fused import act_mul
    with pytest.raises(ValueError, match="'relu'"):
        act_mul(torch.zeros(2, 4), "relu")


def _combine_case(gen, n, k, rows, h, dtype, device, missing):
    """Expert rows yp [rows + 3, h] whose last 3 rows are poison (no pos may reach them), pos [n, k] a random
    injective map into the first rows with `missing` of the (t, j) entries -1, weights [n, k]."""
    yp = _randn(gen, rows + 3, h, dtype=dtype, device=device)
    yp[rows:] = float("nan")
    flat = torch.randperm(rows, generator=gen)[:n * k].to(torch.int32)
    flat[torch.randperm(n * k, generator=gen)[:missing]] = -1
    return yp, flat.view(n, k).to(device), torch.rand(n, k, generator=gen).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k, h, missing", [
    (1, 1, 80, 0),  # one token, top-1
    (9, 8, 1100, 20),  # top-8, two column programs, pairs other ranks compute
    (5, 2, 64, 10),  # every pair elsewhere: zeros
])
def test_moe_combine(device, dtype, n, k, h, missing):
    from tp_lora.ops.triton.fused import moe_combine
    gen = torch.Generator().manual_seed(n * k + h)
    yp, pos, w = _combine_case(gen, n, k, n * k + 7, h, dtype, device, missing)
    got = moe_combine(yp, pos, w)
    assert got.shape == (n, h) and got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got, ref.moe_combine_ref(yp, pos, w), **_tol(device, dtype))


def test_moe_combine_reference_matches_index_add():
    gen = torch.Generator().manual_seed(11)
    n, k, h = 6, 3, 16
    yp, pos, w = _combine_case(gen, n, k, 30, h, torch.float64, "cpu", 4)
    want = torch.zeros(n, h, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            if pos[t, j] >= 0:
                want[t].add_(w[t, j].double() * yp[pos[t, j]])
    torch.testing.assert_close(ref.moe_combine_ref(yp, pos, w), want)
    assert ref.moe_combine_ref(yp[:0], pos, w).eq(0).all()  # no pairs computed here


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, experts, k, renormalize, round_weights", [
    (1, 8, 2, True, False),  # Mixtral: renormalised, float32 weights
    (33, 60, 4, False, True),  # Qwen2-MoE: 60 experts (not a power of two), top-4, weights rounded
    (17, 128, 8, True, True),  # Qwen3-MoE
    (5, 64, 6, False, False),  # top-6
])
def test_moe_topk(device, dtype, tokens, experts, k, renormalize, round_weights):
    from tp_lora.ops.triton.fused import moe_topk
    gen = torch.Generator().manual_seed(tokens * experts + k)
    logits = _randn(gen, tokens, experts, dtype=dtype, device=device, std=2.0)
    ids, w = moe_topk(logits, k, renormalize, round_weights)
    want_ids, want_w = ref.moe_topk_ref(logits, k, renormalize, round_weights)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (tokens, k)
    # 16-bit logits tie often, and torch.topk orders equal values as it likes: the experts' logits must agree.
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids)) and (ids.sort(1)[0].diff(1) > 0).all()
    torch.testing.assert_close(w, want_w, **_tol(device, dtype))


@pytest.mark.parametrize("shares, experts, k", [(2, 128, 8), (3, 60, 4)])
def test_moe_topk_sums_the_router_gemms_shares(device, shares, experts, k):
    """The router GEMM's K shares (SplitSums) summed in order and rounded to the logits' dtype by the top-k kernel:
    the top k of their total's softmax, as moe_topk_ref takes it; the weights rounded through that dtype. (float16
    under the interpreter, which rounds bfloat16 by truncation.)"""
    from tp_lora.ops.split_sums import SplitSums
    from tp_lora.ops.triton.fused import moe_topk
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(shares * experts)
    parts = _randn(gen, shares, 19, experts, dtype=torch.float32, device=device, std=1.5)
    sums = SplitSums(parts, None, None, dtype)
    ids, w = moe_topk(sums, k, False, True)
    logits = sums.total()
    want_ids, want_w = ref.moe_topk_ref(logits, k, False, True)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids)) and (ids.sort(1)[0].diff(1) > 0).all()
    assert torch.equal(w, want_w) and torch.equal(w, w.to(dtype).float())
    with pytest.raises(ValueError, match="no scales"):
        moe_topk(SplitSums(parts, parts[0, 0], None, dtype), k, False, True)


@pytest.mark.parametrize("hidden", [64, 1500])  # one block, several with a partial last one
def test_embedding_shard(device, hidden):
    """Rows of a vocabulary shard (ids 40..69 of 100) for ids inside, at its edges and outside it (zeros), bit-equal
    to the reference, in the ids' shape."""
    from tp_lora.ops.triton.fused import embedding_shard
    gen = torch.Generator().manual_seed(hidden)
    weight = _randn(gen, 30, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([[0, 39, 40, 41], [69, 70, 99, 55]], device=device)
    got = embedding_shard(weight, ids, 40)
    assert got.shape == (2, 4, hidden) and got.dtype == torch.bfloat16
    assert torch.equal(got, ref.embedding_shard_ref(weight, ids, 40))
    assert torch.equal(got[0, 2], weight[0]) and torch.equal(got[1, 0], weight[29]) and not got[0, :2].any()


@pytest.mark.parametrize("valid", [11, 17, 0])  # some / none / all padding
def test_moe_topk_padding_rows_route_nowhere(device, valid):
    """A CUDA graph's rows from valid[0] on get ids -1; the other rows and every weight are as without."""
    from tp_lora.ops.triton.fused import moe_topk
    gen = torch.Generator().manual_seed(valid)
    logits = _randn(gen, 17, 8, dtype=torch.float32, device=device, std=2.0)
    v = torch.tensor([valid], dtype=torch.int32, device=device)
    ids, w = moe_topk(logits, 2, True, False, v)
    plain_ids, plain_w = moe_topk(logits, 2, True, False)
    want_ids, _ = ref.moe_topk_ref(logits, 2, True, False, v)
    pad = torch.arange(17, device=device) >= valid
    assert torch.equal(ids, want_ids) and (ids[pad] == -1).all() and torch.equal(ids[~pad], plain_ids[~pad])
    assert torch.equal(w, plain_w)


def test_moe_topk_takes_the_lowest_index_among_ties(device):
    from tp_lora.ops.triton.fused import moe_topk
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]], device=device)
    ids, w = moe_topk(logits, 3, True, False)
    assert ids.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(w, torch.full((1, 3), 1 / 3, device=device))


def _race_inputs(gen, rows, vocab, device, dtype=torch.float32):
    """Logits with a clear winner in a later block than the first, raw logits, temperatures (greedy and hot rows),
    noise keys, three grammar bitmask rows (the last allows nothing: its row takes the stop tokens), rows taking them
    (-1: none), and the allow rows (printable tokens: most; stop tokens: two)."""
    logits = _randn(gen, rows, vocab, device=device, std=4.0)
    logits[0, vocab // 2] = 50.0
    raw = _randn(gen, rows, vocab, device=device, std=2.0)
    temps = torch.tensor([(0.0, 0.7, 1.0, 1.9)[i % 4] for i in range(rows)], device=device)
    keys = torch.randint(0, 1 << 32, (rows,), generator=gen).to(device)
    width = (vocab + 31) // 32
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, width), dtype=torch.int32, generator=gen)
    words[2] = 0
    where = torch.tensor([(-1, 0, 1, 2)[i % 4] for i in range(rows)], dtype=torch.int32, device=device)
    printable = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, width), dtype=torch.int32, generator=gen)
    printable = printable[0] | printable[1] | printable[2]  # 7 of 8 bits set
    stops = torch.zeros(width, dtype=torch.int32)
    for t in (1, vocab - 1):
        stops[t // 32] |= 1 << (t % 32) if t % 32 != 31 else -2 ** 31
    allow = torch.stack([printable, stops]).to(device)
    return logits.to(dtype), raw.to(dtype), temps, keys, words.to(device), where, allow


@pytest.mark.parametrize("rows, vocab", [
    (1, 7),  # a vocabulary smaller than one block
    (5, 4096),  # whole blocks only
    (7, 10007),  # several blocks, the last one partial
    (64, 33),  # many hot rows: the kernel's noise is the reference's (whose draws follow softmax(x / T): test_sampler)
])
@pytest.mark.parametrize("grammar", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_race(device, rows, vocab, grammar, dtype):
    from tp_lora.ops.triton.sampling import race
    gen = torch.Generator().manual_seed(rows * vocab + grammar)
    logits, raw, temps, keys, words, where, allow = _race_inputs(gen, rows, vocab, device, dtype)
    cases = [(logits, None, temps, keys, None, None, None)]
    if grammar:
        cases += [(logits, raw, temps, keys, None, None, None), (logits, raw, temps, keys, words, where, allow)]
    for args in cases:
        got, want = race(*args), sampling.race_ref(*args)
        assert got.dtype == torch.float64 and got.shape == (2, rows)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    # the reference against independent formulas: greedy rows take the argmax, grammar rows a token their bits and
    # the printable set allow (a row allowing none: a stop token), every row's log-probability is log_softmax of
    # raw at its token
    toks = want[0].long()
    if not grammar:
        assert toks[0] == vocab // 2
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = lambda w: ((w[:, None] >> shifts) & 1).bool().flatten()[:vocab]  # noqa: E731
    for i in range(rows):
        allowed = torch.ones(vocab, dtype=torch.bool, device=device)
        if args[4] is not None and where[i] >= 0:
            allowed = bits(words[where[i]]) & bits(allow[0])
            if not allowed.any():
                allowed = bits(allow[1])
                assert where[i] == 2 and int(toks[i]) in (1, vocab - 1)
        assert allowed[toks[i]]
        if temps[i] == 0:
            assert toks[i] == int(torch.where(allowed, logits[i].float(), -float("inf")).argmax())
        base = (logits if args[1] is None else raw)[i].double()
        assert abs(float(want[1, i]) - float(torch.log_softmax(base, -1)[toks[i]])) < 1e-4


def test_race_grammar_rows_allowing_tokens_of_one_chunk_only(device):
    """A grammar row whose allowed tokens all lie in one part of the vocabulary (the kernel splits rows over chunks)
    takes one of them, not a stop token; a row allowing none takes the best stop token, which lies in another."""
    from tp_lora.ops.triton.sampling import race
    rows, vocab = 3, 9000
    gen = torch.Generator().manual_seed(9)
    logits = _randn(gen, rows, vocab, device=device, std=4.0)
    logits[:, 8990] = -30.0  # allowed, yet far below the stop tokens' logits
    logits[:, [1, 4500]] = 20.0
    width = (vocab + 31) // 32
    words = torch.zeros(2, width, dtype=torch.int32)
    words[0, 8990 // 32] = 1 << (8990 % 32)  # one allowed token, in the last chunk; words[1] allows none
    stops = torch.zeros(width, dtype=torch.int32)
    for t in (1, 4500):
        stops[t // 32] |= 1 << (t % 32)
    allow = torch.stack([torch.full((width,), -1, dtype=torch.int32), stops]).to(device)
    temps = torch.tensor([0.0, 0.9, 0.0], device=device)
    keys = torch.randint(0, 1 << 32, (rows,), generator=gen).to(device)
    where = torch.tensor([0, 0, 1], dtype=torch.int32, device=device)
    args = (logits, None, temps, keys, words.to(device), where, allow)
    got, want = race(*args), sampling.race_ref(*args)
    assert got[0].tolist() == want[0].tolist() == [8990.0, 8990.0, 1.0]
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_race_greedy_rows_take_the_lowest_index_among_ties(device):
    from tp_lora.ops.triton.sampling import race
    logits = torch.full((2, 9000), -3.0, device=device)
    logits[0, [5, 70, 4100, 8999]] = 1.0  # ties in three blocks (two in the first): the first block's first wins
    logits[1, [4200, 4300, 8300]] = 2.0  # ties in later blocks only (two in one)
    logits[1, :4096] = -float("inf")  # the first blocks (and chunks) masked out whole
    args = (logits, None, torch.zeros(2, device=device), torch.zeros(2, dtype=torch.long, device=device), None, None,
            None)
    got = race(*args)
    assert got[0].tolist() == [5.0, 4200.0] and not got[1].isnan().any()
    torch.testing.assert_close(got[1], sampling.race_ref(*args)[1], rtol=1e-5, atol=1e-5)



def test_norm_and_act_mul_take_the_warps_measured_at_decode():
    """The launch constants an H200's 8B decode step measured (BENCHMARKS.md): 16 warps for a norm's row of 4096 at
    decode (3.47 -> 2.96 us at 2 K shares), a warp per 512 columns for act_mul's whole-row per-token programs; past
    decode's rows (prefill) the constants before them."""
    from tp_lora.ops.triton.fused import DECODE_ROWS, act_warps, norm_warps
    assert [norm_warps(32, 4096), norm_warps(32, 2048), norm_warps(DECODE_ROWS + 1, 4096)] == [16, 4, 4]
    assert [norm_warps(32, 8192), norm_warps(2048, 8192)] == [16, 8]
    assert [act_warps(32, 16384), act_warps(32, 1024), act_warps(2048, 16384), act_warps(2048, 1024)] == [32, 4, 16, 4]
