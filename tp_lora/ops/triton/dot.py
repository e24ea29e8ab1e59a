"""The tile product of the LoRA, MoE LoRA and grouped GEMM kernels, and the operand types it takes.

Under TRITON_INTERPRET=1 (CPU) the interpreter's bf16 dot is wrong, so bf16 operands are rounded to bf16 and then
multiplied in float32 (same values).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = (torch.float8_e4m3fn,)
TL_TYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # torch -> Triton


@triton.jit
def mm(a, b, CDT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    # Operands are rounded to CDT, then fed to the dot as DOT (= CDT, except float32 under the interpreter, whose
    # bf16 dot is wrong). PREC matters for float32 operands only: "ieee" where the caller wants fp32 accuracy.
    return tl.dot(a.to(CDT).to(DOT), b.to(CDT).to(DOT), input_precision=PREC)


def interpreting() -> bool:
    # Decided when the kernels were decorated (triton.jit reads TRITON_INTERPRET then), not by today's environment.
    return type(mm).__name__ == "InterpretedFunction"


def fp8_dot():
    """The operand type of an fp8 x fp8 tile product: e4m3 on the GPU's fp8 tensor cores, float32 under the
    interpreter (the same values)."""
    return tl.float32 if interpreting() else tl.float8e4nv


def check_act8(option: str, w: torch.Tensor, scale) -> None:
    """An ACT8 option (activations quantized in the kernel: "kernel: its name") multiplies fp8 weights with their
    scales: ValueError otherwise."""
    if scale is None or w.dtype not in FP8:
        raise ValueError(f"{option} multiplies fp8 weights with their scales, got {w.dtype} weights"
                         f"{' without scales' if scale is None else ''}")


def compute_types(act: torch.dtype, weight: torch.dtype):
    """(operand rounding type, dot operand type, dot precision) for activations `act` times weights `weight`."""
    if weight in FP8:
        weight = act  # fp8 is widened to the activations' type before the dot (exact for e4m3 into bf16/fp16)
    if act == weight and act in (torch.float16, torch.bfloat16):
        cdt = TL_TYPES[act]
        dot = tl.float32 if (act == torch.bfloat16 and interpreting()) else cdt
        return cdt, dot, "tf32"  # precision flag only matters for fp32 operands
    return tl.float32, tl.float32, "ieee"  # fp32 layers ask for fp32 accuracy: no tf32 rounding
