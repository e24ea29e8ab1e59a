"""Grouped expert GEMM: one launch for every local expert over the pair-ordered rows of a routing plan.

    grouped_mm(x [C, K], w [E, N, K], ends [E] int32, scale=None, block_k=None, rows=None) -> [C, N],
        rows ends[e-1]:ends[e] = x[rows] @ w[e]^T
    rows [C] int64: the GEMM's row i is x[rows[i]] (the routing plan's tokens: no gathered copy where the kernel
    runs).

w in x's dtype, or float8_e4m3fn with scale [E, N] per output channel or [E, N, ceil(K / block_k)] per block
(tp_lora.ops.fp8.dequantize's layouts).

Rows past ends[-1] are left undefined (the plan never reads them). On CUDA with few rows per expert (decode: C over
the experts the routing spreads them over, the model's under expert parallelism, where C is a capacity), and
for fp8 weights at any row count (a dequantised copy of every expert would cost more memory than the experts), our
Triton kernel (tp_lora/ops/triton/grouped_mm.py: one pass over the routed experts' weights; with fp8 weights,
16-bit activations are quantized per (row, 128 columns) in it and multiplied on the fp8 tensor cores); otherwise torch's
grouped GEMM (`F.grouped_mm`) where the installed torch runs it for the device and dtype (CUDA: bf16 on sm90+; CPU
builds that have it), else the per-expert loop `grouped_mm_ref`, which reads the offsets on the host (a sync: eager
only); fp8 weights there are dequantised to x's dtype first.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from tp_lora.ops.fp8 import FP8_DTYPE, act8_takes, dequantize, kernels_take, quantize_per_group
from tp_lora.ops.fused import Rows8, act_mul, act_mul_ref, use_kernels


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor | None = None,
                   block_k: int | None = None, act8: bool = False, rows: torch.Tensor | None = None,
                   gated: bool = False) -> torch.Tensor:
    """The per-expert loop (reference and fallback); rows past ends[-1] are 0. act8: x first rounded to e4m3 per
    (row, K tile) as the Triton kernel's act8 does (float32 out). rows: x[rows] first. gated: w's rows are
    [gate | up], the result act_mul_ref(., "silu") of the product."""
    x = x if rows is None else x[rows]
    if act8:
        from tp_lora.ops.triton.grouped_mm import BLOCK_K  # noqa: PLC0415 - the kernel's tile: its scale groups
        group = BLOCK_K if block_k is None else min(BLOCK_K, block_k)
        x = dequantize(*quantize_per_group(x, group), group)
    if scale is not None:
        w = dequantize(w, scale, block_k).to(x.dtype)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e].t()
        start = end
    return act_mul_ref(out, "silu") if gated else out


SMALL_ROWS = 16  # mean rows per expert (capacity / experts) up to which CUDA runs the Triton kernel


def experts_take_rows8(x: torch.Tensor, w: torch.Tensor, block_k: int | None) -> bool:
    """Whether grouped_mm(x, w, ..., x8) reads x8, x quantized per token (fp8 per-channel experts, 16-bit x, the
    Triton kernels on; x: any tensor of the activations' dtype and device)."""
    return w.dtype == FP8_DTYPE and block_k is None and act8_takes(x, None) and kernels_take(x, None)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor | None = None,
               block_k: int | None = None, rows: torch.Tensor | None = None,
               experts: int | None = None, gated: bool = False, x8: Rows8 | None = None) -> torch.Tensor:
    """experts: how many experts the routing spreads the C rows over (the model's, of which w holds E; default E).
    Under expert parallelism C is a capacity: about C / experts rows reach each local expert, which picks the 16-bit
    path and the Triton kernel's row block (fp8 weights always take the Triton kernel). gated: as grouped_mm_ref
    (16-bit weights, or fp8 ones with act8, on the Triton kernel: in its epilogue; else act_mul after the GEMM).
    x8: x quantized per token by the op that made it, read where experts_take_rows8 says so (else x is)."""
    c = x.shape[0] if rows is None else rows.shape[0]
    spread = max(experts or 0, w.shape[0], 1)
    block = 2 * -(-c // spread)  # a row block of twice the mean: a routing's busier experts read their weights once
    if scale is not None and x8 is not None and experts_take_rows8(x, w, block_k):  # fp8 rows into the MMA
        out = grouped_mm_triton(x8[0], w, ends, scale, None, block, True, rows, gated, x8[1], x.dtype)
        gated = False
    elif scale is not None and kernels_take(x, block_k):  # fp8: never a dequantised copy of every expert
        # 16-bit activations quantized per (row, 128 columns) in the kernel, as fp8_linear's decode GEMM does
        act8 = act8_takes(x, block_k)
        out = grouped_mm_triton(x, w, ends, scale, block_k, block, act8, rows, gated=gated and act8)
        gated = gated and not act8
    elif scale is None and use_kernels(x) and c <= SMALL_ROWS * spread:
        fuse = gated and w.element_size() == 2  # (two float32 weight tiles a stage overflow shared memory)
        out = grouped_mm_triton(x, w, ends, rows_per_expert=block, rows=rows, gated=fuse)
        gated = gated and not fuse
    else:
        x = x if rows is None else x[rows]
        if scale is not None:
            w = dequantize(w, scale, block_k).to(x.dtype)
        if x.shape[0] == 0 or not torch_grouped_available(x.device, x.dtype, x.shape[1], w.shape[1]):
            out = grouped_mm_ref(x, w, ends)
        else:
            out = grouped_mm_torch(x, w, ends)
    return act_mul(out, "silu") if gated else out


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (where torch_grouped_available)."""
    return F.grouped_mm(x.contiguous(), w.transpose(1, 2), offs=ends)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, scale: torch.Tensor | None = None,
                      block_k: int | None = None, rows_per_expert: int = SMALL_ROWS,
                      act8: bool = False, rows: torch.Tensor | None = None, gated: bool = False,
                      x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Our Triton kernel (CUDA, or the interpreter)."""
    from tp_lora.ops.triton.grouped_mm import grouped_mm as kernel  # noqa: PLC0415 - CUDA / forced only
    return kernel(x, w, ends, scale, block_k, rows_per_expert, act8, rows, gated, x_scale, out_dtype)



def torch_grouped_available(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether grouped_mm runs torch's grouped GEMM (one launch, no host sync) for x [*, k] and w [E, n, k] of this
    device and dtype (16-byte aligned rows of K and N elements)."""
    if (k * dtype.itemsize) % 16 or (n * dtype.itemsize) % 16:
        return False
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None
    return _probe(device.type, index, dtype)


@lru_cache(maxsize=None)
def _probe(kind: str, index: int | None, dtype: torch.dtype) -> bool:
    """One tiny call against the loop, once per (device, dtype): capability, not version numbers."""
    if not hasattr(F, "grouped_mm"):
        return False
    if kind == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(index) < (9, 0)):
        return False
    dev = torch.device(kind, index) if index is not None else torch.device(kind)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=g).to(dtype).to(dev)
    w = torch.randn(3, 8, 16, generator=g).to(dtype).to(dev)
    for ends in ([8, 8, 24], [8, 8, 20]):  # every row routed; rows past the last expert
        ends = torch.tensor(ends, dtype=torch.int32, device=dev)
        used = int(ends[-1])
        try:
            got = F.grouped_mm(x, w.transpose(1, 2), offs=ends)[:used]
        except (RuntimeError, NotImplementedError):
            return False
        if not torch.allclose(got.float(), grouped_mm_ref(x, w, ends)[:used].float(), rtol=2e-2, atol=2e-2):
            return False
    return True
