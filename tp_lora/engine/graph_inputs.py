"""A step's inputs padded to the fixed sizes of a captured mixed-step CUDA graph: T token rows, S sequence rows,
block tables W wide. Built on the host (a pure function of the step's lists), copied into the graph's static buffers.

Real tokens and sequences come first, in step order; padding tokens have id 0, position 0 and the scratch
block's first KV slot (no sequence reads it; every slot is in bounds, which the fused K/V write needs); padding sequences own no query (q_len 0, context 0),
their block tables and the unused ends of real ones point at the scratch block, and their logits row is token 0's.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from tp_lora.models.attention import AttnGroup, AttnMeta


@dataclass
class MixedInputs:
    ids: torch.Tensor  # [T] int64 token ids
    positions: torch.Tensor  # [T] int64 position of each token
    kv_slots: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) each token's K/V goes to
    last_token: torch.Tensor  # [S] int64 row of each sequence's last token (its logits are sampled)
    cu_q: torch.Tensor  # [S+1] int32 first token row of each sequence, then the end of the last
    context_lens: torch.Tensor  # [S] int32 positions each sequence attends over after this step
    block_table: torch.Tensor  # [S, W] int32

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

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
                   torch.zeros(seqs, width, **i32))


def pad_mixed_step(ids: list[int], blocks: list[list[int]], starts: list[int], lens: list[int], tokens: int,
                   seqs: int, width: int, block_size: int, scratch: int) -> MixedInputs:
    """Sequence n has lens[n] >= 1 new tokens (its run of `ids`) at positions starts[n].., kept in the blocks
    blocks[n] (covering at least its last new position; entries past `width`, for positions the graph does not
    serve, are dropped). -> host tensors padded to `tokens` x `seqs` x `width`."""
    n, t = len(lens), len(ids)
    if t != sum(lens) or t > tokens or n > seqs or min(lens, default=1) < 1:
        raise ValueError(f"a step of {t} tokens ({sum(lens)} by lens), {n} sequences, lens >= "
                         f"{min(lens, default=1)}: expected at most {tokens} tokens, {seqs} sequences, every len >= 1")
    lens_t = torch.tensor(lens, dtype=torch.int64)
    ends = torch.cumsum(lens_t, 0)
    seq = torch.repeat_interleave(torch.arange(n), lens_t)
    pos = torch.tensor(starts, dtype=torch.int64)[seq] + torch.arange(t) - (ends - lens_t)[seq]
    table = pad_block_table(blocks, seqs, width, scratch)
    out = MixedInputs.zeros(tokens, seqs, width, "cpu")
    out.ids[:t] = torch.tensor(ids, dtype=torch.int64)
    out.positions[:t] = pos
    out.kv_slots.fill_(scratch * block_size)
    out.kv_slots[:t] = table[seq, pos // block_size].long() * block_size + pos % block_size
    out.last_token[:n] = ends - 1
    out.cu_q[1:n + 1] = ends.to(torch.int32)
    out.cu_q[n + 1:] = t
    out.context_lens[:n] = (torch.tensor(starts, dtype=torch.int64) + lens_t).to(torch.int32)
    out.block_table = table
    return out


def pad_block_table(blocks: list[list[int]], rows: int, width: int, scratch: int) -> torch.Tensor:
    """Block tables blocks[n] (entries past `width` dropped) as a host int32 [rows, width] tensor, the rest of each row
    and the padding rows the scratch block. Filled row by row in numpy: the host cost follows the real entries, not
    rows x width (a table for long contexts is hundreds wide; a step's sequences mostly use a few blocks)."""
    if len(blocks) > rows:
        raise ValueError(f"{len(blocks)} block tables: expected at most {rows} rows")
    table = np.full((rows, width), scratch, dtype=np.int32)
    for n, b in enumerate(blocks):
        k = min(len(b), width)
        table[n, :k] = b[:k]
    return torch.from_numpy(table)
