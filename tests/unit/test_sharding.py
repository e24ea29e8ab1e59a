"""Sharding is pure: every rank's pieces tile the full tensor exactly once (or replicate KV heads on purpose)."""
import pytest
import torch

from tp_lora.layers.linear import blocks_aligned, column_spec, qkv_spec, row_spec
from tp_lora.sharding import even_range, shard_lora_a, shard_lora_b, shard_weight, unit_range


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_and_row_shards_tile_the_weight(size):
    w = torch.randn(24, 16)
    col = column_spec(16, 24)
    assert torch.equal(torch.cat([shard_weight(col, 0, w, r, size) for r in range(size)], 0), w)
    row = row_spec(16, 24)
    assert torch.equal(torch.cat([shard_weight(row, 0, w, r, size) for r in range(size)], 1), w)


def test_qkv_replicates_kv_heads_when_tp_exceeds_them():
    spec = qkv_spec(hidden=8, num_heads=4, num_kv_heads=2, head_dim=2)
    k = torch.arange(4 * 8).reshape(4, 8).float()  # 2 kv heads x head_dim 2
    parts = [shard_weight(spec, 1, k, r, 4) for r in range(4)]
    assert torch.equal(parts[0], k[0:2]) and torch.equal(parts[1], k[0:2])
    assert torch.equal(parts[2], k[2:4]) and torch.equal(parts[3], k[2:4])
    q = torch.randn(8, 8)
    assert torch.equal(torch.cat([shard_weight(spec, 0, q, r, 4) for r in range(4)]), q)


def test_uneven_splits_name_the_value():
    with pytest.raises(ValueError, match="of size 10 is not divisible by 4"):
        even_range(10, 0, 4)
    with pytest.raises(ValueError, match="3 heads cannot be split over 2"):
        unit_range(3, 0, 2)


@pytest.mark.parametrize("fully", [False, True])
def test_lora_shards_follow_the_mode(fully):
    col, row = column_spec(16, 12), row_spec(16, 12)
    a, b = torch.randn(8, 16), torch.randn(12, 8)
    a_parts = [shard_lora_a(col, a, r, 2, fully) for r in range(2)]
    assert torch.equal(torch.cat(a_parts, 0), a) if fully else all(torch.equal(p, a) for p in a_parts)
    assert torch.equal(torch.cat([shard_lora_b(col, 0, b, r, 2, fully) for r in range(2)], 0), b)
    assert torch.equal(torch.cat([shard_lora_a(row, a, r, 2, fully) for r in range(2)], 1), a)
    b_parts = [shard_lora_b(row, 0, b, r, 2, fully) for r in range(2)]
    assert torch.equal(torch.cat(b_parts, 0), b) if fully else all(torch.equal(p, b) for p in b_parts)


def test_blocks_aligned_knows_whether_rows_lie_in_whole_scale_blocks():
    """fp8 [128, 128]-block layers hand cuBLAS one scale row per 128 weight rows only when every slice starts on a
    block boundary of its checkpoint tensor and of the local weight."""
    llama = qkv_spec(4096, 32, 8, 128)  # q 4096 | k 1024 | v 1024 rows
    assert all(blocks_aligned(llama, r, p, 128) for p in (1, 2, 8) for r in range(p))
    assert all(blocks_aligned(llama, r, 16, 128) for r in range(16))  # KV heads replicated: one head of 128 rows
    assert blocks_aligned(row_spec(14336, 4096), 1, 2, 128)
    assert blocks_aligned(column_spec(4096, 14336, 14336), 1, 8, 128)  # 1792 rows of each slice
    assert blocks_aligned(column_spec(4096, 14336, 14336), 1, 16, 128)  # 896 = 7 x 128 rows of each slice
    assert not blocks_aligned(column_spec(4096, 1000, 1000), 0, 1, 128)  # the second slice at row 1000
    # head_dim 64, 2 KV heads replicated over 4 ranks: k and v of 64 rows, the second head at a block's middle
    assert not any(blocks_aligned(qkv_spec(1024, 16, 2, 64), r, 4, 128) for r in range(4))
