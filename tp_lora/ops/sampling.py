"""Sampling ops on gathered logits: the torch reference (the CPU path and the test oracle) and the dispatcher the
sampler calls, which takes the Triton kernel of tp_lora/ops/triton/sampling.py on CUDA.

- race: each row's token and its log-probability, as one [2, N] float64 tensor the sampler reads back in one copy.
  A row at temperature 0 takes its argmax (the lowest id among equals); a hot row the exponential race, argmax of
  logit / T - log E with E ~ Exp(1) drawn from a hash of (the row's key, token id): a draw from softmax(logit / T)
  that depends only on the key. Grammar rows choose among the tokens their bitmask row allows (grammar_allowed).
"""
from __future__ import annotations

from typing import Optional

import torch

from tp_lora.ops.fused import use_kernels

MASK32 = 0xFFFFFFFF
TOKEN_STRIDE = 0x9E3779B1  # the noise hash's step between token ids (odd: distinct ids, distinct inputs)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (each product stays below 2^63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 Exp(1) variates of keys [R] (int64 in [0, 2^32)) and the token ids."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = mix32(mix32((keys[:, None] + ids[None, :] * TOKEN_STRIDE) & MASK32) ^ keys[:, None])
    return -torch.log(((h >> 8).float() + 0.5) / float(1 << 24))


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask rows [G, ceil(vocab / 32)] int32 -> [G, vocab] bool: bit v % 32 of word v // 32 set."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]


def grammar_allowed(words: torch.Tensor, allow: torch.Tensor, vocab: int) -> torch.Tensor:
    """[G, vocab] bool: the tokens each grammar bitmask row allows, `words` [G, ceil(vocab / 32)] int32 as the
    grammar library fills them, within allow[0] (tokens a grammar may emit); a row left with none allows allow[1]'s
    (the stop tokens: its output ends). allow: [2, ceil(vocab / 32)] int32."""
    bits = unpack(words & allow[0], vocab)
    return torch.where(bits.any(1, keepdim=True), bits, unpack(allow[1:], vocab))


def race_ref(logits: torch.Tensor, raw: Optional[torch.Tensor], temps: torch.Tensor, keys: torch.Tensor,
             words: Optional[torch.Tensor], grammar_rows: Optional[torch.Tensor],
             allow: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [N, V] (any float dtype) -> [2, N] float64: row i's token (exact in float64) and its log-probability
    under raw [N, V] (default: logits), unscaled by temperature. temps [N] float32: 0 for greedy rows; keys [N]
    int64 in [0, 2^32): hot rows' noise; words [G, ceil(V / 32)] int32: grammar bitmasks (bit v of word v // 32:
    token v), their allowed tokens as grammar_allowed(words, allow) says; grammar_rows [N] int32: row i's bitmask
    row, or -1 (every token)."""
    x = logits.float()
    vocab = x.shape[1]
    hot = temps > 0
    score = torch.where(hot[:, None], x / torch.where(hot, temps, 1.0)[:, None] - torch.log(race_noise(keys, vocab)), x)
    if words is not None:
        allowed = grammar_allowed(words, allow, vocab)[grammar_rows.long().clamp(min=0)] | (grammar_rows < 0)[:, None]
        score = score.masked_fill(~allowed, float("-inf"))
    tokens = score.argmax(-1)
    lp = torch.log_softmax((logits if raw is None else raw).float(), -1).gather(-1, tokens[:, None]).flatten()
    return torch.stack([tokens.double(), lp.double()])


def race(logits: torch.Tensor, raw: Optional[torch.Tensor], temps: torch.Tensor, keys: torch.Tensor,
         words: Optional[torch.Tensor], grammar_rows: Optional[torch.Tensor],
         allow: Optional[torch.Tensor]) -> torch.Tensor:
    if use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.sampling import race as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits, raw, temps, keys, words, grammar_rows, allow)
    return race_ref(logits, raw, temps, keys, words, grammar_rows, allow)
