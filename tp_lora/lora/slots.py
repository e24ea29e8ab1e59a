"""Device slots holding adapters: which adapter sits in which slot, and copying an adapter's (sharded) weights in.

An adapter enters a slot as a SlotImage: this rank's contents of the slot in every LoRA layer (its shard, padded to
max_rank, untargeted modules empty, B already fp8 where lora.dtype=fp8), packed in one host block per dtype. Images
are built off the step loop (by the adapter cache's reader, on a background thread) and a load is then one
host->device copy per dtype plus one batched device copy into the slot's views, instead of a few operations per
module and layer (measured on an H200 at ~15 ms of host time per load that way).

Images stay in pageable memory: page-locking one (cudaHostAlloc, ~13 ms per 20 MB in an H100 profile) cost the
reader more than the rest of a read, while a copy from pageable memory only holds the step loop for the time the
driver takes to stage it (GIL released meanwhile).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_lora.hostcopy import blocks
from tp_lora.lora.layers import LoRARuntime
from tp_lora.lora.pacing import pause


@dataclass
class SlotImage:
    name: str
    blocks: dict[torch.dtype, torch.Tensor]  # one per dtype, in host memory
    views: list[torch.Tensor]  # SlotTable.views(slot)'s shapes, views of the blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte floats (fp8) as bytes: the batched copy is not defined for them, a byte copy is the same."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class SlotTable:
    """`max_loras` device slots shared by every LoRA layer of a model."""

    def __init__(self, rt: LoRARuntime):
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
        self._dst: dict[int, tuple[dict, dict]] = {}
        # Every image starts as a copy of the empty one: each layer says what empty means (fp8 channel scales are 1).
        self._empty, views = blocks(self._template)
        for layer in self.layers:
            layer.clear(views[slice(*self._spans[id(layer)])])

    def views(self, slot: int) -> list[torch.Tensor]:
        """Every layer's views of `slot`, layer after layer."""
        return [v for layer in self.layers for v in layer.slot_views(slot)]

    def image(self, adapter) -> SlotImage:
        """adapter: a LoRAAdapter (tp_lora.lora.adapter) already validated against the model. Host work only."""
        host, views = blocks(self._template, self._empty)
        for path, m in adapter.modules.items():
            pause()
            layer, key = self.rt.targets[path]
            layer.write(views[slice(*self._spans[id(layer)])], key, m.a, m.b, m.scale)
        return SlotImage(adapter.name, host, views)

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy an image into `slot` on the current stream."""
        dense, strided = self._targets(slot)
        for dtype, block in image.blocks.items():
            pieces = block.to(self.device, non_blocking=True).split(self._sizes[dtype])
            d, s = dense[dtype], strided[dtype]
            if d:
                torch._foreach_copy_([v for _, v in d], [_bits(pieces[k]) for k, _ in d])
            if s:
                torch._foreach_copy_([v for _, v in s], [pieces[k].view(v.shape) for k, v in s])
        self.names[slot] = image.name

    def _targets(self, slot: int) -> tuple[dict, dict]:
        """Per dtype the slot's views as (position among that dtype's views, view): the contiguous ones flattened
        (and fp8 as bytes) for the fast batched copy, the strided ones (scale columns) in a second batch. Built once
        per slot: loads reuse them."""
        if slot not in self._dst:
            dense, strided = {}, {}
            by_dtype: dict[torch.dtype, int] = {}
            for v in self.views(slot):
                k = by_dtype.get(v.dtype, 0)
                by_dtype[v.dtype] = k + 1
                if v.is_contiguous():
                    dense.setdefault(v.dtype, []).append((k, _bits(v.view(-1))))
                else:
                    strided.setdefault(v.dtype, []).append((k, v))
            self._dst[slot] = ({d: dense.get(d, []) for d in by_dtype}, {d: strided.get(d, []) for d in by_dtype})
        return self._dst[slot]
