"""Attention over a per-sequence KV cache for a step that may mix prefill and decode.

A step's tokens come grouped by sequence (each sequence's new tokens contiguous, in position order). The
metadata below is built once per step on the host and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    cache_rows: torch.Tensor  # [N] KV-cache row of each sequence
    token_rows: torch.Tensor  # [T] cache row of each token
    positions: torch.Tensor  # [T] position of each token
    pad_index: torch.Tensor  # [N, max_q] token index of each (sequence, query) cell, T for padding
    flat_index: torch.Tensor  # [T] cell n * max_q + j of each token in the padded layout
    mask: torch.Tensor  # [N, 1, max_q, max_kv] True where the query may attend
    max_kv: int
    last_token: torch.Tensor  # [N] index of each sequence's last token in the step (its logits are sampled)


def build_attn_meta(cache_rows: list[int], starts: list[int], lengths: list[int], device,
                    sliding_window: int | None = None, max_kv: int | None = None) -> AttnMeta:
    """Sequence n has `lengths[n]` new tokens at positions starts[n] .. starts[n]+lengths[n]-1.
    max_kv fixes the key length (a CUDA graph needs static shapes); default: the longest sequence after the step."""
    n = len(cache_rows)
    max_q = max(lengths)
    total = sum(lengths)
    max_kv = max_kv or max(s + l for s, l in zip(starts, lengths))
    offs = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    j = torch.arange(max_q)
    lens = torch.tensor(lengths)
    st = torch.tensor(starts)
    pad_index = torch.where(j[None] < lens[:, None], offs[:-1, None] + j[None], torch.tensor(total))
    q_pos = st[:, None] + j[None]  # padded queries get in-range positions: their rows are discarded, never NaN
    k_pos = torch.arange(max_kv)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    seq_of_token = torch.repeat_interleave(torch.arange(n), lens)
    j_of_token = torch.arange(total) - offs[:-1][seq_of_token]
    rows = torch.tensor(cache_rows)
    return AttnMeta(
        cache_rows=rows.to(device), token_rows=rows[seq_of_token].to(device),
        positions=(st[seq_of_token] + j_of_token).to(device), pad_index=pad_index.to(device),
        flat_index=(seq_of_token * max_q + j_of_token).to(device), mask=mask[:, None].to(device), max_kv=max_kv,
        last_token=(offs[1:] - 1).to(device))


class KVCache:
    """Per layer K and V of shape [max_seqs, max_len, kv_heads_local, head_dim]; a sequence owns one row."""

    def __init__(self, num_layers: int, max_seqs: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (max_seqs, max_len, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seqs, self.max_len = max_seqs, max_len


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, meta: AttnMeta,
           scale: float) -> torch.Tensor:
    """q [T, H, d], k/v [T, KV, d] for the step's tokens -> [T, H*d]."""
    kc, vc = cache.k[layer], cache.v[layer]
    kc[meta.token_rows, meta.positions] = k
    vc[meta.token_rows, meta.positions] = v
    heads, d = q.shape[1], q.shape[2]
    qp = torch.cat([q, q.new_zeros(1, heads, d)])[meta.pad_index].transpose(1, 2)  # [N, H, max_q, d]
    keys = kc[meta.cache_rows, :meta.max_kv].transpose(1, 2)  # [N, KV, max_kv, d]
    vals = vc[meta.cache_rows, :meta.max_kv].transpose(1, 2)
    if keys.shape[1] != heads:
        rep = heads // keys.shape[1]
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=meta.mask, scale=scale)
    return out.transpose(1, 2).reshape(-1, heads * d)[meta.flat_index]
