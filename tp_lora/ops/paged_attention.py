"""Decode attention over a paged KV cache: the torch reference (test oracle) and the dispatcher the model calls.

Shapes: q [B, H, d] (one new token per sequence, already written into the cache); k_cache / v_cache
[num_blocks, block_size, KV, d]; block_table [B, W] int (block ids of each sequence, padded with any valid id);
context_lens [B] int (positions 0 .. len-1 are the sequence's keys, the last one its own); window: attend only to the
last `window` positions (0: all); softcap: scores become softcap * tanh(scores / softcap) (0: none, Gemma 2). Query
head h reads KV head h // (H / KV). Returns [B, H, d].
"""
from __future__ import annotations

import torch


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Every position of every block table gathered and masked beyond each context (or before its window), softmax
    in float32: no host sync, so a CUDA graph can capture it too."""
    b, width = block_table.shape
    bs, kv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    rep = q.shape[1] // kv
    pos = torch.arange(width * bs, device=q.device)
    slots = block_table.long()[:, pos // bs] * bs + pos % bs  # [B, P]
    k = k_cache.flatten(0, 1)[slots].float()  # [B, P, KV, d]
    v = v_cache.flatten(0, 1)[slots].float()
    scores = torch.einsum("bgrd,bpgd->bgrp", q.view(b, kv, rep, d).float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    ctx = context_lens.long()[:, None]
    keep = pos[None] < ctx
    if window:
        keep &= pos[None] >= ctx - window
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    v = v.masked_fill(~keep[:, :, None, None], 0.0)  # padding blocks may hold anything
    out = torch.einsum("bgrp,bpgd->bgrd", torch.softmax(scores, -1), v)
    return out.reshape(b, kv * rep, d).to(q.dtype)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The Triton kernel on CUDA (head_dim a power of two >= 16, what tl.dot takes), the reference elsewhere."""
    d = q.shape[-1]
    if q.is_cuda and d >= 16 and not d & (d - 1):
        from tp_lora.ops.triton.paged_attention import paged_decode as kernel  # noqa: PLC0415 - CUDA only
        return kernel(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)
    return paged_decode_ref(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)
