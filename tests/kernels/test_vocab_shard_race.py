"""The race on vocabulary shards (tp_lora.ops.sampling.race_shard, race_combine): each TP rank's parts, four numbers
a row each, combine into the whole vocabulary's race (race_ref): the same tokens, greedy and hot rows, a tie across
shards (and across one shard's chunks: 5000 wide is two kernel parts) won by the lowest id; log-probabilities within
float32 rounding. The torch references and the Triton kernels alike."""
import pytest
import torch

from tp_lora.ops import sampling


@pytest.mark.parametrize("shards, width", [(2, 96), (4, 40), (2, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_shards_race_to_the_whole_vocabularys_token(device, shards, width, dtype):
    from tp_lora.ops.triton.sampling import race_combine, race_shard
    gen = torch.Generator().manual_seed(shards * width)
    rows, vocab = 6, shards * width
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[0, [width + 3, vocab - 2]] = 20.0  # a tie in two later shards: the first one's id wins
    temps = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.9, 0.3])
    keys = torch.randint(0, 1 << 32, (rows,), generator=gen)
    want = sampling.race_ref(logits, None, temps, keys, None, None, None)
    assert int(want[0, 0]) == width + 3
    for shard, combine in ((sampling.race_shard_ref, sampling.race_combine_ref), (race_shard, race_combine)):
        parts = [shard(logits[:, r * width:(r + 1) * width].to(device), temps.to(device), keys.to(device), r * width)
                 for r in range(shards)]
        assert all(p.dtype == torch.float32 and p.shape[1:] == (4, rows) for p in parts)
        got = combine(torch.cat(parts)).cpu()
        assert got.dtype == torch.float64 and torch.equal(got[0], want[0]), shard.__name__
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-5)
