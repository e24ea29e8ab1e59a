"""The layout of an MoE routing plan (MoEPlan), shared by its builders (tp_lora.ops.moe_plan and its Triton
kernels) and the ops that read it (grouped GEMMs, fused MoE LoRA); the width of an EP dispatch row (row_bytes).

Shapes: N dispatched tokens, k top-k, E local experts, L adapter slots (0 without LoRA), C = N * min(k, E) the static
capacity (a token sends at most min(k, E) pairs to this rank's experts), B the static number of LoRA blocks.

Pair order: the first expert_ends[-1] of the C pairs are this rank's, sorted stably by (expert, slot); the rest are
pairs of other ranks' experts (or of padding rows), which no GEMM reads and no token's combine (`pos`) points at.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LORA_BLOCK = 16  # pairs per LoRA block: one (expert, slot) group is cut into blocks of at most this many pairs


@dataclass
class MoEPlan:
    token: torch.Tensor  # [C] int64, row of the pair's token in the dispatched batch (valid for every pair)
    pos: torch.Tensor  # [N, k] int32, pair-order row of token t's j-th expert (-1: this rank does not compute it)
    weight: torch.Tensor  # [N, k] float32, router weights (token order)
    sorted_key: torch.Tensor  # [C] int32, the pair's (expert, slot) key: expert * S + slot + 1, E * S past this rank's
    expert_ends: torch.Tensor  # [E] int32, cumulative end of each expert's pairs (grouped GEMM offsets)
    groups: torch.Tensor  # [B or C, 4] int32 LoRA blocks (expert, slot, start, count) in any order, rows of count 0
    # unused; [0, 4] when the LoRA ops do not run (no adapter in the step: a host fact the caller knows)
    keys_per_expert: int  # S = adapter slots + 1 (no adapter, then slots 0..L-1)

    @property
    def num_pairs(self) -> int:
        return self.token.shape[0]

    @property
    def any_lora(self) -> bool:
        return self.groups.shape[0] > 0

    @property
    def expert(self) -> torch.Tensor:
        """[C] int32, local expert of each pair (E past this rank's pairs)."""
        return (self.sorted_key // self.keys_per_expert).clamp(max=self.expert_ends.shape[0]).to(torch.int32)

    @property
    def slot(self) -> torch.Tensor:
        """[C] int32, adapter slot of each pair's token (-1: none, or not this rank's)."""
        on_rank = self.sorted_key < self.expert_ends.shape[0] * self.keys_per_expert
        return torch.where(on_rank, self.sorted_key % self.keys_per_expert - 1, -1).to(torch.int32)


def num_lora_blocks(cap: int, E: int, L: int) -> int:
    """Static row count of the LoRA block table: every group's blocks fit, whatever the routing."""
    return cap // LORA_BLOCK + min(E * L, cap) + 1


def code_shift(pairs: int) -> int:
    """Bits of a pair's index in its sort code (key << shift | index: the Triton plan's stable order)."""
    return max(pairs - 1, 1).bit_length()


def codes_fit(pairs: int, E: int, L: int) -> bool:
    """Whether every sort code, the largest key E * (L + 1) included, fits in an int32."""
    return (E * (L + 1) + 2) << code_shift(pairs) < 1 << 31


PACK_ALIGN = 16  # bytes: a dispatch row (tp_lora.ops.moe_pack) is a whole number of 16-byte vectors


def row_bytes(hidden_bytes: int, k: int, tags: bool) -> int:
    """Bytes of one dispatch row: hidden | k int32 ids | k float32 weights | int32 slot (if tags), padded."""
    return -(-(hidden_bytes + 8 * k + (4 if tags else 0)) // PACK_ALIGN) * PACK_ALIGN
