"""pack_tokens (tp_lora.ops.moe_pack) in one launch: a program writes one block of 32-bit words of one row, each word
taken from the hidden state, the ids (int64 narrowed to int32), the weights' bits or the slot by its column; rows past
the real tokens get the padding values. No host sync, grid from shapes only (capturable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tp_lora.ops.moe_layout import row_bytes

BLOCK = 512  # words per program


@triton.jit
def _pack_kernel(x_ptr, ids_ptr, w_ptr, tag_ptr, out_ptr, n, s_x, s_ids, s_w, XW, W, K: tl.constexpr,
                 HAS_TAGS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    real = (c * 0 + r) < n  # a mask per word (the interpreter takes no scalar one)
    v = tl.load(x_ptr + r * s_x + c, mask=(c < XW) & real, other=0)
    j = c - XW
    is_id = (j >= 0) & (j < K)
    v = tl.where(is_id, tl.load(ids_ptr + r * s_ids + j, mask=is_id & real, other=-1).to(tl.int32), v)
    jw = j - K
    is_w = (jw >= 0) & (jw < K)
    v = tl.where(is_w, tl.load(w_ptr + r * s_w + jw, mask=is_w & real, other=0), v)
    if HAS_TAGS:
        is_t = jw == K
        v = tl.where(is_t, tl.load(tag_ptr + r + jw * 0, mask=is_t & real, other=-1), v)
    tl.store(out_ptr + r * W + c, v, mask=c < W)


def pack_tokens(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tags: torch.Tensor | None,
                rows: int) -> torch.Tensor:
    n, k = ids.shape
    xw = x.shape[1] * x.element_size() // 4
    width = row_bytes(4 * xw, k, tags is not None) // 4
    out = torch.empty(max(rows, n), width, dtype=torch.int32, device=ids.device)
    xi = x.view(torch.int32)
    w = weights.float()
    if w.stride(-1) != 1:
        w = w.contiguous()
    wi = w.view(torch.int32)
    t = out if tags is None else tags.to(torch.int32).contiguous()
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    _pack_kernel[(out.shape[0], triton.cdiv(width, BLOCK))](
        xi, ids, wi, t, out, n, xi.stride(0), ids.stride(0), wi.stride(0), xw, width, K=k,
        HAS_TAGS=tags is not None, BLOCK=BLOCK)
    return out.view(torch.float32)
