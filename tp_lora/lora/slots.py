"""Device slots holding adapters: which adapter sits in which slot, and copying an adapter's (sharded) weights in.

An adapter enters a slot as a SlotImage: this rank's contents of the slot in every LoRA layer (its shard, padded to
max_rank, untargeted modules empty, B already fp8 where lora.dtype=fp8), packed in one host block per dtype. Images
are built off the step loop (by the adapter cache's reader, on a background thread) and a load is then one
host->device copy per dtype plus one batched device copy into the slot's views, instead of a few operations per
module and layer (measured on an H200 at ~15 ms of host time per load that way).

The host tier keeps images in pageable memory (page-locking each one, cudaHostAlloc, cost ~13 ms per 20 MB in an H100
profile). But a copy from pageable memory holds the step loop while the driver stages the bytes (~6 ms per 20 MB
adapter on an H200 host, the biggest part of a slot load), so on CUDA a fresh image also gets a page-locked copy,
made on the reader thread into blocks of torch's pinned-memory cache (warmed at start, so no cudaHostAlloc on the
way). Its load is then an asynchronous copy; the page-locked copy is dropped once loaded (torch keeps the block
until the copy is done) and at most PINNED_IMAGES exist at a time, beyond which images load from pageable memory.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from tp_lora.hostcopy import blocks
from tp_lora.lora.layers import LoRARuntime
from tp_lora.lora.pacing import pause


@dataclass
class SlotImage:
    name: str
    blocks: dict[torch.dtype, torch.Tensor]  # one per dtype, in host memory
    views: list[torch.Tensor]  # SlotTable.views(slot)'s shapes, views of the blocks
    pinned: Optional[dict[torch.dtype, torch.Tensor]] = None  # a page-locked copy of the blocks, until loaded


# Page-locked image copies alive at once: about as many as the cache reads ahead (lora.cache.PREFETCH_DEPTH), and
# within PINNED_BYTES (torch's pinned cache rounds each block up to a power of two).
PINNED_IMAGES, PINNED_BYTES = 32, 1 << 30


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte floats (fp8) as bytes: the batched copy is not defined for them, a byte copy is the same."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class ImagePool:
    """Host memory for `capacity` slot images shaped like `like`, allocated and faulted in at start, with each
    entry's views made once; an entry is handed out as a copy of `empty`. A fresh image's pages otherwise cost the
    reader most of a read (on a 2-core VM: ~50 ms to fault in 20 MB while the host tier fills), and the host tier
    only grows to its bound once anyway. An entry returns to the pool when its image is dropped."""

    def __init__(self, like: list[torch.Tensor], empty: dict[torch.dtype, torch.Tensor], capacity: int):
        self.empty = empty
        try:
            flat = {dtype: torch.empty(capacity, b.numel(), dtype=dtype) for dtype, b in empty.items()}
        except RuntimeError as e:
            need = capacity * sum(b.nbytes for b in empty.values())
            raise RuntimeError(f"the host adapter cache needs {need / 2**30:.1f} GiB for {capacity} slot images "
                               f"(lora.max_cpu_loras plus the adapters read ahead): lower lora.max_cpu_loras ({e})"
                               ) from e
        self.entries = [blocks(like, empty, {dtype: b[i] for dtype, b in flat.items()}) for i in range(capacity)]
        self.free = list(range(capacity))
        self.lock = threading.Lock()

    def take(self) -> Optional[int]:
        """An entry's index, its blocks reset to `empty`; None when all are in use."""
        with self.lock:
            if not self.free:
                return None
            i = self.free.pop()
        for dtype, block in self.entries[i][0].items():
            block.copy_(self.empty[dtype])
        return i

    def give(self, i: int) -> None:
        with self.lock:
            self.free.append(i)


class SlotTable:
    """`max_loras` device slots shared by every LoRA layer of a model; images of adapters to copy into them are
    built in `host_images` pooled entries (beyond them in new memory)."""

    def __init__(self, rt: LoRARuntime, host_images: int = 0):
        self.rt = rt
        self.names: list[str | None] = [None] * rt.max_loras
        layers = {}
        for layer, _ in rt.targets.values():
            layers[id(layer)] = layer
        self.layers = list(layers.values())
        self._spans = {}
        n = 0
        for layer in self.layers:
            k = len(layer.slot_views(0))
            self._spans[id(layer)] = (n, n + k)
            n += k
        self._template = self.views(0)
        self.device = self._template[0].device
        self._sizes: dict[torch.dtype, list[int]] = {}
        for v in self._template:
            self._sizes.setdefault(v.dtype, []).append(v.numel())
        # Every image starts as a copy of the empty one: each layer says what empty means (fp8 channel scales are 1).
        self._empty, views = blocks(self._template)
        for layer in self.layers:
            layer.clear(views[slice(*self._spans[id(layer)])])
        self._dst = [self._targets(slot) for slot in range(rt.max_loras)]  # built at start: loads only use them
        self._pool = ImagePool(self._template, self._empty, host_images) if host_images else None
        self._pins = None
        if self.device.type == "cuda":
            size = sum(1 << (b.nbytes - 1).bit_length() for b in self._empty.values())
            n = max(1, min(PINNED_IMAGES, PINNED_BYTES // size))
            self._pins = threading.BoundedSemaphore(n)
            # Allocated and freed: torch's pinned-memory cache keeps the blocks for the images' copies.
            warm = [torch.empty_like(b, pin_memory=True) for _ in range(n) for b in self._empty.values()]
            del warm

    def views(self, slot: int) -> list[torch.Tensor]:
        """Every layer's views of `slot`, layer after layer."""
        return [v for layer in self.layers for v in layer.slot_views(slot)]

    def image(self, adapter) -> SlotImage:
        """adapter: a LoRAAdapter (tp_lora.lora.adapter) already validated against the model. Host work only."""
        pause()
        entry = self._pool.take() if self._pool is not None else None
        host, views = blocks(self._template, self._empty) if entry is None else self._pool.entries[entry]
        dsts, srcs = [], []

        def gather(dst: torch.Tensor, src: torch.Tensor) -> None:
            dsts.append(_bits(dst))
            srcs.append(_bits(src))

        for path, m in adapter.modules.items():
            layer, key = self.rt.targets[path]
            layer.write(views[slice(*self._spans[id(layer)])], key, m.a, m.b, m.scale, copy=gather)
        pause()
        torch._foreach_copy_(dsts, srcs)  # one call (GIL released inside) instead of hundreds of small copies
        image = SlotImage(adapter.name, host, views, self._pinned(host))
        if entry is not None:
            weakref.finalize(image, self._pool.give, entry)
        return image

    def _pinned(self, host: dict[torch.dtype, torch.Tensor]) -> Optional[dict[torch.dtype, torch.Tensor]]:
        if self._pins is None or not self._pins.acquire(blocking=False):
            return None
        pinned = {dtype: torch.empty_like(b, pin_memory=True).copy_(b) for dtype, b in host.items()}
        weakref.finalize(next(iter(pinned.values())), self._pins.release)  # loaded, or dropped unloaded
        return pinned

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy an image into `slot` on the current stream."""
        source, image.pinned = image.pinned or image.blocks, None
        for dtype, block in source.items():
            pieces = _bits(block.to(self.device, non_blocking=True)).split(self._sizes[dtype])
            (dense, dense_at), (strided, strided_at) = self._dst[slot][dtype]
            if dense:
                torch._foreach_copy_(dense, [pieces[k] for k in dense_at])
            if strided:
                torch._foreach_copy_(strided, [pieces[k].view(v.shape) for k, v in zip(strided_at, strided)])
        self.names[slot] = image.name

    def _targets(self, slot: int) -> dict[torch.dtype, tuple[tuple[list, list], tuple[list, list]]]:
        """Per dtype the slot's views for the batched copies, each with its position among that dtype's views: the
        contiguous ones flattened (fp8 as bytes), and the strided ones (scale columns) for a second batch."""
        out: dict[torch.dtype, tuple[tuple[list, list], tuple[list, list]]] = {}
        by_dtype: dict[torch.dtype, int] = {}
        for v in self.views(slot):
            k = by_dtype.get(v.dtype, 0)
            by_dtype[v.dtype] = k + 1
            (dense, dense_at), (strided, strided_at) = out.setdefault(v.dtype, (([], []), ([], [])))
            if v.is_contiguous():
                dense.append(_bits(v.view(-1)))
                dense_at.append(k)
            else:
                strided.append(v)
                strided_at.append(k)
        return out
