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
until the copy is done) and those of at most PINNED_IMAGES padded images (within PINNED_BYTES) exist at a time,
beyond which images load from pageable memory.

Images replayed from a read plan are packed: only the values the adapter writes (and the few of the layout's
scales an empty slot lacks), back to back. With a rank below lora.max_rank most of a padded image is rank padding,
which a packed image neither copies on the host nor sends to the device; its load empties the slot on the device
and scatters the pieces into place.
"""
from __future__ import annotations

import bisect
import math
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tp_lora.hostcopy import blocks
from tp_lora.lora.adapter import AdapterError, count_nonfinite, finite_flags, range_limits
from tp_lora.lora.layers import LoRARuntime
from tp_lora.lora.pacing import pause
from tp_lora.ops.fp8 import quantize_fp8_into


@dataclass
class SlotImage:
    name: str
    # One per dtype, in host memory: the slot's views (SlotTable.views) back to back, or with `packed` the plan's
    # pieces (ImagePlan.pieces).
    blocks: dict[torch.dtype, torch.Tensor]
    pinned: Optional[dict[torch.dtype, torch.Tensor]] = None  # a page-locked copy of the blocks, until loaded
    plan: Optional["ImagePlan"] = None  # how to build it again from another file of the same layout
    packed: bool = False


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
    """How an adapter file becomes a packed slot image, for every file of the same layout (the same safetensors
    header and adapter_config.json, so the same modules, shapes, ranks and scales): the file's tensors, as views of
    its bytes, copied (cast where the file's dtype is not the slots') or quantized (fp8 slots) into the packed
    blocks after the `head` (the values of the layout's first image that an empty slot lacks: its scales). Built from
    the first image of a layout when each of its tensors went in as a plain view of the file (no padding); replaying
    it skips the per-module work of a read (SlotTable.replay)."""
    modules: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # module -> (A shape, B shape), as registered
    src: list[ViewSpec]  # views of the file's bytes (uint8), copied
    dst: list[ViewSpec]  # ... into these views of the packed blocks (by the block's dtype)
    qsrc: list[ViewSpec]  # views of the file's bytes, quantized to fp8 per channel (lora.dtype=fp8)
    qdst: list[ViewSpec]  # ... into these fp8 views of the packed blocks
    qscale: list[ViewSpec]  # ... with their channel scales here
    # A replay's NaN/Inf and range screen: runs of the file's bytes covering src + qsrc (a file's tensors usually
    # lie back to back: one run, one norm), each with the range_limits of what its tensors become.
    screen: list[ViewSpec]
    limits: torch.Tensor
    head: dict[torch.dtype, torch.Tensor]  # each packed block starts with these values (fp8 as bytes)
    sizes: dict[torch.dtype, int]  # the packed blocks' sizes
    # Per packed piece, block after block (in `sizes`' order), where it goes in a slot: (index among
    # SlotTable.views(slot), offset in that view's elements, size, stride as if the view were contiguous).
    pieces: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]
    numels: dict[torch.dtype, list[int]]  # the pieces' sizes, per block
    _views: dict = field(default_factory=dict, repr=False)  # (which, buffer address) -> views made before
    _slots: dict = field(default_factory=dict, repr=False)  # slot -> the pieces' places in it

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

    def places(self, slot: int, views: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """The pieces' places in `slot`, whose views (SlotTable.views(slot)) `views` gives; made once per slot."""
        out = self._slots.get(slot)
        if out is None:
            slot_views = views()
            out = self._slots[slot] = [_place(slot_views[k], *where) for k, *where in self.pieces]
        return out


def _place(view: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> Optional[torch.Tensor]:
    """The elements of `view` (fp8 as bytes) that (offset, size, stride) name in its row-major order; None when its
    memory cannot express them (a strided view of more than one dim)."""
    view = _bits(view)
    if view.is_contiguous():
        return view.as_strided(size, stride, view.storage_offset() + offset)
    if view.dim() == 1 and len(size) == 1:  # a column of a [.., max_loras] tensor: the slot's scales
        return view[offset:offset + (size[0] - 1) * stride[0] + 1:stride[0]]
    return None


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


def _numel(sp: ViewSpec) -> int:
    return math.prod(sp[3])


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of this size."""
    return tuple(math.prod(size[i + 1:]) for i in range(len(size)))


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


# At most this many runs of a layout's first image differ from an empty slot outside the file's tensors (its scales:
# a run or two per layer); more make no plan.
MAX_MARKS = 4096


def _marks(specs: list[ViewSpec], image: dict[torch.dtype, torch.Tensor], empty: dict[torch.dtype, torch.Tensor]
           ) -> Optional[list[ViewSpec]]:
    """The runs of `image`'s blocks that differ from `empty`'s, bit for bit, where no view in `specs` (views of
    them) lies, as views; None beyond MAX_MARKS, or when a view's element is not its block's."""
    covered = {dtype: torch.zeros(b.numel(), dtype=torch.bool) for dtype, b in image.items()}
    for base, dtype, offset, size, stride in specs:
        if dtype.itemsize != base.itemsize:
            return None
        covered[base].as_strided(size, stride, offset).fill_(True)
    out = []
    for dtype, mask in covered.items():
        bits = _INT[dtype.itemsize]
        mask = (image[dtype].view(bits) != empty[dtype].view(bits)) & ~mask
        edges = torch.diff(mask.to(torch.int8), prepend=mask.new_zeros(1, dtype=torch.int8),
                           append=mask.new_zeros(1, dtype=torch.int8))
        starts, stops = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        view = torch.uint8 if dtype.itemsize == 1 and dtype.is_floating_point else dtype  # as _bits
        out += [(dtype, view, a, (b - a,), (1,)) for a, b in zip(starts, stops)]
        if len(out) > MAX_MARKS:
            return None
    return out


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Page-locked image copies alive at once: about as many as the cache reads ahead (lora.cache.PREFETCH_DEPTH), and
# within PINNED_BYTES (torch's pinned cache rounds each block up to a power of two).
PINNED_IMAGES, PINNED_BYTES = 32, 1 << 30


def _pinned_size(blocks: dict[torch.dtype, torch.Tensor]) -> int:
    """Bytes of page-locked copies of `blocks` in torch's pinned cache, which rounds each up to a power of two."""
    return sum(1 << (b.nbytes - 1).bit_length() for b in blocks.values())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One-byte floats (fp8) as bytes: the batched copy is not defined for them, a byte copy is the same."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class ImagePool:
    """Host memory for `capacity` slot images shaped like `like`, allocated and faulted in at start, with each
    entry's views made once; an entry is handed out as a copy of the image it starts from. A fresh image's pages
    otherwise cost the reader most of a read (on a 2-core VM: ~50 ms to fault in 20 MB while the host tier fills),
    and the host tier only grows to its bound once anyway. An entry returns to the pool when its image is dropped."""

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
        # The plan of the packed image each slot holds: a packed image of the same plan overwrites everything in it
        # that is not empty, so it needs no emptying first. Anything that writes a slot but load says None.
        self.packed_by: list[Optional[ImagePlan]] = [None] * rt.max_loras
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
        # Per dtype, where each of its views starts in an image's block, and its index among all views.
        self._starts: dict[torch.dtype, list[int]] = {}
        self._index: dict[torch.dtype, list[int]] = {}
        for k, v in enumerate(self._template):
            sizes = self._sizes.setdefault(v.dtype, [])
            self._starts.setdefault(v.dtype, []).append(sum(sizes))
            self._index.setdefault(v.dtype, []).append(k)
            sizes.append(v.numel())
        # Every image starts as a copy of the empty one: each layer says what empty means (fp8 channel scales are 1).
        self._empty, views = blocks(self._template)
        for layer in self.layers:
            layer.clear(views[slice(*self._spans[id(layer)])])
        self._empty_here = {dtype: b.to(self.device) for dtype, b in self._empty.items()}  # empties a slot (packed loads)
        self._dst = [self._targets(slot) for slot in range(rt.max_loras)]  # built at start: loads only use them
        self._pool = ImagePool(self._template, self._empty, host_images) if host_images else None
        # Page-locked bytes left for images' copies (None: not on CUDA), counted as torch's pinned cache rounds them:
        # packed images are smaller, so more of them fit.
        self._pin_left: Optional[int] = None
        self._pin_lock = threading.Lock()
        if self.device.type == "cuda":
            n = max(1, min(PINNED_IMAGES, PINNED_BYTES // _pinned_size(self._empty)))
            self._pin_left = n * _pinned_size(self._empty)
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
        pause()
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

        try:
            for path, m in adapter.modules.items():
                layer, key = self.rt.targets[path]
                layer.write(views[slice(*self._spans[id(layer)])], key, m.a, m.b, m.scale, copy=gather)
            _check_casts(adapter.name, owners, dsts, srcs)
            pause()
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
        plan = None
        if source is not None:
            plan = self._plan(adapter, host, source, (dsts, srcs), (qdsts, qscales, qsrcs))
        return self._finish(adapter.name, host, entry, plan)

    def replay(self, name: str, plan: ImagePlan, source: torch.Tensor) -> Optional[SlotImage]:
        """The packed image of a file laid out as the one `plan` was made from, from its bytes (`source`); None when
        one of its tensors may hold a NaN/Inf or a value beyond the slots' range (the full read then settles it)."""
        src = {torch.uint8: source}
        if not all(finite_flags(plan.views("screen", src), plan.limits)):
            return None
        pause()
        entry = self._pool.take(None) if self._pool is not None else None
        if entry is None:
            host = {dtype: torch.empty(n, dtype=dtype) for dtype, n in plan.sizes.items()}
        else:
            host = {dtype: self._pool.entries[entry][0][dtype][:n] for dtype, n in plan.sizes.items()}
        try:
            for dtype, head in plan.head.items():
                _bits(host[dtype][:head.numel()]).copy_(head)
            torch._foreach_copy_(plan.views("dst", host), plan.views("src", src))
            qsrcs = plan.views("qsrc", src)
            if qsrcs:
                quantize_fp8_into(plan.views("qdst", host), plan.views("qscale", host), qsrcs)
        except BaseException:
            if entry is not None:
                self._pool.give(entry)
            raise
        return self._finish(name, host, entry, plan, packed=True)

    def _entry(self, init: dict[torch.dtype, torch.Tensor]):
        """(pool entry or None, blocks, views) of a new image starting as a copy of `init`: pooled memory while the
        pool has some, new memory beyond it."""
        entry = self._pool.take(init) if self._pool is not None else None
        host, views = blocks(self._template, init) if entry is None else self._pool.entries[entry]
        return entry, host, views

    def _finish(self, name: str, host, entry: Optional[int], plan: Optional[ImagePlan], packed: bool = False
                ) -> SlotImage:
        image = SlotImage(name, host, self._pinned(host), plan, packed)
        if entry is not None:
            weakref.finalize(image, self._pool.give, entry)
        return image

    def _plan(self, adapter, host, source: torch.Tensor, copies, quants) -> Optional[ImagePlan]:
        """copies: (dsts, srcs); quants: (fp8 dsts, scale dsts, srcs), the views of the padded image `host` they were
        copied into. None when a src is not a view of the file's bytes (`source`), a dst not one of the image's
        blocks or not in one slot view, or too much of the image differs from an empty slot (MAX_MARKS)."""
        dsts, srcs = copies
        qdsts, qscales, qsrcs = quants
        specs = []
        for ts, bases in ((srcs, [source]), (dsts, host.values()), (qsrcs, [source]), (qdsts, host.values()),
                          (qscales, host.values())):
            specs.append([next((sp for b in bases if (sp := _spec(t, b)) is not None), None) for t in ts])
            if None in specs[-1]:
                return None
        src, dst, qsrc, qdst, qscale = specs
        marks = _marks(dst + qdst + qscale, host, self._empty)
        if marks is None:
            return None
        # Each block packs its marks (the head) and then its data pieces, in the order of their lists.
        order = [("head", part) for sp in marks for part in self._split(sp)]
        order += [(name, sp) for name, data in (("dst", dst), ("qdst", qdst), ("qscale", qscale)) for sp in data]
        packed: dict[str, list[ViewSpec]] = {"head": [], "dst": [], "qdst": [], "qscale": []}
        sizes, numels, where, heads = {}, {}, [], {}
        for dtype, block in host.items():
            offset = 0
            for name, sp in order:
                if sp[0] != dtype:
                    continue
                k, local = self._locate(sp)
                n = _numel(sp)
                if n and (_extent(sp)[1] - sp[2] > self._template[k].numel() - local
                          or _place(self._template[k], local, sp[3], sp[4]) is None):
                    return None  # not within one slot view, or not a place a slot's memory can express
                if name == "head":
                    heads.setdefault(dtype, []).append(_bits(block[sp[2]:sp[2] + n]))
                where.append((k, local, sp[3], sp[4]))
                packed[name].append((dtype, sp[1], offset, sp[3], _row_major(sp[3])))
                numels.setdefault(dtype, []).append(n)
                offset += n
            if offset > block.numel():  # overlapping pieces: not a layout a plan can pack
                return None
            if offset:
                sizes[dtype] = offset
        head = {dtype: torch.cat(h) for dtype, h in heads.items()}
        modules = {m: (tuple(x.a.shape), tuple(x.b.shape)) for m, x in adapter.modules.items()}
        # Quantization scales values into range: only a NaN/Inf fails it (the file's own dtype's bound).
        screen, limits = _screen_runs(src + qsrc, range_limits([sp[1] for sp in dst] + [sp[1] for sp in qsrc]).tolist())
        return ImagePlan(modules, src, packed["dst"], qsrc, packed["qdst"], packed["qscale"], screen, limits, head,
                         sizes, where, numels)

    def _locate(self, sp: ViewSpec) -> tuple[int, int]:
        """(index among SlotTable.views, offset in that view) of the slot view a view of an image's block starts in."""
        starts = self._starts[sp[0]]
        j = bisect.bisect_right(starts, sp[2]) - 1
        return self._index[sp[0]][j], sp[2] - starts[j]

    def _split(self, sp: ViewSpec) -> list[ViewSpec]:
        """A 1-dim run of an image's block cut where its slot views meet."""
        dtype, view, first, (n,), _ = sp
        starts, sizes = self._starts[dtype], self._sizes[dtype]
        out = []
        while n > 0:
            j = bisect.bisect_right(starts, first) - 1
            take = min(n, starts[j] + sizes[j] - first)
            out.append((dtype, view, first, (take,), (1,)))
            first, n = first + take, n - take
        return out

    def _pinned(self, host: dict[torch.dtype, torch.Tensor]) -> Optional[dict[torch.dtype, torch.Tensor]]:
        need = _pinned_size(host)
        with self._pin_lock:
            if self._pin_left is None or need > self._pin_left:
                return None
            self._pin_left -= need
        pinned = {dtype: torch.empty_like(b, pin_memory=True).copy_(b) for dtype, b in host.items()}
        weakref.finalize(next(iter(pinned.values())), self._unpin, need)  # loaded, or dropped unloaded
        return pinned

    def _unpin(self, nbytes: int) -> None:
        with self._pin_lock:
            self._pin_left += nbytes

    def load(self, slot: int, image: SlotImage) -> None:
        """Copy an image into `slot` on the current stream."""
        source, image.pinned = image.pinned or image.blocks, None
        if not image.packed:
            self._write(slot, source)
        else:  # emptied, then the pieces scattered into place: rank padding never crosses to the device
            plan = image.plan
            # The host->device copy first: from pageable memory it holds the host until the stream reaches it, and
            # the stream's kernels (emptying the slot) wait for room beside the steps' kernels.
            pieces = [p for dtype, numels in plan.numels.items()
                      for p in _bits(source[dtype].to(self.device, non_blocking=True)).split(numels)]
            if self.packed_by[slot] is not plan:
                self._write(slot, self._empty_here)
            places = plan.places(slot, lambda: self.views(slot))
            torch._foreach_copy_(places, [p.view(v.shape) for p, v in zip(pieces, places)])
        self.names[slot] = image.name
        self.packed_by[slot] = image.plan if image.packed else None

    def _write(self, slot: int, source: dict[torch.dtype, torch.Tensor]) -> None:
        """Copy whole image blocks (host or device) into `slot`."""
        for dtype, block in source.items():
            pieces = _bits(block.to(self.device, non_blocking=True)).split(self._sizes[dtype])
            (dense, dense_at), (strided, strided_at) = self._dst[slot][dtype]
            if dense:
                torch._foreach_copy_(dense, [pieces[k] for k in dense_at])
            if strided:
                torch._foreach_copy_(strided, [pieces[k].view(v.shape) for k, v in zip(strided_at, strided)])

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
