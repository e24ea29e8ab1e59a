"""Attention over a paged KV cache: the torch references (test oracles) and the dispatchers the model calls.

Decode (paged_decode): q [B, H, d] (one new token per sequence, already written into the cache); k_cache / v_cache
[num_blocks, block_size, KV, d]; block_table [B, W] int (block ids of each sequence, padded with any valid id);
context_lens [B] int (positions 0 .. len-1 are the sequence's keys, the last one its own); window: attend only to the
last `window` positions (0: all); softcap: scores become softcap * tanh(scores / softcap) (0: none, Gemma 2). Query
head h reads KV head h // (H / KV). Returns [B, H, d].

Varlen (paged_varlen): the same with the new tokens of S sequences packed, any number each: q [T, H, d]; cu_q [S+1]
int32, sequence s owns query rows cu_q[s] .. cu_q[s+1]-1, its last q_len = cu_q[s+1] - cu_q[s] positions (causal:
query j of the q_len sits at position context_lens[s] - q_len + j); block_table [S, W], context_lens [S]. A sequence
may have q_len 0 (padding: it reads and writes nothing); rows past cu_q[S] belong to no sequence and come back
undefined (zeros from the reference). Returns [T, H, d].
"""
from __future__ import annotations

import torch

from tp_lora.ops.fused import rope_write_kv, rope_write_kv_ref
from tp_lora.ops.split_sums import SplitSums


def paged_varlen_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, cu_q: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Each token's sequence found by a search over cu_q, every position of that sequence's block table gathered
    and masked to the causal (windowed) range, softmax in float32. No host sync; memory O(T x W x block_size)."""
    t, heads, d = q.shape
    width = block_table.shape[1]
    bs, kv = k_cache.shape[1], k_cache.shape[2]
    rep = heads // kv
    cu = cu_q.long()
    tok = torch.arange(t, device=q.device)
    covered = tok < cu[-1]
    seq = torch.searchsorted(cu[1:], tok, right=True).clamp(max=block_table.shape[0] - 1)
    q_pos = context_lens.long()[seq] - (cu[seq + 1] - tok)  # [T] position of each query
    pos = torch.arange(width * bs, device=q.device)
    slots = block_table.long()[:, pos // bs] * bs + pos % bs  # [S, P]
    in_ctx = pos[None] < context_lens.long()[:, None]  # [S, P]
    k = k_cache.flatten(0, 1)[slots].float()  # [S, P, KV, d]
    v = v_cache.flatten(0, 1)[slots].float().masked_fill(~in_ctx[:, :, None, None], 0.0)  # padding may hold NaN
    scores = torch.einsum("tgrd,tpgd->tgrp", q.view(t, kv, rep, d).float(), k[seq]) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keep = (pos[None] <= q_pos[:, None]) & covered[:, None]
    if window:
        keep &= pos[None] > q_pos[:, None] - window
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("tgrp,tpgd->tgrd", torch.softmax(scores, -1), v[seq])
    out = torch.where(covered[:, None, None, None], out, 0.0)  # rows of no sequence: all-masked softmax is NaN
    return out.reshape(t, heads, d).to(q.dtype)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """A decode is a varlen step of one query per sequence: paged_varlen_ref with cu_q = 0, 1, .., B (no host sync,
    so a CUDA graph can capture it too)."""
    cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_varlen_ref(q, k_cache, v_cache, block_table, context_lens, cu_q, scale, window, softcap)


def kernel_takes(head_dim: int) -> bool:
    """Whether the Triton attention kernels take this head_dim (a power of two >= 16, what tl.dot takes)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The Triton kernel on CUDA (head_dim as kernel_takes), the reference elsewhere."""
    if q.is_cuda and kernel_takes(q.shape[-1]):
        from tp_lora.ops.triton.paged_attention import paged_decode as kernel  # noqa: PLC0415 - CUDA only
        return kernel(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)
    return paged_decode_ref(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)


def paged_decode_rope_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, offset: bool,
                          kv_scales: tuple[float, float], block_table: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """A decode step's attention from its projected q [B, H, d], k / v [B, KV, d]: rope_write_kv_ref's RoPE and K / V
    write (slots [B]), then paged_decode_ref."""
    q = rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset, kv_scales)
    return paged_decode_ref(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)


def rope_kernel_takes(x: torch.Tensor, head_dim: int, rotary_dim: int) -> bool:
    """Whether paged_decode_rope runs the decode kernel with RoPE for projections like x (its device), heads of
    head_dim and rotary_dim (with unit strides along the last dims)."""
    return x.is_cuda and kernel_takes(head_dim) and rotary_dim <= head_dim and rotary_dim % 2 == 0


def paged_decode_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, offset: bool,
                      kv_scales: tuple[float, float], block_table: torch.Tensor, context_lens: torch.Tensor,
                      scale: float, window: int = 0, softcap: float = 0.0, sums: SplitSums | None = None,
                      out8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """On CUDA one launch of the decode kernel that also applies RoPE and writes K / V (one launch less per layer);
    elsewhere, or where the kernel does not take the shapes, rope_write_kv then paged_decode. sums: q, k and v are
    views of the qkv GEMM's SplitSums' first share, which the kernel sums; out8: the output also quantized per (row,
    head) there (tp_lora.ops.triton.paged_attention.paged_decode's); both only where rope_kernel_takes."""
    r, d = cos.shape[-1], q.shape[-1]
    if rope_kernel_takes(q, d, r) and all(x.stride(-1) == 1 for x in (q, k, v, cos, sin, k_cache, v_cache)):
        from tp_lora.ops.triton.paged_attention import paged_decode as kernel  # noqa: PLC0415 - CUDA only
        return kernel(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap,
                      rope=(k, v, cos, sin, slots, q_weight, k_weight, eps, offset, kv_scales), sums=sums, out8=out8)
    if sums is not None or out8 is not None:
        raise ValueError(f"paged_decode_rope: SplitSums and out8 are the decode kernel's (CUDA, a power-of-two "
                         f"head_dim, an even rotary dim), got {q.device}, head_dim {d}, rotary dim {r}")
    q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, q_weight, k_weight, eps, offset, kv_scales)
    return paged_decode(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap)


def paged_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, cu_q: torch.Tensor, scale: float, window: int = 0,
                 softcap: float = 0.0) -> torch.Tensor:
    """The Triton kernel on CUDA (head_dim as kernel_takes), the reference elsewhere."""
    if q.is_cuda and kernel_takes(q.shape[-1]):
        from tp_lora.ops.triton.paged_varlen import paged_varlen as kernel  # noqa: PLC0415 - CUDA only
        return kernel(q, k_cache, v_cache, block_table, context_lens, cu_q, scale, window, softcap)
    return paged_varlen_ref(q, k_cache, v_cache, block_table, context_lens, cu_q, scale, window, softcap)
