"""A page-locked host counter that a CUDA stream waits on (the driver's cuStreamWaitValue32): work queued behind
HostFlag.wait(stream, n) starts once a host thread has raised the counter to n (raise_to). Lets the host queue device
work whose input another host thread or process is still writing into pinned memory (the grammar masks) and go on.

A number must be raised after the data it guards is written (x86 keeps stores in order), and every number a stream
waits for must be raised, also on an error, or the stream waits for ever. Numbers wrap within int32."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0, a comparison that survives wrap-around
_driver = None  # libcuda once loaded; False where it cannot be


def _cuda_driver():
    """libcuda with the two calls used here typed, or None (no driver library, or one without the v2 memory ops)."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                         ctypes.c_uint]
            _driver = lib
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


class HostFlag:
    """One int32 in pinned host memory (`value`, page-locked and mapped; default: a new one), read by the device at
    its device address."""

    def __init__(self, driver, value: Optional[torch.Tensor] = None):
        self.driver = driver
        self.value = torch.zeros(1, dtype=torch.int32, pin_memory=True) if value is None else value
        ptr = ctypes.c_uint64()
        code = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(ptr), self.value.data_ptr(), 0)
        if code != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed: CUresult {code}")
        self.address = ptr.value

    def wait(self, stream: torch.cuda.Stream, number: int) -> None:
        """Queue on `stream` a wait until the counter reaches `number`."""
        code = self.driver.cuStreamWaitValue32_v2(stream.cuda_stream, self.address, number, GEQ)
        if code != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {code}")

    def raise_to(self, number: int) -> None:
        """Let the work waiting for `number` (or less) go; from any host thread, no CUDA call."""
        self.value[0] = number


def host_flag(device: torch.device, value: Optional[torch.Tensor] = None) -> Optional[HostFlag]:
    """A HostFlag for CUDA `device` (over `value`, HostFlag's), or None where the driver cannot make one (the caller
    then waits on the host). Checked once on a side stream: a wait for what is already raised returns at once."""
    driver = _cuda_driver() if device.type == "cuda" else None
    if driver is None:
        return None
    try:
        with torch.cuda.device(device):
            flag = HostFlag(driver, value)
            side = torch.cuda.Stream(device)
            flag.wait(side, 0)
            side.synchronize()
        return flag
    except RuntimeError:
        return None
