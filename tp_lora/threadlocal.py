"""Per-thread settings that hold inside a with-block (buffer reuse, torch
threads)."""
from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch


@contextlib.contextmanager
def setting(local: threading.local, name: str, value):
    """local.<name> = value on this thread inside the block; the previous value (None if unset) after it."""
    old = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, old)


@contextlib.contextmanager
def torch_threads(n: Optional[int]):
    """torch's intra-op threads for this thread's ops inside the block (None: as they are). The count is per thread
    (torch.set_num_threads sets OpenMP's, which each thread keeps for its own parallel regions once it has made one),
    so the adapter reader can copy on several cores while the step loop runs on one."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
