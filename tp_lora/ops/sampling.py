"""Sampling ops on gathered logits: the torch reference (the CPU path and the test oracle) and the dispatcher the
sampler calls, which takes the Triton kernel of tp_lora/ops/triton/sampling.py on CUDA.

- greedy: each row's most likely token (the lowest id among equals) and its log-probability, as one [2, N] float64
  tensor the sampler reads back in one copy.
- masked_logits: the logits as float32 with some rows restricted to the tokens of a bitmask row (structured output's
  masks), in one launch.
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


def allowed_words(bits: torch.Tensor, keep: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """int32 bitmask words [M, W] (bit i % 32 of word i // 32 allows token i) restricted to `keep` [W]; a row left
    allowing nothing allows `dead` [W] instead."""
    words = bits & keep
    return torch.where(words.any(1, keepdim=True), words, dead)


def masked_logits_ref(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, keep: torch.Tensor,
                      dead: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> float32 [N, V]: row i as it is where rows[i] < 0, else -inf at the tokens that
    allowed_words(bits, keep, dead)[rows[i]] does not allow. rows: int64 [N]; bits: int32 [M, ceil(V / 32)]."""
    words = allowed_words(bits, keep, dead)
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    out = logits.float().clone()
    for i in (rows >= 0).nonzero().flatten().tolist():
        out[i].masked_fill_(~allowed[int(rows[i])], float("-inf"))
    return out


def masked_logits(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor, keep: torch.Tensor,
                  dead: torch.Tensor) -> torch.Tensor:
    if use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.sampling import masked_logits as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits, rows, bits, keep, dead)
    return masked_logits_ref(logits, rows, bits, keep, dead)
