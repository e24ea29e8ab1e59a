"""Ticket counters of the kernels whose last program to finish does the closing work (the split-K GEMM's reduce, the
decode attention's merge, the routing plan's LoRA block table at decode sizes): int32, all 0 between launches, each
launch resetting the counters it took. One buffer per device, made at the first call (the runner's eager warm-up,
before any graph is captured); kernels on one stream take turns on it.
"""
from __future__ import annotations

import torch

MIN_TICKETS = 1 << 14
_buffers: dict[int, torch.Tensor] = {}


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed counters on `device`."""
    key = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else -1
    if key not in _buffers or _buffers[key].numel() < n:
        _buffers[key] = torch.zeros(max(n, MIN_TICKETS), dtype=torch.int32, device=device)
    return _buffers[key]
