"""The Triton varlen paged attention kernel against its torch reference; the reference itself against the step's
gathered SDPA path (build_attn_meta + attend) and against the paged decode reference."""
import pytest
import torch
from _paged import fp8_edges, poisoned_cache

from tp_lora.models.attention import KVCache, attend, build_attn_meta
from tp_lora.ops.fused import write_kv
from tp_lora.ops.paged_attention import paged_decode_ref, paged_varlen_ref


def _case(gen, seqs, heads, kv, d, bs, dtype, device, pad_seqs=0, pad_tokens=0, width=None):
    """seqs: (q_len, context) per sequence, packed in order, then `pad_seqs` padding sequences (q_len 0, context 0)
    and `pad_tokens` query rows of no sequence. Block tables are shuffled over the cache; their unused entries (and
    every entry of a padding sequence) point at a NaN-poisoned block that a correct kernel never reads."""
    k_cache, v_cache, table = poisoned_cache(gen, [c for _, c in seqs], len(seqs) + pad_seqs, kv, d, bs, dtype,
                                             width)
    lens = [n for n, _ in seqs] + [0] * pad_seqs
    cu_q = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ctx = torch.tensor([c for _, c in seqs] + [0] * pad_seqs, dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]) + pad_tokens, heads, d, generator=gen).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(k_cache), to(v_cache), to(table), to(ctx), to(cu_q)


@pytest.mark.parametrize("seqs, bs, rep, window, softcap, pad_seqs, pad_tokens", [
    ([(1, 1)], 16, 4, 0, 0.0, 0, 0),  # one query, one position
    ([(3, 3), (1, 17), (20, 20), (1, 5)], 8, 4, 0, 0.0, 2, 5),  # ragged, decodes between chunks, padding
    ([(37, 37)], 16, 1, 0, 0.0, 0, 0),  # a chunk over several query blocks and block boundaries, rep 1
    ([(12, 70), (1, 33), (9, 9)], 16, 4, 0, 0.0, 1, 3),  # chunked-prefill continuation: context > q_len
    ([(30, 90), (1, 70), (5, 5)], 16, 4, 20, 0.0, 0, 0),  # window shorter than the chunk and the context
    ([(17, 40), (1, 9)], 16, 1, 0, 1.5, 3, 0),  # soft-capped scores (Gemma 2), a cap small enough to matter
    ([(70, 130)], 8, 3, 0, 0.0, 0, 2),  # rep 3: query blocks of 5 tokens in 16-row tiles; several key tiles
])
@pytest.mark.parametrize("rows", [16, 64])
@pytest.mark.parametrize("split", [False, True])
def test_kernel_matches_reference(device, monkeypatch, seqs, bs, rep, window, softcap, pad_seqs, pad_tokens, rows,
                                  split):
    """split: each query block's keys over as many partitions of 16 positions as the table's width allows (blocks
    whose early rows see none of a partition's keys, causal partitions beside unmasked ones), merged by the last."""
    from tp_lora.ops.triton import paged_attention as pa
    from tp_lora.ops.triton import paged_varlen as pv
    monkeypatch.setattr(pv, "tile", lambda rep, t, s, d: (rows // rep, rows))  # both tile shapes on every case
    if split:
        monkeypatch.setattr(pa, "MIN_PART", 16)
        monkeypatch.setattr(pv, "BLOCK_N", 16)
        monkeypatch.setattr(pv, "TARGET_PROGRAMS", 1 << 20)
    paged_varlen = pv.paged_varlen
    gen = torch.Generator().manual_seed(sum(n + c for n, c in seqs) + bs + rep)
    kv, d = 2, 16
    args = _case(gen, seqs, kv * rep, kv, d, bs, torch.float32, device, pad_seqs, pad_tokens)
    got = paged_varlen(*args, 0.25, window, softcap)
    want = paged_varlen_ref(*args, 0.25, window, softcap)
    if softcap:
        assert not torch.allclose(want, paged_varlen_ref(*args, 0.25, window)), "the cap changed nothing"
    n = sum(q for q, _ in seqs)
    assert torch.isfinite(want[:n]).all() and not want[n:].any()
    tol = 1e-5 if device == "cpu" else 1e-4  # float32 dots in full precision on GPU too
    torch.testing.assert_close(got[:n], want[:n], rtol=tol, atol=tol)


@pytest.mark.parametrize("seqs, bs, rep, window, softcap, pad_seqs, pad_tokens", [
    ([(3, 3), (1, 17), (20, 20), (1, 5)], 8, 4, 0, 0.0, 2, 5),  # ragged, decodes between chunks, padding
    ([(12, 70), (1, 33), (9, 9)], 16, 3, 0, 0.0, 1, 3),  # continuation (context > q_len), rep 3, odd lengths
    ([(30, 90), (1, 70), (5, 5)], 16, 4, 20, 0.0, 0, 0),  # window shorter than the chunk and the context
    ([(17, 40), (1, 16)], 16, 1, 0, 1.5, 3, 0),  # soft-capped, rep 1, a context of exactly one block
])
@pytest.mark.parametrize("rows", [16, 64])
def test_kernel_fp8_cache_matches_reference(device, monkeypatch, seqs, bs, rep, window, softcap, pad_seqs,
                                            pad_tokens, rows):
    """An fp8 cache (with e4m3's edges: +-448, subnormals) read as stored and widened exactly: the kernel against the
    reference over the same bytes, given the queries as the kernel multiplies them (q x scale rounded to float16),
    within float16 probabilities' rounding of the values."""
    from tp_lora.ops.triton import paged_varlen as pv
    monkeypatch.setattr(pv, "tile", lambda rep, t, s, d: (rows // rep, rows))
    gen = torch.Generator().manual_seed(sum(n + c for n, c in seqs) + bs + rep + 1)
    kv, d = 2, 16
    q, k, v, table, ctx, cu_q = _case(gen, seqs, kv * rep, kv, d, bs, torch.float32, "cpu", pad_seqs, pad_tokens)
    k, v = fp8_edges(k, gen), fp8_edges(v, gen)
    got = pv.paged_varlen(*(t.to(device) for t in (q, k, v, table, ctx, cu_q)), 0.25, window, softcap).cpu()
    n = sum(qn for qn, _ in seqs)
    want = paged_varlen_ref((q * 0.25).half().float(), k, v, table, ctx, cu_q, 1.0, window, softcap)
    assert torch.isfinite(got[:n]).all()
    tol = 2.0 ** -8 * v.float().nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(got[:n], want[:n], rtol=2e-3, atol=tol)


@pytest.mark.parametrize("apart", [True, False])
def test_fp8_decodes_apart(device, monkeypatch, apart):
    """Over an fp8 cache, sequences of one query run in the decode kernel (split over its partitions, their rows
    written there) and the rest in the varlen kernel, or all in the varlen kernel: either way the reference's rows
    over the same bytes, window or none."""
    from tp_lora.ops.triton import paged_attention as pa
    from tp_lora.ops.triton import paged_varlen as pv
    monkeypatch.setattr(pv, "DECODES_APART_FP8", apart)
    monkeypatch.setattr(pa, "MIN_PART", 32)
    gen = torch.Generator().manual_seed(21)
    q, k, v, table, ctx, cu_q = _case(gen, [(1, 150), (7, 30), (1, 3), (1, 64), (12, 80)], 8, 2, 16, 16,
                                      torch.float32, "cpu", 2, 3, width=12)
    k, v = fp8_edges(k, gen), fp8_edges(v, gen)
    n = int(cu_q[-1])
    tol = 2.0 ** -8 * v.float().nan_to_num(0.0).abs().max().item()
    for window in (0, 40):
        got = pv.paged_varlen(*(t.to(device) for t in (q, k, v, table, ctx, cu_q)), 0.3, window)[:n].cpu()
        want = paged_varlen_ref((q * 0.3).half().float(), k, v, table, ctx, cu_q, 1.0, window)[:n]
        torch.testing.assert_close(got, want, rtol=2e-3, atol=tol)


def test_padding_sequences_write_nothing(device, monkeypatch):
    """Query rows past the real sequences keep what the output buffer held: padding sequences own no rows."""
    from tp_lora.ops.triton.paged_varlen import paged_varlen
    gen = torch.Generator().manual_seed(5)
    q, kc, vc, table, ctx, cu_q = _case(gen, [(4, 6), (1, 3)], 4, 2, 16, 4, torch.float32, device, 4, 6)
    want = paged_varlen_ref(q, kc, vc, table, ctx, cu_q, 0.5)
    monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, 7.0))  # the kernel's output buffer
    got = paged_varlen(q, kc, vc, table, ctx, cu_q, 0.5)
    assert (got[5:] == 7.0).all()
    tol = 1e-5 if device == "cpu" else 1e-4
    torch.testing.assert_close(got[:5], want[:5], rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel runs natively on CUDA only")
def test_kernel_bf16_on_gpu():
    from tp_lora.ops.triton.paged_varlen import paged_varlen
    gen = torch.Generator().manual_seed(3)
    seqs = [(1, 128)] * 31 + [(512, 512), (100, 2048)]
    args = _case(gen, seqs, 32, 8, 128, 16, torch.bfloat16, "cuda", pad_seqs=7, pad_tokens=100)
    n = sum(q for q, _ in seqs)
    got = paged_varlen(*args, 128 ** -0.5, 0)[:n].float()
    want = paged_varlen_ref(*args, 128 ** -0.5, 0)[:n].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernel runs natively on CUDA only")
def test_kernel_fp8_bf16_queries_on_gpu():
    """A mixed step at the 8B shape over an fp8 cache with bf16 queries, against the reference. (Not against the bf16
    kernel: with e4m3's 448 keys, bf16 against f16 rounding of the queries moves scores by whole units.)"""
    from tp_lora.ops.triton.paged_varlen import paged_varlen
    gen = torch.Generator().manual_seed(6)
    seqs = [(1, 2048)] * 6 + [(1, 300)] * 6 + [(64, 64), (40, 700)]  # the reference holds [T, 2048, 8, 128] floats
    q, k, v, table, ctx, cu_q = _case(gen, seqs, 32, 8, 128, 16, torch.float32, "cpu", pad_seqs=3, pad_tokens=50)
    k8, v8 = fp8_edges(k, gen), fp8_edges(v, gen)
    q, k8, v8, table, ctx, cu_q = (t.cuda() for t in (q.bfloat16(), k8, v8, table, ctx, cu_q))
    n = sum(qn for qn, _ in seqs)
    got = paged_varlen(q, k8, v8, table, ctx, cu_q, 128 ** -0.5)[:n].float()
    want = paged_varlen_ref((q.float() * 128 ** -0.5).half().float(), k8.float(), v8.float(), table, ctx, cu_q,
                            1.0)[:n]
    tol = 2.0 ** -8 * v8.float().nan_to_num(0.0).abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=tol)


def test_reference_matches_decode_reference():
    """One new token per sequence: the decode reference's computation."""
    gen = torch.Generator().manual_seed(2)
    q, kc, vc, table, ctx, cu_q = _case(gen, [(1, 9), (1, 1), (1, 16)], 8, 2, 8, 4, torch.float32, "cpu")
    for window, softcap in ((0, 0.0), (4, 0.0), (0, 2.0)):
        torch.testing.assert_close(paged_varlen_ref(q, kc, vc, table, ctx, cu_q, 0.3, window, softcap),
                                   paged_decode_ref(q, kc, vc, table, ctx, 0.3, window, softcap))


@pytest.mark.parametrize("lengths, starts, window, softcap", [
    ([1, 5, 1, 3, 1], [4, 0, 7, 2, 0], None, None),
    ([6, 1, 4], [3, 9, 0], 3, None),
    ([2, 7], [5, 0], None, 1.2),
])
def test_reference_matches_gathered_sdpa(lengths, starts, window, softcap):
    """The same step through build_attn_meta's gathered layout (SDPA on CPU) and through the varlen reference."""
    gen = torch.Generator().manual_seed(sum(lengths) + (window or 0))
    heads, kv, d, bs = 6, 2, 8, 4
    need = [-(-(st + n) // bs) for st, n in zip(starts, lengths)]
    ids = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    cache = KVCache(1, sum(need) + 2, bs, kv, d, torch.float32, "cpu")
    cache.k[0].normal_(generator=gen)
    cache.v[0].normal_(generator=gen)
    t = sum(lengths)
    q = torch.randn(t, heads, d, generator=gen)
    k, v = torch.randn(t, kv, d, generator=gen), torch.randn(t, kv, d, generator=gen)
    meta = build_attn_meta(tables, starts, lengths, bs, "cpu", window, decode_kernel=False)
    write_kv(cache.k[0], cache.v[0], meta.slots, k, v)
    want = attend(q, cache, 0, meta, 0.3, softcap=softcap)
    width = max(need)
    table = torch.tensor([tb + [tb[0]] * (width - len(tb)) for tb in tables], dtype=torch.int32)
    ctx = torch.tensor([st + n for st, n in zip(starts, lengths)], dtype=torch.int32)
    cu_q = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got = paged_varlen_ref(q, cache.k[0], cache.v[0], table, ctx, cu_q, 0.3, window or 0, softcap or 0.0)
    torch.testing.assert_close(got.reshape(t, -1), want, rtol=1e-5, atol=1e-5)


def test_tile_shapes():
    from tp_lora.ops.triton.paged_varlen import tile
    assert tile(4, 64, 32, 128) == (4, 16)  # mostly decodes: 4 tokens x 4 heads
    assert tile(4, 768, 32, 128) == (16, 64)  # room for chunks
    assert tile(4, 768, 32, 256) == (4, 16)  # a wide head keeps the small tile
    assert tile(3, 64, 32, 128) == (5, 16)  # rows past 5 x 3 stay empty
    assert tile(32, 64, 32, 128) == (1, 32)  # every head of a KV head in one tile
