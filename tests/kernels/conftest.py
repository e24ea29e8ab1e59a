"""Kernel tests run the Triton kernels natively on CUDA and under the Triton interpreter elsewhere.

triton.jit decides between compiling and interpreting when a kernel is decorated, so TRITON_INTERPRET must be set
before tp_lora.ops.triton is first imported: pytest imports this file before the test modules beside it."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "tp_lora.ops.triton.kernels" in sys.modules:
        raise RuntimeError("tp_lora.ops.triton was imported before tests/kernels/conftest.py could set "
                           "TRITON_INTERPRET=1: run with TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"  # no GPU to compile for


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _default_scheme(monkeypatch):
    """Tests that change the module-wide scheme must not leak it into the next test: each sets a copy of it."""
    from tp_lora.ops.triton import schedule
    monkeypatch.setattr(schedule, "_state", dict(schedule._state))
