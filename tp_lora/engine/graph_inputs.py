"""A step's inputs padded to the fixed sizes of a captured CUDA graph, built on the host (a pure function of the
step's lists, written with numpy: a few vector ops instead of one torch op per field) and copied into the graph's
static buffers.

Mixed steps: T token rows, S sequence rows, block tables W wide. Real tokens and sequences come first, in step
order; padding tokens have id 0, position 0 and the scratch block's first KV slot (no sequence reads it; every slot
is in bounds, which the fused K/V write needs); padding sequences own no query (q_len 0, context 0), their block
tables and the unused ends of real ones point at the scratch block, and their logits row is token 0's.
Decode steps: B rows of one token each; padding rows have id 0, position 0 (the scratch block's first slot, context
1) and all-scratch tables.
A token's `feed` (-1 for none) names the row of the previous step's sampled tokens its id comes from on the device
(a step launched before that one's tokens reached the host); its staged id is then a placeholder.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

import numpy as np
import torch

from tp_lora.models.attention import AttnGroup, AttnMeta, token_positions


class _Fields:
    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]):
        """The fields over `tensors` (in field order; e.g. views of one staging buffer)."""
        return cls(*tensors)


@dataclass
class MixedInputs(_Fields):
    ids: torch.Tensor  # [T] int64 token ids
    positions: torch.Tensor  # [T] int64 position of each token
    kv_slots: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) each token's K/V goes to
    last_token: torch.Tensor  # [S] int64 row of each sequence's last token (its logits are sampled)
    cu_q: torch.Tensor  # [S+1] int32 first token row of each sequence, then the end of the last
    context_lens: torch.Tensor  # [S] int32 positions each sequence attends over after this step
    block_table: torch.Tensor  # [S, W] int32
    feed: torch.Tensor  # [T] int64 row of the previous step's sampled tokens giving the id, or -1

    def meta(self, window: int | None) -> AttnMeta:
        """The attention layout over these tensors: one varlen group of every row (computed nothing on the host, so a
        graph captures it over its static buffers)."""
        group = AttnGroup(tokens=None, block_table=self.block_table, context_lens=self.context_lens, cu_q=self.cu_q)
        return AttnMeta(slots=self.kv_slots, positions=self.positions, groups=[group], last_token=self.last_token,
                        window=window or 0)

    @classmethod
    def zeros(cls, tokens: int, seqs: int, width: int, device) -> MixedInputs:
        """Buffers of the sizes (the graph's static inputs)."""
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        return cls(torch.zeros(tokens, **i64), torch.zeros(tokens, **i64), torch.zeros(tokens, **i64),
                   torch.zeros(seqs, **i64), torch.zeros(seqs + 1, **i32), torch.zeros(seqs, **i32),
                   torch.zeros(seqs, width, **i32), torch.full((tokens,), -1, **i64))


@dataclass
class DecodeInputs(_Fields):
    ids: torch.Tensor  # [B] int64 token ids
    positions: torch.Tensor  # [B] int64 position of each row's token
    kv_slots: torch.Tensor  # [B] int64 cache slot (block * block_size + offset) each row's K/V goes to
    last_token: torch.Tensor  # [B] int64 0..B-1: every row's logits are sampled
    context_lens: torch.Tensor  # [B] int32 positions each row attends over (its position + 1)
    block_table: torch.Tensor  # [B, W] int32
    valid: torch.Tensor  # [1] int64 count of real rows (read by models with graph_rows)
    feed: torch.Tensor  # [B] int64 row of the previous step's sampled tokens giving the id, or -1

    def meta(self, window: int | None) -> AttnMeta:
        """The attention layout over these tensors (nothing computed on the device: the host filled every field)."""
        group = AttnGroup(tokens=None, block_table=self.block_table, context_lens=self.context_lens)
        return AttnMeta(slots=self.kv_slots, positions=self.positions, groups=[group], last_token=self.last_token,
                        window=window or 0)

    @classmethod
    def zeros(cls, rows: int, width: int, device) -> DecodeInputs:
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(rows, **i64), torch.zeros(rows, **i64), torch.zeros(rows, **i64),
                   torch.arange(rows, **i64), torch.ones(rows, dtype=torch.int32, device=device),
                   torch.zeros(rows, width, dtype=torch.int32, device=device), torch.zeros(1, **i64),
                   torch.full((rows,), -1, **i64))


def fill_block_table(table: np.ndarray, blocks: list[list[int]], scratch: int) -> None:
    """table [S, W] <- row n: blocks[n][:W], then scratch (rows past len(blocks) all scratch); one conversion of
    every kept entry and one masked scatter."""
    n, width = len(blocks), table.shape[1]
    table.fill(scratch)
    if n == 0:
        return
    kept = np.fromiter(map(len, blocks), np.int64, n)
    if kept.max() > width:
        kept = np.minimum(kept, width)
        blocks = [b[:width] for b in blocks]
    table[:n][np.arange(width) < kept[:, None]] = np.array(list(chain.from_iterable(blocks)), dtype=np.int32)


def pad_mixed_step(ids: list[int], blocks: list[list[int]], starts: list[int], lens: list[int], tokens: int,
                   seqs: int, width: int, block_size: int, scratch: int, out: MixedInputs | None = None,
                   feeds: list[int] | None = None) -> MixedInputs:
    """Sequence n has lens[n] >= 1 new tokens (its run of `ids`) at positions starts[n].., kept in the blocks
    blocks[n] (covering at least its last new position; entries past `width`, for positions the graph does not
    serve, are dropped), and its last token fed from feeds[n] (None: none fed). -> host tensors padded to `tokens` x
    `seqs` x `width`: written into `out` (host tensors of those sizes, e.g. a graph's staging buffers; every element
    is set) if given, else new."""
    n, t = len(lens), len(ids)
    if t != sum(lens) or t > tokens or n > seqs or min(lens, default=1) < 1:
        raise ValueError(f"a step of {t} tokens ({sum(lens)} by lens), {n} sequences, lens >= "
                         f"{min(lens, default=1)}: expected at most {tokens} tokens, {seqs} sequences, every len >= 1")
    if out is None:
        out = MixedInputs.zeros(tokens, seqs, width, "cpu")
    elif out.ids.shape[0] != tokens or out.block_table.shape != (seqs, width):
        raise ValueError(f"out holds {out.ids.shape[0]} tokens and tables {tuple(out.block_table.shape)}, expected "
                         f"{tokens} and ({seqs}, {width})")
    o = MixedInputs(*(x.numpy() for x in out.tensors()))
    seq, pos, ends = token_positions(starts, lens)
    fill_block_table(o.block_table, blocks, scratch)
    o.ids[:t] = ids
    o.ids[t:] = 0
    o.positions[:t] = pos
    o.positions[t:] = 0
    o.kv_slots[:t] = o.block_table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    o.kv_slots[t:] = scratch * block_size
    o.last_token[:n] = ends - 1
    o.last_token[n:] = 0
    o.cu_q[0] = 0
    o.cu_q[1:n + 1] = ends
    o.cu_q[n + 1:] = t
    o.context_lens[:n] = np.asarray(starts) + np.asarray(lens)
    o.context_lens[n:] = 0
    o.feed.fill(-1)
    if feeds is not None:
        o.feed[ends - 1] = feeds
    return out


def pad_decode_step(ids: list[int], blocks: list[list[int]], starts: list[int], rows: int, width: int,
                    block_size: int, scratch: int, out: DecodeInputs | None = None, feeds: list[int] | None = None
                    ) -> DecodeInputs:
    """Row n decodes token ids[n] at position starts[n] with block table blocks[n] (cut to `width`), its id fed from
    feeds[n] (None: none fed). -> host
    tensors padded to `rows` x `width`: written into `out` (every element is set) if given, else new."""
    n = len(ids)
    if n > rows or len(blocks) != n or len(starts) != n:
        raise ValueError(f"a decode step of {n} ids, {len(blocks)} tables, {len(starts)} starts: expected one of "
                         f"each per row, at most {rows} rows")
    if out is None:
        out = DecodeInputs.zeros(rows, width, "cpu")
    elif out.ids.shape[0] != rows or out.block_table.shape != (rows, width):
        raise ValueError(f"out holds {out.ids.shape[0]} rows and tables {tuple(out.block_table.shape)}, expected "
                         f"{rows} and ({rows}, {width})")
    o = DecodeInputs(*(x.numpy() for x in out.tensors()))
    o.ids[:n] = ids
    o.ids[n:] = 0
    o.positions[:n] = starts
    o.positions[n:] = 0
    fill_block_table(o.block_table, blocks, scratch)
    pos = o.positions
    o.kv_slots[:] = o.block_table[np.arange(rows), pos // block_size].astype(np.int64) * block_size + pos % block_size
    o.last_token[:] = np.arange(rows)
    o.context_lens[:] = pos + 1
    o.valid[0] = n
    o.feed[:n] = feeds if feeds is not None else -1
    o.feed[n:] = -1
    return out
