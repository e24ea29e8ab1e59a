"""Triton LoRA ops against the torch reference (tp_lora.ops.torch_ref), on fresh random inputs.

Every case poisons what a correct kernel must not read or write: x rows and shrink-buffer rows of tokens without an
adapter, and weights and scales of slots no token uses, are NaN (a read of them shows up as NaN in the result);
expand's output is checked bit for bit outside the rows/columns it may write, and in overwrite mode the region it
must write starts as NaN. Shapes are small and deliberately not multiples of the block sizes (the interpreter is
slow, and ragged edges are where masks go wrong).
"""
from __future__ import annotations

import zlib

import pytest
import torch

from tp_lora.ops import fp8 as fp8_lib
from tp_lora.ops import torch_ref
from tp_lora.ops import triton as tri
from tp_lora.ops.batch import build_lora_batch
from tp_lora.ops.triton import configs, lora_launch, schedule

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}  # relative error, by norm
SCHEMES = ("sorted", "chunked")
KERNELS = SCHEMES + ("rows",)  # the tiled kernels under each scheme, and the one-token-per-program kernels
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(autouse=True)
def _poison_shrink_buffers(monkeypatch):
    """Shrink allocates its output uninitialised where the kernel must write every row itself: make that NaN."""
    real = lora_launch._new_buffer

    def poisoned(shape, zero, device):
        buf = real(shape, zero, device)
        return buf if zero else buf.fill_(float("nan"))
    monkeypatch.setattr(lora_launch, "_new_buffer", poisoned)


@pytest.fixture(params=KERNELS)
def scheme(request, monkeypatch):
    """The scheme a case passes to shrink / expand, with the kernels forced at every step size: "rows" runs the
    one-token-per-program kernels (scheme None: they have no work table), a scheme the tiled kernels."""
    rows = request.param == "rows"
    monkeypatch.setattr(configs, "SHRINK_ROWS_MAX_T", 1 << 30 if rows else 0)
    monkeypatch.setattr(configs, "EXPAND_ROWS_MAX_T", 1 << 30 if rows else 0)
    return None if rows else request.param


def _gen(*key) -> torch.Generator:
    """A generator seeded per test case (stable across runs, unlike hash() of strings)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _slots(mix: str, t: int, max_loras: int, gen: torch.Generator) -> list[int]:
    if mix == "mixed":  # with tokens of no adapter
        return torch.randint(-1, max_loras, (t,), generator=gen).tolist()
    if mix == "one_adapter":  # not slot 0: a kernel defaulting to slot 0 must fail
        return [max_loras - 1] * t
    if mix == "more_adapters_than_tokens":
        return torch.randperm(max_loras, generator=gen)[:t].tolist()
    if mix == "no_adapter":
        return [-1] * t
    raise ValueError(mix)


def _rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _poison_unused(ws: list[torch.Tensor], slots: list[int]) -> None:
    """NaN into weight slots no token uses, in place (dim 0 = slot)."""
    unused = sorted(set(range(ws[0].shape[0])) - set(slots))
    for w in ws:
        w[unused] = float("nan")


def _weights(n_slices, max_loras, rows, cols, dtype, device, gen, slots, ranks=None, rank_dim=1):
    """n_slices x [L, rows_s, cols] (rows may be a list), zero past each slot's rank (ranks[slot]) along rank_dim,
    NaN in unused slots."""
    rows = rows if isinstance(rows, (list, tuple)) else [rows] * n_slices
    ws = [_rand((max_loras, r, cols), torch.float32, "cpu", gen, scale=0.3) for r in rows]
    if ranks is not None:
        for w in ws:
            for slot, rk in enumerate(ranks):
                w[slot].narrow(rank_dim - 1, rk, w.shape[rank_dim] - rk).zero_()
    _poison_unused(ws, slots)
    return [w.to(dtype).to(device) for w in ws]


def _scales(n_slices, max_loras, slots, device, gen):
    s = torch.rand(n_slices, max_loras, generator=gen) + 0.5
    _poison_unused([s.t()], slots)
    return s.to(device)


def _x(t, k, dtype, device, gen, slots):
    x = _rand((t, k), torch.float32, "cpu", gen)
    if t:
        x[torch.tensor(slots) < 0] = float("nan")
    return x.to(dtype).to(device)


def _buf(n_slices, t, r, device, gen, slots):
    u = _rand((n_slices, t, r), torch.float32, "cpu", gen)
    if t:
        u[:, torch.tensor(slots) < 0] = float("nan")
    return u.to(device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check_shrink(out, ref, slots, dtype):
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not out.isnan().any(), "NaN: the kernel read a poisoned row, slot or scale"
    none = torch.tensor(slots, dtype=torch.long, device=out.device) < 0
    assert (out[:, none] == 0).all(), "rows of tokens without an adapter must be exactly 0"
    assert _rel(out, ref) <= TOL[dtype], f"relative error {_rel(out, ref):.2e} > {TOL[dtype]:.0e}"


def _run_expand(buf, lora_b, batch, out0, slots, offset, add, scheme, **kw):
    """Run both backends on copies of out0; check the Triton result against the reference and that every element
    outside (tokens with an adapter, or with add=False every token) x (target columns) is bit-identical to out0,
    and (add=False) the rows of tokens without an adapter there exactly 0."""
    out, ref = out0.clone(), out0.clone()
    tri.expand(buf, lora_b, batch, out, offset=offset, add=add, scheme=scheme, **kw)
    torch_ref.expand(buf, lora_b, batch, ref, offset=offset, add=add, **kw)
    written = torch.zeros_like(out, dtype=torch.bool)
    width = sum(b.shape[1] for b in lora_b)
    has = torch.tensor(slots, dtype=torch.long, device=out.device) >= 0
    written[has if add else slice(None), offset:offset + width] = True
    if not add:
        assert (out[~has, offset:offset + width] == 0).all() and (ref[~has, offset:offset + width] == 0).all()
    iv = INT_VIEW[out.dtype]
    assert torch.equal(out.view(iv)[~written], out0.view(iv)[~written]), "expand touched rows/columns it must not"
    assert not out[written].isnan().any(), "expand left (NaN-poisoned) elements of its region unwritten"
    if written.any():
        assert _rel(out[written], ref[written]) <= TOL[out.dtype], f"relative error {_rel(out[written], ref[written]):.2e}"
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_slices", [1, 3])
def test_shrink(device, scheme, dtype, n_slices):
    gen = torch.Generator().manual_seed(hash((scheme, str(dtype), n_slices)) % 2**31)
    t, max_loras, rank, k = 37, 5, 16, 72
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, dtype, device, gen, slots)
    lora_a = _weights(n_slices, max_loras, rank, k, dtype, device, gen, slots)
    scales = _scales(n_slices, max_loras, slots, device, gen)
    out = tri.shrink(x, lora_a, scales, batch, scheme=scheme)
    _check_shrink(out, torch_ref.shrink(x, lora_a, scales, batch), slots, dtype)


LAYOUTS = {  # widths of the slices, output offset, extra output columns
    "one_slice": ([48], 0, 0),
    "qkv_gqa": ([40, 8, 8], 0, 0),  # q wider than k / v; widths not multiples of a block
    "qkv_offset": ([40, 8, 8], 5, 3),  # a fully sharded row layer writes into its own columns
    "width_one": ([16, 1, 7], 1, 2),  # 1s are compile-time constants natively: such slices launch alone
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("add", [True, False], ids=["add", "overwrite"])
def test_expand(device, scheme, dtype, layout, add):
    gen = torch.Generator().manual_seed(hash((scheme, str(dtype), layout, add)) % 2**31)
    widths, offset, extra = LAYOUTS[layout]
    t, max_loras, rank = 37, 5, 16
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    buf = _buf(len(widths), t, rank, device, gen, slots)
    lora_b = _weights(len(widths), max_loras, widths, rank, dtype, device, gen, slots)
    out0 = _rand((t, offset + sum(widths) + extra), dtype, device, gen)
    if not add:
        out0[:, offset:offset + sum(widths)] = float("nan")
    _run_expand(buf, lora_b, batch, out0, slots, offset, add, scheme)


@pytest.mark.parametrize("rank", [1, 8, 16, 64, 128, 256])
def test_ranks_with_zero_padded_adapters(device, scheme, rank):
    """Slot buffers have max_rank columns; adapters of smaller rank are zero-padded (as LoRALinear.write does)."""
    gen = torch.Generator().manual_seed(rank)
    t, max_loras, k, widths = 29, 4, 40, [24, 8]
    ranks = [rank, max(1, rank // 2), max(1, rank // 8), rank]
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, torch.float32, device, gen, slots)
    lora_a = _weights(2, max_loras, rank, k, torch.float32, device, gen, slots, ranks=ranks, rank_dim=1)
    lora_b = _weights(2, max_loras, widths, rank, torch.float32, device, gen, slots, ranks=ranks, rank_dim=2)
    scales = _scales(2, max_loras, slots, device, gen)
    u = tri.shrink(x, lora_a, scales, batch, scheme=scheme)
    _check_shrink(u, torch_ref.shrink(x, lora_a, scales, batch), slots, torch.float32)
    _run_expand(u, lora_b, batch, _rand((t, sum(widths)), torch.float32, device, gen), slots, 0, True, scheme)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("base_bias", [False, True], ids=["no_base_bias", "base_bias"])
def test_lora_epilogue(device, dtype, base_bias):
    """DoRA scale and lora_B bias per token's slot; rows of tokens without an adapter stay bit for bit."""
    gen = _gen("epilogue", str(dtype), base_bias)
    t, max_loras, p = 19, 4, 300  # p: more than one column block, not a multiple of one
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    scale = (torch.rand(max_loras, p, generator=gen) + 0.5).to(device)
    bias = _rand((max_loras, p), torch.float32, device, gen)
    _poison_unused([scale, bias], slots)
    bb = _rand((p,), dtype, device, gen) if base_bias else None
    out0 = _rand((t, p), dtype, device, gen)
    out, ref = out0.clone(), out0.clone()
    tri.lora_epilogue(out, scale, bias, batch, base_bias=bb)
    torch_ref.lora_epilogue(ref, scale, bias, batch, base_bias=bb)
    none = torch.tensor(slots, device=device) < 0
    iv = INT_VIEW[dtype]
    assert torch.equal(out.view(iv)[none], out0.view(iv)[none]), "rows of tokens without an adapter changed"
    assert not out.isnan().any(), "NaN: the kernel read a slot no token uses"
    assert _rel(out[~none], ref[~none]) <= TOL[dtype]
    assert _rel(ref[~none], out0[~none]) > 0.1, "the epilogue must change the rows it scales"


MIXES = {  # (mix, T, max_loras)
    "one_adapter_for_all": ("one_adapter", 41, 3),
    "more_adapters_than_tokens": ("more_adapters_than_tokens", 3, 8),
    "no_adapter": ("no_adapter", 9, 4),
    "decode_single_token": ("one_adapter", 1, 4),
    "mixed_with_none": ("mixed", 23, 6),
}


@pytest.mark.parametrize("case", list(MIXES))
def test_adapter_mixes_end_to_end(device, scheme, case):
    """shrink -> expand of a packed layer for each way tokens can split between adapters (bf16, as served)."""
    mix, t, max_loras = MIXES[case]
    gen = torch.Generator().manual_seed(t * 100 + max_loras)
    k, rank, widths = 56, 8, [24, 16]
    slots = _slots(mix, t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, torch.bfloat16, device, gen, slots)
    lora_a = _weights(2, max_loras, rank, k, torch.bfloat16, device, gen, slots)
    lora_b = _weights(2, max_loras, widths, rank, torch.bfloat16, device, gen, slots)
    scales = _scales(2, max_loras, slots, device, gen)
    u = tri.shrink(x, lora_a, scales, batch, scheme=scheme)
    _check_shrink(u, torch_ref.shrink(x, lora_a, scales, batch), slots, torch.bfloat16)
    _run_expand(u, lora_b, batch, _rand((t, sum(widths)), torch.bfloat16, device, gen), slots, 0, True, scheme)


def test_empty_batch(device, scheme):
    batch = build_lora_batch([], 4, device)
    x = torch.zeros(0, 32, dtype=torch.bfloat16, device=device)
    lora_a = [torch.randn(4, 8, 32, device=device).to(torch.bfloat16)]
    u = tri.shrink(x, lora_a, torch.ones(1, 4, device=device), batch, scheme=scheme)
    assert u.shape == (1, 0, 8) and u.dtype == torch.float32
    out = torch.zeros(0, 16, dtype=torch.bfloat16, device=device)
    tri.expand(u, [torch.randn(4, 16, 8, device=device).to(torch.bfloat16)], batch, out, scheme=scheme)
    e = tri.embedding_shrink(torch.zeros(0, dtype=torch.long, device=device),
                             torch.randn(4, 10, 8, device=device), torch.ones(1, 4, device=device), batch)
    assert e.shape == (1, 0, 8)


@pytest.mark.parametrize("tiled", SCHEMES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_and_strided_token_blocks(device, tiled, split_k, monkeypatch):
    """Configs the default table does not pick at these sizes: split-K with atomics, several K blocks per program,
    and (sorted) fewer programs than token blocks, so each program strides over its adapter's blocks."""
    def shrink_cfg(*_):
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=split_k, num_warps=4, num_stages=2)

    def expand_cfg(*_):
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
    monkeypatch.setattr(configs, "shrink_config", shrink_cfg)
    monkeypatch.setattr(configs, "expand_config", expand_cfg)
    monkeypatch.setattr(configs, "SHRINK_ROWS_MAX_T", 0)
    monkeypatch.setattr(configs, "EXPAND_ROWS_MAX_T", 0)
    if tiled == "sorted":
        monkeypatch.setattr(lora_launch, "_m_programs", lambda *a: 2)
    _split_k_case(device, tiled, split_k)


@pytest.mark.parametrize("k_per_program", [32, 1 << 20])
def test_rows_split_k_and_narrow_tiles(device, k_per_program, monkeypatch):
    """The one-token-per-program kernels with small tiles: K split over 3 programs (atomics, a ragged last split),
    or one program looping over every K block; expand over several n blocks of each slice."""
    monkeypatch.setattr(configs, "SHRINK_ROWS", dict(BLOCK_K=16, K_PER_PROGRAM=k_per_program, num_warps=4,
                                                     num_stages=2))
    monkeypatch.setattr(configs, "EXPAND_ROWS", dict(BLOCK_N=16, num_warps=4, num_stages=1))
    monkeypatch.setattr(configs, "SHRINK_ROWS_MAX_T", 1 << 30)
    monkeypatch.setattr(configs, "EXPAND_ROWS_MAX_T", 1 << 30)
    _split_k_case(device, None, 3 if k_per_program == 32 else 1)


def _split_k_case(device, scheme, seed):
    gen = torch.Generator().manual_seed(seed)
    t, max_loras, rank, k, widths = 70, 3, 24, 88, [20, 36]  # rank 24 > BLOCK_K: expand loops over K too
    slots = [0] * 50 + [-1] * 5 + [2] * 15  # 4 blocks of 16 for slot 0
    perm = torch.randperm(t, generator=gen).tolist()
    slots = [slots[i] for i in perm]
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, torch.float32, device, gen, slots)
    lora_a = _weights(2, max_loras, rank, k, torch.float32, device, gen, slots)
    lora_b = _weights(2, max_loras, widths, rank, torch.float32, device, gen, slots)
    scales = _scales(2, max_loras, slots, device, gen)
    u = tri.shrink(x, lora_a, scales, batch, scheme=scheme)
    _check_shrink(u, torch_ref.shrink(x, lora_a, scales, batch), slots, torch.float32)
    _run_expand(u, lora_b, batch, _rand((t, sum(widths)), torch.float32, device, gen), slots, 0, True, scheme)


def test_many_slices_and_strided_weights(device):
    """More slices than one launch takes (3), and a slice with other strides: split into several launches."""
    gen = torch.Generator().manual_seed(7)
    t, max_loras, rank, k, widths = 19, 3, 8, 40, [8, 16, 8, 24, 16]
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, torch.float32, device, gen, slots)
    lora_a = _weights(5, max_loras, rank, k, torch.float32, device, gen, slots)
    lora_a[1] = lora_a[1].transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major rows
    lora_b = _weights(5, max_loras, widths, rank, torch.float32, device, gen, slots)
    lora_b[3] = lora_b[3].transpose(1, 2).contiguous().transpose(1, 2)
    scales = _scales(5, max_loras, slots, device, gen)
    u = tri.shrink(x, lora_a, scales, batch)
    _check_shrink(u, torch_ref.shrink(x, lora_a, scales, batch), slots, torch.float32)
    _run_expand(u, lora_b, batch, _rand((t, 2 + sum(widths)), torch.float32, device, gen), slots, 2, True, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab_start", [0, 11])
def test_embedding_shrink(device, dtype, vocab_start):
    gen = torch.Generator().manual_seed(vocab_start)
    t, max_loras, vocab_local, rank = 33, 4, 20, 16
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    # ids on both sides of this rank's vocab range [vocab_start, vocab_start + vocab_local)
    ids = torch.randint(0, vocab_start + vocab_local + 8, (t,), generator=gen).to(device)
    lora_a_t = _weights(1, max_loras, vocab_local, rank, dtype, device, gen, slots)[0]
    scales = _scales(1, max_loras, slots, device, gen)
    out = tri.embedding_shrink(ids, lora_a_t, scales, batch, vocab_start)
    ref = torch_ref.embedding_shrink(ids, lora_a_t, scales, batch, vocab_start)
    assert not out.isnan().any()
    assert torch.equal(out, ref)  # a scaled row lookup: exact


def test_quantize_fp8_per_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 16, generator=gen) * torch.rand(3, 40, 1, generator=gen) * 5
    w[1, 7] = 0.0  # an all-zero channel (zero-padded slot) must stay exact
    q, s = fp8_lib.quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 40) and s.dtype == torch.float32
    back = q.float() * s.unsqueeze(-1)
    assert (back[1, 7] == 0).all()
    assert _rel(back, w) < 0.05  # e4m3: 3 mantissa bits
    assert (q.float().abs().amax(-1)[w.abs().amax(-1) > 0] == fp8_lib.FP8_MAX).all()  # full range used


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_weights(device, scheme, dtype):
    """fp8 A and B with per-channel scales: the kernels dequantise on the fly and match the reference on the very
    same fp8 weights (no extra error), and the dequantised weights within fp8 rounding."""
    gen = torch.Generator().manual_seed(hash((scheme, str(dtype))) % 2**31)
    t, max_loras, rank, k, widths = 31, 4, 16, 64, [40, 8, 8]
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, dtype, device, gen, slots)
    a_hi = _weights(3, max_loras, rank, k, torch.float32, device, gen, slots)
    b_hi = _weights(3, max_loras, widths, rank, torch.float32, device, gen, slots)
    a8, a_sc = zip(*(fp8_lib.quantize_fp8_per_channel(a) for a in a_hi))
    b8, b_sc = zip(*(fp8_lib.quantize_fp8_per_channel(b) for b in b_hi))
    scales = _scales(3, max_loras, slots, device, gen)
    u = tri.shrink(x, a8, scales, batch, a_scales=a_sc, scheme=scheme)
    _check_shrink(u, torch_ref.shrink(x, a8, scales, batch, a_scales=a_sc), slots, dtype)
    out0 = _rand((t, sum(widths)), dtype, device, gen)
    out = _run_expand(u, b8, batch, out0, slots, 0, True, scheme, b_scales=b_sc)
    hi = out0.clone()
    torch_ref.expand(torch_ref.shrink(x, a_hi, scales, batch), b_hi, batch, hi)
    has = torch.tensor(slots, device=device) >= 0
    assert _rel(out[has] - out0[has], hi[has] - out0[has]) < 0.08  # fp8 rounding of A and B


# --- schedule: the per-step work tables ---

def _table(sched):
    return sched.table.cpu().tolist()


@pytest.mark.parametrize("seg", [16, 32])
def test_chunked_segments_cover_each_adapter_once(seg):
    gen = torch.Generator().manual_seed(seg)
    t, max_loras = 150, 6
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, "cpu")
    sched = tri.prepare(batch, "chunked", seg)
    assert sched.entries == schedule.chunked_entries(t, max_loras, seg) == -(-t // seg) + max_loras + 1
    order = batch.order.tolist()
    seen = []
    for slot, start, count in zip(*_table(sched)):
        assert 0 <= count <= seg
        toks = order[start:start + count]
        assert all(slots[i] == slot for i in toks)  # one adapter (or none: slot -1) per segment
        seen += toks
    assert sorted(seen) == list(range(t))  # every token once, those without an adapter too (shrink zeroes them)


def test_sorted_table_is_padded_to_max_loras_plus_one():
    batch = build_lora_batch([2, -1, 2, 0, 5], 8, "cpu")
    sched = tri.prepare(batch, "sorted")
    assert sched.entries == 9  # the adapters' groups and the no-adapter group
    assert _table(sched) == [[-1, 0, 2, 5, -1, -1, -1, -1, -1], [0, 1, 2, 4, 0, 0, 0, 0, 0],
                             [1, 1, 2, 1, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_grid_shape_depends_only_on_t_and_max_loras(scheme):
    """What a CUDA graph needs: every split of T tokens between adapters gives tables of one shape."""
    gen = torch.Generator().manual_seed(3)
    shapes = {tuple(tri.prepare(build_lora_batch(_slots(mix, 6, 8, gen), 8, "cpu"), scheme).table.shape)
              for mix in ("mixed", "one_adapter", "no_adapter", "more_adapters_than_tokens")}
    assert len(shapes) == 1


def test_schedule_built_once_per_step(device, monkeypatch):
    """Derived metadata is built (and copied to the device) once per step and scheme, not once per layer."""
    monkeypatch.setattr(configs, "SHRINK_ROWS_MAX_T", 0)  # the tiled kernels (the others build no table)
    monkeypatch.setattr(configs, "EXPAND_ROWS_MAX_T", 0)
    copies = []
    real = schedule.to_device
    monkeypatch.setattr(schedule, "to_device", lambda tables, dev: copies.append(1) or real(tables, dev))
    gen = torch.Generator().manual_seed(5)
    t, max_loras = 20, 3
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, 32, torch.float32, device, gen, slots)
    lora_a = _weights(1, max_loras, 8, 32, torch.float32, device, gen, slots)
    lora_b = _weights(1, max_loras, 16, 8, torch.float32, device, gen, slots)
    scales = _scales(1, max_loras, slots, device, gen)
    for _layer in range(3):
        u = tri.shrink(x, lora_a, scales, batch)
        tri.expand(u, lora_b, batch, torch.zeros(t, 16, device=device))
    assert len(copies) == 1 and len(batch.derived) == 1
    tri.set_scheme("sorted")
    tri.shrink(x, lora_a, scales, batch)
    assert len(copies) == 2 and len(batch.derived) == 2  # one per scheme


def test_set_scheme_validates():
    with pytest.raises(ValueError):
        tri.set_scheme("banana")
    with pytest.raises(ValueError):
        tri.set_scheme("chunked", segment_size=24)
    tri.set_scheme("chunked", segment_size=32)
    batch = build_lora_batch([0, 1, 1], 2, "cpu")
    assert tri.prepare(batch).segment_size == 32
    assert ("chunked", 32) in batch.derived


def test_backend_is_reachable_by_name():
    from tp_lora.ops import get_backend
    ops = get_backend("triton")
    for name in ("shrink", "expand", "embedding_shrink"):
        assert callable(getattr(ops, name))


# --- CUDA only: graph capture and host syncs ---

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, sync detection)")


@cuda_only
@pytest.mark.gpu
def test_cuda_graph_replays_another_adapter_split(scheme):
    """Capture shrink + expand for one split of T tokens, copy another split's order and table into the captured
    buffers, replay: the result matches the reference for the new split (grid fixed by T and max_loras)."""
    dev, gen = "cuda", torch.Generator().manual_seed(11)
    t, max_loras, k, rank, widths = 48, 8, 64, 16, [64, 16, 16]
    first = build_lora_batch(_slots("one_adapter", t, max_loras, gen), max_loras, dev)
    x = _rand((t, k), torch.bfloat16, dev, gen)
    lora_a = [_rand((max_loras, rank, k), torch.bfloat16, dev, gen, 0.3) for _ in widths]
    lora_b = [_rand((max_loras, w, rank), torch.bfloat16, dev, gen, 0.3) for w in widths]
    scales = torch.rand(3, max_loras, generator=gen).to(dev)
    out = torch.zeros(t, sum(widths), dtype=torch.bfloat16, device=dev)
    sched = tri.prepare(first, scheme)

    def step():
        out.zero_()
        tri.expand(tri.shrink(x, lora_a, scales, first, scheme=scheme), lora_b, first, out, scheme=scheme)
    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    second = build_lora_batch(_slots("mixed", t, max_loras, gen), max_loras, dev)
    first.token_slot.copy_(second.token_slot)
    first.order.copy_(second.order)
    sched.table.copy_(tri.prepare(second, scheme).table)
    graph.replay()
    ref = torch.zeros_like(out)
    torch_ref.expand(torch_ref.shrink(x, lora_a, scales, second), lora_b, second, ref)
    assert _rel(out, ref) < TOL[torch.bfloat16]


@cuda_only
@pytest.mark.gpu
def test_no_host_sync(scheme):
    dev, gen = "cuda", torch.Generator().manual_seed(12)
    t, max_loras = 40, 4
    slots = _slots("mixed", t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, dev)
    x = _rand((t, 64), torch.bfloat16, dev, gen)
    lora_a = [_rand((max_loras, 16, 64), torch.bfloat16, dev, gen)]
    lora_b = [_rand((max_loras, 32, 16), torch.bfloat16, dev, gen)]
    scales = torch.ones(1, max_loras, device=dev)
    out = torch.zeros(t, 32, dtype=torch.bfloat16, device=dev)
    tri.expand(tri.shrink(x, lora_a, scales, batch, scheme=scheme), lora_b, batch, out, scheme=scheme)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tri.expand(tri.shrink(x, lora_a, scales, batch, scheme=scheme), lora_b, batch, out, scheme=scheme)
        tri.embedding_shrink(torch.zeros(t, dtype=torch.long, device=dev), torch.randn(max_loras, 10, 16, device=dev),
                             scales, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
