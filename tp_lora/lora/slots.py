"""Device slots holding adapters: which adapter sits in which slot, and copying an adapter's (sharded) weights in.

An adapter enters a slot as a SlotImage: this rank's contents of the slot in every LoRA layer (its shard, padded to
max_rank, untargeted modules empty, B already fp8 where lora.dtype=fp8), packed in one host block per dtype. Images
are built off the step loop (by the adapter cache's reader, on a background thread) and a load is then one
host->device copy per dtype plus one batched device copy into the slot's views, instead of a few operations per
module and layer on the step loop's host time.

The host tier keeps images in pageable memory (page-locking each one, cudaHostAlloc, is slow). But a copy from
pageable memory holds the step loop while the driver stages the bytes (the biggest part of a slot load), so on CUDA
a fresh image also gets a page-locked copy, made on the reader thread into blocks of torch's pinned-memory cache
(warmed at start, so no cudaHostAlloc on the way). Its load is then an asynchronous copy; the page-locked copy is
dropped once loaded (torch keeps the block until the copy is done) and at most PINNED_IMAGES exist at a time, beyond
which images load from pageable memory.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from tp_lora.hostcopy import blocks
from tp_lora.lora import dora
from tp_lora.lora.adapter import count_nonfinite, finite_flags, range_limits
from tp_lora.lora.layers import LoRARuntime
from tp_lora.lora.peft_format import AdapterError
from tp_lora.ops.fp8 import quantize_fp8_into


@dataclass
class SlotImage:
    name: str
    blocks: dict[torch.dtype, torch.Tensor]  # one per dtype, in host memory
    views: list[torch.Tensor]  # SlotTable.views(slot)'s shapes, views of the blocks
    pinned: Optional[dict[torch.dtype, torch.Tensor]] = None  # a page-locked copy of the blocks, until loaded
    plan: Optional["ImagePlan"] = None  # how to build it again from another file of the same layout
    dora: tuple[int, ...] = ()  # SlotTable.layers indices of the layers whose DoRA g a load computes
    saved: tuple[int, ...] = ()  # ... and of the layers it brings a modules_to_save copy to


# A view as (dtype of the tensor it views, its dtype, storage offset in its elements, size, stride).
ViewSpec = tuple[torch.dtype, torch.dtype, int, tuple[int, ...], tuple[int, ...]]


def _spec(view: torch.Tensor, base: torch.Tensor) -> Optional[ViewSpec]:
    """`view` described relative to `base` (a 1-dim tensor), or None when it does not view base's memory."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    offset = view.data_ptr() - base.data_ptr()
    if offset < 0 or offset % view.element_size():
        return None
    return base.dtype, view.dtype, offset // view.element_size(), tuple(view.shape), tuple(view.stride())


def _make(spec: ViewSpec, base: torch.Tensor) -> torch.Tensor:
    _, dtype, offset, size, stride = spec
    if base.dtype != dtype:
        width = dtype.itemsize // base.element_size()  # a wider type views whole elements only
        base = (base[:base.numel() - base.numel() % width] if width > 1 else base).view(dtype)
    return base.as_strided(size, stride, base.storage_offset() + offset)


@dataclass
class ImagePlan:
    """How an adapter file becomes a slot image, for every file of the same layout (the same safetensors header and
    adapter_config.json, so the same modules, shapes, ranks and scales): copy the image `template` (the first such
    image: scales, padding, untargeted modules) where the file's tensors do not go, and then those, as views of its
    bytes, into their places, cast where the file's dtype is not the slot's, and quantized where the slot holds fp8.
    Built from the first image of a layout when each of its tensors went in as a plain view of the file (no
    padding); replaying it skips the per-module work of a read (SlotTable.replay)."""
    modules: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # module -> (A shape, B shape), as registered
    template: dict[torch.dtype, torch.Tensor]
    src: list[ViewSpec]  # views of the file's bytes (uint8), copied
    dst: list[ViewSpec]  # ... into these views of the image's blocks (by the block's dtype)
    qsrc: list[ViewSpec]  # views of the file's bytes, quantized to fp8 per channel (lora.dtype=fp8)
    qdst: list[ViewSpec]  # ... into these fp8 views of the image
    qscale: list[ViewSpec]  # ... with their channel scales here
    # A replay's NaN/Inf and range screen: runs of the file's bytes covering src + qsrc (a file's tensors usually
    # lie back to back: one run, one norm), each with the range_limits of what its tensors become.
    screen: list[ViewSpec]
    limits: torch.Tensor
    # The template's parts that no dst / qdst / qscale view covers (scales, rank padding), copied instead of the
    # whole template; None: the whole template (too many pieces, as with rank padding in every row of B).
    gaps: Optional[list[ViewSpec]]
    dora: tuple[int, ...]  # as SlotImage.dora
    saved: tuple[int, ...]  # as SlotImage.saved
    _views: dict = field(default_factory=dict, repr=False)  # (which, buffer address) -> views made before

    def views(self, which: str, base: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """The views of list `which` (src, dst, qsrc, ...) into `base` (dtype -> 1-dim tensor), made once per
        buffer: the views keep their buffer alive, so its address cannot be reused by another."""
        key = (which, tuple(b.data_ptr() for b in base.values()))
        out = self._views.get(key)
        if out is None:
            if len(self._views) > 4096:  # buffers of an image pool that grew past its size come and go
                self._views.clear()
            out = self._views[key] = [_make(sp, base[sp[0]]) for sp in getattr(self, which)]
        return out


def _check_casts(name: str, owners: list[str], dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Raise for the first tensor (of a validated adapter: no NaN/Inf) with values beyond the range of the slot dtype
    it is cast into (an fp32 file for fp16 slots): the cast would make them Inf."""
    cast = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if d.dtype != s.dtype]
    if not cast:
        return
    for i, ok in zip(cast, finite_flags([srcs[i] for i in cast], range_limits([dsts[i].dtype for i in cast]))):
        bad = 0 if ok else count_nonfinite(srcs[i].to(dsts[i].dtype))
        if bad:
            raise AdapterError(f"adapter {name!r}: module {owners[i]!r}: {bad} values of a {tuple(srcs[i].shape)} "
                               f"{srcs[i].dtype} tensor lie beyond the range of the slots' {dsts[i].dtype} "
                               f"(±{torch.finfo(dsts[i].dtype).max:g})")


def _extent(sp: ViewSpec) -> tuple[int, int]:
    """[first, last + 1) of the elements (of the view's dtype, from its base's start) a non-empty view touches."""
    _, _, offset, size, stride = sp
    return offset, offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))


def _screen_runs(specs: list[ViewSpec], limits: list[float]) -> tuple[list[ViewSpec], torch.Tensor]:
    """The fewest 1-dim views of the specs' (common) base covering every element of theirs, each with the lowest
    limit of the specs it covers. A run joins only views that touch or overlap, so it screens no byte outside their
    extents (at most the rest of a sharded tensor, which the full read screens anyway)."""
    runs: list[list] = []  # [base dtype, dtype, start, stop, limit]
    for sp, limit in sorted(((sp, lim) for sp, lim in zip(specs, limits) if all(sp[3])),
                            key=lambda x: (str(x[0][1]), x[0][2])):
        start, stop = _extent(sp)
        last = runs[-1] if runs else None
        if last is not None and last[1] == sp[1] and start <= last[3]:
            last[3], last[4] = max(last[3], stop), min(last[4], limit)
        else:
            runs.append([sp[0], sp[1], start, stop, limit])
    return ([(b, d, start, (stop - start,), (1,)) for b, d, start, stop, _ in runs],
            torch.tensor([r[4] for r in runs], dtype=torch.float64))


# A replay copies at most this many template pieces; more (rank padding in every row) copy the whole template.
MAX_GAPS = 4096


def _gaps(specs: list[ViewSpec], blocks: dict[torch.dtype, torch.Tensor]) -> Optional[list[ViewSpec]]:
    """The runs of `blocks` that no view in `specs` (views of them) covers, as views; None beyond MAX_GAPS, or when a
    view's element is not its block's."""
    covered = {dtype: torch.zeros(b.numel(), dtype=torch.bool) for dtype, b in blocks.items()}
    for base, dtype, offset, size, stride in specs:
        if dtype.itemsize != base.itemsize:
            return None
        covered[base].as_strided(size, stride, offset).fill_(True)
    out = []
    for dtype, mask in covered.items():
        edges = torch.diff((~mask).to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8),
                           append=mask.new_zeros(1, dtype=torch.int8))
        starts, stops = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        view = torch.uint8 if dtype.itemsize == 1 and dtype.is_floating_point else dtype  # as _bits
        out += [(dtype, view, a, (b - a,), (1,)) for a, b in zip(starts, stops)]
        if len(out) > MAX_GAPS:
            return None
    return out


# Page-locked image copies alive at once: about as many as the cache reads ahead (lora.cache.PREFETCH_DEPTH), and
# within PINNED_BYTES (torch's pinned cache rounds each block up to a power of two).
PINNED_IMAGES, PINNED_BYTES = 32, 1 << 30


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte floats (fp8) as bytes: the batched copy is not defined for them, a byte copy is the same."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class ImagePool:
    """Host memory for `capacity` slot images shaped like `like`, allocated and faulted in at start, with each
    entry's views made once; an entry is handed out as a copy of the image it starts from. A fresh image's page
    faults would otherwise cost the reader most of a read while the host tier fills, and the host tier only grows to
    its bound once anyway. An entry returns to the pool when its image is dropped."""

    def __init__(self, like: list[torch.Tensor], empty: dict[torch.dtype, torch.Tensor], capacity: int):
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

    def take(self, init: Optional[dict[torch.dtype, torch.Tensor]]) -> Optional[int]:
        """An entry's index, its blocks copies of `init` (blocks shaped like `empty`; None: left as they are); None
        when all are in use."""
        with self.lock:
            if not self.free:
                return None
            i = self.free.pop()
        if init is not None:
            for dtype, block in self.entries[i][0].items():
                block.copy_(init[dtype])
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
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
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

    def image(self, adapter, source: Optional[torch.Tensor] = None) -> SlotImage:
        """adapter: a LoRAAdapter (tp_lora.lora.adapter) already validated against the model. Host work only.
        source: the bytes of the file its tensors view (stfile.RawFile.data): the image then carries the plan to
        build the images of files of the same layout (None when some tensor was not a plain view of them)."""
        entry, host, views = self._entry(self._empty)
        dsts, srcs, owners = [], [], []
        quants = []  # (fp8 dst, its scales, src)

        def gather(dst: torch.Tensor, src: torch.Tensor, scales: Optional[torch.Tensor] = None) -> None:
            if scales is not None:
                quants.append((dst, scales, src))
                return
            if dst.dtype == src.dtype:  # fp8 as bytes; a cast (fp32 file, 16-bit slot) keeps its types
                dst, src = _bits(dst), _bits(src)
            dsts.append(dst)
            srcs.append(src)
            owners.append(path)

        dora_layers, saved_layers = set(), set()
        try:
            for path, m in adapter.modules.items():
                layer, key = self.rt.targets[path]
                mine = views[slice(*self._spans[id(layer)])]
                layer.write(mine, key, m.a, m.b, m.scale, copy=gather)
                if m.magnitude is not None or m.bias is not None:
                    try:
                        layer.write_extras(mine, key, m.scale, m.magnitude, m.bias, copy=gather)
                    except ValueError as e:
                        raise AdapterError(f"adapter {adapter.name!r}: module {path!r}: {e}") from e
                if m.magnitude is not None:
                    dora_layers.add(self._index[id(layer)])
            for path, table in adapter.saved.items():
                layer, _ = self.rt.targets[path]
                try:
                    layer.write_saved(views[slice(*self._spans[id(layer)])], layer.saved_at, table, copy=gather)
                except ValueError as e:
                    raise AdapterError(f"adapter {adapter.name!r}: modules_to_save {path!r}: {e}") from e
                saved_layers.add(self._index[id(layer)])
            _check_casts(adapter.name, owners, dsts, srcs)
            # One call (GIL released inside) instead of hundreds of small copies; it casts where the file's dtype is
            # not the slot's.
            torch._foreach_copy_(dsts, srcs)
            qdsts, qscales, qsrcs = (list(x) for x in zip(*quants)) if quants else ([], [], [])
            if quants:
                quantize_fp8_into(qdsts, qscales, qsrcs)
        except BaseException:  # the image is not made: its pool entry goes back
            if entry is not None:
                self._pool.give(entry)
            raise
        plan, marks = None, (tuple(sorted(dora_layers)), tuple(sorted(saved_layers)))
        if source is not None:
            plan = self._plan(adapter, host, source, (dsts, srcs), (qdsts, qscales, qsrcs), marks)
        return self._finish(adapter.name, host, views, entry, plan, marks)

    def replay(self, name: str, plan: ImagePlan, source: torch.Tensor) -> Optional[SlotImage]:
        """The image of a file laid out as the one `plan` was made from, from its bytes (`source`); None when one of
        its tensors may hold a NaN/Inf or a value beyond the slots' range (the full read then settles it)."""
        src = {torch.uint8: source}
        if not all(finite_flags(plan.views("screen", src), plan.limits)):
            return None
        entry, host, views = self._entry(plan.template if plan.gaps is None else None)
        if plan.gaps:
            torch._foreach_copy_(plan.views("gaps", host), plan.views("gaps", plan.template))
        srcs, qsrcs = plan.views("src", src), plan.views("qsrc", src)
        torch._foreach_copy_(plan.views("dst", host), srcs)
        if qsrcs:
            quantize_fp8_into(plan.views("qdst", host), plan.views("qscale", host), qsrcs)
        return self._finish(name, host, views, entry, plan, (plan.dora, plan.saved))

    def _entry(self, init: Optional[dict[torch.dtype, torch.Tensor]]):
        """(pool entry or None, blocks, views) of a new image starting as a copy of `init` (None: any contents):
        pooled memory while the pool has some, new memory beyond it."""
        entry = self._pool.take(init) if self._pool is not None else None
        host, views = blocks(self._template, init) if entry is None else self._pool.entries[entry]
        return entry, host, views

    def _finish(self, name: str, host, views, entry: Optional[int], plan: Optional[ImagePlan],
                marks: tuple[tuple[int, ...], tuple[int, ...]]) -> SlotImage:
        """marks: (SlotImage.dora, SlotImage.saved)."""
        image = SlotImage(name, host, views, self._pinned(host), plan, *marks)
        if entry is not None:
            weakref.finalize(image, self._pool.give, entry)
        return image

    @staticmethod
    def _plan(adapter, host, source: torch.Tensor, copies, quants, marks) -> Optional[ImagePlan]:
        """copies: (dsts, srcs); quants: (fp8 dsts, scale dsts, srcs). None when a src is not a view of the file's
        bytes (`source`), or a dst not one of the image's blocks."""
        dsts, srcs = copies
        qdsts, qscales, qsrcs = quants
        specs = []
        for ts, bases in ((srcs, [source]), (dsts, host.values()), (qsrcs, [source]), (qdsts, host.values()),
                          (qscales, host.values())):
            specs.append([next((sp for b in bases if (sp := _spec(t, b)) is not None), None) for t in ts])
            if None in specs[-1]:
                return None
        modules = {m: (tuple(x.a.shape), tuple(x.b.shape)) for m, x in adapter.modules.items()}
        src, dst, qsrc, qdst, qscale = specs
        # Quantization scales values into range: only a NaN/Inf fails it (the file's own dtype's bound).
        screen, limits = _screen_runs(src + qsrc, range_limits([sp[1] for sp in dst] + [sp[1] for sp in qsrc]).tolist())
        return ImagePlan(modules, {dtype: b.clone() for dtype, b in host.items()}, src, dst, qsrc, qdst, qscale,
                         screen, limits, _gaps(dst + qdst + qscale, host), *marks)

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
        for i in image.dora:  # the same layers on every rank: the refresh's collectives match
            dora.refresh(self.layers[i], slot)
        for i, layer in enumerate(self.layers):
            if getattr(layer, "saved_table", None) is not None:
                (layer.saved_slots.add if i in image.saved else layer.saved_slots.discard)(slot)
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
