"""The Triton paged decode kernel against its torch reference (itself checked against dense softmax attention)."""
import pytest
import torch
from _paged import fp8_edges, poisoned_cache

from tp_lora.ops.paged_attention import paged_decode_ref


def _case(gen, lens, heads, kv, d, bs, dtype, device, width=None):
    """A cache with shuffled (non-contiguous) block tables for sequences of `lens` positions; padding entries of a
    table point at a poisoned block that a correct kernel never reads."""
    k_cache, v_cache, table = poisoned_cache(gen, lens, len(lens), kv, d, bs, dtype, width)
    q = torch.randn(len(lens), heads, d, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), to(table), to(torch.tensor(lens, dtype=torch.int32))


def test_reference_matches_dense_attention():
    gen = torch.Generator().manual_seed(1)
    bs, heads, kv, d = 4, 6, 2, 8
    q, kc, vc, table, lens = _case(gen, [1, 5, 9], heads, kv, d, bs, torch.float32, "cpu")
    got = paged_decode_ref(q, kc, vc, table, lens, 0.3, window=3)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(0, n - 3), n)
        slots = table[b, pos // bs].long() * bs + pos % bs
        k = kc.flatten(0, 1)[slots].repeat_interleave(heads // kv, 1)
        v = vc.flatten(0, 1)[slots].repeat_interleave(heads // kv, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=0.3)[:, 0]
        torch.testing.assert_close(got[b], want)


@pytest.mark.parametrize("lens, bs, window, softcap", [
    ([1], 16, 0, 0.0),  # one position
    ([16, 17, 3], 16, 0, 0.0),  # exactly a block, a block + 1, ragged
    ([70, 5, 33], 16, 20, 0.0),  # sliding window shorter than the context
    ([130, 1], 8, 0, 0.0),  # several inner iterations
    ([40, 9], 16, 0, 1.5),  # soft-capped scores (Gemma 2), a cap small enough to change them
])
def test_kernel_matches_reference(device, lens, bs, window, softcap):
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(sum(lens) + bs + window)
    heads, kv, d = 8, 2, 16  # rep 4: the query heads of one KV head in one tile
    args = _case(gen, lens, heads, kv, d, bs, torch.float32, device)
    got = paged_decode(*args, 0.25, window, softcap)
    want = paged_decode_ref(*args, 0.25, window, softcap)
    if softcap:
        assert not torch.allclose(want, paged_decode_ref(*args, 0.25, window)), "the cap changed nothing"
    tol = 1e-5 if device == "cpu" else 1e-4  # float32 dots in full precision on GPU too
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_kernel_partitions_merge(device, monkeypatch):
    """Context split into partitions (small batch, long table), some of them empty for short sequences."""
    from tp_lora.ops.triton import paged_attention as pa
    monkeypatch.setattr(pa, "MIN_PART", 64)
    gen = torch.Generator().manual_seed(7)
    heads, kv, d, bs = 4, 4, 16, 16  # rep 1 (multi-head)
    args = _case(gen, [200, 3], heads, kv, d, bs, torch.float32, device, width=16)
    assert pa.partitions(2, kv, 16 * bs, d) > 1
    got = pa.paged_decode(*args, 0.5, 0)
    want = paged_decode_ref(*args, 0.5, 0)
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_partitions_grow_as_heads_shrink():
    """A head half as wide streams half the bytes per program: its grid aims at twice the programs (32 sequences x
    8 KV heads: one partition at head_dim 128, two at 64)."""
    from tp_lora.ops.triton import paged_attention as pa
    assert pa.partitions(32, 8, 2048, 128) == 1
    assert pa.partitions(32, 8, 2048, 64) == 2


def test_kernel_splits_each_sequence(device, monkeypatch):
    """A grid of several partitions splits each sequence's own context: a short one runs whole in its first
    partition, which writes its output (its partials are never written), a long one over every partition, whose
    last to finish merges them; a windowed one splits its window. The merge tickets are back at 0 after each call."""
    from tp_lora.ops.triton import paged_attention as pa
    from tp_lora.ops.triton.tickets import tickets
    monkeypatch.setattr(pa, "MIN_PART", 16)
    monkeypatch.setattr(pa, "BLOCK_N", 16)
    gen = torch.Generator().manual_seed(12)
    args = _case(gen, [5, 300, 40, 1], 8, 2, 16, 16, torch.float32, device, width=20)
    assert pa.partitions(4, 2, 20 * 16, 16) > 4
    for window in (0, 37, 0):
        torch.testing.assert_close(pa.paged_decode(*args, 0.4, window), paged_decode_ref(*args, 0.4, window),
                                   rtol=1e-4, atol=1e-4)
        assert not tickets(args[0].device, 1).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel runs natively on CUDA only")
def test_kernel_bf16_on_gpu():
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(3)
    args = _case(gen, [2048, 1, 777, 64] * 8, 32, 8, 128, 16, torch.bfloat16, "cuda")
    got = paged_decode(*args, 128 ** -0.5, 0).float()
    want = paged_decode_ref(*args, 128 ** -0.5, 0).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def _fp8_case(gen, lens, heads, kv, d, bs, device, width=None):
    """_case's inputs over an fp8 cache with e4m3's edges (+-448, subnormals), queries float32."""
    q, k, v, table, ctx = _case(gen, lens, heads, kv, d, bs, torch.float32, "cpu", width)
    return tuple(t.to(device) for t in (q, fp8_edges(k, gen), fp8_edges(v, gen), table, ctx))


def fp8_close(got, q, k, v, table, ctx, scale, window=0, softcap=0.0):
    """got equals the reference over the fp8 cache read as float32, given the queries as the kernel multiplies them
    (q x scale rounded to float16, then scale 1: a 448 key would turn q's rounding into whole units of score), within
    float16 probabilities' rounding of the values (2^-11 of the largest each, up to 2^-8 over a long context)."""
    qh = (q.float() * scale).half().float()
    k, v = k.float(), v.float()  # exact, and indexed on any device
    want = paged_decode_ref(qh, k, v, table, ctx, 1.0, window, softcap)
    tol = 2.0 ** -8 * v.nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=tol)


@pytest.mark.parametrize("lens, bs, rep, window, softcap", [
    ([1], 16, 4, 0, 0.0),  # one position
    ([16, 17, 3, 31], 16, 4, 0, 0.0),  # exactly a block, a block + 1, ragged, odd
    ([70, 5, 33], 16, 3, 20, 0.0),  # sliding window; rep 3 (GQA padded to a 16-row tile)
    ([130, 1], 8, 1, 0, 0.0),  # several inner iterations, multi-head
    ([40, 9], 16, 8, 0, 1.5),  # soft-capped scores, rep 8
])
def test_kernel_fp8_cache_matches_reference(device, lens, bs, rep, window, softcap):
    """An fp8 cache is read as stored and widened exactly: the kernel against the reference over the same bytes."""
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(sum(lens) + bs + rep)
    kv, d = 2, 16
    args = _fp8_case(gen, lens, kv * rep, kv, d, bs, device)
    assert args[1].dtype == torch.float8_e4m3fn
    got = paged_decode(*args, 0.25, window, softcap)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    fp8_close(got, *args, 0.25, window, softcap)


def test_kernel_fp8_partitions_merge(device, monkeypatch):
    """Context split into partitions of whole fp8 tiles (small batch, long table), some empty for short sequences."""
    from tp_lora.ops.triton import paged_attention as pa
    monkeypatch.setattr(pa, "MIN_PART", 64)
    gen = torch.Generator().manual_seed(8)
    args = _fp8_case(gen, [200, 3, 77], 8, 4, 16, 16, device, width=16)  # rep 2
    assert pa.partitions(3, 4, 16 * 16, 16, 1) > 2
    fp8_close(pa.paged_decode(*args, 0.5, 0), *args, 0.5)


def test_kernel_fp8_queries_past_float16_range(device):
    """Queries far past float16's range (1e5) with a scale that brings the scores back: the scale is applied before
    the queries narrow to float16, so no score overflows."""
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(9)
    q, k, v, table, ctx = _fp8_case(gen, [45, 12], 8, 2, 16, 16, device)
    q = q * 1e5
    got = paged_decode(q, k, v, table, ctx, 1e-5)
    assert torch.isfinite(got).all()
    fp8_close(got, q, k, v, table, ctx, 1e-5)


def test_kernel_fp8_subnormals(device):
    """A cache of e4m3 subnormals only (m x 2^-9) and queries large enough that they decide the scores: a widening
    that flushed or misread them would miss by far more than the tolerance (2^-10 of values below 2^-6)."""
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(10)
    q, k, v, table, ctx = _case(gen, [37, 16, 5], 8, 2, 16, 16, torch.float32, "cpu")
    k, v = ((torch.randint(-7, 8, x.shape, generator=gen) * 2.0 ** -9).where(~x.isnan(), x).to(torch.float8_e4m3fn)
            for x in (k, v))
    assert k.float().nan_to_num(0).abs().max() < 2 ** -6
    args = tuple(t.to(device) for t in (q * 300, k, v, table, ctx))
    fp8_close(paged_decode(*args, 0.25), *args, 0.25)


def test_fp8_partitions_double():
    """At the 8B decode shape (32 sequences x 8 KV heads, head_dim 128) a bf16 cache runs one partition, an fp8 one
    (half the bytes per position) two, as a bf16 cache of head_dim 64 does."""
    from tp_lora.ops.triton import paged_attention as pa
    assert pa.partitions(32, 8, 4096, 128, 2) == 1
    assert pa.partitions(32, 8, 4096, 128, 1) == 2 == pa.partitions(32, 8, 4096, 64, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel runs natively on CUDA only")
def test_kernel_fp8_bf16_queries_on_gpu():
    """The 8B decode shape over an fp8 cache with bf16 queries, against the reference. (Not against the bf16 kernel:
    with e4m3's 448 keys, bf16 against f16 rounding of the queries moves scores by whole units.)"""
    from tp_lora.ops.triton.paged_attention import paged_decode
    gen = torch.Generator().manual_seed(4)
    q, k, v, table, ctx = _case(gen, [2048, 1, 777, 64, 4096] * 6, 32, 8, 128, 16, torch.float32, "cpu")
    k8, v8 = fp8_edges(k, gen), fp8_edges(v, gen)
    q, k8, v8, table, ctx = (t.cuda() for t in (q.bfloat16(), k8, v8, table, ctx))
    got = paged_decode(q, k8, v8, table, ctx, 128 ** -0.5)
    fp8_close(got, q, k8, v8, table, ctx, 128 ** -0.5)


def _rope_inputs(gen, b, heads, kv, d, r, ctx, device):
    """Projected q [b, heads, d], k / v [b, kv, d] of each sequence's new token (views of one packed row, as the qkv
    layer's output is split), cos / sin [b, 1, r] at its position ctx - 1, and the slot of that position."""
    qkv = torch.randn(b, (heads + 2 * kv) * d, generator=gen)
    q, k, v = (x.view(b, -1, d) for x in qkv.split([heads * d, kv * d, kv * d], -1))
    inv = 1.0 / 500.0 ** (torch.arange(0, r, 2).float() / r)
    ang = (ctx.float() - 1)[:, None] * inv[None]
    cos, sin = (f(torch.cat([ang, ang], -1))[:, None] for f in (torch.cos, torch.sin))
    return [t.to(device) for t in (q, k, v, cos, sin)]


@pytest.mark.parametrize("lens, bs, rep, r, norm, fp8, window, min_part", [
    ([1, 16, 17, 40], 16, 4, 16, False, False, 0, 128),  # one position, a block, a block + 1; full rotary
    ([70, 5, 33], 16, 3, 8, True, False, 20, 128),  # partial rotary, per-head norms (with +1), sliding window
    ([200, 3, 77], 16, 2, 16, False, True, 0, 64),  # fp8 cache with its scales; partitions, the new one last
])
def test_kernel_with_rope_writes_the_new_kv_and_matches_reference(device, monkeypatch, lens, bs, rep, r, norm, fp8,
                                                                  window, min_part):
    """paged_decode with rope (paged_decode_rope on CUDA): RoPE on q and k in the kernel, the new K / V written at
    their slots by the partition that reads them back, against rope_write_kv_ref + paged_decode_ref on copies of the
    same caches: the output, and every cache entry after (the rest untouched, the poisoned block included)."""
    from tp_lora.ops.paged_attention import paged_decode_rope_ref
    from tp_lora.ops.triton import paged_attention as pa
    monkeypatch.setattr(pa, "MIN_PART", min_part)
    gen = torch.Generator().manual_seed(sum(lens) + r)
    kv, d = 2, 16
    make = _fp8_case if fp8 else lambda *a, **kw: _case(*a[:6], torch.float32, *a[6:], **kw)
    _, kc, vc, table, ctx = make(gen, lens, kv * rep, kv, d, bs, device, width=16)
    q, k, v, cos, sin = _rope_inputs(gen, len(lens), kv * rep, kv, d, r, ctx.cpu(), device)
    last = (ctx - 1).long()
    slots = (table.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs).to(device)
    qw, kw = (torch.randn(d, generator=gen).to(device) for _ in range(2)) if norm else (None, None)
    scales = (2.0, 0.5) if fp8 else (1.0, 1.0)
    args = (slots, qw, kw, 1e-6, norm, scales)
    kc2, vc2 = kc.clone(), vc.clone()
    got = pa.paged_decode(q, kc, vc, table, ctx, 0.25, window, rope=(k, v, cos, sin) + args)
    want = paged_decode_rope_ref(q, k, v, cos, sin, kc2, vc2, *args, table, ctx, 0.25, window)
    new = torch.zeros(kc.shape[0] * bs, dtype=torch.bool, device=device)
    new[slots] = True
    new = new.view(kc.shape[:2])
    for a, b in ((kc, kc2), (vc, vc2)):  # the rest bit for bit; the new entries within float32's last bits (RoPE's
        # rounding), over fp8 within one e4m3 step (those bits may round a value across a step); the interpreter
        # halves an fp8 value whose rounding carries into the exponent (test_fused_ops), so on the CPU: within 2x
        a, b = a.float(), b.float()
        assert torch.equal(a[~new].nan_to_num(7.0), b[~new].nan_to_num(7.0))
        if fp8 and device == "cpu":
            assert ((a[new] - b[new]).abs() <= b[new].abs() / 2 + 2.0 ** -9).all()
        else:
            torch.testing.assert_close(a[new], b[new], rtol=0.13 if fp8 else 1e-5, atol=2.0 ** -9 if fp8 else 1e-6)
    if fp8:
        from tp_lora.ops.fused import rope_write_kv_ref
        qr = rope_write_kv_ref(q, k, v, cos, sin, kc2.clone(), vc2.clone(), *args)
        fp8_close(got, qr, kc, vc, table, ctx, 0.25, window)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
