"""Vocab-parallel embedding and LM head: each rank holds V/p rows of the vocabulary."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.linear import copy_checked
from tp_lora.ops.fused import embedding_shard
from tp_lora.ops.mm16 import mm16
from tp_lora.sharding import LinearSpec, OutSlice, take, vocab_range


class VocabParallelEmbedding(nn.Module):
    """partial(ids): rows of ids this rank holds, zeros elsewhere; finish: all-reduce assembles every row."""

    def __init__(self, vocab: int, hidden: int, tp: comm.Group, dtype=torch.float32, device: Any = "cpu"):
        super().__init__()
        self.tp, self.vocab, self.hidden = tp, vocab, hidden
        self.vocab_start, self.vocab_end = vocab_range(vocab, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden, dtype=dtype,
                                               device=device), requires_grad=False)

    def load(self, weight: Any) -> None:
        copy_checked(self.weight.data, take(weight, (self.vocab_start, self.vocab_end), 0), "embedding")

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight[ids]
        return embedding_shard(self.weight, ids, self.vocab_start)

    def finish(self, z: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(z, self.tp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(ids))


class ParallelLMHead(nn.Module):
    """Column-parallel on the vocabulary: partial = local logits [T, V/p], finish gathers [T, V].
    With tied embeddings it shares the embedding's shard (both split the vocab the same way)."""

    def __init__(self, vocab: int, hidden: int, tp: comm.Group, dtype=torch.float32, device: Any = "cpu",
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp, self.vocab, self.hidden = tp, vocab, hidden
        self.vocab_start, self.vocab_end = vocab_range(vocab, tp.rank, tp.size)
        # Same split as a one-slice column-parallel linear, so LoRALinear wraps it unchanged (logits LoRA).
        self.spec = LinearSpec("column", hidden, (OutSlice(vocab),))
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden, dtype=dtype,
                                                   device=device), requires_grad=False)

    def load(self, weight: Any) -> None:
        copy_checked(self.weight.data, take(weight, (self.vocab_start, self.vocab_end), 0), "lm_head")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return mm16(x, self.weight, head=True)

    def finish(self, z: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(z, self.tp, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))
