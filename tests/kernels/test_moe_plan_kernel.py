"""The routing plan's Triton launches (the pairs' sort, the expert ends, the LoRA block table) against
sort_pairs_ref (torch's stable sort), torch.searchsorted and lora_blocks_ref on the device under test: random
routings, half of the experts local, all pairs to one expert, a rank that receives nothing, padding rows, one local
expert, with and without adapter slots (few: a compact block table, by the last ranking program to finish or by a
launch of its own; many: a row per sorted pair, written as the pairs are ranked), more pairs than one program ranks,
more sorted pairs than one program of the block table's own launch takes (each counts the block starts of the
others), (expert, slot) groups of many LoRA blocks, more local experts than programs (each counts the ends of
several), and two launch settings."""
import pytest
import torch

from tp_lora.ops.moe_plan import lora_blocks_ref, sort_pairs_ref

CASES = {  # name: (tokens, k, global experts, expert_start, local experts, ids override)
    "random": (40, 3, 8, 0, 8, None),
    "half_of_the_experts": (40, 3, 8, 4, 4, None),
    "all_to_one_expert": (37, 3, 8, 0, 8, [5, 0, 1]),
    "rank_receives_nothing": (9, 3, 8, 4, 4, [0, 1, 2]),
    "padding_rows": (6, 3, 8, 0, 8, [-1, -1, -1]),
    "one_local_expert": (40, 3, 8, 7, 1, None),
    "many_pairs": (200, 8, 64, 32, 32, None),  # 1600 pairs: 50 ranking programs, 7 comparison blocks each
    "groups_across_chunks": (300, 2, 2, 0, 2, [0, 1]),  # 600 pairs, ~75 an (expert, slot) group: blocks across
    # the block table's chunks of 512 sorted pairs
    "more_experts_than_programs": (3, 2, 64, 0, 48, None),  # 6 pairs: 2 programs count 24 ends each (of 32 lanes)
    "mixed_step": (1086, 8, 128, 0, 128, None),  # 8688 pairs (an ep2 mixed step's)
}


@pytest.mark.parametrize("L", [0, 3, 64])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("settings", [None, (32, 4, 64)])
def test_plan_kernel_matches_torch_stable_sort(device, name, L, settings):
    from tp_lora.ops.triton.moe_plan import plan_pairs
    from tp_lora.ops.triton.tickets import tickets
    n, k, e_all, e0, e_local, fixed = CASES[name]
    if n * k > 4096 and device != "cuda":
        pytest.skip("tens of thousands of pairs: minutes under the interpreter")
    g = torch.Generator().manual_seed(len(name) + 100 * L)
    if fixed is None:
        ids = torch.rand(n, e_all, generator=g).topk(k, -1).indices
    else:
        ids = torch.tensor([fixed] * n)
    slots = torch.randint(-1, L, (n,), generator=g, dtype=torch.int32) if L else None
    want = sort_pairs_ref(ids, slots, e0, e_local, L)
    bounds = torch.arange(L + 1, (e_local + 1) * (L + 1), L + 1, dtype=torch.int32)
    want += (torch.searchsorted(want[2], bounds, out_int32=True),)
    got = plan_pairs(ids.to(device), None if slots is None else slots.to(device), e0, e_local, L, settings)
    for field, w, x in zip(("token", "pos", "sorted_key", "expert_ends"), want, got[:4], strict=True):
        assert x.dtype == w.dtype and x.shape == w.shape, field
        assert torch.equal(x.cpu(), w), f"{name}: {field} differs"
    if L:
        check_blocks(got[4].cpu(), want[2], e_local, L, name)
    else:
        assert got[4].shape == (0, 4)
    assert not tickets(got[0].device, 1).any()


def check_blocks(got_g: torch.Tensor, sorted_key: torch.Tensor, E: int, L: int, name: str):
    """The kernel's LoRA block table holds lora_blocks_ref's used rows, in key order: each at its start pair's row
    where the table has a row per sorted pair (C <= min(B, CHUNK)), else first; every other row 0."""
    from tp_lora.ops.moe_layout import num_lora_blocks
    from tp_lora.ops.triton.moe_plan import CHUNK
    want_g, cap = lora_blocks_ref(sorted_key, E, L), sorted_key.shape[0]
    used, rows = want_g[:, 3] > 0, got_g[:, 3] > 0
    if cap <= min(num_lora_blocks(cap, E, L), CHUNK):
        assert got_g.shape == (cap, 4) and torch.equal(got_g[rows, 2], rows.nonzero()[:, 0].int()), name
    else:
        assert got_g.shape == want_g.shape and rows[:int(used.sum())].all(), name
    assert torch.equal(got_g[rows], want_g[used]) and (got_g[~rows] == 0).all(), f"{name}: LoRA blocks differ"


def test_plan_kernel_rows_per_pair_of_groups_of_many_blocks(device):
    """A table with a row per sorted pair (a decode step's) where (expert, slot) groups of 33 pairs take 3 blocks
    each: a block starts every LORA_BLOCK pairs of its group, whatever the groups before it."""
    from tp_lora.ops.triton.moe_plan import plan_pairs
    n, E, L = 40, 8, 64
    ids = torch.tensor([[5, 0, 1]] * n)
    slots = torch.full((n,), 9, dtype=torch.int32)
    slots[::6] = 2  # groups (e, 2) of 7 pairs ahead of groups (e, 9) of 33
    want = sort_pairs_ref(ids, slots, 0, E, L)
    got = plan_pairs(ids.to(device), slots.to(device), 0, E, L)
    assert torch.equal(got[2].cpu(), want[2])
    assert got[4].shape[0] == want[2].shape[0], "expected a row per sorted pair"
    check_blocks(got[4].cpu(), want[2], E, L, "groups of many blocks")


@pytest.mark.parametrize("lora", [False, True])
def test_plan_and_combine_read_the_dispatch_views_where_they_lie(device, lora):
    """The EP dispatch's unpacked ids, weights and slots are strided column views of the packed rows
    (tp_lora.ops.moe_pack): the plan kernel and the combine read them in place and give what contiguous copies give,
    and nothing writes to the packed rows."""
    from tp_lora.ops import fused
    from tp_lora.ops.moe_pack import pack_tokens_ref, unpack_tokens
    from tp_lora.ops.triton.fused import moe_combine
    from tp_lora.ops.triton.moe_plan import plan_pairs
    n, k, h, e_all, e0, e_local = 21, 4, 24, 16, 4, 8
    g = torch.Generator().manual_seed(41 + lora)
    x = torch.randn(n, h, generator=g)
    ids = torch.rand(n, e_all, generator=g).topk(k, -1).indices
    w = torch.rand(n, k, generator=g)
    L = 3 if lora else 0
    tags = torch.randint(-1, L, (n,), generator=g, dtype=torch.int32) if lora else None
    packed = pack_tokens_ref(x, ids, w, tags, n + 3).to(device)
    before = packed.clone()
    _, uids, uw, utags = unpack_tokens(packed, h, torch.float32, k, lora)
    assert uids.stride(0) > k and uw.stride(0) > k, "the test needs strided views"
    got = plan_pairs(uids, utags, e0, e_local, L)
    want = plan_pairs(uids.contiguous(), None if utags is None else utags.contiguous(), e0, e_local, L)
    for field, a, b in zip(("token", "pos", "sorted_key", "expert_ends", "groups"), want, got, strict=True):
        assert torch.equal(a, b), f"{field} differs"
    yp = torch.randn(got[0].shape[0], h, generator=g).to(device)
    torch.testing.assert_close(moe_combine(yp, got[1], uw), fused.moe_combine_ref(yp, got[1], uw.contiguous()))
    assert torch.equal(packed.view(torch.uint8), before.view(torch.uint8))
