"""Host tensors packed one block per dtype: onto the device without stalling the host (to_device), or as zeroed
views to fill (blocks); fixed-shape tensors staged in one page-locked buffer and sent in one copy (Staging).

A plain .to("cuda") of pageable memory makes the host wait until the stream has drained, so every step's metadata
copy would serialise host and GPU. to_device packs the tensors, one buffer per dtype, into pinned memory (one
page-locked allocation per dtype instead of one per tensor), from which a copy to the device is asynchronous.
"""
from __future__ import annotations

from typing import Callable

import torch


def to_device(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The host tensors on `device`, in order: one asynchronous copy per dtype (on CPU: the tensors themselves)."""
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return _packed(tensors, lambda flat: flat.to(device, non_blocking=True))


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


def _packed(tensors: list[torch.Tensor], place: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each dtype's tensors concatenated into one pinned block, place(block) -> where they go; views of the result."""
    sizes, offsets = _layout(tensors)
    placed = {}
    for dtype, n in sizes.items():
        block = torch.empty(n, dtype=dtype, pin_memory=True)
        placed[dtype] = place(torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype], out=block))
    return _views(placed, tensors, offsets)


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
        self.host = [self._view(self._host, t, o) for t, o in zip(like, offsets)]
        self.device = [self._view(self._device, t, o) for t, o in zip(like, offsets)]
        self._sent = torch.cuda.Event() if self._cuda else None

    @staticmethod
    def _view(buf: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
        return buf[offset:offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)

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
