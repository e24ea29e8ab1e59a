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
    """Sequence by sequence: gather its keys from its blocks, softmax in float32."""
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    rep = q.shape[1] // kv
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        pos = torch.arange(max(0, n - window) if window else 0, n, device=q.device)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(rep, 1)  # [n, H, d]
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(rep, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        w = torch.softmax(scores, -1)
        out[b] = torch.einsum("hn,nhd->hd", w, v).to(q.dtype)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The Triton kernel on CUDA (head_dim a power of two >= 16, what tl.dot takes), the reference elsewhere."""
    d = q.shape[-1]
    if q.is_cuda and d >= 16 and not d & (d - 1):
        from tp_lora.ops.triton.paged_attention import paged_decode as kernel  # noqa: PLC0415 - CUDA only
        return kernel(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)
    return paged_decode_ref(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)
