"""Per-thread settings that hold inside a with-block (the adapter reader's pause points and buffer reuse)."""
from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def setting(local: threading.local, name: str, value):
    """local.<name> = value on this thread inside the block; the previous value (None if unset) after it."""
    old = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, old)
