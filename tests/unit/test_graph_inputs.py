"""The padded inputs of a mixed-step CUDA graph: exact tensors for a small step, the same layout as the eager
metadata, and the same attention output through the varlen path (its torch reference on CPU)."""
import numpy as np
import pytest
import torch

from tp_lora.engine.graph_inputs import DecodeInputs, MixedInputs, fill_block_table, pad_decode_step, pad_mixed_step
from tp_lora.hostcopy import Staging
from tp_lora.models.attention import KVCache, attend, build_attn_meta
from tp_lora.ops.fused import write_kv


def test_small_step_exact():
    # seq 0: decode at position 5 (blocks [7, 2], bs 4); seq 1: a 3-token chunk at positions 1..3 (block [4]).
    got = pad_mixed_step([11, 21, 22, 23], [[7, 2], [4]], [5, 1], [1, 3], tokens=6, seqs=3, width=3, block_size=4,
                         scratch=9)
    assert got.ids.tolist() == [11, 21, 22, 23, 0, 0]
    assert got.positions.tolist() == [5, 1, 2, 3, 0, 0]
    assert got.kv_slots.tolist() == [2 * 4 + 1, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 9 * 4, 9 * 4]
    assert got.last_token.tolist() == [0, 3, 0]
    assert got.cu_q.tolist() == [0, 1, 4, 4]
    assert got.context_lens.tolist() == [6, 4, 0]
    assert got.block_table.tolist() == [[7, 2, 9], [4, 9, 9], [9, 9, 9]]
    assert got.cu_q.dtype == got.context_lens.dtype == got.block_table.dtype == torch.int32


def test_block_crossing_slot_and_padding_slots():
    # A table longer than the graph's width (a block for a position it never serves) is cut.
    got = pad_mixed_step([1, 2, 3], [[3, 8, 5]], [3], [3], tokens=4, seqs=1, width=2, block_size=4, scratch=9)
    assert got.kv_slots.tolist() == [3 * 4 + 3, 8 * 4 + 0, 8 * 4 + 1, 9 * 4]
    assert got.positions.tolist() == [3, 4, 5, 0]
    assert got.block_table.tolist() == [[3, 8]]


def test_written_into_staging_views_over_stale_values():
    # A graph's staging buffers hold the last step's values: every element must be rewritten.
    args = ([11, 21, 22, 23], [[7, 2], [4]], [5, 1], [1, 3])
    sizes = dict(tokens=6, seqs=3, width=3, block_size=4, scratch=9)
    staging = Staging(MixedInputs.zeros(6, 3, 3, "cpu").tensors(), "cpu")
    for t in staging.fill():
        t.fill_(-7)
    got = pad_mixed_step(*args, **sizes, out=MixedInputs.of(staging.fill()))
    want = pad_mixed_step(*args, **sizes)
    for g, w in zip(got.tensors(), want.tensors()):
        assert torch.equal(g, w)
    staging.send()
    for d, w in zip(staging.device, want.tensors()):
        assert torch.equal(d, w)
    with pytest.raises(ValueError, match="expected 8 and"):
        pad_mixed_step(*args, **(sizes | dict(tokens=8)), out=MixedInputs.of(staging.fill()))


def test_decode_step_exact():
    out = DecodeInputs.zeros(4, 3, "cpu")
    for t in out.tensors():
        t.fill_(-7)
    got = pad_decode_step([5, 6], [[7, 2, 3, 1], [4]], [9, 0], rows=4, width=3, block_size=4, scratch=8, out=out)
    assert got.ids.tolist() == [5, 6, 0, 0]
    assert got.positions.tolist() == [9, 0, 0, 0]
    assert got.block_table.tolist() == [[7, 2, 3], [4, 8, 8], [8, 8, 8], [8, 8, 8]]
    assert got.kv_slots.tolist() == [3 * 4 + 1, 4 * 4, 8 * 4, 8 * 4]  # position 9: block 2 (id 3), offset 1
    assert got.context_lens.tolist() == [10, 1, 1, 1] and got.context_lens.dtype == torch.int32
    assert got.last_token.tolist() == [0, 1, 2, 3]
    assert got.valid.tolist() == [2] and got.block_table.dtype == torch.int32


@pytest.mark.parametrize("kwargs", [dict(tokens=3), dict(seqs=1)])
def test_too_big_for_the_graph_is_named(kwargs):
    args = dict(tokens=8, seqs=4, width=4, block_size=4, scratch=9) | kwargs
    with pytest.raises(ValueError, match="expected at most"):
        pad_mixed_step([1, 2, 3, 4], [[0, 1], [2]], [0, 0], [3, 1], **args)


def test_matches_eager_metadata_and_attention():
    gen = torch.Generator().manual_seed(4)
    heads, kv, d, bs = 4, 2, 8, 4
    lengths, starts = [1, 6, 1, 3], [9, 0, 2, 5]
    need = [-(-(st + n) // bs) for st, n in zip(starts, lengths)]
    pool = torch.randperm(sum(need), generator=gen).tolist()
    tables = [pool[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    t = sum(lengths)
    ids = torch.randint(0, 100, (t,), generator=gen).tolist()
    padded = pad_mixed_step(ids, tables, starts, lengths, tokens=t + 5, seqs=6, width=max(need) + 1,
                            block_size=bs, scratch=sum(need))
    eager = build_attn_meta(tables, starts, lengths, bs, "cpu", decode_kernel=False)
    assert torch.equal(padded.kv_slots[:t], eager.slots) and torch.equal(padded.positions[:t], eager.positions)
    assert torch.equal(padded.last_token[:len(lengths)], eager.last_token)
    cache = KVCache(1, sum(need), bs, kv, d, torch.float32, "cpu")
    cache.k[0].normal_(generator=gen)
    cache.v[0].normal_(generator=gen)
    q = torch.randn(t + 5, heads, d, generator=gen)
    k, v = torch.randn(t + 5, kv, d, generator=gen), torch.randn(t + 5, kv, d, generator=gen)
    write_kv(cache.k[0], cache.v[0], eager.slots, k[:t], v[:t])
    want = attend(q[:t], cache, 0, eager, 0.4)
    write_kv(cache.k[0], cache.v[0], padded.kv_slots, k, v)  # padding rows go to the scratch block
    got = attend(q, cache, 0, padded.meta(None), 0.4)
    torch.testing.assert_close(got[:t], want, rtol=1e-5, atol=1e-5)


def test_mixed_graph_sizes():
    from tp_lora.engine.runner import mixed_sizes
    assert mixed_sizes(4096, 32) == [(64, 32), (128, 32), (256, 32), (512, 32), (640, 32), (768, 32), (896, 32),
                                     (1024, 32), (1536, 32), (2048, 32), (3072, 32), (4096, 32)]
    assert mixed_sizes(300, 256) == [(64, 64), (128, 128), (256, 256), (300, 256)]  # the budget itself is the last
    assert mixed_sizes(16, 4) == [(16, 4)]
    assert mixed_sizes(8192, 8)[-2:] == [(3072, 8), (4096, 8)]  # past 4096 tokens steps run eagerly


def test_fill_block_table_pads_and_truncates():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    width, scratch = 5, 99
    blocks = [torch.randint(0, 50, (int(k),), generator=gen).tolist() for k in (0, 3, 5, 8)]  # empty, short, full, long
    table = np.full((6, width), -7, dtype=np.int32)  # stale entries: every one must be rewritten
    fill_block_table(table, blocks, scratch)
    want = torch.full((6, width), scratch, dtype=torch.int32)
    for n, b in enumerate(blocks):
        for j, x in enumerate(b[:width]):
            want[n, j] = x
    assert torch.equal(torch.from_numpy(table), want)
