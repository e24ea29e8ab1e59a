"""Sampling ops on gathered logits: the torch reference (the CPU path and the test oracle) and the dispatcher the
sampler calls, which takes the Triton kernel of tp_lora/ops/triton/sampling.py on CUDA.

- greedy: each row's most likely token (the lowest id among equals) and its log-probability, as one [2, N] float64
  tensor the sampler reads back in one copy.
"""
from __future__ import annotations

import torch

from tp_lora.ops.fused import use_kernels


def greedy_ref(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32 -> [2, N] float64: argmax token ids (exact in float64), their log-probabilities."""
    lp = torch.log_softmax(logits, -1)
    tokens = lp.argmax(-1)
    return torch.stack([tokens.double(), lp.gather(-1, tokens[:, None]).flatten().double()])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    if use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.sampling import greedy as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits)
    return greedy_ref(logits)
