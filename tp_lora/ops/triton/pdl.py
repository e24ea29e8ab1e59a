"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with launch_pdl may start while the kernel before it on the stream is still running: it does what
depends on nothing earlier (the weights' L2 prefetch) first, then `grid_wait` blocks until the previous kernel has
finished and its writes are visible, and lets the next kernel launch early. Every PDL kernel calls grid_wait before
it touches memory another kernel writes or reads, so kernels still see each other's results in stream order; a
kernel launched without PDL simply waits for the whole previous kernel, as always. Captured in CUDA graphs as
programmatic edges.

`launch_kwargs()` is the launch's extra keyword (empty where PDL is off: the CPU interpreter, GPUs before sm90, or
`ENABLED = False`, which benchmarks set for their A/B rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # benchmarks' A/B switch; the kernels read it at launch (graph capture fixes it per graph)


def active(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use PDL (compiled in as their PDL constexpr)."""
    if not ENABLED or device.type != "cuda" or _interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_kwargs(on: bool) -> dict:
    return {"launch_pdl": True} if on else {}


@triton.jit
def grid_wait(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream (all of it, memory visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 to fetch the 128-byte lines under `ptrs` (one in-bounds pointer per line) and keep them (evict_last)."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def _interpreting() -> bool:
    return type(grid_wait).__name__ == "InterpretedFunction"
