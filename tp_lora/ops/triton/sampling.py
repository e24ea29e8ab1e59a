"""Triton kernel of the sampling ops, with the signature of the reference in tp_lora/ops/sampling.py. One launch,
shapes only (no host sync): a CUDA graph captures it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.fused import as_rows

GREEDY_BLOCK = 4096  # vocabulary entries per iteration of greedy's one program per row
MASK_BLOCK = 2048  # vocabulary entries per program of masked_logits


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


@triton.jit
def _masked_logits_kernel(x_ptr, out_ptr, rows_ptr, bits_ptr, keep_ptr, dead_ptr, s_x, s_o, s_b, V, W,
                          BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """Program (row, block of BLOCK tokens): the row's bitmask row m (-1: none); whether bits[m] & keep allows any
    token at all (a pass over its W words, WORDS at a time), then this block's tokens kept or set to -inf."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + t * s_x + i, mask=i < V, other=0.0).to(tl.float32)
    m = tl.load(rows_ptr + t)
    if m >= 0:
        live = 0
        for w0 in range(0, W, WORDS):
            w = w0 + tl.arange(0, WORDS)
            words = tl.load(bits_ptr + m * s_b + w, mask=w < W, other=0) & tl.load(keep_ptr + w, mask=w < W, other=0)
            live = live | tl.max((words != 0).to(tl.int32), 0)
        word = tl.load(bits_ptr + m * s_b + i // 32, mask=i < V, other=0) & tl.load(keep_ptr + i // 32, mask=i < V,
                                                                                     other=0)
        word = tl.where(live != 0, word, tl.load(dead_ptr + i // 32, mask=i < V, other=0))
        x = tl.where(((word >> (i % 32)) & 1) != 0, x, -float("inf"))
    tl.store(out_ptr + t * s_o + i, x, mask=i < V)


def masked_logits(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, keep: torch.Tensor,
                  dead: torch.Tensor) -> torch.Tensor:
    x = as_rows(logits, "masked_logits' logits")
    n, v = x.shape
    out = torch.empty(n, v, dtype=torch.float32, device=x.device)
    w = bits.shape[1]
    _masked_logits_kernel[(n, triton.cdiv(v, MASK_BLOCK))](
        x, out, rows, bits, keep, dead, x.stride(0), out.stride(0), bits.stride(0), v, w, BLOCK=MASK_BLOCK,
        WORDS=min(1024, triton.next_power_of_2(w)))
    return out
