"""Attention over a paged KV cache for a step that may mix prefill and decode.

The cache is a pool of fixed-size blocks; a sequence's positions live in the blocks of its block table (position p
in block table[p // block_size] at offset p % block_size). A step's tokens come grouped by sequence (each
sequence's new tokens contiguous, in position order). The metadata below is built once per step on the host and
shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tp_lora.hostcopy import to_device
from tp_lora.ops.fused import Rows8, rope_write_kv
from tp_lora.ops.paged_attention import paged_decode, paged_decode_rope, paged_varlen
from tp_lora.ops.split_sums import SplitSums

# cuDNN's attention is left out: it builds a plan (host time) per new shape, and eager steps (prefill, mixed) change
# shape every step.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttnGroup:
    """Sequences attended together: decodes through the paged decode kernel (block_table set); any mix of new
    tokens through the varlen paged kernel (cu_q set too: a CUDA graph's step, every token of the step); or, on CPU
    and for eager prefill chunks, gathered into one padded [n, max_q] query layout over [n, max_kv] keys (kv_index
    set)."""
    tokens: torch.Tensor | None  # [t] step index of each of the group's tokens; None: every token, in order
    block_table: torch.Tensor | None = None  # [n, W] blocks of each sequence (paged kernels)
    context_lens: torch.Tensor | None = None  # [n] positions each sequence attends over (paged kernels)
    cu_q: torch.Tensor | None = None  # [n+1] int32 first step token of each sequence, then the end (varlen kernel)
    kv_index: torch.Tensor | None = None  # [n, max_kv] cache slot of each sequence's positions 0..max_kv-1
    pad_index: torch.Tensor | None = None  # [n, max_q] step token index of each (sequence, query) cell, T for padding
    flat_index: torch.Tensor | None = None  # [t] cell s * max_q + j of each of the group's tokens
    mask: torch.Tensor | None = None  # [n, 1, max_q, max_kv] True where the query may attend
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
    slots: torch.Tensor  # [T] cache slot (block * block_size + offset) each token's K and V are written to
    positions: torch.Tensor  # [T] position of each token
    groups: list[AttnGroup]
    last_token: torch.Tensor  # [N] index of each sequence's last token in the step (its logits are sampled)
    window: int = 0  # sliding window (0: none)


def token_positions(starts: list[int], lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequence n's lengths[n] new tokens at positions starts[n].. (its run of the step's tokens) -> (sequence of each
    token [T], its position [T], each sequence's end in the step [N]), int64."""
    lens = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lens)
    seq = np.repeat(np.arange(len(lens)), lens)
    return seq, np.arange(seq.shape[0]) + (np.asarray(starts, dtype=np.int64) - (ends - lens))[seq], ends


def build_attn_meta(block_tables: list[list[int]], starts: list[int], lengths: list[int], block_size: int, device,
                    sliding_window: int | None = None, decode_kernel: bool | None = None) -> AttnMeta:
    """Sequence n has `lengths[n]` new tokens at positions starts[n] .. starts[n]+lengths[n]-1, kept in the blocks
    block_tables[n] (covering every position up to its last new token).

    Decoding sequences (one new token) and prefill chunks are attended as two groups: padded together, every
    decode row would carry the longest chunk's query length. Decodes go through the paged decode kernel when
    `decode_kernel` (default: on CUDA), else with the chunks through the gathered layout. Built on the host, moved in
    one pinned copy."""
    device = torch.device(device)
    if decode_kernel is None:
        decode_kernel = device.type == "cuda"
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    total = offs[-1]
    decodes = [i for i, n in enumerate(lengths) if n == 1]
    chunks = [i for i, n in enumerate(lengths) if n != 1]
    parts = [p for p in (decodes, chunks) if p]
    groups = [_decode_group(p, block_tables, starts, offs) if p is decodes and decode_kernel
              else _group(p, block_tables, starts, lengths, offs, total, block_size, sliding_window) for p in parts]
    seq, positions, ends = token_positions(starts, lengths)
    width = max(len(t) for t in block_tables)
    tables = np.array([t + [0] * (width - len(t)) for t in block_tables], dtype=np.int64)
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    host = [torch.from_numpy(slots), torch.from_numpy(positions), torch.from_numpy(ends - 1)]
    names = ("tokens", "block_table", "context_lens", "kv_index", "pad_index", "flat_index", "mask")
    fields = [[n for n in names if getattr(g, n) is not None and (n != "tokens" or len(groups) > 1)] for g in groups]
    for g, f in zip(groups, fields):
        host += [getattr(g, n) for n in f]
    dev = iter(to_device(host, device))
    meta = AttnMeta(slots=next(dev), positions=next(dev), groups=groups, last_token=next(dev),
                    window=sliding_window or 0)
    for g, f in zip(groups, fields):
        for n in f:
            setattr(g, n, next(dev))
        if len(groups) == 1:
            g.tokens = None  # one group covers every token, in order
    return meta


def _decode_group(seqs: list[int], block_tables, starts, offs) -> AttnGroup:
    width = max(len(block_tables[i]) for i in seqs)
    table = torch.tensor([block_tables[i] + [0] * (width - len(block_tables[i])) for i in seqs], dtype=torch.int32)
    return AttnGroup(tokens=torch.tensor([offs[i] for i in seqs]), block_table=table,
                     context_lens=torch.tensor([starts[i] + 1 for i in seqs], dtype=torch.int32))


def _group(seqs: list[int], block_tables, starts, lengths, offs, total: int, block_size: int,
           sliding_window) -> AttnGroup:
    """The gathered layout of a group, on the host."""
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
    # Positions past a sequence's own are masked: they read its first block, whatever it holds.
    blocks = [torch.tensor(block_tables[i])[torch.clamp(k_pos // block_size, max=len(block_tables[i]) - 1)]
              for i in seqs]
    kv_index = torch.stack(blocks) * block_size + k_pos[None] % block_size
    cells = torch.arange(len(seqs) * max_q).view(len(seqs), max_q)
    return AttnGroup(tokens=pad_index[valid], kv_index=kv_index, pad_index=pad_index, flat_index=cells[valid],
                     mask=mask[:, None])


class KVCache:
    """Per layer K and V of shape [num_blocks + 1, block_size, kv_heads_local, head_dim]: `num_blocks` for the
    sequences' block tables, and a last, scratch block that padded CUDA-graph rows write to."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype,
                 device):
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def scratch(self) -> int:
        return self.num_blocks


def decodes_only(meta: AttnMeta) -> bool:
    """Whether the step is decodes only (one group over block tables), which rope_attend runs in paged_decode_rope."""
    g = meta.groups[0] if len(meta.groups) == 1 else None
    return g is not None and g.block_table is not None and g.cu_q is None


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, layer: int, meta: AttnMeta, scale: float, window: int | None, softcap: float | None,
                q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, offset: bool,
                kv_scales: tuple[float, float], sums: SplitSums | None = None, out8: Rows8 | None = None
                ) -> torch.Tensor:
    """The step's projected q [T, H, d], k / v [T, KV, d] -> attention [T, H*d]: RoPE (after the optional per-head
    norm, tp_lora.ops.fused.rope_write_kv), K and V written at meta.slots, then attend(); a step of decodes only
    does all three in the decode kernel's launch (paged_decode_rope), which also takes q, k and v as views of the qkv
    GEMM's SplitSums (sums) and writes its output quantized per (row, head) into out8 (where rope_kernel_takes)."""
    kc, vc = cache.k[layer], cache.v[layer]
    if decodes_only(meta):
        g = meta.groups[0]
        return paged_decode_rope(q, k, v, cos, sin, kc, vc, meta.slots, q_weight, k_weight, eps, offset, kv_scales,
                                 g.block_table, g.context_lens, scale, window or meta.window,
                                 softcap or 0.0, sums, out8).view(-1, q.shape[1] * q.shape[2])
    q = rope_write_kv(q, k, v, cos, sin, kc, vc, meta.slots, q_weight, k_weight, eps, offset, kv_scales)
    return attend(q, cache, layer, meta, scale, window, softcap)


def attend(q: torch.Tensor, cache: KVCache, layer: int, meta: AttnMeta, scale: float, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """q [T, H, d] for the step's tokens, whose K and V are in the cache at meta.slots already (the model writes them
    with RoPE, tp_lora.ops.fused.rope_write_kv) -> [T, H*d]. window: this layer's sliding window (models
    whose layers differ; a window shared by every layer is the step's, meta.window). softcap: scores become
    softcap * tanh(scores / softcap) before the mask (Gemma 2)."""
    kc, vc = cache.k[layer], cache.v[layer]
    heads, d = q.shape[1], q.shape[2]

    def decode(g: AttnGroup, qs: torch.Tensor) -> torch.Tensor:
        return paged_decode(qs, kc, vc, g.block_table, g.context_lens, scale, window or meta.window,
                            softcap or 0.0).view(-1, heads * d)

    if meta.groups and meta.groups[0].cu_q is not None:  # the only group: every token of the step
        g = meta.groups[0]
        return paged_varlen(q, kc, vc, g.block_table, g.context_lens, g.cu_q, scale, window or meta.window,
                            softcap or 0.0).view(-1, heads * d)
    if len(meta.groups) == 1 and meta.groups[0].block_table is not None:
        return decode(meta.groups[0], q)
    q_ext = torch.cat([q, q.new_zeros(1, heads, d)])  # the padding cell's index T reads zeros
    if len(meta.groups) == 1:
        return _attend_group(q_ext, kc, vc, meta.groups[0], scale, window, softcap)
    out = q.new_empty(q.shape[0], heads * d)
    for g in meta.groups:
        if g.block_table is not None:
            out[g.tokens] = decode(g, q[g.tokens])
        else:
            out[g.tokens] = _attend_group(q_ext, kc, vc, g, scale, window, softcap)
    return out


def _attend_group(q_ext, kc, vc, g: AttnGroup, scale: float, window: int | None, softcap: float | None
                  ) -> torch.Tensor:
    heads, d = q_ext.shape[1], q_ext.shape[2]
    n, max_q = g.pad_index.shape
    # [n, KV, max_kv, d] in the queries' dtype (an fp8 cache widens exactly)
    keys = kc.view(-1, *kc.shape[2:])[g.kv_index].transpose(1, 2).to(q_ext.dtype)
    vals = vc.view(-1, *vc.shape[2:])[g.kv_index].transpose(1, 2).to(q_ext.dtype)
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
