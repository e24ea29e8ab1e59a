"""The adapter cache, three tiers:

  registry  every adapter under lora.adapter_dir, registered at start from adapter_config.json and the safetensors
            HEADER only (names, module shapes, rank; no weights), checked against the model's LoRA targets;
  host      weights read on first use (load_peft_adapter: PEFT's rules) and turned into this rank's slot image
            (tp_lora.lora.slots: its shard, padded, in the slots' dtypes) by the `images` the model
            attaches; at most lora.max_cpu_loras adapters, the one fetched least often lately evicted (decayed
            counts over HOST_HALF_LIFE x lora.max_cpu_loras fetches, tp_lora.lora.popularity; recency among equals);
  device    lora.max_loras SlotTable slots; a copy into one runs on a side CUDA stream and carries only this rank's
            shard.

Lazy reads find a corrupt or rewritten file late, and every rank of a TP group reads it separately, so each read
that touches the disk ends with the ranks agreeing (one small exchange): all fail the adapter or none does, with
the same message, and the scheduler on every rank makes the same decision.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tp_lora import distributed as comm
from tp_lora.lora import stfile
from tp_lora.lora.adapter import LoRAAdapter, load_peft_adapter, validate_adapter
from tp_lora.lora.peft_format import (CONFIG_FILE, PEFT_PREFIX, SAVED, WEIGHTS_FILE, AdapterError, check_extras,
                                      is_embedding_copy,
                                      is_targeted, module_rank_alpha, parse_extra_key, parse_key, read_adapter_config,
                                      saved_module)
from tp_lora.lora.popularity import Popularity
from tp_lora.threadlocal import torch_threads


HOST_HALF_LIFE = 32  # fetches per host entry over which an adapter's fetch count halves (the host tier's eviction)
MAX_PLANS = 16  # adapter layouts whose read plans are kept (each holds one image as its template)
PREFETCH_DEPTH = 32  # adapters read ahead of need, held beside the host tier until fetched
# One reader: reads share the step loop's host, and a second reader thread waits less for reads but slows the steps
# more (BENCHMARKS.md).
READERS = 1
# A read ahead that starts within BEHIND_S of the step loop waiting for a read takes read_threads (the reads are
# what holds the steps up); otherwise one, beside the steps.
BEHIND_S = 0.1


def _err(name: str, msg: str) -> AdapterError:
    return AdapterError(f"adapter {name!r}: {msg}")


@dataclass
class AdapterInfo:
    """What the registry knows of an adapter without reading its weights."""
    name: str
    path: str
    rank: int
    targets: set[str]  # short names of the modules it touches (q_proj, gate_up_proj, ...): which layers to wrap
    # module path -> (A shape, B shape) from the header; None when the file uses PEFT target_parameters (fused MoE
    # experts), whose per-expert modules only exist after the load splits them
    modules: Optional[dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = None
    file_bytes: int = 0


def read_safetensors_header(path: str, owner: str) -> dict[str, dict]:
    """The weights' header, checked against the file (a truncated file fails at registration, not at first use)."""
    try:
        return stfile.read_header(path)
    except stfile.SafetensorsError as e:
        raise _err(owner, str(e)) from e


def register_adapter(name: str, path: str) -> AdapterInfo:
    """An AdapterInfo from the config and the weights' header; raises AdapterError naming what is wrong."""
    # target_parameters (fused 3D experts): load_peft_adapter maps them at the first load.
    cfg = read_adapter_config(path, name, allow=("target_parameters",))
    fused = bool(cfg.get("target_parameters"))
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise _err(name, f"{weights} not found (a PEFT adapter dir holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    header = read_safetensors_header(weights, name)
    if not header:
        raise _err(name, f"{weights} holds no tensors")
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    saved: set[str] = set()  # modules_to_save copies: the layers to wrap, with room for them
    extras: dict[str, set[str]] = {}  # module -> its DoRA magnitude ("M") / lora_B bias
    kinds: dict[str, bool] = {}  # module -> whether it is an embedding
    for key, meta in header.items():
        if meta.get("dtype") not in stfile.FLOAT_DTYPES:
            raise _err(name, f"{weights}: tensor {key!r} has dtype {meta.get('dtype')}, expected a floating type "
                             f"{stfile.FLOAT_DTYPES}")
        parsed = parse_key(key)
        if parsed is None:
            k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
            copy_of = saved_module(cfg, k)
            if copy_of is not None:
                saved.add(copy_of.rsplit(".", 1)[-1])
                continue
            extra = parse_extra_key(key)
            if extra is not None:
                extras.setdefault(extra[0], set()).add(extra[1])
                continue
            if is_embedding_copy(k) or fused:
                continue
            raise _err(name, f"{weights}: tensor {key!r} is not a LoRA weight this runtime understands (expected "
                             f"<module>.lora_A.weight / lora_B.weight / lora_embedding_A / lora_embedding_B)")
        module, which = parsed
        if len(meta["shape"]) != 2:
            raise _err(name, f"{weights}: tensor {key!r} has shape {tuple(meta['shape'])}, expected 2 dims")
        parts.setdefault(module, {})[which] = tuple(meta["shape"])
        kinds[module] = "embedding" in key
    if fused:
        targets = {t.rsplit(".", 1)[-1] for t in cfg["target_parameters"] if isinstance(t, str)}
        targets |= {m.replace(".base_layer", "").rsplit(".", 1)[-1] for m in parts}
        ranks = [s["A"][0] for s in parts.values() if "A" in s]
        return AdapterInfo(name, path, max(ranks, default=0), targets, None, os.path.getsize(weights))
    check_extras(name, cfg, weights, extras, kinds)
    modules = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _err(name, f"{weights}: module {module!r} has lora_{set(ab).pop()} but no lora_{missing}")
        a, b = ab["A"], ab["B"]
        if a[0] != b[1]:
            raise _err(name, f"{weights}: module {module!r}: lora_A {a} has rank {a[0]} but lora_B {b} has rank "
                             f"{b[1]} (expected A [r, in], B [out, r])")
        if not is_targeted(cfg, module):
            raise _err(name, f"{weights} has LoRA weights for {module!r}, which target_modules="
                             f"{cfg.get('target_modules')!r} does not select (PEFT would not load them)")
        r, _ = module_rank_alpha(cfg, module)
        if a[0] != r:
            raise _err(name, f"{weights}: module {module!r} has rank {a[0]} but {CONFIG_FILE} gives it r={r} "
                             f"(r / rank_pattern mismatch)")
        modules[module] = (a, b)
    if not modules and not saved:
        raise _err(name, f"{weights} holds no LoRA weights (keys: {sorted(header)[:4]}...)")
    targets = {m.rsplit(".", 1)[-1] for m in modules} | saved | {SAVED + m for m in saved}
    return AdapterInfo(name, path, max((a[0] for a, _ in modules.values()), default=0), targets, modules,
                       os.path.getsize(weights))


def check_shapes(info: AdapterInfo, module_shapes: dict[str, tuple[int, int]], max_rank: int) -> None:
    """The header's shapes against the model (validate_adapter's checks that need no weights)."""
    n = info.name
    for module, (a, b) in (info.modules or {}).items():
        if a[0] > max_rank:
            raise _err(n, f"module {module!r} has rank {a[0]} > lora.max_rank={max_rank} (raise lora.max_rank to at "
                          f"least {info.rank})")
        if module not in module_shapes:
            near = sorted(k for k in module_shapes if k.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1])
            hint = f"; the model has e.g. {near[:2]}" if near else ""
            raise _err(n, f"has weights for module {module!r}, which this model lacks (or has no LoRA on) — built "
                          f"for another model?{hint}")
        fin, fout = module_shapes[module]
        if a[1] != fin or b[0] != fout:
            raise _err(n, f"module {module!r}: A {a} / B {b} do not fit the model's A {(a[0], fin)} / B "
                          f"{(fout, a[0])} (in={fin}, out={fout}) — built for another model?")


def load_checked(info: AdapterInfo, dtype: Optional[torch.dtype], module_shapes: Optional[dict], max_rank: Optional[int]
                 ) -> LoRAAdapter:
    """Read an adapter and check it against the model and against what the registry saw at start."""
    adapter = load_peft_adapter(info.path, name=info.name, dtype=dtype)
    if module_shapes is not None:
        validate_adapter(adapter, module_shapes, max_rank)
    if info.modules is not None:
        now = {m: (tuple(x.a.shape), tuple(x.b.shape)) for m, x in adapter.modules.items()}
        if now != info.modules:
            diff = sorted(set(now.items()) ^ set(info.modules.items()))[:2]
            raise _err(info.name, f"{os.path.join(info.path, WEIGHTS_FILE)} changed since it was registered at "
                                  f"start (modules / shapes now differ: {diff})")
    return adapter


def _safely(name: str, fn: Callable[[], object]) -> tuple[Optional[object], Optional[str]]:
    """(fn(), None), or (None, why) for whatever a bad file raises: it fails this adapter only."""
    try:
        return fn(), None
    except (AdapterError, OSError, ValueError) as e:
        return None, str(e)
    except Exception as e:
        return None, f"adapter {name!r}: {type(e).__name__}: {e}"


@dataclass
class CacheStats:
    host_hits: int = 0
    host_misses: int = 0  # reads from disk
    host_evictions: int = 0
    device_loads: int = 0
    prefetched: int = 0  # misses served by a read done before fetch() (read ahead, or by wait_any)
    read_seconds: float = 0.0  # step-loop time spent getting misses into the host tier (waits on prefetches too)
    copy_seconds: float = 0.0  # host -> device slot (host time to issue the copies)
    extra: dict = field(default_factory=dict)


class AdapterCache:
    """Registry + host tier; device loads go through load_slot. `group`: the ranks that must agree (the TP group)."""

    def __init__(self, paths: dict[str, str], max_cpu_loras: int, dtype: torch.dtype, group: comm.Group):
        self.max_cpu_loras, self.dtype, self.group = max_cpu_loras, dtype, group
        self.images = None  # the model's SlotTable (attach_model): makes the host tier's slot images
        self._plans: OrderedDict[tuple, object] = OrderedDict()  # (header, config) -> the layout's ImagePlan
        self.infos: dict[str, AdapterInfo] = {}
        self.bad: dict[str, str] = {}
        self.host: OrderedDict[str, object] = OrderedDict()  # name -> its slot image (or the adapter, without images)
        self.popularity = Popularity(HOST_HALF_LIFE * max(max_cpu_loras, 1))  # fetches per adapter, decayed
        self._staged: dict[str, Future] = {}  # name -> (adapter, error) being read ahead, beside the host tier
        self._reader: Optional[ThreadPoolExecutor] = None
        # Threads for a read the step loop waits on (the engine's read_threads); reads ahead take one, or as many while
        # the step loop waits for reads (BEHIND_S).
        self.read_threads: Optional[int] = None
        self._waited = -math.inf  # when the step loop last waited for a read (time.perf_counter)
        self.stats = CacheStats()
        self.module_shapes: Optional[dict] = None
        self.max_rank: Optional[int] = None
        for name, path in paths.items():
            try:
                self.infos[name] = register_adapter(name, path)
            except (AdapterError, ValueError, OSError) as e:
                self.bad[name] = str(e)
        self._agree_registry()

    def attach_model(self, module_shapes: dict[str, tuple[int, int]], max_rank: int, images=None) -> None:
        """Check every registered adapter's shapes against the model; the misfits become bad. images: the model's
        tp_lora.lora.slots.SlotTable, whose slot images the host tier then keeps instead of the adapters."""
        self.module_shapes, self.max_rank, self.images = module_shapes, max_rank, images
        for name in list(self.infos):
            try:
                check_shapes(self.infos[name], module_shapes, max_rank)
            except AdapterError as e:
                self._mark_bad(name, str(e))
        self._agree_registry()

    def register(self, name: str, path: str) -> Optional[str]:
        """Add adapter `name` at `path` at run time: its header checked against the model (attach_model first) and
        its weights read into the host tier. None, or why not (the same verdict on every rank); a refused adapter
        leaves no trace, so a fixed file can be registered again."""
        try:
            info = register_adapter(name, path)
            check_shapes(info, self.module_shapes, self.max_rank)
            err = None
        except (AdapterError, ValueError, OSError) as e:
            err = str(e)
        err = self._agree(err)
        if err is None:
            self.infos[name] = info
            try:
                self.fetch(name)
            except AdapterError as e:
                err = str(e)
        if err is not None:
            self.remove(name)
        return err

    def remove(self, name: str) -> None:
        """Forget adapter `name` (registered, bad, read or being read)."""
        self.infos.pop(name, None)
        self.bad.pop(name, None)
        self.host.pop(name, None)
        self.popularity.forget(name)
        staged = self._staged.pop(name, None)
        if staged is not None:
            staged.cancel()

    def _mark_bad(self, name: str, why: str) -> None:
        self.bad[name] = why
        self.infos.pop(name, None)
        self.host.pop(name, None)

    def _agree_registry(self) -> None:
        """Every rank keeps the same adapters (a file rewritten while the ranks read it could split them)."""
        if self.group.size == 1:
            return
        for bad in comm.all_gather_object(sorted(self.bad.items()), self.group):
            for name, why in bad:
                if name not in self.bad:
                    self._mark_bad(name, why)

    def _agree(self, err: Optional[str]) -> Optional[str]:
        """The first rank's error, if any rank had one: the same verdict and message on every rank."""
        if self.group.size == 1:
            return err
        return next((e for e in comm.all_gather_object(err, self.group) if e), None)

    # ---- host tier -------------------------------------------------------------------------------------------
    def fetch(self, name: str):
        """The adapter in host memory (its slot image, with `images`), read from disk on a miss (or taken from a
        prefetch). Raises AdapterError (the same on every rank) when it cannot be used; it is then moved to `bad`."""
        if name in self.bad:
            raise AdapterError(self.bad[name])
        self.popularity.use(name)
        if name in self.host:
            self.stats.host_hits += 1
            self.host.move_to_end(name)
            return self.host[name]
        if name not in self.infos:
            raise AdapterError(f"adapter {name!r} is not registered (known: {sorted(self.infos)[:8]}...)")
        self.stats.host_misses += 1
        t0 = time.perf_counter()
        staged = self._staged.pop(name, None)
        if staged is None or not staged.done():
            self._waited = t0
        if staged is not None and not staged.cancel():
            self.stats.prefetched += 1
            adapter, err = staged.result()
        else:  # not read ahead, or still queued behind other reads ahead: read it now, beside them
            adapter, err = self._read_safely(self.infos[name], self.read_threads)
        err = self._agree(err)
        self.stats.read_seconds += time.perf_counter() - t0
        if err:
            self._mark_bad(name, err)
            raise AdapterError(err)
        self.host[name] = adapter
        while len(self.host) > self.max_cpu_loras:
            order = list(self.host)[:-1]  # least recently used first; never the adapter just read
            del self.host[order[min(range(len(order)), key=lambda i: (self.popularity[order[i]], i))]]
            self.stats.host_evictions += 1
        return adapter

    def ready(self, name: str) -> bool:
        """Whether fetch(name) returns without waiting for a read (on this rank)."""
        if name in self.host or name in self.bad:
            return True
        staged = self._staged.get(name)
        return staged is not None and staged.done()

    def wait_any(self, names: list[str], timeout: float = 0.01) -> None:
        """Bring this rank closer to having one of `names` ready (see ready): read the first whose read has not
        started here and now (its queued read ahead dropped), else wait up to `timeout` for one under way. The time
        counts as read time."""
        t0 = self._waited = time.perf_counter()
        if any(self.ready(name) for name in names):  # ready here, not yet on every rank: let them catch up
            time.sleep(min(timeout, 1e-3))
        else:
            for name in names:
                staged = self._staged.get(name)
                if staged is None or staged.cancel():
                    done = self._staged[name] = Future()
                    done.set_result(self._read_safely(self.infos[name], self.read_threads))
                    break
            else:
                wait([self._staged[name] for name in names], timeout, FIRST_COMPLETED)
        self.stats.read_seconds += time.perf_counter() - t0

    def prefetch(self, names) -> None:
        """Start reading adapters that will be fetched soon (in order, at most PREFETCH_DEPTH at a time) on a
        background thread, so disk reads overlap the steps instead of stalling the step loop. Local to this rank:
        fetch() still takes the ranks' common verdict."""
        for name in names:
            if len(self._staged) >= PREFETCH_DEPTH:
                return
            if name in self._staged or name in self.host or name in self.bad or name not in self.infos:
                continue
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=READERS,
                                                  thread_name_prefix="tp_lora-adapter-read")
            self._staged[name] = self._reader.submit(self._read_ahead, self.infos[name])

    def _read_ahead(self, info: AdapterInfo):
        """On a reader thread."""
        behind = time.perf_counter() - self._waited < BEHIND_S
        return self._read_safely(info, self.read_threads if behind else 1)

    def forget(self) -> None:
        """Drop the host tier and any prefetches (a cold start for benchmarks)."""
        self.host.clear()
        self._staged.clear()

    def close(self) -> None:
        """Drop queued reads ahead and wait for the one running (a few ms): no reader thread is left inside torch
        while the process groups and the interpreter go down."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None
        self._staged.clear()

    def _read_safely(self, info: AdapterInfo, threads: Optional[int] = 1) -> tuple[Optional[object], Optional[str]]:
        """(slot image or adapter, None) or (None, why); on `threads` threads (None: this thread's torch count). A
        read ahead takes one unless the step loop waits for reads (BEHIND_S): more threads on every read would slow
        the steps beside them more than they speed the read."""
        if self.images is None:
            return _safely(info.name, lambda: load_checked(info, self.dtype, self.module_shapes, self.max_rank))
        # Nothing of the read outlives this call (the image is a copy): its buffer serves the next read.
        with stfile.reusing_buffer(), torch_threads(threads):
            return _safely(info.name, lambda: self._read_image(info, threads or 1))

    def _read_image(self, info: AdapterInfo, threads: int):
        """The slot image of a file: by its layout's plan when an earlier file had the same layout, else by a full
        read and check (which makes the plan)."""
        raw = key = None
        try:
            raw = stfile.read_file(os.path.join(info.path, WEIGHTS_FILE), threads)
            with open(os.path.join(info.path, CONFIG_FILE), "rb") as f:
                key = (raw.header, raw.data.numel(), f.read())
        except (OSError, stfile.SafetensorsError):
            pass  # the full read below says what is wrong
        plan = self._plans.get(key) if key is not None else None
        if plan is not None and plan.modules == info.modules:
            image = self.images.replay(info.name, plan, raw.data)
            if image is not None:
                return image
        with stfile.given(raw):  # in the file's dtype: the image casts as it copies, and can record a plan
            adapter = load_checked(info, None, self.module_shapes, self.max_rank)
        image = self.images.image(adapter, raw.data if raw is not None else None)
        if image.plan is not None and key is not None:
            self._plans[key] = image.plan
            while len(self._plans) > MAX_PLANS:
                self._plans.popitem(last=False)
        return image

    # ---- device tier -----------------------------------------------------------------------------------------
    def load_slot(self, slots, slot: int, image, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Copy a fetched slot image into device slot `slot` of the SlotTable, on `stream` when given (the caller
        makes the compute stream wait for it before the slot is read)."""
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            slots.load(slot, image)
        self.stats.device_loads += 1
        self.stats.copy_seconds += time.perf_counter() - t0
