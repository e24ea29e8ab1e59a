"""The grouped expert GEMM (the dispatcher: our Triton kernel for few rows per expert on CUDA, torch's grouped GEMM
where this torch runs it, else the loop; and the Triton kernel itself) against the per-expert loop, on the device
under test: empty experts, every row to one expert, no routed rows, rows past the last expert (the plan's capacity),
and a Qwen3-MoE expert's shape; under expert parallelism the dispatcher counts the rows per expert over the model's
experts."""
import pytest
import torch

from tp_lora.ops.grouped_mm import grouped_mm, grouped_mm_ref, torch_grouped_available


@pytest.mark.parametrize("impl", ["dispatch", "triton", "triton_rows_32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,k,n", [([3, 0, 9, 4], 32, 24), ([0, 0, 16, 0], 32, 24), ([0, 0, 0, 0], 32, 24),
                                        ([5, 5, 5, 5], 40, 16), ([70, 0, 190, 3, 0, 250], 2048, 768)])
def test_grouped_mm_matches_the_per_expert_loop(device, dtype, counts, k, n, impl):
    g = torch.Generator().manual_seed(sum(counts) + k)
    used = sum(counts)
    x = torch.randn(used + 3, k, generator=g).to(dtype).to(device)  # 3 rows past the last expert
    w = (torch.randn(len(counts), n, k, generator=g) * k ** -0.5).to(dtype).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    if impl.startswith("triton"):  # row blocks of 16, or of 32 (experts past them walk several)
        from tp_lora.ops.triton.grouped_mm import grouped_mm as kernel
        got = kernel(x, w, ends, rows_per_expert=32 if impl == "triton_rows_32" else 16)
    else:
        got = grouped_mm(x, w, ends)
    assert got.shape == (used + 3, n) and got.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    start = 0
    for e, end in enumerate(ends.tolist()):  # rows past ends[-1] are undefined: not compared
        torch.testing.assert_close(got[start:end].float(), x[start:end].float() @ w[e].float().t(), **tol)
        start = end
    if device == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (9, 0):
        assert torch_grouped_available(x.device, dtype, k, n), "torch's grouped GEMM should run on sm90 in bf16"
    torch.testing.assert_close(got[:used], grouped_mm_ref(x, w, ends)[:used], **tol)



@pytest.mark.parametrize("impl", ["dispatch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_reads_the_plans_rows(device, dtype, impl):
    """rows: row i of the GEMM is x[rows[i]] (repeated and unsorted tokens, x a strided view as the EP dispatch
    unpacks it), against the gathered rows' loop in float32."""
    counts, k, n = [5, 0, 11, 3], 48, 40
    g = torch.Generator().manual_seed(31 + k)
    tokens, used = 9, sum(counts)
    packed = torch.randn(tokens, k + 5, generator=g).to(dtype).to(device)
    x = packed[:, :k]  # unit column stride, row stride k + 5
    rows = torch.randint(0, tokens, (used + 2,), generator=g).to(device)  # 2 pairs past the last expert
    w = (torch.randn(len(counts), n, k, generator=g) * k ** -0.5).to(dtype).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    if impl == "triton":
        from tp_lora.ops.grouped_mm import grouped_mm_triton
        got = grouped_mm_triton(x, w, ends, rows=rows)
    else:
        got = grouped_mm(x, w, ends, rows=rows)
    assert got.shape == (used + 2, n) and got.dtype == dtype
    a = x.float()[rows]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    start = 0
    for e, end in enumerate(ends.tolist()):
        torch.testing.assert_close(got[start:end].float(), a[start:end] @ w[e].float().t(), **tol)
        start = end
    torch.testing.assert_close(got[:used], grouped_mm_ref(x, w, ends, rows=rows)[:used], **tol)


@pytest.mark.parametrize("experts,kernel", [(None, False), (4, False), (16, True)])
def test_expert_parallel_capacity_counts_rows_over_the_models_experts(monkeypatch, device, experts, kernel):
    """C = 128 rows for 4 local experts is 32 a local expert, but a rank holding 4 of the model's 16 gets about 8 of
    them each: the Triton kernel (kernels forced) runs where C / the model's experts is within SMALL_ROWS, and the
    result is the loop's either way."""
    from tp_lora.ops import fused, grouped_mm as dispatch
    monkeypatch.setattr(fused, "KERNELS", True)
    ran = []
    kernel_fn = dispatch.grouped_mm_triton
    monkeypatch.setattr(dispatch, "grouped_mm_triton", lambda *a, **kw: ran.append(kw) or kernel_fn(*a, **kw))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(128, 32, generator=g).to(device), (torch.randn(4, 24, 32, generator=g) * 32 ** -0.5).to(device)
    ends = torch.tensor([7, 15, 24, 30], dtype=torch.int32, device=device)  # a rank's share of the capacity
    assert 128 > dispatch.SMALL_ROWS * 4 and 128 <= dispatch.SMALL_ROWS * 16
    got = grouped_mm(x, w, ends, experts=experts)
    assert bool(ran) == kernel
    if kernel:  # its row block takes twice the mean of 8 rows an expert
        assert ran[0]["rows_per_expert"] == 16
    torch.testing.assert_close(got[:30], grouped_mm_ref(x, w, ends)[:30], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("experts,block", [(None, 64), (16, 16)])
def test_fp8_experts_take_the_same_row_block(monkeypatch, device, experts, block):
    """fp8 experts always take the Triton kernel, its row block twice the mean rows an expert as 16-bit ones: 128
    rows over 4 local experts is 2 x 32 (capped at 64 by the kernel), over 16 of the model's experts 2 x 8."""
    from tp_lora.ops import fused, grouped_mm as dispatch
    from tp_lora.ops.fp8 import quantize_fp8_per_channel
    monkeypatch.setattr(fused, "KERNELS", True)
    ran = []
    kernel_fn = dispatch.grouped_mm_triton
    monkeypatch.setattr(dispatch, "grouped_mm_triton", lambda *a, **kw: ran.append(a) or kernel_fn(*a, **kw))
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-16, 17, (128, 128), generator=g).float()
    x[:, 0] = 448.0  # each row's 128-column group quantizes exactly (scale 1; the interpreter rounds fp8 wrongly)
    x = x.to(torch.bfloat16).to(device)
    w, scale = quantize_fp8_per_channel(torch.randn(4, 24, 128, generator=g) * 128 ** -0.5)
    w, scale = w.to(device), scale.to(device)
    ends = torch.tensor([7, 15, 24, 30], dtype=torch.int32, device=device)
    got = grouped_mm(x, w, ends, scale, experts=experts)
    assert min(ran[0][5], 64) == block
    want = grouped_mm_ref(x, w, ends, scale, act8=True)
    torch.testing.assert_close(got[:30].float(), want[:30].float(), rtol=2e-2, atol=0.5)



@pytest.mark.parametrize("weights", ["bf16", "f32", "fp8", "fp8_act8_narrow", "fp8_act8_wide", "fp8_act8_block"])
def test_gated_equals_act_mul_after_the_gemm(device, monkeypatch, weights):
    """gated: silu(gate) * up. 16-bit weights, and fp8 ones with bf16 rows (act8: the gate and up tiles take the same
    quantized rows; narrow tiles, two column blocks a program, the last one part-empty, or wide ones where the GPU
    has too few SMs for the narrow programs to fit one wave; scales per channel, or per 128-column block with the up
    rows' own): in the Triton kernel's epilogue, equal bit for bit to
    the unfused kernel followed by act_mul's kernel (each product rounded to the output dtype first, as act_mul reads
    it), rows gathered, empty experts and rows past the last expert included; float32 rows over float32 / fp8
    weights: the dispatcher runs the GEMM, then act_mul (the kernel refuses gated for them). Every path agrees with
    grouped_mm_ref (the loop, then act_mul_ref)."""
    from tp_lora.ops import fused
    from tp_lora.ops.fp8 import quantize_fp8_per_channel
    from tp_lora.ops.grouped_mm import grouped_mm_triton
    from tp_lora.ops.triton import grouped_mm as kernel
    from tp_lora.ops.triton.fused import act_mul
    counts, k, inter, tokens = [6, 0, 11, 2, 0], 256, 168, 13
    g = torch.Generator().manual_seed(len(weights) + 17)
    act8 = weights.startswith("fp8_act8")
    wide = 5 * -(-inter // kernel.GATED8_WIDE[0]) > 3 * kernel.num_sms(None)  # 5 experts' programs of wide tiles
    if weights.endswith("wide") and not wide:
        monkeypatch.setattr(kernel, "num_sms", lambda index: 1)
    assert weights != "fp8_act8_narrow" or not wide
    dtype = torch.bfloat16 if weights == "bf16" or act8 else torch.float32
    # Multiples of 1/4 and 1/64 with small sums: every product and partial sum exact in float32, so the GEMM's
    # result does not depend on its summation order (the interpreter's numpy dot differs by column otherwise).
    x = torch.randint(-4, 5, (tokens, k), generator=g) / 4
    if act8:  # integers with a 448 in each 128-column group: the rows quantize exactly (scale 1)
        x = (x * 4).index_fill_(1, torch.tensor([0, 128]), 448.0)
    x = x.to(dtype).to(device)
    rows = torch.randint(0, tokens, (sum(counts) + 3,), generator=g).to(device)  # 3 pairs past the last expert
    w, scale = torch.randint(-4, 5, (len(counts), 2 * inter, k), generator=g) / 64, None
    w *= 1 + torch.arange(2 * inter)[:, None] % 3  # a gate row's fp8 scale differs from its up row's
    if act8:
        w[..., [0, 128]] = 0  # the rows' 448s (their scale) add nothing: gate values stay where silu is finite
    block_k = 128 if weights.endswith("block") else None
    if weights.startswith("fp8"):
        w, scale = quantize_fp8_per_channel(w)
        if block_k:  # powers of two per (row, 128 columns), an up row's unlike its gate row's: products stay exact
            scale = scale[..., None] * 2.0 ** torch.randint(-2, 3, (*scale.shape, k // block_k), generator=g)
        scale = scale.to(device)
    w = w.to(dtype if scale is None else w.dtype).to(device)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(device)
    used = sum(counts)
    monkeypatch.setattr(fused, "KERNELS", True)
    got = grouped_mm(x, w, ends, scale, block_k, rows, gated=True)
    assert got.shape == (used + 3, inter) and got.dtype == dtype
    if dtype == torch.bfloat16:
        fused_out = grouped_mm_triton(x, w, ends, scale, block_k, 16, act8, rows, gated=True)
        unfused = act_mul(grouped_mm_triton(x, w, ends, scale, block_k, 16, act8, rows), "silu")
        assert torch.equal(fused_out[:used], unfused[:used]) and torch.equal(got[:used], fused_out[:used])
    else:
        with pytest.raises(ValueError, match="gated takes 16-bit weights, or fp8 ones with act8"):
            grouped_mm_triton(x, w, ends, scale, None, 16, False, rows, gated=True)
    want = grouped_mm_ref(x, w, ends, scale, block_k, act8, rows, gated=True)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got[:used].float(), want[:used].float(), **tol)
