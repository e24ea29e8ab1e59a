"""Token choice from gathered logits. Every TP rank holds the same logits and the same generator state, so every
rank picks the same token without a broadcast."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: list[float], top_p: float,
           generator: torch.Generator | None) -> tuple[list[int], list[float]]:
    """logits [N, V] float32 -> (token per row, its log-probability under the unscaled distribution).
    Temperature 0 is greedy."""
    logprobs = torch.log_softmax(logits, -1)
    tokens = logprobs.argmax(-1)
    hot = [i for i, t in enumerate(temperatures) if t > 0]  # decided on the host: no device round trip for greedy
    if hot:
        rows = torch.tensor(hot, device=logits.device)
        temps = torch.tensor([temperatures[i] for i in hot], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits[rows] / temps[:, None], -1)
        if top_p < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        picks = torch.multinomial(probs.cpu(), 1, generator=generator).flatten().to(logits.device)
        tokens[rows] = picks
    chosen = logprobs.gather(-1, tokens[:, None]).flatten()
    # One device->host transfer for both (token ids are exact in float64).
    host = torch.stack([tokens.double(), chosen.double()]).tolist()
    return [int(t) for t in host[0]], host[1]
