"""Host tensors packed one block per dtype: onto the device without stalling the host (to_device), or as zeroed
views to fill (blocks); fixed-shape tensors staged in one page-locked buffer and sent in one copy (Staging).

A plain .to("cuda") of pageable memory makes the host wait until the stream has drained, so every step's metadata
copy would serialise host and GPU. to_device packs the tensors into a page-locked ring allocated once per process
(a page-locked allocation per call costs tens of microseconds of host time, several a step), from which one copy to
the device is asynchronous; a stretch of the ring is written again once the copy out of it has run.
"""
from __future__ import annotations

import threading
from collections import deque

import torch


def to_device(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The host tensors on `device`, in order: packed into the page-locked ring, one asynchronous copy (on CPU: the
    tensors themselves)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    with ring.lock:
        src = ring.take(total)
        for t, o in zip(tensors, offsets):
            _bytes_view(src, t, o).copy_(t)
        dst = torch.empty(total, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        ring.copied(device)
    return [_bytes_view(dst, t, o) for t, o in zip(tensors, offsets)]


_ALIGN = 16  # bytes: every packed tensor starts aligned for its dtype


def _bytes_view(buf: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """The bytes of uint8 `buf` from `offset` as a tensor shaped like `like`."""
    return buf[offset:offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


class PinnedRing:
    """Page-locked bytes handed out in order, round and round (made at the first take: CUDA only). take() waits for
    the copies out of the stretch it hands out, which have normally run long before the ring comes round."""

    def __init__(self, size: int = 1 << 22):
        self.size = size
        self.lock = threading.Lock()
        self.buf: torch.Tensor | None = None
        self.head = 0
        self.busy: deque = deque()  # (start, end, event after the copy out of it), oldest first
        self._taken = (0, 0)

    def take(self, n: int) -> torch.Tensor:
        if n > self.size:  # larger than the ring: a page-locked block of its own
            self._taken = (0, 0)
            return torch.empty(n, dtype=torch.uint8, pin_memory=True)
        if self.buf is None:
            self.buf = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
        if self.head + n > self.size:  # round again: the last lap's tail past here first (the oldest copies)
            while self.busy and self.busy[0][0] >= self.head:
                self.busy.popleft()[2].synchronize()
            self.head = 0
        start, end = self.head, self.head + n
        while self.busy and self.busy[0][0] < end and start < self.busy[0][1]:  # reused in the order handed out
            self.busy.popleft()[2].synchronize()
        self.head, self._taken = end, (start, end)
        return self.buf[start:end]

    def copied(self, device: torch.device) -> None:
        """The copy out of the last take() is queued on `device`'s current stream."""
        start, end = self._taken
        if end > start:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.busy.append((start, end, event))
            if len(self.busy) > 256 and self.busy[0][2].query():  # a bounded queue of live events
                self.busy.popleft()


ring = PinnedRing()  # to_device's


def blocks(like: list[torch.Tensor], init: dict[torch.dtype, torch.Tensor] | None = None,
           into: dict[torch.dtype, torch.Tensor] | None = None
           ) -> tuple[dict[torch.dtype, torch.Tensor], list[torch.Tensor]]:
    """(Pageable) host tensors shaped like `like`, in order, as views of one block per dtype -> (dtype -> block,
    views). The blocks are `into` (blocks of the right sizes) or new, and start as copies of `init` (blocks this
    function returned before), else zeros."""
    sizes, offsets = _layout(like)
    if into is None:
        into = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
    out = {dtype: into[dtype].copy_(init[dtype]) if init is not None else into[dtype].zero_() for dtype in sizes}
    return out, _views(out, like, offsets)


def _layout(like: list[torch.Tensor]) -> tuple[dict[torch.dtype, int], list[int]]:
    """Per dtype the total element count, and each tensor's offset in its dtype's block."""
    sizes: dict[torch.dtype, int] = {}
    offsets = []
    for t in like:
        offsets.append(sizes.get(t.dtype, 0))
        sizes[t.dtype] = offsets[-1] + t.numel()
    return sizes, offsets


def _views(flat: dict[torch.dtype, torch.Tensor], like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [flat[t.dtype][o:o + t.numel()].view(t.shape) for t, o in zip(like, offsets)]


class Staging:
    """Tensors shaped like `like` as views of one device byte buffer (e.g. a graph's static inputs, `device`) with a
    page-locked host twin (`host`): a step fills the host views, then send() moves them all in one asynchronous copy.
    The host views are handed out again only once the last copy from them has run (an event wait that has normally
    passed already: a step's copy runs before its replay)."""

    ALIGN = 256  # bytes: every view starts aligned for any dtype and for vector loads

    def __init__(self, like: list[torch.Tensor], device: torch.device | str):
        device = torch.device(device)
        offsets, total = [], 0
        for t in like:
            offsets.append(total)
            total = -(-(total + t.numel() * t.element_size()) // self.ALIGN) * self.ALIGN
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.uint8, pin_memory=self._cuda)
        self._device = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host = [_bytes_view(self._host, t, o) for t, o in zip(like, offsets)]
        self.device = [_bytes_view(self._device, t, o) for t, o in zip(like, offsets)]
        self._sent = torch.cuda.Event() if self._cuda else None

    def fill(self) -> list[torch.Tensor]:
        """The host views, free to be overwritten (the last send's copy has run)."""
        if self._sent is not None:
            self._sent.synchronize()
        return self.host

    def send(self) -> None:
        """Copy every host view into its device view (queued on the current stream)."""
        self._device.copy_(self._host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()
