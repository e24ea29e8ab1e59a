"""Device slots holding adapters: which adapter sits in which slot, and copying an adapter's (sharded) weights in."""
from __future__ import annotations

from tp_lora.lora.layers import LoRARuntime


class SlotTable:
    """`max_loras` device slots shared by every LoRA layer of a model. Loading resets the slot in every layer first,
    so modules an adapter does not target contribute nothing (no leftovers of the slot's previous adapter)."""

    def __init__(self, rt: LoRARuntime):
        self.rt = rt
        self.names: list[str | None] = [None] * rt.max_loras

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def _layers(self):
        seen = {}
        for layer, _ in self.rt.targets.values():
            seen[id(layer)] = layer
        return seen.values()

    def load(self, slot: int, adapter) -> None:
        """adapter: a LoRAAdapter (tp_lora.lora.adapter) already validated against the model."""
        self.reset(slot)
        for path, m in adapter.modules.items():
            layer, slice_idx = self.rt.targets[path]
            layer.set_slot(slot, slice_idx, m.a, m.b, m.scale)
        self.names[slot] = adapter.name

    def reset(self, slot: int) -> None:
        for layer in self._layers():
            layer.reset_slot(slot)
        self.names[slot] = None
