"""SplitSums: the output of a GEMM whose K is split in shares, left as the shares' float32 partial sums for the op
that reads it (tp_lora.ops.fp8.fp8_linear's sums, summed by tp_lora.ops.fused.add_rms_norm's kernel)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitSums:
    """The output [M, N] of a GEMM whose K is split in S shares, left as their float32 partial sums parts [S, M, N]
    for the op that reads it: summed in share order, times col [N] and then row [M] (each float32, or None), rounded
    to dtype. The GEMM then skips the sum its last share would make (tp_lora.ops.triton.fp8_gemm)."""
    parts: torch.Tensor
    col: torch.Tensor | None
    row: torch.Tensor | None
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The output as the GEMM writes it when it sums the shares itself (the reference of the readers' sum)."""
        acc = torch.zeros_like(self.parts[0])
        for part in self.parts:
            acc = acc + part
        if self.col is not None:
            acc = acc * self.col
        if self.row is not None:
            acc = acc * self.row.reshape(-1, 1)
        return acc.to(self.dtype)
