"""Sampling ops on gathered logits: the torch reference (the CPU path and the test oracle) and the dispatcher the
sampler calls, which takes the Triton kernel of tp_lora/ops/triton/sampling.py on CUDA.

- race: each row's token and its log-probability, as one [2, N] float64 tensor the sampler reads back in one copy.
  A row at temperature 0 takes its argmax (the lowest id among equals); a hot row the exponential race, argmax of
  logit / T - log E with E ~ Exp(1) drawn from a hash of (the row's key, token id): a draw from softmax(logit / T)
  that depends only on the key. Grammar rows choose among the tokens their bitmask row allows (grammar_allowed).
- race_shard / race_combine: the race on vocabulary-parallel logits (each TP rank its shard; the noise depends on the
  token id only, so the shards' winners hold the whole race's), the ranks exchanging a few numbers a row, not logits.
  The race kernel splits every row the same way over chunks of the vocabulary.
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


def race_noise(keys: torch.Tensor, vocab: int, offset: int = 0) -> torch.Tensor:
    """[R, vocab] float32 Exp(1) variates of keys [R] (int64 in [0, 2^32)) and the token ids offset .. offset +
    vocab - 1."""
    ids = torch.arange(offset, offset + vocab, device=keys.device, dtype=torch.int64)
    h = mix32(mix32((keys[:, None] + ids[None, :] * TOKEN_STRIDE) & MASK32) ^ keys[:, None])
    return -torch.log(((h >> 8).float() + 0.5) / float(1 << 24))


def race_scores(x: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """float32 logits x [N, V] of tokens offset .. offset + V - 1 -> each token's race score: its logit in greedy
    rows (temps 0), logit / T - log E in hot ones (E: race_noise)."""
    hot = temps > 0
    noise = race_noise(keys, x.shape[1], offset)
    return torch.where(hot[:, None], x / torch.where(hot, temps, 1.0)[:, None] - torch.log(noise), x)


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
    score = race_scores(x, temps, keys)
    if words is not None:
        allowed = grammar_allowed(words, allow, vocab)[grammar_rows.long().clamp(min=0)] | (grammar_rows < 0)[:, None]
        score = score.masked_fill(~allowed, float("-inf"))
    tokens = score.argmax(-1)
    lp = torch.log_softmax((logits if raw is None else raw).float(), -1).gather(-1, tokens[:, None]).flatten()
    return torch.stack([tokens.double(), lp.double()])


def race_shard_ref(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, offset: int) -> torch.Tensor:
    """race_ref's parts on one vocabulary shard (no grammar, raw = logits): logits [N, V/p] holding tokens offset ..
    offset + V/p - 1 -> [P, 4, N] float32, P parts of the shard in vocabulary order (here 1; the kernel's: chunks):
    each row's best race score there, its token (the lowest id among equals; exact below 2^24), the token's logit,
    and the part's log-sum-exp. race_combine of every shard's parts gives race_ref's tokens and its
    log-probabilities but for float32 rounding."""
    x = logits.float()
    best, arg = race_scores(x, temps, keys, offset).max(-1)
    return torch.stack([best, (arg + offset).float(), x.gather(-1, arg[:, None]).flatten(),
                        torch.logsumexp(x, -1)])[None]


def race_combine_ref(parts: torch.Tensor) -> torch.Tensor:
    """parts [P, 4, N] float32 (race_shard's, concatenated in vocabulary order) -> [2, N] float64: each row's token,
    the best score's (the first part's among equals: the lowest id), and its log-probability over the whole
    vocabulary."""
    parts = parts.double()
    win = parts[:, 0].argmax(0)
    got = parts.gather(0, win[None, None, :].expand(1, 4, -1))[0]
    return torch.stack([got[1], got[2] - torch.logsumexp(parts[:, 3], 0)])


def race_combine(parts: torch.Tensor) -> torch.Tensor:
    if use_kernels(parts) and parts.shape[-1]:
        from tp_lora.ops.triton.sampling import race_combine as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(parts)
    return race_combine_ref(parts)


def race_shard(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, offset: int) -> torch.Tensor:
    if use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.sampling import race_shard as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits, temps, keys, offset)
    return race_shard_ref(logits, temps, keys, offset)


def race(logits: torch.Tensor, raw: Optional[torch.Tensor], temps: torch.Tensor, keys: torch.Tensor,
         words: Optional[torch.Tensor], grammar_rows: Optional[torch.Tensor],
         allow: Optional[torch.Tensor]) -> torch.Tensor:
    if use_kernels(logits) and logits.shape[0]:
        from tp_lora.ops.triton.sampling import race as kernel  # noqa: PLC0415 - CUDA / forced only
        return kernel(logits, raw, temps, keys, words, grammar_rows, allow)
    return race_ref(logits, raw, temps, keys, words, grammar_rows, allow)
