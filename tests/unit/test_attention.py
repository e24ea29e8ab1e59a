"""Attention over the KV cache for steps that mix decodes and prefill chunks, against a per-token loop."""
import pytest
import torch

from tp_lora.models.attention import KVCache, attend, build_attn_meta
from tp_lora.ops.fused import write_kv


def _reference(q, k_all, v_all, positions_of_seq, seq_of_token, pos_of_token, scale, window):
    """Token by token: softmax over the keys of its own sequence at positions <= its own (within the window)."""
    heads, kv_heads = q.shape[1], k_all[0].shape[1]
    out = []
    for t in range(q.shape[0]):
        s, p = seq_of_token[t], pos_of_token[t]
        keep = [i for i in range(positions_of_seq[s]) if i <= p and (not window or i > p - window)]
        keys = k_all[s][keep].repeat_interleave(heads // kv_heads, 1)  # [K, H, d]
        vals = v_all[s][keep].repeat_interleave(heads // kv_heads, 1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[t], keys) * scale, -1)
        out.append(torch.einsum("hk,khd->hd", w, vals).reshape(-1))
    return torch.stack(out)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decode_kernel", [False, True])
@pytest.mark.parametrize("lengths, window", [([1, 5, 1, 3, 1], None), ([1, 1, 1], None), ([4, 2], None),
                                             ([1, 6, 1], 3)])
def test_mixed_step_matches_per_token_attention(lengths, window, device, decode_kernel):
    gen = torch.Generator().manual_seed(len(lengths) * 7 + (window or 0))
    heads, kv_heads, d, bs = 6, 2, 8, 4  # rep 3 != kv 2: a mixed-up head layout cannot pass by symmetry
    starts = [int(torch.randint(0, 6, (1,), generator=gen)) for _ in lengths]
    # Each sequence's blocks, shuffled over a pool with spare blocks (a table is not a contiguous range).
    need = [-(-(st + n) // bs) for st, n in zip(starts, lengths)]
    ids = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    cache = KVCache(1, sum(need) + 3, bs, kv_heads, d, torch.float32, device)
    for layer in (cache.k[0], cache.v[0]):
        layer.fill_(1e4)  # a slot attended to that is neither written now nor history poisons the output
    # History already in the cache (positions < start), random per sequence.
    k_all = [torch.randn(st + n, kv_heads, d, generator=gen) for st, n in zip(starts, lengths)]
    v_all = [torch.randn(st + n, kv_heads, d, generator=gen) for st, n in zip(starts, lengths)]
    for t, st, k, v in zip(tables, starts, k_all, v_all):
        for p in range(st):
            cache.k[0][t[p // bs], p % bs], cache.v[0][t[p // bs], p % bs] = k[p].to(device), v[p].to(device)
    seq_of_token = [s for s, n in enumerate(lengths) for _ in range(n)]
    pos_of_token = [starts[s] + j for s, n in enumerate(lengths) for j in range(n)]
    q = torch.randn(len(seq_of_token), heads, d, generator=gen)
    k_new = torch.cat([k[st:] for k, st in zip(k_all, starts)])
    v_new = torch.cat([v[st:] for v, st in zip(v_all, starts)])
    meta = build_attn_meta(tables, starts, lengths, bs, device, window, decode_kernel=decode_kernel)
    assert len(meta.groups) == (2 if 1 in lengths and any(n > 1 for n in lengths) else 1)
    write_kv(cache.k[0], cache.v[0], meta.slots, k_new.to(device), v_new.to(device))
    got = attend(q.to(device), cache, 0, meta, 0.3).cpu()
    want = _reference(q, k_all, v_all, [st + n for st, n in zip(starts, lengths)], seq_of_token, pos_of_token, 0.3,
                      window)
    tol = 1e-5 if device == "cpu" else 2e-4  # GPU kernels may sum in another order or use tf32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert meta.last_token.tolist() == [sum(lengths[:i + 1]) - 1 for i in range(len(lengths))]
