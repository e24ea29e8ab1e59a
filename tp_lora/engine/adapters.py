"""The adapter registry beside the step: which adapters exist and which are unusable, their reads into host memory
(tp_lora.lora.cache.AdapterCache), which device slot holds which (SlotState), and the copies of read adapters into
their slots on a side stream. Every rank of a TP group makes the same calls and reaches the same verdicts."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError
from tp_lora.engine.scheduler import LOOKAHEAD, Scheduler
from tp_lora.engine.slot_state import SlotState
from tp_lora.lora.adapter import AdapterError
from tp_lora.lora.cache import AdapterCache, AdapterInfo
from tp_lora.lora.slots import SlotTable

# The longest the step waits for the reads of the next admission group's adapters before admitting without them:
# waiting keeps the batch full when reads take their usual few ms, the bound keeps one slow file from stalling all.
READ_WAIT_S = 0.1
# Beyond this a read's copies gain little more (host memory bandwidth) and take cores from the other ranks.
MAX_READ_THREADS = 8


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it, as under a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_threads(requested: int, device_type: str, cores: int, local_ranks: int) -> Optional[int]:
    """Threads for an adapter read the step waits on (parallel.read_threads): `requested`, or for 0 on CUDA the
    rank's share of the host's `cores` less one (at most MAX_READ_THREADS), and None (the thread's own) on CPU,
    where reads share the cores with the model's compute."""
    if requested:
        return requested
    if device_type != "cuda":
        return None
    return max(1, min(MAX_READ_THREADS, cores // max(1, local_ranks) - 1))


class AdapterRegistry:
    """Adapters by name, read on first use and copied into the `slots` (None when the model has no LoRA layers)."""

    def __init__(self, cache: AdapterCache, slots: Optional[SlotTable], max_loras: int, device: torch.device,
                 tp: comm.Group):
        self.cache, self.slots, self.tp, self.device = cache, slots, tp, device
        self.state = SlotState(max_loras)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copies_pending = False
        # Admission waits (boundedly) for reads where they overlap GPU steps. On CPU reads and steps share the cores,
        # and the step reading what it admits keeps each run's batches, and so its rounding, the same.
        self.overlap_reads = device.type == "cuda"
        self._identities: dict[str, int] = {}  # name -> its identity while loaded (identity())
        self.unloading: set[str] = set()  # adapters being unloaded: no new request may name them (unregister())
        self._next_identity = 1

    @property
    def infos(self) -> dict[str, AdapterInfo]:
        """Usable adapters as registered (names, shapes); weights are read on first use."""
        return self.cache.infos

    @property
    def bad(self) -> dict[str, str]:
        """name -> why it cannot be used (found at start, or at its first read)."""
        return self.cache.bad

    def identity(self, name: Optional[str]) -> int:
        """An adapter's identity in the prefix cache: 0 for the base model, else a number given at first use and
        new after every unload, so a reload under the same name never meets the old weights' KV blocks."""
        if name is None:
            return 0
        if name not in self._identities:
            self._identities[name] = self._next_identity
            self._next_identity += 1
        return self._identities[name]

    def failure(self, name: str) -> str:
        why = self.bad[name]
        return f"adapter {name!r} failed to load: {why.removeprefix(f'adapter {name!r}: ')}"

    def unknown(self, name: str) -> Optional[str]:
        """Why a request may not name adapter `name`, or None."""
        if name in self.bad:
            return self.failure(name)
        if name in self.unloading:
            return f"adapter {name!r} is being unloaded: it takes no new requests"
        if name not in self.infos:
            known = sorted(self.infos)
            shown = (f"{known[:10]} and {len(known) - 10} more" if len(known) > 10 else known) if known \
                else "none (no adapter was found under lora.adapter_dir or loaded since)"
            return f"unknown adapter {name!r}; known adapters: {shown}"
        return None

    # ---- run-time registration (every rank, between steps) ---------------------------------------------------
    def register(self, name: str, path: str) -> Optional[str]:
        """Add adapter `name` from `path`. None, or why not."""
        if name in self.unloading:
            return f"adapter {name!r} is being unloaded; load it again once that has finished"
        if name in self.infos:
            return f"adapter {name!r} is already loaded (unload it first)"
        if self.slots is None:
            return ("the model has no LoRA layers: this process started without adapters (lora.adapter_dir with at "
                    "least one adapter makes them, for the modules its adapters target)")
        if self.state.pinned:
            return "adapters are pinned in slots here (parallel.ep_attention=dp with ep_size > 1): none can be added"
        return self.cache.register(name, path)

    def unregister(self, name: str) -> Optional[str]:
        """Start unloading adapter `name`: from now on no new request may name it (`unloading`); remove() forgets it
        once none uses it. None, or why it cannot be unloaded."""
        if name not in self.infos and name not in self.bad:
            return f"adapter {name!r} is not loaded"
        if self.state.pinned:
            return "adapters are pinned in slots here (parallel.ep_attention=dp with ep_size > 1): none can be removed"
        self.unloading.add(name)
        return None

    def remove(self, name: str) -> None:
        """Forget adapter `name`, being unloaded and used by no request any more: its slot, its host copy, its
        identity."""
        self.unloading.discard(name)
        slot = self.state.slot_of(name)
        if slot is not None:
            self.state.clear(slot)
            self.slots.names[slot] = None
        self.cache.remove(name)
        self._identities.pop(name, None)

    def pin_all(self, max_loras: int, ep_size: int) -> None:
        """Expert parallelism over DP replicas sends a token's adapter slot to the rank owning its expert, so every
        rank must hold every adapter in the same slot: load them all once, in name order."""
        names = sorted(self.infos)
        if len(names) > max_loras:
            raise ConfigError(f"parallel.ep_attention=dp with ep_size={ep_size} pins every adapter in a slot, but "
                              f"there are {len(names)} adapters for lora.max_loras={max_loras}: raise lora.max_loras")
        slot = 0
        for name in names:
            image = self.fetch(name)
            if image is None:
                continue  # now in `bad`, on every rank alike
            self.cache.load_slot(self.slots, slot, image)
            self.state.names[slot] = name
            slot += 1
        self.state.pinned = True

    def forget(self) -> None:
        """Empty the host cache and the slots between runs: every adapter is read again at its next use."""
        if self.state.pinned:
            return
        if any(self.state.users):
            raise RuntimeError("the adapter cache was reset while a run holds slots")
        self.cache.forget()
        for slot in range(len(self.state)):
            self.state.clear(slot)
        if self.slots is not None:
            self.slots.names = [None] * len(self.slots.names)

    # ---- reads and slot copies ----------------------------------------------------------------------------------
    def fetch(self, name: str) -> Optional[object]:
        """An adapter's host form (its slot image), or None when it cannot be used (the same verdict on every rank)."""
        try:
            return self.cache.fetch(name)
        except AdapterError:
            return None

    def copy_into_slot(self, slot: int, image) -> None:
        """Copy a read adapter into `slot`, on the side stream where there is one (sync() orders it before use). A
        DoRA image's load runs collectives over the TP group (its g's norms): on the side stream they first wait for
        the compute stream's work, so no two kernels over the group's peer buffer ever run at once."""
        if self.copy_stream is not None and image.dora and self.tp.size > 1:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self.cache.load_slot(self.slots, slot, image, self.copy_stream)
        self.copies_pending = self.copy_stream is not None

    def sync(self) -> None:
        """Make the compute stream wait for the slot copies issued so far, before any slot is read."""
        if self.copies_pending:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self.copies_pending = False

    def wanted(self, sched: Scheduler) -> list[str]:
        """Adapters of the next waiting requests that are not in a slot, in queue order."""
        return list(dict.fromkeys(r.adapter for r in sched.waiting[:LOOKAHEAD]
                                  if r.adapter is not None and self.state.slot_of(r.adapter) is None))

    def loadable(self, sched: Scheduler) -> tuple[Optional[set[str]], list[str]]:
        """(adapters the next step may copy into slots, those still being read) over the waiting requests the
        scheduler may admit next; (None, []) without overlap_reads: any, read when admitted. Waits up to
        READ_WAIT_S for the reads of the first group's adapters. The ranks of a TP group agree on which reads are
        done and on when the wait ends (times differ per rank)."""
        if not self.overlap_reads:
            return None, []
        if not sched.may_admit():
            return set(), []
        wanted = self.wanted(sched)
        if not wanted:
            return set(), []
        self.cache.prefetch(wanted)
        first = {r.adapter for r in sched.waiting[:sched.group_size]}
        deadline = time.perf_counter() + READ_WAIT_S
        while True:
            flags = comm.all_true([self.cache.ready(n) for n in wanted] + [time.perf_counter() < deadline], self.tp)
            unread = [n for n, ok in zip(wanted, flags) if not ok]
            due = [n for n in unread if n in first]
            if not due or not flags[-1]:
                return {n for n, ok in zip(wanted, flags) if ok}, unread
            self.cache.wait_any(due)

    def place(self, names: list[str]) -> dict[str, int]:
        """Put every adapter of `names` in a slot at once, outside a run (prompt scoring): name -> slot. Raises
        ValueError naming what does not fit or cannot be read."""
        st, slot_of = self.state, {}
        try:
            for name in names:
                slot = st.slot_of(name)
                if slot is None:
                    slot = st.victim(set(names))
                    if slot is None:
                        raise ValueError(f"{len(names)} adapters do not fit in lora.max_loras={len(st)} slots")
                    image = self.fetch(name)
                    if image is None:
                        raise ValueError(self.failure(name))
                    st.assign(slot, name)
                    self.copy_into_slot(slot, image)
                    st.loaded(slot)
                st.acquire(slot)  # held until all are placed, so no later name evicts it
                slot_of[name] = slot
        finally:
            for s in slot_of.values():
                st.release(s)
        return slot_of

    def close(self) -> None:
        self.cache.close()
