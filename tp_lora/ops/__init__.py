"""LoRA kernel backends. Each backend is a module exposing the same functions as `torch_ref`:
shrink, expand, embedding_shrink (and, for MoE, the fused MoE LoRA op)."""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = ("torch", "triton")


def get_backend(name: str, device: str = "cpu") -> ModuleType:
    """'auto' picks triton on CUDA and the torch reference elsewhere (CI runs Triton on CPU only in kernel tests,
    under TRITON_INTERPRET=1, which is far too slow for whole models)."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "torch":
        return importlib.import_module("tp_lora.ops.torch_ref")
    if name == "triton":
        return importlib.import_module("tp_lora.ops.triton")
    raise ValueError(f"lora.backend={name!r}: expected one of {('auto',) + BACKENDS}")
