"""SplitSums: the output of a GEMM whose K is split in shares, left as the shares' float32 partial sums for the op
that reads it (tp_lora.ops.fp8.fp8_linear's sums, summed by tp_lora.ops.fused.add_rms_norm's kernel)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SplitSums:
    """The output [M, N] of a GEMM whose K is split in S shares, left as their float32 partial sums parts [S, M, N]
    for the op that reads it: summed in share order, times col [N] and then row [M] (each float32, or None), rounded
    to dtype. The GEMM then skips the sum its last share would make (tp_lora.ops.triton.fp8_gemm). delta [M, N]
    float32 (or None), at the parts' strides: added to that rounded sum, rounded again, as a LoRA expand adds into
    the GEMM's output (the expand ran beside the GEMM, tp_lora.lora.layers; the output of a GEMM that did not split
    K then comes as one share in dtype)."""
    parts: torch.Tensor
    col: torch.Tensor | None
    row: torch.Tensor | None
    dtype: torch.dtype
    delta: torch.Tensor | None = None

    def __post_init__(self):
        d = self.delta
        if d is not None and (d.dtype != torch.float32 or d.shape != self.parts.shape[1:]
                              or d.stride() != self.parts[0].stride()):
            raise ValueError(f"SplitSums' delta needs float32 {tuple(self.parts.shape[1:])} at strides "
                             f"{tuple(self.parts[0].stride())}, got {d.dtype} {tuple(d.shape)} at {tuple(d.stride())}")

    def total(self) -> torch.Tensor:
        """The output as the GEMM writes it when it sums the shares itself (the reference of the readers' sum)."""
        acc = torch.zeros_like(self.parts[0])
        for part in self.parts:
            acc = acc + part
        if self.col is not None:
            acc = acc * self.col
        if self.row is not None:
            acc = acc * self.row.reshape(-1, 1)
        if self.delta is not None:
            acc = acc.to(self.dtype).float() + self.delta
        return acc.to(self.dtype)
