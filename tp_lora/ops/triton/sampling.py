"""Triton kernel of the sampling ops, with the signature of the reference in tp_lora/ops/sampling.py. One launch,
shapes only (no host sync): a CUDA graph captures it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.fused import as_rows

GREEDY_BLOCK = 4096  # vocabulary entries per iteration of greedy's one program per row


@triton.jit
def _greedy_kernel(x_ptr, out_ptr, s_x, n, V, BLOCK: tl.constexpr):
    """One row per program: running max, its first index and the sum of exp(x - max), rescaled as the max grows."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = -float("inf")
    arg = 0
    total = 0.0
    for start in range(0, V, BLOCK):
        i = start + offs
        x = tl.load(x_ptr + t * s_x + i, mask=i < V, other=-float("inf")).to(tl.float32)
        m = tl.max(x, 0)
        j = tl.min(tl.where(x == m, i, V), 0)  # the lowest index of this block's max
        new = tl.maximum(best, m)
        none = -float("inf")  # masked-out logits (and a running max still at -inf) add nothing, never a NaN
        kept = tl.sum(tl.where(x > none, tl.exp(x - new), 0.0), 0)
        total = total * tl.where(best > none, tl.exp(best - new), 0.0) + kept
        arg = tl.where(m > best, j, arg)
        best = new
    tl.store(out_ptr + t, arg.to(tl.float64))
    tl.store(out_ptr + n + t, (-tl.log(total)).to(tl.float64))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    rows = as_rows(logits, "greedy's logits")
    n, v = rows.shape
    out = torch.empty(2, n, dtype=torch.float64, device=rows.device)
    _greedy_kernel[(n,)](rows, out, rows.stride(0), n, v, BLOCK=GREEDY_BLOCK)
    return out
