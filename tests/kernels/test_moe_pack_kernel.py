"""The Triton pack of EP dispatch rows against pack_tokens_ref, bit for bit, on the device under test: hidden states
of 2- and 4-byte dtypes, with and without adapter slots, padding rows, a rank with no tokens, rows already at the
dispatch size, a strided slice of hidden states, wide rows (several programs a row)."""
import pytest
import torch

from tp_lora.ops.moe_pack import pack_tokens_ref, unpack_tokens

CASES = {  # name: (tokens, rows, hidden, dtype, k, tags)
    "bf16_tags_padded": (5, 8, 8, torch.bfloat16, 2, True),
    "fp32_no_tags": (3, 4, 6, torch.float32, 3, False),
    "no_tokens": (0, 4, 16, torch.bfloat16, 2, True),
    "full": (6, 6, 16, torch.bfloat16, 4, False),
    "wide_rows": (3, 5, 1500, torch.bfloat16, 8, True),  # 750 words of hidden: two programs a row
}


@pytest.mark.parametrize("name", list(CASES))
def test_pack_kernel_matches_reference(device, name):
    from tp_lora.ops.triton.moe_pack import pack_tokens
    n, rows, h, dtype, k, with_tags = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(n, h + 2, generator=g).to(dtype)[:, :h]  # rows of a wider tensor
    ids = torch.randint(-1, 64, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    tags = torch.randint(-1, 4, (n,), generator=g, dtype=torch.int32) if with_tags else None
    want = pack_tokens_ref(x, ids, w, tags, rows)
    got = pack_tokens(x.to(device), ids.to(device), w.to(device), None if tags is None else tags.to(device), rows)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32)), f"{name}: packed words differ"
    xs, ids2, w2, t2 = unpack_tokens(got.cpu(), h, dtype, k, with_tags)
    assert ids2[:n].tolist() == ids.tolist() and ids2[n:].eq(-1).all() and torch.equal(w2[:n], w)
    assert torch.equal(xs[:n], x.cpu())
    assert t2 is None or (torch.equal(t2[:n], tags) and t2[n:].eq(-1).all())
