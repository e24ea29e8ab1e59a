"""Attention over a per-sequence KV cache for a step that may mix prefill and decode.

A step's tokens come grouped by sequence (each sequence's new tokens contiguous, in position order). The
metadata below is built once per step on the host and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tp_lora.hostcopy import to_device

# cuDNN's attention is left out: it builds a plan per new shape, and eager steps (prefill, mixed) change shape
# every step: profiled on an H100 at ~6.5 ms of host time per call.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttnGroup:
    """Sequences attended together in one padded [n, max_q] query layout."""
    cache_rows: torch.Tensor  # [n] KV-cache row of each sequence
    pad_index: torch.Tensor  # [n, max_q] step token index of each (sequence, query) cell, T for padding
    flat_index: torch.Tensor  # [t] cell s * max_q + j of each of the group's tokens
    mask: torch.Tensor  # [n, 1, max_q, max_kv] True where the query may attend
    max_kv: int
    tokens: torch.Tensor | None  # [t] step index of each of the group's tokens; None: every token, in order
    _sdpa_masks: dict = field(default_factory=dict, repr=False)

    def sdpa_mask(self, rep: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """The mask as attention takes it with `rep` query heads folded into the query length: additive, in the
        activations' dtype, built by the first layer of the step and reused by the others (SDPA would convert a
        boolean mask again in every layer). window: a layer's own sliding window over the step's causal mask."""
        key = (rep, dtype, window)
        if key not in self._sdpa_masks:
            allowed = self.mask if window is None else within_window(self.mask, window)
            allowed = allowed if rep == 1 else allowed.repeat(1, 1, rep, 1)
            self._sdpa_masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._sdpa_masks[key]


def within_window(mask: torch.Tensor, window: int) -> torch.Tensor:
    """mask [..., max_kv] of causal rows -> only the last `window` keys up to each query (a query's position is its
    last allowed key: it always sees itself)."""
    k_pos = torch.arange(mask.shape[-1], device=mask.device)
    q_pos = torch.where(mask, k_pos, -1).amax(-1, keepdim=True)
    return mask & (k_pos > q_pos - window)


@dataclass
class AttnMeta:
    token_rows: torch.Tensor  # [T] cache row of each token
    positions: torch.Tensor  # [T] position of each token
    groups: list[AttnGroup]
    last_token: torch.Tensor  # [N] index of each sequence's last token in the step (its logits are sampled)


def build_attn_meta(cache_rows: list[int], starts: list[int], lengths: list[int], device,
                    sliding_window: int | None = None) -> AttnMeta:
    """Sequence n has `lengths[n]` new tokens at positions starts[n] .. starts[n]+lengths[n]-1.

    Decoding sequences (one new token) and prefill chunks are attended as two groups: padded together, every
    decode row would carry the longest chunk's query length, and a mixed step of 64 sequences with one 256-token
    chunk would compute (and copy) 64x the attention it needs. Built on the host, moved in one pinned copy."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    total = offs[-1]
    parts = [p for p in ([i for i, n in enumerate(lengths) if n == 1], [i for i, n in enumerate(lengths) if n != 1])
             if p]
    groups = [_group(p, cache_rows, starts, lengths, offs, total, sliding_window) for p in parts]
    lens = torch.tensor(lengths)
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    j_of_token = torch.arange(total) - torch.tensor(offs[:-1])[seq_of_token]
    host = [torch.tensor(cache_rows)[seq_of_token], torch.tensor(starts)[seq_of_token] + j_of_token,
            torch.tensor(offs[1:]) - 1]
    for g in groups:
        host += [g.cache_rows, g.pad_index, g.flat_index, g.mask] + ([g.tokens] if len(groups) > 1 else [])
    dev = iter(to_device(host, device))
    token_rows, positions, last_token = next(dev), next(dev), next(dev)
    for g in groups:
        g.cache_rows, g.pad_index, g.flat_index, g.mask = next(dev), next(dev), next(dev), next(dev)
        g.tokens = next(dev) if len(groups) > 1 else None  # one group covers every token, in order
    return AttnMeta(token_rows=token_rows, positions=positions, groups=groups, last_token=last_token)


def _group(seqs: list[int], cache_rows, starts, lengths, offs, total: int, sliding_window) -> AttnGroup:
    """The group's layout, on the host."""
    lens = torch.tensor([lengths[i] for i in seqs])
    st = torch.tensor([starts[i] for i in seqs])
    first = torch.tensor([offs[i] for i in seqs])
    max_q = int(lens.max())
    max_kv = int((st + lens).max())
    j = torch.arange(max_q)
    valid = j[None] < lens[:, None]
    pad_index = torch.where(valid, first[:, None] + j[None], torch.tensor(total))
    q_pos = st[:, None] + j[None]  # padded queries get in-range positions: their rows are discarded, never NaN
    k_pos = torch.arange(max_kv)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    cells = torch.arange(len(seqs) * max_q).view(len(seqs), max_q)
    return AttnGroup(cache_rows=torch.tensor([cache_rows[i] for i in seqs]), pad_index=pad_index,
                     flat_index=cells[valid], mask=mask[:, None], max_kv=max_kv, tokens=pad_index[valid])


class KVCache:
    """Per layer K and V of shape [max_seqs, max_len, kv_heads_local, head_dim]; a sequence owns one row."""

    def __init__(self, num_layers: int, max_seqs: int, max_len: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (max_seqs, max_len, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seqs, self.max_len = max_seqs, max_len


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, meta: AttnMeta,
           scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, d], k/v [T, KV, d] for the step's tokens -> [T, H*d]. window: this layer's sliding window (models
    whose layers differ; a window shared by every layer is in the step's mask already). softcap: scores become
    softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    kc, vc = cache.k[layer], cache.v[layer]
    kc[meta.token_rows, meta.positions] = k
    vc[meta.token_rows, meta.positions] = v
    heads, d = q.shape[1], q.shape[2]
    q_ext = torch.cat([q, q.new_zeros(1, heads, d)])  # the padding cell's index T reads zeros
    if len(meta.groups) == 1:
        return _attend_group(q_ext, kc, vc, meta.groups[0], scale, window, softcap)
    out = q.new_empty(q.shape[0], heads * d)
    for g in meta.groups:
        out[g.tokens] = _attend_group(q_ext, kc, vc, g, scale, window, softcap)
    return out


def _attend_group(q_ext, kc, vc, g: AttnGroup, scale: float, window: int | None, softcap: float | None
                  ) -> torch.Tensor:
    heads, d = q_ext.shape[1], q_ext.shape[2]
    n, max_q = g.pad_index.shape
    keys = kc[g.cache_rows, :g.max_kv].transpose(1, 2)  # [n, KV, max_kv, d]
    vals = vc[g.cache_rows, :g.max_kv].transpose(1, 2)
    kv = keys.shape[1]
    rep = heads // kv
    # The `rep` query heads of one KV head (heads h = kv_i * rep + r) share its keys: folded into the query length,
    # they attend to K and V as stored instead of to `rep` copies of them.
    qp = q_ext[g.pad_index].view(n, max_q, kv, rep, d).permute(0, 2, 3, 1, 4).reshape(n, kv, rep * max_q, d)
    mask = g.sdpa_mask(rep, qp.dtype, window)
    if softcap is not None:
        out = softcapped_attention(qp, keys, vals, mask, scale, softcap)
    else:
        with sdpa_kernel(_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask, scale=scale)
    out = out.view(n, kv, rep, max_q, d).permute(0, 3, 1, 2, 4).reshape(n * max_q, heads * d)
    return out[g.flat_index]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """Attention with capped scores, in plain torch (SDPA has no soft-cap): q [n, KV, Q, d], k/v [n, KV, K, d],
    additive mask [n, 1, Q, K] -> [n, KV, Q, d]. Softmax in float32, as transformers' eager Gemma 2."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)
