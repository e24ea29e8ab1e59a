"""The rows one all-gather carries for expert parallelism: per token its hidden state's bytes, top-k expert ids,
top-k weights and (with LoRA) adapter slot, as 4-byte words, so ids and weights cross exactly (bytes, not a float
cast) in one collective of a dtype the peer all-gather moves (float32; nothing adds them).

Row layout (bytes): hidden | k int32 ids | k float32 weights | int32 slot (if tags) |
zeros up to a whole number of 16-byte vectors (aligned rows: the gathered hidden states are read in place).
Padding rows up to the dispatch's row count: ids -1 (routed nowhere), weights 0, slot -1, hidden 0.
"""
from __future__ import annotations

import torch

from tp_lora.ops.fused import use_kernels
from tp_lora.ops.moe_layout import row_bytes

def pack_tokens_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tags: torch.Tensor | None,
                    rows: int) -> torch.Tensor:
    """x [n, H], ids [n, k] int, weights [n, k] float, tags [n] int (or None) -> [max(rows, n), W / 4] float32 words
    of the rows above (W = row_bytes)."""
    n, k = ids.shape
    hb = x.shape[1] * x.element_size()
    packed = torch.zeros(max(rows, n), row_bytes(hb, k, tags is not None), dtype=torch.uint8, device=ids.device)
    packed[:n, :hb] = x.contiguous().view(torch.uint8)
    packed[n:, hb:hb + 4 * k] = 255  # int32 -1
    packed[:n, hb:hb + 4 * k] = ids.to(torch.int32).contiguous().view(torch.uint8)
    packed[:n, hb + 4 * k:hb + 8 * k] = weights.float().contiguous().view(torch.uint8)
    if tags is not None:
        packed[:, hb + 8 * k:hb + 8 * k + 4] = 255
        packed[:n, hb + 8 * k:hb + 8 * k + 4] = tags.to(torch.int32).reshape(n, 1).contiguous().view(torch.uint8)
    return packed.view(torch.float32)


def pack_tokens(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tags: torch.Tensor | None,
                rows: int) -> torch.Tensor:
    """pack_tokens_ref's rows; on CUDA one Triton launch where the hidden bytes are whole words (the reference's
    torch ops are seven)."""
    if use_kernels(ids) and _words(x):
        from tp_lora.ops.triton.moe_pack import pack_tokens as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(x, ids, weights, tags, rows)
    return pack_tokens_ref(x, ids, weights, tags, rows)


def _words(x: torch.Tensor) -> bool:
    """Whether x [n, H]'s rows are whole, aligned 4-byte words (what the kernel reads)."""
    size = x.element_size()
    return x.stride(-1) == 1 and (x.shape[1] * size) % 4 == 0 and (x.stride(0) * size) % 4 == 0 \
        and (x.storage_offset() * size) % 4 == 0


def unpack_tokens(packed: torch.Tensor, hidden: int, dtype: torch.dtype, k: int, tags: bool):
    """The gathered rows of pack_tokens -> x [N, H], ids [N, k] int32, weights [N, k] f32, tags [N] (None if not
    packed): views of `packed` where aligned."""
    packed = packed.view(torch.uint8)
    hb = hidden * torch.empty(0, dtype=dtype).element_size()
    x = _as(packed[:, :hb], dtype)
    ids = _as(packed[:, hb:hb + 4 * k], torch.int32)
    w = _as(packed[:, hb + 4 * k:hb + 8 * k], torch.float32)
    t = _as(packed[:, hb + 8 * k:hb + 8 * k + 4], torch.int32).reshape(-1) if tags else None
    return x, ids, w, t


def _as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns b [N, c] read as dtype: a view where the rows are aligned for it, else a copy."""
    size = torch.empty(0, dtype=dtype).element_size()
    if b.stride(0) % size == 0 and b.storage_offset() % size == 0:
        return b.view(dtype)
    return b.contiguous().view(dtype)
