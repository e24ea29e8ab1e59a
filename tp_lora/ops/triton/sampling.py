"""Triton kernel of the sampling ops, with the signature of the reference in tp_lora/ops/sampling.py. One launch,
shapes only (no host sync): a CUDA graph captures it."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tp_lora.ops.triton.fused import as_rows

RACE_BLOCK = 2048  # vocabulary entries per iteration of a race program
RACE_PROGRAMS = 1024  # a race's programs (rows x vocabulary chunks) to aim for


@triton.jit
def _mix32(x):
    """sampling.mix32 on uint32 values (products wrap mod 2^32 as the reference's masks do)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _race_kernel(x_ptr, raw_ptr, t_ptr, key_ptr, w_ptr, g_ptr, a_ptr, out_ptr, s_x, s_raw, s_w, s_a, n, V, offset,
                 CHUNK, HAS_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, c): part c of row r, its tokens c * CHUNK .. (c + 1) * CHUNK - 1 (ids offset on: a vocabulary
    shard). The running best score and its first index among the tokens the row allows; the running max of the raw
    logits and the sum of exp(raw - max), rescaled as the max grows; the chosen token's raw logit. Written as the
    part's float32 numbers (best, token, its raw logit, log-sum-exp); HAS_WORDS adds whether the part holds a token
    the row's grammar allows, and the best among the stop tokens, its token and raw logit (taken where a row allows
    none)."""
    r = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    offs = tl.arange(0, BLOCK)
    temp = tl.load(t_ptr + r)
    hot = temp > 0
    key = tl.load(key_ptr + r).to(tl.uint32)
    stride = tl.full([BLOCK], 0x9E3779B1, tl.uint32)  # sampling.TOKEN_STRIDE
    if HAS_WORDS:
        g = tl.load(g_ptr + r)
    else:
        g = -1
    none = -float("inf")
    best = none
    arg = lo
    best_stop = none
    arg_stop = lo
    alive = 0
    top = none
    total = 0.0
    for start in range(lo, hi, BLOCK):
        i = start + offs
        inside = i < hi
        x = tl.load(x_ptr + r * s_x + i, mask=inside, other=none).to(tl.float32)
        y = tl.load(raw_ptr + r * s_raw + i, mask=inside, other=none).to(tl.float32)
        if hot:  # greedy rows draw no noise
            h = _mix32(_mix32(key + (i + offset).to(tl.uint32) * stride) ^ key)
            e = -tl.log(((h >> 8).to(tl.float32) + 0.5) / 16777216.0)  # Exp(1)
            s = x / temp - tl.log(e)
        else:
            s = x
        if HAS_WORDS:
            w = tl.load(w_ptr + tl.maximum(g, 0).to(tl.int64) * s_w + i // 32, mask=inside, other=0)
            w = w & tl.load(a_ptr + i // 32, mask=inside, other=0)  # tokens a grammar may emit
            bit = tl.where(g >= 0, (w >> (i % 32)) & 1, 1) & inside.to(tl.int32)  # no grammar: every token
            stop = (tl.load(a_ptr + s_a + i // 32, mask=inside, other=0) >> (i % 32)) & 1
            alive = tl.maximum(alive, tl.max(bit, 0))
            ss = tl.where(stop != 0, s, none)
            ms = tl.max(ss, 0)
            arg_stop = tl.where(ms > best_stop, tl.min(tl.where(ss == ms, i, V), 0), arg_stop)
            best_stop = tl.maximum(best_stop, ms)
            s = tl.where(bit != 0, s, none)
        m = tl.max(s, 0)
        j = tl.min(tl.where(s == m, i, V), 0)  # the lowest index of this block's best
        arg = tl.where(m > best, j, arg)
        best = tl.maximum(best, m)
        new = tl.maximum(top, tl.max(y, 0))
        kept = tl.sum(tl.where(y > none, tl.exp(y - new), 0.0), 0)  # masked-out logits add nothing, never a NaN
        total = total * tl.where(top > none, tl.exp(top - new), 0.0) + kept
        top = new
    at = out_ptr + tl.program_id(1) * (8 if HAS_WORDS else 4) * n + r
    tl.store(at, best)
    tl.store(at + n, (arg + offset).to(tl.float32))
    tl.store(at + 2 * n, tl.load(raw_ptr + r * s_raw + arg).to(tl.float32))
    tl.store(at + 3 * n, top + tl.log(total))
    if HAS_WORDS:
        tl.store(at + 4 * n, alive.to(tl.float32))
        tl.store(at + 5 * n, best_stop)
        tl.store(at + 6 * n, (arg_stop + offset).to(tl.float32))
        tl.store(at + 7 * n, tl.load(raw_ptr + r * s_raw + arg_stop).to(tl.float32))


def race(logits: torch.Tensor, raw: Optional[torch.Tensor], temps: torch.Tensor, keys: torch.Tensor,
         words: Optional[torch.Tensor], grammar_rows: Optional[torch.Tensor],
         allow: Optional[torch.Tensor]) -> torch.Tensor:
    x = as_rows(logits, "race's logits")
    y = x if raw is None else as_rows(raw, "race's raw logits")
    grammar = (words, grammar_rows, allow) if words is not None else None
    return race_combine(_race_parts(x, y, temps, keys, 0, grammar))


def race_chunk(rows: int, vocab: int) -> int:
    """Vocabulary entries per program of a race over [rows, vocab]: whole blocks, about RACE_PROGRAMS programs in
    all (a row's serial loop over the whole vocabulary leaves most SMs idle)."""
    blocks = triton.cdiv(vocab, RACE_BLOCK)
    return RACE_BLOCK * triton.cdiv(blocks, max(1, min(blocks, triton.cdiv(RACE_PROGRAMS, rows))))


def _race_parts(x: torch.Tensor, y: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, offset: int,
                grammar: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The race's parts [P, 4, N] float32 (with grammar rows (words, rows, allow): [P, 8, N]), P chunks a row."""
    n, v = x.shape
    chunk = race_chunk(n, v)
    parts = triton.cdiv(v, chunk)
    w, g, a = grammar if grammar is not None else (temps, temps, temps)  # unread without a grammar
    out = torch.empty(parts, 4 if grammar is None else 8, n, dtype=torch.float32, device=x.device)
    _race_kernel[(n, parts)](x, y, temps, keys, w, g, a, out, x.stride(0), y.stride(0), w.stride(0), a.stride(0), n,
                             v, offset, chunk, HAS_WORDS=grammar is not None, BLOCK=RACE_BLOCK)
    return out


def race_shard(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, offset: int) -> torch.Tensor:
    x = as_rows(logits, "race's logits")
    return _race_parts(x, x, temps, keys, offset)


@triton.jit
def _combine_kernel(p_ptr, out_ptr, n, P, HAS_WORDS: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Parts -> each of BLOCK rows' (token, log-probability) in float64: the part with the best score (the first
    among equals), its token, and its raw logit less the log-sum-exp of the parts' log-sum-exps. HAS_WORDS: a row
    whose parts hold no token its grammar allows takes the best of the stop tokens instead."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    w = tl.arange(0, P_PAD)
    m = (w[:, None] < P) & (r[None, :] < n)
    at = p_ptr + w[:, None] * (8 if HAS_WORDS else 4) * n + r[None, :]
    best = tl.load(at, mask=m, other=-float("inf"))
    token = tl.load(at + n, mask=m, other=0.0)
    chosen = tl.load(at + 2 * n, mask=m, other=0.0)
    if HAS_WORDS:
        alive = tl.max(tl.load(at + 4 * n, mask=m, other=0.0), 0) > 0
        best = tl.where(alive[None, :], best, tl.load(at + 5 * n, mask=m, other=-float("inf")))
        token = tl.where(alive[None, :], token, tl.load(at + 6 * n, mask=m, other=0.0))
        chosen = tl.where(alive[None, :], chosen, tl.load(at + 7 * n, mask=m, other=0.0))
    top = tl.max(best, 0)
    win = tl.min(tl.where(m & (best == top[None, :]), w[:, None], P_PAD), 0)
    sel = w[:, None] == win[None, :]
    token = tl.sum(tl.where(sel, token, 0.0), 0)
    chosen = tl.sum(tl.where(sel, chosen, 0.0), 0).to(tl.float64)
    lse = tl.load(at + 3 * n, mask=m, other=-float("inf")).to(tl.float64)
    big = tl.maximum(tl.max(lse, 0), -1e30)  # finite: the rows past n (all -inf) give no NaN
    total = big + tl.log(tl.where(r < n, tl.sum(tl.exp(lse - big[None, :]), 0), 1.0))
    tl.store(out_ptr + r, token.to(tl.float64), mask=r < n)
    tl.store(out_ptr + n + r, chosen - total, mask=r < n)


def race_combine(parts: torch.Tensor) -> torch.Tensor:
    """sampling.race_combine_ref's signature; also takes the grammar parts [P, 8, N] of race's own launch."""
    p, k, n = parts.shape
    x = parts.contiguous()
    out = torch.empty(2, n, dtype=torch.float64, device=x.device)
    pad = triton.next_power_of_2(p)
    block = min(max(1, 4096 // pad), triton.next_power_of_2(max(n, 1)))  # a [pad, block] tile
    _combine_kernel[(triton.cdiv(n, block),)](x, out, n, p, HAS_WORDS=k == 8, P_PAD=pad, BLOCK=block)
    return out
