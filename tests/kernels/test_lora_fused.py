"""The fused LoRA op (tp_lora.ops.triton.shrink_expand: shrink and expand in one launch) against the torch reference
(tp_lora.ops.torch_ref.shrink_expand), on fresh random inputs poisoned like test_lora_ops: x rows of tokens without
an adapter and weights / scales of slots no token uses are NaN, and every output element outside (tokens with an
adapter) x (the layer's columns) must stay bit-identical.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tp_lora.lora.batch import build_lora_batch
from tp_lora.ops import fp8 as fp8_lib
from tp_lora.ops import torch_ref
from tp_lora.ops import triton as tri
from tp_lora.ops.triton import configs

sys.path.insert(0, os.path.dirname(__file__))
from test_lora_ops import INT_VIEW, MIXES, SCHEMES, TOL, _gen, _rand, _rel, _scales, _slots, _weights, _x  # noqa: E402


def _layer(gen, device, t, max_loras, k, widths, rank, dtype, mix="mixed", ranks=None):
    """Inputs of one LoRA layer: slots, batch, x, A and B per slice (zero past each slot's rank), scales."""
    slots = _slots(mix, t, max_loras, gen)
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, dtype, device, gen, slots)
    lora_a = _weights(len(widths), max_loras, rank, k, dtype, device, gen, slots, ranks=ranks, rank_dim=1)
    lora_b = _weights(len(widths), max_loras, widths, rank, dtype, device, gen, slots, ranks=ranks, rank_dim=2)
    return slots, batch, x, lora_a, lora_b, _scales(len(widths), max_loras, slots, device, gen)


def _check(slots, batch, x, lora_a, lora_b, scales, out0, offset=0, scheme=None, tol=None, **kw):
    """Run the fused op and the reference on copies of out0; the fused result must match inside the region it may
    write and leave everything else bit-identical."""
    out, ref = out0.clone(), out0.clone()
    tri.shrink_expand(x, lora_a, lora_b, scales, batch, out, offset, scheme=scheme, **kw)
    ws, counts = tri._fused_workspace(out.device, 1)
    assert not ws.any() and not counts.any(), "the K-split workspace must be left zeroed for the next launch"
    torch_ref.shrink_expand(x, lora_a, lora_b, scales, batch, ref, offset, **kw)
    written = torch.zeros_like(out, dtype=torch.bool)
    has = torch.tensor(slots, dtype=torch.long, device=out.device) >= 0
    written[has, offset:offset + sum(b.shape[1] for b in lora_b)] = True
    iv = INT_VIEW[out.dtype]
    assert torch.equal(out.view(iv)[~written], out0.view(iv)[~written]), "touched rows/columns it must not"
    assert not out[written].isnan().any(), "NaN: read a poisoned row, slot or scale"
    if written.any():
        err = _rel(out[written], ref[written])
        assert err <= (tol or TOL[out.dtype]), f"relative error {err:.2e}"
    return out


LAYOUTS = {  # widths of the slices, output offset, extra output columns
    "one_slice": ([48], 0, 0),
    "qkv_gqa": ([40, 8, 8], 0, 0),  # q wider than k / v (4096 / 1024 / 1024 scaled down), not multiples of a block
    "gate_up": ([36, 36], 3, 5),  # two slices inside a wider output
    "width_one": ([16, 1, 7], 1, 2),  # 1s are compile-time constants natively: such slices launch alone
}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_matches_reference(device, scheme, dtype, layout):
    widths, offset, extra = LAYOUTS[layout]
    gen = _gen("fused", scheme, str(dtype), layout)
    t, max_loras, rank, k = 37, 5, 16, 72
    slots, batch, x, a, b, scales = _layer(gen, device, t, max_loras, k, widths, rank, dtype)
    out0 = _rand((t, offset + sum(widths) + extra), dtype, device, gen)
    _check(slots, batch, x, a, b, scales, out0, offset, scheme)


@pytest.mark.parametrize("rank", [8, 16, 24, 64])
def test_fused_zero_padded_ranks(device, rank):
    """Slots hold max_rank columns; smaller adapters are zero-padded. 24 is not a power of two: the rank tile is
    masked past it."""
    gen = _gen("ranks", rank)
    t, max_loras, k, widths = 29, 4, 40, [24, 8]
    ranks = [rank, max(1, rank // 2), max(1, rank // 8), rank]
    slots, batch, x, a, b, scales = _layer(gen, device, t, max_loras, k, widths, rank, torch.float32, ranks=ranks)
    _check(slots, batch, x, a, b, scales, _rand((t, sum(widths)), torch.float32, device, gen))


FUSED_MIXES = dict(MIXES, many_adapters=("mixed", 64, 40))  # (mix, T, max_loras)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(FUSED_MIXES))
def test_fused_adapter_mixes(device, scheme, case):
    """Every way tokens can split between adapters: one for all, more adapters than tokens, none (nothing may be
    written), a single decode token, many adapters with per-adapter scales."""
    mix, t, max_loras = FUSED_MIXES[case]
    gen = _gen("mixes", scheme, case)
    slots, batch, x, a, b, scales = _layer(gen, device, t, max_loras, 56, [24, 16], 8, torch.float32, mix=mix)
    _check(slots, batch, x, a, b, scales, _rand((t, 40), torch.float32, device, gen), scheme=scheme)


@pytest.mark.parametrize("fp8_a", [False, True], ids=["fp8_b", "fp8_a_and_b"])
def test_fused_fp8_weights(device, fp8_a):
    """fp8 B (lora.dtype=fp8) and fp8 A, per-channel scales: the same values as the reference on the very same fp8
    weights."""
    gen = _gen("fp8", fp8_a)
    t, max_loras, rank, k, widths = 31, 4, 16, 64, [40, 8, 8]
    slots, batch, x, a, b, scales = _layer(gen, device, t, max_loras, k, widths, rank, torch.float32)
    b, b_sc = zip(*(fp8_lib.quantize_fp8_per_channel(w) for w in b))
    kw = dict(b_scales=b_sc)
    if fp8_a:
        a, a_sc = zip(*(fp8_lib.quantize_fp8_per_channel(w) for w in a))
        kw["a_scales"] = a_sc
    _check(slots, batch, x, a, b, scales, _rand((t, sum(widths)), torch.float32, device, gen), **kw)


SPLITS = {  # programs per slice, K split per slice (else N split)
    "n_split_one_each": ((1, 1, 1), (0, 0, 0)),
    "n_split": ((2, 3, 2), (0, 0, 0)),
    "n_split_idle_programs": ((3, 4, 5), (0, 0, 0)),  # more programs than N blocks: some get none
    "k_split": ((2, 3, 6), (1, 1, 1)),  # 6 K blocks: 3 / 2 / 1 per program
    "k_split_idle_programs": ((8, 4, 2), (1, 1, 1)),  # more programs than K blocks: some add nothing
    "mixed": ((4, 2, 3), (1, 0, 1)),
}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("split", list(SPLITS))
def test_fused_program_splits(device, scheme, split, monkeypatch):
    """Configs the model does not pick at these sizes: several programs per slice striding over the N blocks, or
    splitting K (partials through the workspace, the last to arrive expands), several K blocks with a ragged last
    one, and (sorted) groups longer than a token block, shared between two programs."""
    programs, splits = SPLITS[split]

    def cfg(*_):
        return dict(BLOCK_R=32, BLOCK_K=16, BLOCK_N=16, PROGRAMS=programs, SPLIT_K=splits, num_warps=4, num_stages=2)
    monkeypatch.setattr(configs, "fused_config", cfg)
    if scheme == "sorted":
        monkeypatch.setattr(tri, "_m_programs", lambda *a: 2)
    gen = _gen("splits", scheme, split)
    t, max_loras, rank, k, widths = 70, 3, 24, 88, [20, 100, 52]  # 2, 7 and 4 N blocks of 16; K = 5.5 blocks
    slots = [0] * 50 + [-1] * 5 + [2] * 15  # 4 token blocks of 16 for slot 0
    slots = [slots[i] for i in torch.randperm(t, generator=gen).tolist()]
    batch = build_lora_batch(slots, max_loras, device)
    x = _x(t, k, torch.float32, device, gen, slots)
    a = _weights(3, max_loras, rank, k, torch.float32, device, gen, slots)
    b = _weights(3, max_loras, widths, rank, torch.float32, device, gen, slots)
    scales = _scales(3, max_loras, slots, device, gen)
    _check(slots, batch, x, a, b, scales, _rand((t, sum(widths)), torch.float32, device, gen), scheme=scheme)


def test_fused_is_one_launch_and_falls_back_above_its_sizes(device, monkeypatch):
    """Decode sizes never go through shrink / expand (no intermediate, no zero fill); above FUSED_MAX_TOKENS the
    pair computes the same thing."""
    calls = []
    real_shrink = tri.shrink
    monkeypatch.setattr(tri, "shrink", lambda *a, **k: calls.append("shrink") or real_shrink(*a, **k))
    gen = _gen("fallback")
    slots, batch, x, a, b, scales = _layer(gen, device, 20, 4, 32, [16, 8], 8, torch.float32)
    out0 = _rand((20, 24), torch.float32, device, gen)
    fused = _check(slots, batch, x, a, b, scales, out0)
    assert calls == []
    monkeypatch.setattr(configs, "FUSED_MAX_TOKENS", 8)
    pair = _check(slots, batch, x, a, b, scales, out0)
    assert calls == ["shrink"]
    torch.testing.assert_close(pair, fused, rtol=1e-6, atol=1e-6)


def test_fused_refuses_unpaired_slices(device):
    x = torch.zeros(3, 8, device=device)
    a = [torch.zeros(2, 4, 8, device=device)] * 2
    b = [torch.zeros(2, 16, 4, device=device)]
    batch = build_lora_batch([0, 1, 0], 2, device)
    for ops in (tri, torch_ref):
        with pytest.raises(ValueError, match="2 A slices but 1 B slices"):
            ops.shrink_expand(x, a, b, torch.ones(2, 2, device=device), batch, torch.zeros(3, 16, device=device))


def test_refreshed_static_batch_matches_direct(device):
    """What a CUDA-graph replay relies on (checked here without a graph): the fused op run on a static batch whose
    buffers were refreshed with a new split computes what the new batch computes directly."""
    gen = _gen("refresh")
    t, max_loras, k, widths, rank = 12, 4, 32, [24, 8], 8
    a = [_rand((max_loras, rank, k), torch.float32, device, gen) for _ in widths]
    b = [_rand((max_loras, w, rank), torch.float32, device, gen) for w in widths]
    scales = torch.rand(2, max_loras, generator=gen).to(device)
    x = _rand((t, k), torch.float32, device, gen)
    static = build_lora_batch([0] * t, max_loras, device)  # the capture-time mix
    tri.refresh_static_batch(static, static)
    for _ in range(3):
        new = build_lora_batch(torch.randint(-1, max_loras, (t,), generator=gen).tolist(), max_loras, device)
        tri.refresh_static_batch(static, new)
        want = torch.full((t, 32), float("nan"), device=device)
        got = want.clone()
        tri.shrink_expand(x, a, b, scales, new, want)
        tri.shrink_expand(x, a, b, scales, static, got)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("t", [1, 32, 64, 256])
def test_fused_config_at_8b_shapes(t):
    """Programs per slice stay within the slice's N blocks (K blocks when they split K) and the grid stays within a
    few waves, for the 8B layer shapes (qkv, o, gate_up, down) at 32 adapters."""
    from tp_lora.ops.triton.schedule import chunked_entries
    entries = chunked_entries(t, 32, configs.segment_size(t))
    for k, widths in ((4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))):
        cfg = configs.fused_config(t, 16, k, widths, entries, 132)
        tiles = [-(-w // cfg["BLOCK_N"]) for w in widths]
        k_blocks = -(-k // cfg["BLOCK_K"])
        assert all(1 <= p <= (k_blocks if sp else n) for p, sp, n in zip(cfg["PROGRAMS"], cfg["SPLIT_K"], tiles)), \
            (widths, cfg)
        assert min(entries, t) * sum(cfg["PROGRAMS"]) <= 4 * 132, (t, widths, cfg)


# --- CUDA only: graph capture and host syncs ---

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, sync detection)")


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [256, 2048], ids=["n_split", "k_split"])  # what fused_config picks at these K
def test_fused_cuda_graph_replays_another_split(scheme, k):
    """Capture the fused op for one split of T tokens, refresh the captured buffers with another split, replay: the
    result matches the reference for the new split (grid fixed by T and max_loras)."""
    dev, gen = "cuda", _gen("graph", scheme, k)
    t, max_loras, rank, widths = 48, 8, 16, [256, 64, 64]
    tri.set_scheme(scheme)
    static = build_lora_batch(_slots("one_adapter", t, max_loras, gen), max_loras, dev)
    tri.refresh_static_batch(static, static)
    x = _rand((t, k), torch.bfloat16, dev, gen)
    a = [_rand((max_loras, rank, k), torch.bfloat16, dev, gen, 0.3) for _ in widths]
    b = [_rand((max_loras, w, rank), torch.bfloat16, dev, gen, 0.3) for w in widths]
    scales = torch.rand(3, max_loras, generator=gen).to(dev)
    out = torch.zeros(t, sum(widths), dtype=torch.bfloat16, device=dev)

    def step():
        out.zero_()
        tri.shrink_expand(x, a, b, scales, static, out)
    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    second = build_lora_batch(_slots("mixed", t, max_loras, gen), max_loras, dev)
    tri.refresh_static_batch(static, second)
    graph.replay()
    ref = torch.zeros_like(out)
    torch_ref.shrink_expand(x, a, b, scales, second, ref)
    assert _rel(out, ref) < TOL[torch.bfloat16]


@cuda_only
@pytest.mark.gpu
def test_fused_k_split_repeated(monkeypatch):
    """K split with many programs per block, launched back to back: every launch must see a clean workspace and
    the last program to arrive must see every partial (a missing one or a leftover shows as a wrong result)."""
    dev, gen = "cuda", _gen("repeat")
    slots, batch, x, a, b, scales = _layer(gen, dev, 64, 8, 4096, [512, 128], 16, torch.bfloat16)
    ref = torch.zeros(64, 640, dtype=torch.bfloat16, device=dev)
    torch_ref.shrink_expand(x, a, b, scales, batch, ref)
    real = configs.fused_config
    monkeypatch.setattr(configs, "fused_config", lambda *args: dict(real(*args), PROGRAMS=(16, 16), SPLIT_K=(1, 1)))
    for _ in range(50):
        out = torch.zeros_like(ref)
        tri.shrink_expand(x, a, b, scales, batch, out)
        assert _rel(out, ref) < TOL[torch.bfloat16]
    ws, counts = tri._fused_workspace(out.device, 1)
    assert not ws.any() and not counts.any()


@cuda_only
@pytest.mark.gpu
def test_fused_no_host_sync():
    dev, gen = "cuda", _gen("sync")
    t, max_loras = 40, 4
    batch = build_lora_batch(_slots("mixed", t, max_loras, gen), max_loras, dev)
    x = _rand((t, 64), torch.bfloat16, dev, gen)
    a = [_rand((max_loras, 16, 64), torch.bfloat16, dev, gen)]
    b = [_rand((max_loras, 32, 16), torch.bfloat16, dev, gen)]
    scales = torch.ones(1, max_loras, device=dev)
    out = torch.zeros(t, 32, dtype=torch.bfloat16, device=dev)
    tri.shrink_expand(x, a, b, scales, batch, out)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tri.shrink_expand(x, a, b, scales, batch, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
