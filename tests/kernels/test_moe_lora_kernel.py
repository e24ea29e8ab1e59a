"""Triton fused MoE LoRA (shrink / expand) against the torch reference, under TRITON_INTERPRET=1 on the CPU.

Routings leave experts and whole (expert, slot) groups empty, tokens without an adapter are mixed in, ranks and
widths are not powers of two. Expand writes into a poisoned output: rows of pairs with no adapter must come back
bit-identical (NaN stays NaN), the others must equal the reference."""
import pytest
import torch

from tp_lora.ops import moe_ref
from tp_lora.ops.moe_plan import build_plan

L, E_ALL, K = 3, 8, 2


def _pairs(n: int, e0: int, e_local: int, gen: torch.Generator, device, skew: bool = False):
    logits = torch.randn(n, E_ALL, generator=gen)
    if skew:  # every token to experts 0 and 1: other experts (and other ranks' experts) get nothing
        logits[:, 2:] -= 100
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    slots = torch.randint(-1, L, (n,), generator=gen)
    slots[slots == 1] = -1  # slot 1 unused: its groups are empty
    return build_plan(ids.to(device), w.to(device), slots.to(torch.int32).to(device), e0, e_local, L, lora=True)


# Launch settings besides the defaults: narrow tiles with ragged last ones (K = 48 / 20 in 16- or 32-wide runs; widths
# 20 and 48 in 16- or 32-column tiles), the fused op's columns over several programs (one 20-column slice in 2 or 3);
# the fused op's one-pair blocks on its rows path in narrow tiles ("narrow"; by default in wide ones), or on the tiles
# as larger blocks ("ragged").
LAUNCHES = {"default": ({}, {}, {}),
            "narrow": (dict(BLOCK_K=16, num_warps=1, num_stages=2), dict(BLOCK_N=16, num_warps=1, num_stages=1),
                       dict(BLOCK_K=16, BLOCK_N=16, N_PER_PROGRAM=16, num_warps=1, num_stages=2, ROW_K=16,
                            ROW_N=16)),
            "ragged": (dict(BLOCK_K=32), dict(BLOCK_N=32),
                       dict(BLOCK_K=32, BLOCK_N=16, N_PER_PROGRAM=8, ONE_ROW=False))}


CASES = [(case, dtype, "default") for case in ("local_half", "all_experts", "skewed_elsewhere", "no_lora")
         for dtype in (torch.float32, torch.bfloat16)]
CASES += [("all_experts", torch.float32, launch) for launch in LAUNCHES if launch != "default"]
CASES += [("local_half", torch.bfloat16, launch) for launch in LAUNCHES if launch != "default"]


@pytest.mark.parametrize("case,dtype,launch", CASES)
def test_moe_lora_matches_reference(device, dtype, case, launch, monkeypatch):
    from tp_lora.ops.triton import moe_lora

    for name, cfg in zip(("SHRINK", "EXPAND", "FUSED"), LAUNCHES[launch]):
        monkeypatch.setattr(moe_lora, name, dict(getattr(moe_lora, name), **cfg))
    gen = torch.Generator().manual_seed(hash((case, str(dtype), launch)) % 2**31)
    n, hidden, inter, rank = 37, 48, 20, 12
    e0, e_local = {"local_half": (4, 4), "all_experts": (0, 8), "skewed_elsewhere": (4, 4),
                   "no_lora": (0, 8)}[case]
    pairs = _pairs(n, e0, e_local, gen, device, skew=case == "skewed_elsewhere")
    if case == "no_lora":
        pairs = build_plan(pairs.expert[:, None].long() + e0, pairs.weight[:, None], None, e0, e_local, L)
    p = pairs.num_pairs
    # bf16: the rounding of r-term dots of O(1) values
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rnd(p, hidden)
    a13 = [rnd(L, e_local, rank, hidden, scale=hidden ** -0.5) for _ in range(2)]
    b13 = [rnd(L, e_local, inter, rank) for _ in range(2)]
    a2 = [rnd(L, e_local, rank, inter, scale=inter ** -0.5)]
    b2 = [rnd(L, e_local, hidden, rank)]
    scales = (torch.rand(3, L, e_local, generator=gen) + 0.5).to(device)

    # w1 | w3: one shrink launch for both slices, then expand into the packed [P, 2I] gate_up output.
    u_ref = moe_ref.moe_lora_shrink(x, a13, scales[:2], pairs)
    u = moe_lora.moe_lora_shrink(x, a13, scales[:2], pairs)
    torch.testing.assert_close(u, u_ref, **tol)
    lora_rows = pairs.slot >= 0
    assert (u[:, ~lora_rows] == 0).all(), "pairs without an adapter must shrink to exact zeros"
    for add in (True, False):
        poison = rnd(p, 2 * inter)
        poison[~lora_rows] = float("nan")
        z_ref, z = poison.clone(), poison.clone()
        moe_ref.moe_lora_expand(u_ref, b13, pairs, z_ref, add=add)
        moe_lora.moe_lora_expand(u_ref, b13, pairs, z, add=add)
        torch.testing.assert_close(z, z_ref, equal_nan=True, **tol)
        assert torch.isnan(z[~lora_rows]).all(), "rows of pairs without an adapter were written"

    # The fused op: the same sum in one launch (u in registers), untouched rows untouched.
    z_ref, z = poison.clone(), poison.clone()
    moe_ref.moe_lora_fused(x, a13, scales[:2], b13, pairs, z_ref)
    moe_lora.moe_lora_fused(x, a13, scales[:2], b13, pairs, z)
    torch.testing.assert_close(z, z_ref, equal_nan=True, **tol)
    assert torch.isnan(z[~lora_rows]).all(), "rows of pairs without an adapter were written"
    # ... reading each pair's row where it lies (rows: the pairs' tokens, as the model passes the dispatched tokens)
    tokens = rnd(n + 5, hidden)
    rows = torch.randint(0, n + 5, (p,), generator=gen).to(device)
    z_rows = poison.clone()
    moe_lora.moe_lora_fused(tokens, a13, scales[:2], b13, pairs, z_rows, rows=rows)
    z_ref = poison.clone()
    moe_ref.moe_lora_fused(tokens[rows], a13, scales[:2], b13, pairs, z_ref)
    torch.testing.assert_close(z_rows, z_ref, equal_nan=True, **tol)
    assert torch.isnan(z_rows[~lora_rows]).all(), "rows of pairs without an adapter were written"

    # w2: one slice, expanded at an offset into a wider output (a fully sharded rank's columns of the sum).
    h = rnd(p, inter)
    u2_ref = moe_ref.moe_lora_shrink(h, a2, scales[2:], pairs)
    u2 = moe_lora.moe_lora_shrink(h, a2, scales[2:], pairs)
    torch.testing.assert_close(u2, u2_ref, **tol)
    y = rnd(p, hidden + 16)
    y_ref, y_fused = y.clone(), y.clone()
    moe_ref.moe_lora_expand(u2_ref, b2, pairs, y_ref, offset=16)
    moe_lora.moe_lora_expand(u2_ref, b2, pairs, y, offset=16)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y[:, :16], y_ref[:, :16], rtol=0, atol=0)
    moe_lora.moe_lora_fused(h, a2, scales[2:], b2, pairs, y_fused, offset=16)
    torch.testing.assert_close(y_fused, y_ref, **tol)
    torch.testing.assert_close(y_fused[:, :16], y_ref[:, :16], rtol=0, atol=0)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_lora_fp8_b(device, dtype):
    """lora.dtype=fp8: expert B as e4m3 with per-output-channel scales (tp_lora.ops.fp8, the dense layers' helper).
    Triton matches the reference on the very same fp8 weights, untouched rows stay untouched (NaN), and both are
    within the dense fp8 bound (tests/kernels/test_lora_ops.py::test_fp8_weights) of the unquantised B. An expert
    with an all-zero B (an empty slot) keeps scale 1 and adds exact zeros."""
    from tp_lora.ops import fp8 as fp8_lib
    from tp_lora.ops.triton import moe_lora

    gen = torch.Generator().manual_seed(hash(("fp8", str(dtype))) % 2**31)
    n, inter, rank, e0, e_local = 29, 24, 12, 0, 8
    pairs = _pairs(n, e0, e_local, gen, device)
    p = pairs.num_pairs
    lora_rows = pairs.slot >= 0
    u = torch.randn(2, p, rank, generator=gen).to(device) * lora_rows[None, :, None].to(device)
    b_hi = [torch.randn(L, e_local, w, rank, generator=gen) * torch.rand(L, e_local, w, 1, generator=gen)
            for w in (inter, inter)]
    b_hi[1][0, 3] = 0.0  # an empty expert of one slot: exact zeros
    b8, b_sc = zip(*(fp8_lib.quantize_fp8_per_channel(b) for b in b_hi))
    b8, b_sc = [b.to(device) for b in b8], [s.to(device) for s in b_sc]
    assert all(b.dtype == torch.float8_e4m3fn for b in b8) and b_sc[0].shape == (L, e_local, inter)
    assert (b_sc[1][0, 3] == 1).all()

    out0 = (torch.randn(p, 2 * inter, generator=gen)).to(dtype).to(device)
    out0[~lora_rows] = float("nan")
    got, ref, hi = out0.clone(), out0.clone(), out0.clone()
    moe_lora.moe_lora_expand(u, b8, pairs, got, b_scales=b_sc)
    moe_ref.moe_lora_expand(u, b8, pairs, ref, b_scales=b_sc)
    moe_ref.moe_lora_expand(u, [b.to(device) for b in b_hi], pairs, hi)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=6e-2)
    torch.testing.assert_close(got, ref, equal_nan=True, **tol)
    assert torch.isnan(got[~lora_rows]).all(), "rows of pairs without an adapter were written"
    has = lora_rows
    assert _rel(got[has] - out0[has], hi[has] - out0[has]) < 0.08  # fp8 rounding of B
    assert _rel(ref[has] - out0[has], hi[has] - out0[has]) < 0.08
    # The fused op on the same fp8 B: shrink (A from u's source) and expand in one launch.
    x = torch.randn(p, 16, generator=gen).to(dtype).to(device)
    a = [torch.randn(L, e_local, rank, 16, generator=gen).to(dtype).to(device) * 0.25 for _ in range(2)]
    scales = (torch.rand(2, L, e_local, generator=gen) + 0.5).to(device)
    fused, fused_ref = out0.clone(), out0.clone()
    moe_lora.moe_lora_fused(x, a, scales, b8, pairs, fused, b_scales=b_sc)
    moe_ref.moe_lora_fused(x, a, scales, b8, pairs, fused_ref, b_scales=b_sc)
    torch.testing.assert_close(fused, fused_ref, equal_nan=True, **tol)
    assert torch.isnan(fused[~lora_rows]).all(), "rows of pairs without an adapter were written"
    # One slice alone (w2) at an offset, with the scales of a wider stack: the same dequantisation.
    y0 = torch.randn(p, inter + 8, generator=gen).to(dtype).to(device)
    y, y_ref = y0.clone(), y0.clone()
    moe_lora.moe_lora_expand(u[1:], b8[1:], pairs, y, offset=8, b_scales=b_sc[1:])
    moe_ref.moe_lora_expand(u[1:], b8[1:], pairs, y_ref, offset=8, b_scales=b_sc[1:])
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y[:, :8], y0[:, :8], rtol=0, atol=0)


def test_backends_expose_the_moe_ops():
    from tp_lora.ops import get_backend
    for name in ("torch", "triton"):
        ops = get_backend(name)
        assert callable(ops.moe_lora_shrink) and callable(ops.moe_lora_expand), name
        assert callable(ops.moe_lora_fused), name


def test_empty_pairs():
    from tp_lora.ops.triton import moe_lora

    pairs = build_plan(torch.zeros(0, K, dtype=torch.long), torch.zeros(0, K), torch.zeros(0, dtype=torch.int32),
                       0, 4, L, lora=True)
    a = [torch.zeros(L, 4, 8, 16)]
    u = moe_lora.moe_lora_shrink(torch.zeros(0, 16), a, torch.ones(1, L, 4), pairs)
    assert u.shape == (1, 0, 8)
    moe_lora.moe_lora_expand(u, [torch.zeros(L, 4, 16, 8)], pairs, torch.zeros(0, 16))
    moe_lora.moe_lora_fused(torch.zeros(0, 16), a, torch.ones(1, L, 4), [torch.zeros(L, 4, 16, 8)], pairs,
                            torch.zeros(0, 16))


def test_fused_needs_one_b_per_a():
    from tp_lora.ops.triton import moe_lora

    pairs = _pairs(5, 0, 4, torch.Generator().manual_seed(0), "cpu")
    a, b = [torch.zeros(L, 4, 8, 16)] * 2, [torch.zeros(L, 4, 16, 8)]
    with pytest.raises(ValueError, match="2 A stacks for 1 B stacks"):
        moe_lora.moe_lora_fused(torch.zeros(pairs.num_pairs, 16), a, torch.ones(2, L, 4), b, pairs,
                                torch.zeros(pairs.num_pairs, 32))
