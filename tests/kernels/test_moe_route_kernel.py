"""The MoE router in one Triton launch (logits, softmax top-k and, when asked, the routing plan) against independent
torch references: float32 logits of the same operands, softmax, a stable descending sort (the lowest index among
equal weights), and the plan's references (sort_pairs_ref, searchsorted, lora_blocks_ref). Operands lie on a grid of
multiples of 1/64 so that every logit is exact in any summation order (and ties happen: their order is checked).
Cases: Mixtral's 8 experts, Qwen3's 128 at top-8, 60 experts (not a power of two), one row, the most rows, hidden
sizes off the kernel's tiles, graph padding rows, a rank holding part of the experts, adapter slots."""
import pytest
import torch

from tp_lora.ops.moe_plan import lora_blocks_ref, sort_pairs_ref

CASES = {  # name: (rows, hidden, experts, k, renormalize, round weights)
    "mixtral": (7, 96, 8, 2, True, False),
    "qwen3": (32, 256, 128, 8, True, True),
    "sixty_experts": (5, 200, 60, 4, False, True),
    "one_row": (1, 128, 16, 3, True, False),
    "most_rows": (64, 64, 128, 8, True, False),
}


def _grid(shape, gen, lo=-4, hi=5, unit=64.0):
    return torch.randint(lo, hi, shape, generator=gen).float() / unit


def _reference(x, w, k, renormalize, round_weights, valid, first):
    """Top-k ids / weights of softmax(x @ w^T) (logits rounded to x's dtype), lowest index first among equals."""
    p = torch.softmax((x.float() @ w.float().T).to(x.dtype).float(), -1)
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    wts = p.gather(1, order)
    if renormalize:
        wts = wts / wts.sum(-1, keepdim=True)
    if round_weights:
        wts = wts.to(x.dtype).float()
    if valid is not None:
        order = order.masked_fill((torch.arange(first, first + x.shape[0]) >= valid)[:, None], -1)
    return order, wts


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_route_kernel_matches_softmax_topk(device, name, padding):
    from tp_lora.ops.triton.moe_route import route
    from tp_lora.ops.triton.tickets import tickets
    n, hidden, experts, k, renorm, rnd = CASES[name]
    g = torch.Generator().manual_seed(n * 1000 + experts + padding)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        x, w = _grid((n, hidden), g).to(dtype), _grid((experts, hidden), g).to(dtype)
        valid, first = (torch.tensor([max(1, n - 2)], dtype=torch.int32), 1) if padding else (None, 0)
        want_ids, want_w = _reference(x, w, k, renorm, rnd, None if valid is None else valid.item(), first)
        ids, wts, plan = route(x.to(device), w.to(device), k, renorm, rnd,
                               None if valid is None else valid.to(device), first)
        assert plan is None and ids.dtype == torch.int64 and wts.dtype == torch.float32
        assert torch.equal(ids.cpu(), want_ids), f"{name} {dtype}: ids differ"
        torch.testing.assert_close(wts.cpu(), want_w, rtol=1e-6, atol=1e-6)
        assert not tickets(ids.device, 1).any()


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("e0, local", [(0, 128), (32, 64), (120, 8)])
def test_route_kernel_plans_the_pairs_as_the_references(device, e0, local, lora):
    """Qwen3's routing (128 experts, top-8, 32 rows) with the plan of the experts [e0, e0 + local)."""
    from tp_lora.ops.triton.moe_route import route
    n, hidden, experts, k = 32, 128, 128, 8
    g = torch.Generator().manual_seed(e0 + local + lora)
    x, w = _grid((n, hidden), g), _grid((experts, hidden), g)
    L = 4 if lora else 0
    slots = torch.randint(-1, L, (n,), generator=g, dtype=torch.int32) if lora else None
    ids, wts, plan = route(x.to(device), w.to(device), k, True, False, None, 0,
                           None if slots is None else slots.to(device), (e0, local, L))
    want_ids, _ = _reference(x, w, k, True, False, None, 0)
    assert torch.equal(ids.cpu(), want_ids)
    want = sort_pairs_ref(want_ids, slots, e0, local, L)
    bounds = torch.arange(L + 1, (local + 1) * (L + 1), L + 1, dtype=torch.int32)
    want += (torch.searchsorted(want[2], bounds, out_int32=True),)
    for field, a, b in zip(("token", "pos", "sorted_key", "expert_ends"), want, plan[:4], strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape, field
        assert torch.equal(b.cpu(), a), f"{field} differs"
    if lora:
        want_g, got_g = lora_blocks_ref(want[2], local, L), plan[4].cpu()
        used = want_g[:, 3] > 0
        assert got_g.shape == want_g.shape
        assert torch.equal(got_g[:int(used.sum())], want_g[used]) and (got_g[int(used.sum()):] == 0).all()
    else:
        assert plan[4].shape == (0, 4)


def test_route_dispatch_plans_in_the_kernel_or_after_it(device, monkeypatch):
    """tp_lora.ops.moe_plan.route with kernels forced: decode rows take the one launch (its plan equals build_plan's
    over its ids), rows past the kernel's logits take F.linear + moe_topk + build_plan: both give the same routing."""
    from tp_lora.ops import fused, moe_plan
    from tp_lora.ops.triton import moe_route
    monkeypatch.setattr(fused, "KERNELS", True)
    calls = []
    real = moe_route.route
    monkeypatch.setattr(moe_route, "route", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    w = _grid((16, 64), g).to(device)
    for n in (12, 2048):  # 2048 x 16 padded logits: more than one program holds
        x = _grid((n, 64), g).to(device)
        slots = torch.randint(-1, 2, (n,), generator=g, dtype=torch.int32).to(device)
        local = moe_plan.Local(slots, 4, 8, 2, True)
        ids, wts, plan = moe_plan.route(x, w, 2, True, False, local=local)
        want = moe_plan.build_plan(ids, wts, *local)
        for field in ("token", "pos", "sorted_key", "expert_ends", "groups", "weight"):
            assert torch.equal(getattr(plan, field), getattr(want, field)), f"{n} rows: {field}"
        assert plan.keys_per_expert == want.keys_per_expert
    assert calls == [12], "decode rows take the kernel, a prefill's rows do not"
