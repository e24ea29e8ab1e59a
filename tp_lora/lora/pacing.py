"""Pause points for background work that shares the GIL with the step loop.

Adapter reads run on a reader thread while the engine steps. Both are Python driving many small torch calls, so
they trade the GIL at every call, and the step loop, which launches ~1000 kernels per eager step, slows down while
a read is going (measured on a 2-core CPU: a small op went from 3.7 us to 8.6 us with one reader busy, to 56 us with
four, that last figure with the cores oversubscribed too). A read is therefore a few large stages that spend their
time outside the GIL (one file read into untouched memory, one batched norm, one batched copy into the image; the
same 2-core CPU: the small op went from 3.3 us to 4.7 us beside a reader that never pauses, 19 us before), and the
reader calls pause() between stages; under paced(fn) that runs fn, which the adapter cache uses to wait while the
step loop is busy. Elsewhere pause() does nothing.
"""
from __future__ import annotations

import threading
from typing import Callable

from tp_lora.threadlocal import setting

_local = threading.local()


def pause() -> None:
    fn = getattr(_local, "fn", None)
    if fn is not None:
        fn()


def paced(fn: Callable[[], None]):
    """pause() calls fn on this thread inside the block."""
    return setting(_local, "fn", fn)
