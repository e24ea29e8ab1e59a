"""Token choice from gathered logits. Every TP rank holds the same logits and the same generator states, so every
rank picks the same token without a broadcast."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from tp_lora.ops.sampling import greedy


def draw(logits: torch.Tensor, temperatures: list[float], top_p: Union[float, Sequence[float]],
         generator: Union[torch.Generator, None, Sequence[Optional[torch.Generator]]]) -> torch.Tensor:
    """logits [N, V] float32 -> [2, N] float64 on logits' device: each row's token id (exact in float64) and its
    log-probability under the unscaled distribution, so one device->host copy reads both. Temperature 0 is greedy
    (no host sync); top_p and generator are one for all rows or a list with one per row (a request with its own seed
    has its own generator); the rows sharing a generator draw in one call, in row order, on the host."""
    out = greedy(logits)  # [2, N] float64: each row's argmax token, its log-probability
    hot = [i for i, t in enumerate(temperatures) if t > 0]  # decided on the host: no device round trip for greedy
    if hot:
        rows = torch.tensor(hot, device=logits.device)
        temps = torch.tensor([temperatures[i] for i in hot], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits[rows] / temps[:, None], -1)
        tops = [top_p] * len(hot) if isinstance(top_p, (int, float)) else [top_p[i] for i in hot]
        if min(tops) < 1.0:
            keep = torch.tensor(tops, dtype=torch.float32, device=logits.device)[:, None]
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > keep  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs.cpu()
        gens = [generator] * len(hot) if not isinstance(generator, (list, tuple)) else [generator[i] for i in hot]
        picks = torch.empty(len(hot), dtype=torch.int64)
        for g in dict.fromkeys(gens):  # each generator draws its rows in one call
            mine = [j for j, x in enumerate(gens) if x is g]
            picks[mine] = torch.multinomial(probs[mine], 1, generator=g).flatten()
        picks = picks.to(logits.device)
        out[0, rows] = picks.double()
        out[1, rows] = torch.log_softmax(logits[rows], -1).gather(-1, picks[:, None]).flatten().double()
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """logits [N, V] -> per row the k most likely (token, log-probability), most likely first."""
    vals, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
