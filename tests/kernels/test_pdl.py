"""Programmatic dependent launch in the decode chain (tp_lora.ops.triton.pdl): which launches go early, and that a
chain of early launches, eager or replayed from a CUDA graph, gives exactly what the same kernels give without it."""
from dataclasses import replace

import pytest
import torch

from tp_lora.ops.fp8 import quantize_fp8_per_channel
from tp_lora.ops.triton import fp8_gemm, pdl
from tp_lora.ops.triton.fused import act_mul, add_rms_norm

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_the_note_of_a_releasing_launch_is_taken_once_by_the_launch_reading_its_output(monkeypatch):
    """The launchers' bookkeeping, as on a Hopper GPU (pdl_args / released / forget over any tensors), one note per
    stream: a launch on a side stream (the LoRA shrink) leaves the main stream's note alone."""
    stream = [1]
    monkeypatch.setattr(pdl, "_key", lambda device: (0, stream[0]))
    monkeypatch.setattr(pdl, "_released", {})
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    assert pdl.pdl_args(a) == dict(PDL=True, launch_pdl=False)  # nothing released yet
    pdl.released(a, b)  # e.g. a norm writing its rows and their fp8 copy
    assert pdl.pdl_args(b) == dict(PDL=True, launch_pdl=True)
    assert not pdl.pdl_args(a)["launch_pdl"]  # the note was taken by the launch after
    pdl.released(a)
    assert not pdl.pdl_args(c)["launch_pdl"]  # c was not written by it; the note is gone anyway
    assert not pdl.pdl_args(a)["launch_pdl"]
    pdl.released(a)
    pdl.forget(a.device)  # a launch that does not release came in between
    assert not pdl.pdl_args(a)["launch_pdl"]
    pdl.released(a)
    stream[0] = 2  # a side stream: its launches and notes are its own
    pdl.forget(a.device)
    assert not pdl.pdl_args(a)["launch_pdl"]
    pdl.released(c)
    stream[0] = 1
    assert pdl.pdl_args(a)["launch_pdl"]  # the main stream's note outlived the side stream's launches
    stream[0] = 2
    assert pdl.pdl_args(c)["launch_pdl"]


def test_a_launch_goes_early_only_right_after_a_releasing_one(device):
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    w = torch.rand(256, device=device, dtype=torch.bfloat16)
    out, _ = add_rms_norm(x, None, w, 1e-6)
    assert pdl.pdl_args(out) == dict(PDL=HOPPER, launch_pdl=HOPPER)  # the norm releases the next launch
    assert pdl.pdl_args(out) == dict(PDL=HOPPER, launch_pdl=False)  # once
    out, _ = add_rms_norm(x, None, w, 1e-6)
    assert not pdl.pdl_args(x)["launch_pdl"]  # not what the norm wrote
    out, _ = add_rms_norm(x, None, w, 1e-6)
    pdl.forget(out.device)  # a launch that does not release came in between (the LoRA kernels)
    assert not pdl.pdl_args(out)["launch_pdl"]


def _chain(x, res, w_norm, w13, s13, w2, s2):
    """norm (fp8 rows) -> gate_up (XQ) -> act_mul (fp8 rows) -> down (XQ) -> add + norm: the fp8 decode MLP."""
    t, h = x.shape
    q, qs = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device), torch.empty(t, device=x.device)
    y, res = add_rms_norm(x, res, w_norm, 1e-6, out8=(q, qs))
    gu = fp8_gemm.w8a16_mm(q, w13, s13, None, fp8_gemm.w8a16_config(t, *w13.shape, xq=True), qs, x.dtype)
    n = w2.shape[1]
    q2, qs2 = torch.empty(t, n, dtype=torch.float8_e4m3fn, device=x.device), torch.empty(t, device=x.device)
    act_mul(gu, "silu", out8=(q2, qs2))
    down = fp8_gemm.w8a16_mm(q2, w2, s2, None, fp8_gemm.w8a16_config(t, *w2.shape, xq=True), qs2, x.dtype)
    return add_rms_norm(down, res, w_norm, 1e-6)


def _early_gives_plain_results(step, weights, inputs, monkeypatch):
    """step(x, res, *weights) -> tensors, eagerly and replayed from a CUDA graph (fresh inputs each replay: a kernel
    reading too early reads stale rows), then with plain launches (PDL compiled out): the same bits."""
    x, res = torch.empty_like(inputs[0]), torch.empty_like(inputs[1])
    step(x, res, *weights)  # compile, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_graph = step(x, res, *weights)
    got = []
    for i in range(0, len(inputs), 2):
        x.copy_(inputs[i])
        res.copy_(inputs[i + 1])
        graph.replay()
        eager = step(inputs[i], inputs[i + 1], *weights)
        got.append([v.clone() for v in got_graph + eager])
    monkeypatch.setattr(pdl, "_index", lambda device: None)
    for i in range(0, len(inputs), 2):
        want = step(inputs[i], inputs[i + 1], *weights)
        for j, g in enumerate(got[i // 2]):  # (graph's out, residual, eager's out, residual)
            assert torch.equal(g, want[j % 2]), (i, j)


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper (or later) GPU")
def test_early_launches_give_the_plain_launches_results(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    h, n, t = 1024, 2048, 32
    w13, s13 = quantize_fp8_per_channel(torch.randn(2 * n, h, generator=gen) / 32)
    w2, s2 = quantize_fp8_per_channel(torch.randn(h, n, generator=gen) / 45)
    weights = [v.cuda() for v in (torch.rand(h, generator=gen).bfloat16() + 0.5, w13, s13, w2, s2)]
    inputs = [torch.randn(t, h, generator=gen).bfloat16().cuda() for _ in range(2 * 6)]
    _early_gives_plain_results(_chain, weights, inputs, monkeypatch)


def _adapter_layer(x, res, w_norm, w, s, rt, lora_a, lora_b, scales):
    """norm (fp8 rows) -> an fp8 layer with its LoRA -> the next norm, as a decode step with adapters runs them: the
    shrink of the normed rows and its expand into a float32 delta on a side stream (LoRARuntime.beside) beside the
    GEMM of their fp8 copy, which leaves its K shares (SplitSums) for the next norm to sum and add the delta to."""
    t, h = x.shape
    q, qs = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device), torch.empty(t, device=x.device)
    y, res = add_rms_norm(x, res, w_norm, 1e-6, out8=(q, qs))
    cfg = dict(fp8_gemm.w8a16_config(t, *w.shape, xq=True), SPLIT_K=2, BLOCK_K=128)

    def side():
        delta = torch.empty(t, w.shape[0], dtype=torch.float32, device=x.device)
        rt.ops.expand(rt.ops.shrink(y, lora_a, scales, rt.batch), lora_b, rt.batch, delta, add=False)
        return delta
    delta, z = rt.beside(side, lambda: fp8_gemm.w8a16_mm(q, w, s, None, cfg, qs, x.dtype, sums=True), x.device, t)
    return add_rms_norm(replace(z, delta=delta), res, w_norm, 1e-6)


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper (or later) GPU")
def test_a_gemm_beside_a_side_stream_lora_goes_early_and_the_join_ends_the_chain(monkeypatch):
    """The side stream's LoRA leaves the main stream's note: the fp8 GEMM after the norm launches early, eagerly and
    in a CUDA graph, and so does the expand after its shrink on the side stream; the norm after the join does not
    (an early start would not wait for the side's delta); the layer's outputs (fresh inputs each replay) are the
    bits of plain launches."""
    from tp_lora.ops.triton import lora_launch
    from tp_lora.lora.layers import LoRARuntime
    from tp_lora.ops import get_backend
    from tp_lora.ops.batch import build_lora_batch
    from tp_lora.ops.triton import fused
    gen = torch.Generator().manual_seed(11)
    h, n, t, rank, slots = 1024, 1024, 32, 16, 4
    w, s = (v.cuda() for v in quantize_fp8_per_channel(torch.randn(n, h, generator=gen) / 32))
    lora_a = [(torch.randn(slots, rank, h, generator=gen) / 32).bfloat16().cuda()]
    lora_b = [(torch.randn(slots, n, rank, generator=gen) / 4).bfloat16().cuda()]
    scales = torch.full((1, slots), 0.5, device="cuda")
    rt = LoRARuntime(slots, rank, False, get_backend("triton"))
    rt.batch = build_lora_batch([i % (slots + 1) - 1 for i in range(t)], slots, "cuda")
    weights = ((torch.rand(h, generator=gen) + 0.5).bfloat16().cuda(), w, s, rt, lora_a, lora_b, scales)
    inputs = [torch.randn(t, h, generator=gen).bfloat16().cuda() for _ in range(2 * 4)]
    early = {"gemm": [], "norm": [], "lora": []}

    def args(kind):
        def note(*xs):
            out = pdl.pdl_args(*xs)
            early[kind].append(out["launch_pdl"])
            return out
        return note
    monkeypatch.setattr(fp8_gemm, "pdl_args", args("gemm"))
    monkeypatch.setattr(fused, "pdl_args", args("norm"))
    monkeypatch.setattr(lora_launch, "pdl_args", args("lora"))
    _early_gives_plain_results(_adapter_layer, weights, inputs, monkeypatch)
    # compiling, capturing, each eager step early; the plain steps after them not; no norm early (the first reads
    # a fresh input, the second comes after the join); of the LoRA kernels the expand (after its shrink)
    steps, pdl_steps = 2 + len(inputs), 2 + len(inputs) // 2
    assert early == {"gemm": [True] * pdl_steps + [False] * (len(inputs) // 2), "norm": [False] * 2 * steps,
                     "lora": [False, True] * pdl_steps + [False, False] * (len(inputs) // 2)}, early


def _moe_adapter_block(x, logits, w13, w2, slots, max_loras, a13, b13, a2, b2, scales):
    """A MoE block with adapters at decode after its router's GEMM (tp_lora.models.moe, tp_lora.lora.moe's default
    mode): top-k, the routing plan, the gate_up grouped GEMM reading the pairs' tokens, its fused LoRA (its shrink
    before its wait), act_mul, the down GEMM, its fused LoRA, the weighted sum of each token's pairs."""
    from tp_lora.ops.moe_plan import build_plan
    from tp_lora.ops.triton import grouped_mm, moe_lora
    from tp_lora.ops.triton.fused import act_mul, moe_combine, moe_topk
    ids, weights = moe_topk(logits, 4, True, True)
    plan = build_plan(ids, weights, slots, 0, w13.shape[0], max_loras, lora=True)
    z = grouped_mm.grouped_mm(x, w13, plan.expert_ends, rows_per_expert=8, rows=plan.token)
    moe_lora.moe_lora_fused(x, a13, scales[:2], b13, plan, z, rows=plan.token)
    h = act_mul(z, "silu")
    y = grouped_mm.grouped_mm(h, w2, plan.expert_ends, rows_per_expert=8)
    moe_lora.moe_lora_fused(h, a2, scales[2:], b2, plan, y)
    return [moe_combine(y, plan.pos, plan.weight), h]


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper (or later) GPU")
def test_a_moe_block_launches_early_after_its_router_and_gives_the_plain_launches_results(monkeypatch):
    """After the router's GEMM (cuBLAS: a plain launch) every kernel of the block launches early: the plan after the
    top-k, the expert GEMMs after the plan or act_mul, the fused MoE LoRA after its GEMM (its shrink beside the GEMM's
    last programs, its add into the GEMM's output after the wait), act_mul, the combine; the block's outputs (fresh
    tokens and logits each replay) are the bits of plain launches."""
    from tp_lora.ops.triton import fused, grouped_mm, moe_lora, moe_plan
    gen = torch.Generator().manual_seed(13)
    t, h, inter, experts, rank, slots = 32, 1024, 512, 16, 16, 4

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()
    weights = (rnd(experts, 2 * inter, h, scale=h ** -0.5), rnd(experts, h, inter, scale=inter ** -0.5),
               (torch.arange(t) % (slots + 1) - 1).to(torch.int32).cuda(), slots,
               [rnd(slots, experts, rank, h, scale=h ** -0.5) for _ in range(2)],
               [rnd(slots, experts, inter, rank) for _ in range(2)], [rnd(slots, experts, rank, inter)],
               [rnd(slots, experts, h, rank, scale=rank ** -0.5)], torch.full((3, slots, experts), 0.5).cuda())
    inputs = [rnd(t, h) if i % 2 == 0 else rnd(t, experts) for i in range(2 * 4)]
    early = {"gemm": [], "lora": [], "plan": [], "fused": []}

    def args(kind, module):
        real = module.pdl_args

        def note(*xs):
            out = real(*xs)
            early[kind].append(out["launch_pdl"])
            return out
        monkeypatch.setattr(module, "pdl_args", note)
    for kind, module in (("gemm", grouped_mm), ("lora", moe_lora), ("plan", moe_plan), ("fused", fused)):
        args(kind, module)
    _early_gives_plain_results(_moe_adapter_block, weights, inputs, monkeypatch)
    # compiling, capturing, each eager step: all but the top-k early (its logits come from before); the plain steps
    # after them not. fused: top-k, act_mul, combine.
    steps, plain = 2 + len(inputs) // 2, len(inputs) // 2
    assert early == {"gemm": [True, True] * steps + [False] * 2 * plain,
                     "lora": [True, True] * steps + [False] * 2 * plain, "plan": [True] * steps + [False] * plain,
                     "fused": [False, True, True] * steps + [False] * 3 * plain}, early
