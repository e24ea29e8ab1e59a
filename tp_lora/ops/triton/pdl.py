"""Programmatic dependent launch (Hopper and later) in the decode chain (norms, fp8 GEMMs, attention, act_mul; a MoE
block's top-k, routing plan, expert GEMMs, fused LoRA and combine; a few tokens' dense LoRA shrink and its expand):
a kernel launches while the one before it finishes, so the launch gap overlaps that kernel's tail.

Every such kernel takes PDL (on for compiled kernels on Hopper and later) and calls wait_prior(PDL) in every program,
before it reads what the kernel just before it writes or writes anything an earlier kernel reads or writes, and
before any early return (a kernel that ended without waiting would let the next one pass it); everything older than
the kernel just before it has finished by then (that one released after its own wait), so work on older inputs may
come first (the fused MoE LoRA's shrink). Once its main loads or loop are done, or at once, it calls
release_next(PDL), and its launcher notes the outputs (released()). A launch asks for PDL only where an input was
written by the launch just before it on the same stream that released it (pdl_args): launched early after a kernel
that does not release (cuBLAS, torch, the dense LoRA expand), a kernel waits longer than a plain launch would. The
notes are kept per stream, so kernels on a side stream (the LoRA shrink and expand beside a base GEMM) leave the main
stream's chain as it was. Off the GPU (CPU, the interpreter, older GPUs) both calls compile out and launches are plain.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tp_lora.ops.triton.dot import interpreting

# (device index, stream) -> data pointers written by the last releasing launch on that stream
_released: dict[tuple[int, int], tuple[int, ...]] = {}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished (a no-op unless launched with PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel launch once every program has come here (or ended)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch(ptr, L2: tl.constexpr, ON: tl.constexpr):
    """Ask L2 (else L1) for the lines at ptr, a pointer or a tensor of them, where ON (inline PTX: compiled kernels
    only). A hint that changes no value, so a kernel may give it before its wait for what no earlier kernel writes."""
    if ON:
        level: tl.constexpr = "L2" if L2 else "L1"
        tl.inline_asm_elementwise("prefetch.global." + level + " [$1]; mov.u32 $0, 0;", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _index(device: torch.device) -> int | None:
    """The device's index where its kernels can take PDL, else None."""
    if device.type != "cuda" or interpreting():
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return index if _hopper(index) else None


def _key(device: torch.device) -> tuple[int, int] | None:
    """(device index, current stream) where kernels on the device can take PDL, else None."""
    index = _index(device)
    return None if index is None else (index, torch.cuda.current_stream(index).cuda_stream)


def pdl_args(x: torch.Tensor, *more: torch.Tensor) -> dict:
    """The PDL constexpr and launch option of a launch reading x (and more): PDL wherever supported, launched early
    only where the launch just before it on this stream released it and wrote one of them."""
    key = _key(x.device)
    if key is None:
        return dict(PDL=False, launch_pdl=False)
    written = _released.pop(key, ())
    return dict(PDL=True, launch_pdl=any(t.data_ptr() in written for t in (x, *more)))


def released(*outs: torch.Tensor) -> None:
    """Note the launch just made (a kernel that calls release_next) and the tensors it writes."""
    key = _key(outs[0].device)
    if key is not None:
        _released[key] = tuple(o.data_ptr() for o in outs)


def forget(device: torch.device) -> None:
    """Note a launch on the current stream that does not release its successor early (and may write what the last
    releasing one did)."""
    key = _key(device)
    if key is not None:
        _released.pop(key, None)
