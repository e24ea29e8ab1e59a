"""LoRA wrappers over the base parallel layers: one class per layer *family*, parameterised by the layer's
LinearSpec (how it is sharded) and the sharding mode; all slicing lives in tp_lora.sharding.

For a token of adapter a: y = x W^T + s_a (x A_a^T) B_a^T. Where the LoRA math sits relative to the base layer's
communication (see ARCHITECTURE.md):
  column, default        A whole, B split on out           shrink -> expand                    no collective
  column, fully sharded  A split on rank, B split on out   shrink -> all_gather(u) -> expand   1 all-gather per layer
  row, default           A split on in, B whole            shrink -> expand into partial sum   none (base all-reduce)
  row, fully sharded     A split on in, B split on out     shrink -> all_reduce(u) -> expand into own columns
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable, Optional

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_lora.ops.batch import LoRABatch
from tp_lora.lora.peft_format import SAVED
from tp_lora.lora.saved import SavedCopies
from tp_lora.ops.fp8 import FP8_DTYPE, quantize_fp8_per_channel
from tp_lora.ops.fused import Rows8
from tp_lora.ops.split_sums import SplitSums
from tp_lora.sharding import row_lora_out_offset, shard_lora_a, shard_lora_b, take


# Rows per weight matrix up to which a base GEMM is bound by reading its weights (below the GPU's FLOPs-per-byte
# ridge), so a LoRA shrink beside it costs little (LoRARuntime.beside; measured in BENCHMARKS.md).
SIDE_STREAM_MAX_ROWS = 256
# Rows up to which a step's LoRA is expanded beside the base GEMM into a delta its reader adds (LoRALinear.partial's
# sums): decode sizes, where the expand is a latency on the GEMM's chain; past them it adds into the base's output.
DELTA_MAX_ROWS = 64


@dataclass
class LoRARuntime:
    """State every LoRA layer of a model shares: sizes, backend, and the current step's batch metadata
    (set once per step by the model, read by every layer)."""
    max_loras: int
    max_rank: int
    fully_sharded: bool
    ops: ModuleType
    fp8: bool = False  # store B as float8_e4m3 with per-output-channel scales (lora.dtype=fp8)
    batch: LoRABatch | None = None
    # module path -> (layer, slice index): where a PEFT target module lands in this model
    targets: dict = field(default_factory=dict)
    # Bumped whenever a layer's step gains work (its DoRA / lora_bias epilogue): CUDA graphs captured before lack it.
    layout: int = 0
    _side: torch.cuda.Stream | None = field(default=None, init=False, repr=False)

    def active(self) -> bool:
        return self.batch is not None and self.batch.any_lora

    def beside(self, shrink: Callable[[], torch.Tensor], base: Callable[[], torch.Tensor],
               device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(shrink(), base()): on CUDA, where the base GEMM multiplies at most SIDE_STREAM_MAX_ROWS rows by each of
        its weight matrices, the LoRA shrink (at decode sizes with its expand) runs on a side stream beside it (both
        then wait on memory and leave SMs idle; with more rows the GEMM needs every SM and the two would contend).
        Every side-stream use waits on the main stream first, so the shrink's output memory is safe to reuse once
        freed."""
        if device.type != "cuda" or rows > SIDE_STREAM_MAX_ROWS:
            return shrink(), base()
        from tp_lora.ops.triton.pdl import forget  # noqa: PLC0415 - CUDA only (the Triton kernels' launch notes)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        main = torch.cuda.current_stream(device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            forget(device)  # the side's first launch starts in full: it waits on the main stream's work
            u = shrink()
        z = base()
        main.wait_stream(self._side)
        forget(device)  # a launch after the join starts in full (an early, PDL one would not wait for the side's work)
        return u, z


# The key of a PEFT module that covers every packed slice of a layer (Phi-3's qkv_proj / gate_up_proj): one A over the
# input, one B over the concatenated outputs.
FUSED = "fused"

# copy(dst, src) puts src into dst; copy(dst, src, scales) quantizes src per channel into dst (fp8) and scales.
Copy = Callable[..., None]


def copy_into(dst: torch.Tensor, src: torch.Tensor, scales: Optional[torch.Tensor] = None) -> None:
    if scales is None:
        dst.copy_(src)
        return
    q, s = quantize_fp8_per_channel(src)
    dst.copy_(q)
    scales.copy_(s)


class SlotBuffers:
    """The per-slot state of a LoRA layer as a flat list of views (slot_views), so an adapter's slot contents can
    be assembled anywhere (a host image, tp_lora.lora.slots) and copied into a slot in one go. `write` and `clear`
    act on such a list, wherever it lives."""

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        raise NotImplementedError

    unit_views = 0  # trailing views of slot_views whose empty value is 1 (fp8 channel scales of B, DoRA scales)

    def clear(self, views: list[torch.Tensor]) -> None:
        """An empty slot: zero weights and scales, the unit views 1 (fp8: zeros stay exact zeros; DoRA: no scale)."""
        n = len(views) - self.unit_views
        for v in views[:n]:
            v.zero_()
        for v in views[n:]:
            v.fill_(1.0)

    def write(self, views: list[torch.Tensor], key, a: torch.Tensor, b: torch.Tensor, scale: float,
              copy: Copy = copy_into) -> None:
        """Put one target module's LoRA (whole: a [r, in], b [out, r]) into the views, tensors through copy (see
        Copy): an image builder gathers them into one batched copy and one batched quantization."""
        raise NotImplementedError

    def write_extras(self, views: list[torch.Tensor], key, scale: float, magnitude: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], copy: Copy = copy_into) -> None:
        """DoRA's magnitude / lora_B's bias of one target module (whole, [out]); layers without them refuse."""
        raise ValueError(f"{type(self).__name__} takes no DoRA magnitude or lora_B bias (linear layers only)")


def pad_rank(t: torch.Tensor, dim: int, size: int, device: torch.device) -> torch.Tensor:
    """t on `device` (where the slot views being written live: a host image, or the slots themselves), its rank dim
    zero-padded to max_rank (a smaller adapter then contributes exact zeros in the padding)."""
    if t.shape[dim] > size:
        raise ValueError(f"LoRA rank {t.shape[dim]} exceeds lora.max_rank={size}")
    if t.device != device:
        t = t.to(device, non_blocking=True)
    if t.shape[dim] == size:
        return t
    return torch.nn.functional.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, size - t.shape[dim]])


def _first(view: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    """The first r entries of `view`'s rank dim (a LoRA of rank r), the others zeroed. A smaller rank written this
    way needs no padded copy, so the slot image's copies stay plain views of the adapter's tensors (what a read plan
    replays: tp_lora.lora.slots.ImagePlan)."""
    if r > view.shape[dim]:
        raise ValueError(f"LoRA rank {r} exceeds lora.max_rank={view.shape[dim]}")
    if r < view.shape[dim]:
        view.narrow(dim, r, view.shape[dim] - r).zero_()
    return view.narrow(dim, 0, r)


class LoRALinear(SlotBuffers, SavedCopies, nn.Module):
    """Multi-LoRA over a ParallelLinear (column / merged / qkv / row / replicated) or the LM head.

    Buffers per packed slice s: lora_a[s] [L, r_local, in_local], lora_b[s] [L, out_local_s, r], scales [S, L];
    per layer, over the columns of its partial output P (column: the local rows of every slice; row: all `out`):
    dora [S, L] (1 where the slot's slice is DoRA), dora_g [L, P] float32 (DoRA's g, 1 elsewhere; holds m from the
    slot copy until tp_lora.lora.dora.refresh turns it into g), lora_bias [L, P] float32 (scale * lora_B's bias, on
    the columns this rank adds: a row layer's default mode adds it on rank 0 only). With DoRA or lora_bias in a slot
    the partial output becomes g * (z - base bias) + base bias + lora_bias for its tokens (ops.lora_epilogue): g
    scales each rank's partial sum of a row layer, the same as scaling the sum.
    """

    def __init__(self, base: nn.Module, rt: LoRARuntime, saved: bool = False):
        super().__init__()
        self.base, self.rt = base, rt
        spec, tp = base.spec, base.tp
        self.init_saved(base, rt.max_loras, saved)  # the LM head's modules_to_save copies (tp_lora.lora.saved)
        self.spec, self.tp = spec, tp
        # With one rank "fully sharded" and default coincide; keep the collective-free path.
        self.fully_sharded = rt.fully_sharded and tp.size > 1 and spec.kind != "replicated"
        if self.fully_sharded and rt.max_rank % tp.size:
            raise ValueError(f"lora.fully_sharded needs lora.max_rank ({rt.max_rank}) divisible by tp_size "
                             f"({tp.size})")
        r_a = rt.max_rank // tp.size if (self.fully_sharded and spec.kind == "column") else rt.max_rank
        in_local = base.weight.shape[1]
        if spec.kind == "column":
            b_rows = spec.local_out_widths(tp.rank, tp.size)
        elif spec.kind == "row" and self.fully_sharded:
            b_rows = (spec.out_features // tp.size,)
        else:
            b_rows = spec.out_widths
        dtype, device = getattr(base, "dtype", base.weight.dtype), base.weight.device  # an fp8 base: its activations'
        self.lora_a = nn.ParameterList(
            [nn.Parameter(torch.zeros(rt.max_loras, r_a, in_local, dtype=dtype, device=device), requires_grad=False)
             for _ in spec.slices])
        b_dtype = FP8_DTYPE if rt.fp8 else dtype
        self.lora_b = nn.ParameterList(
            [nn.Parameter(torch.zeros(rt.max_loras, rows, rt.max_rank, dtype=b_dtype, device=device),
                          requires_grad=False) for rows in b_rows])
        # Per output channel of B; 1 for empty slots so their zeros stay exact zeros.
        self.b_scales = [torch.ones(rt.max_loras, rows, dtype=torch.float32, device=device) for rows in b_rows] \
            if rt.fp8 else None
        self.unit_views = (len(b_rows) if rt.fp8 else 0) + 1  # fp8 channel scales, then dora_g
        self.register_buffer("scales", torch.zeros(len(spec.slices), rt.max_loras, dtype=torch.float32,
                                                   device=device))
        cols = sum(b_rows) if spec.kind == "column" else spec.out_features
        self.register_buffer("dora", torch.zeros(len(spec.slices), rt.max_loras, dtype=torch.float32, device=device))
        self.register_buffer("dora_g", torch.ones(rt.max_loras, cols, dtype=torch.float32, device=device))
        self.register_buffer("lora_bias", torch.zeros(rt.max_loras, cols, dtype=torch.float32, device=device))
        self.epilogue = False  # set once a slot image with DoRA or lora_bias in this layer is made
        self.out_offset = row_lora_out_offset(spec, tp.rank, tp.size) if (
            spec.kind == "row" and self.fully_sharded) else 0

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """[A_s for s] + [B_s for s] + [scales, dora, lora_bias] (+ saved_views) (+ [fp8 channel scales of B_s for s])
        + [dora_g]."""
        return ([a.data[slot] for a in self.lora_a] + [b.data[slot] for b in self.lora_b]
                + [self.scales[:, slot], self.dora[:, slot], self.lora_bias[slot]] + self.saved_views(slot)
                + [bs[slot] for bs in self.b_scales or ()] + [self.dora_g[slot]])

    @property
    def saved_at(self) -> int:
        """Where the saved views start in slot_views."""
        return 2 * len(self.lora_a) + 3

    def write(self, views: list[torch.Tensor], slice_idx: int, a: torch.Tensor, b: torch.Tensor, scale: float,
              copy: Copy = copy_into) -> None:
        """One slice of an adapter, given whole: a [r, in], b [out_s, r]; this rank keeps its shard. slice_idx FUSED:
        b [out, r] spans every slice: each slice gets A and its rows of B (the same delta, cut at slice bounds)."""
        if slice_idx == FUSED:
            for s, b_s in enumerate(b.split(self.spec.out_widths)):
                self.write(views, s, a, b_s, scale, copy)
            return
        n = len(self.lora_a)
        dev = views[0].device
        r, size = a.shape[0], (self.tp.rank, self.tp.size)
        a_dst, b_dst = views[slice_idx], views[n + slice_idx]
        if self.fully_sharded and self.spec.kind == "column":  # the ranks split A's rank dim: pad, then split
            a = pad_rank(a, 0, self.rt.max_rank, dev)
        else:
            a_dst = _first(a_dst, 0, r)
        b_dst = _first(b_dst, 1, r)
        copy(a_dst, shard_lora_a(self.spec, a, *size, self.fully_sharded))
        b = shard_lora_b(self.spec, slice_idx, b, *size, self.fully_sharded)
        copy(b_dst, b, views[self.saved_at + len(self.saved_views(0)) + slice_idx] if self.b_scales is not None
             else None)
        views[2 * n][slice_idx] = scale

    def columns(self, slice_idx: int) -> tuple[int, int]:
        """[start, stop) of slice `slice_idx` among the columns of this rank's partial output."""
        if self.spec.kind != "column":
            return 0, self.spec.out_features
        widths = [b.shape[1] for b in self.lora_b]
        return sum(widths[:slice_idx]), sum(widths[:slice_idx + 1])

    def write_extras(self, views: list[torch.Tensor], slice_idx, scale: float, magnitude: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], copy: Copy = copy_into) -> None:
        """DoRA's m / lora_B's bias of one slice, given whole ([out_s]; FUSED: [out] over every slice)."""
        if slice_idx == FUSED:
            for s, (m_s, b_s) in enumerate(zip(*(v.split(self.spec.out_widths) if v is not None else
                                                 [None] * len(self.spec.out_widths) for v in (magnitude, bias)))):
                self.write_extras(views, s, scale, m_s, b_s, copy)
            return
        n, size = len(self.lora_a), (self.tp.rank, self.tp.size)
        lo, hi = self.columns(slice_idx)
        if not self.epilogue:
            self.epilogue = True
            self.rt.layout += 1
        if magnitude is not None:
            copy(views[-1][lo:hi], self._own_rows(slice_idx, magnitude))
            views[2 * n + 1][slice_idx] = 1.0
        if bias is not None:
            dst = views[2 * n + 2]
            if self.spec.kind == "row" and self.fully_sharded:  # this rank adds its own columns of the sum
                lo, hi = self.out_offset, self.out_offset + self.lora_b[0].shape[1]
                copy(dst[lo:hi], shard_lora_b(self.spec, slice_idx, bias[:, None], *size, True)[:, 0] * scale)
            elif self.spec.kind != "row" or self.tp.rank == 0:  # a row layer's default mode: rank 0 adds it
                copy(dst[lo:hi], self._own_rows(slice_idx, bias) * scale)

    def _own_rows(self, slice_idx: int, v: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-output vector of a slice (column: its shard; row: whole)."""
        if self.spec.kind != "column":
            return v
        return shard_lora_b(self.spec, slice_idx, v[:, None], self.tp.rank, self.tp.size, False)[:, 0]

    def forward(self, x: torch.Tensor, x8: Rows8 | None = None) -> torch.Tensor:
        return self.base.finish(self.partial(x, x8))

    def _expand(self, u: torch.Tensor, z: torch.Tensor, add: bool = True) -> None:
        """z (+)= u's expand by each token's B (add: into the base's output; else a float32 delta of its shape)."""
        self.rt.ops.expand(u, self.lora_b, self.rt.batch, z, offset=self.out_offset, add=add, b_scales=self.b_scales)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA of x [T, in] alone: [T, out] float32, 0 for tokens without an adapter."""
        u = self.rt.ops.shrink(x, self.lora_a, self.scales, self.rt.batch)
        delta = torch.empty(x.shape[0], self.base.weight.shape[0], dtype=torch.float32, device=x.device)
        self._expand(u, delta, add=False)
        return delta

    def takes_rows8(self, x: torch.Tensor, group: int | None = None) -> bool:
        return self.base.takes_rows8(x, group)

    def partial(self, x: torch.Tensor, x8: Rows8 | None = None, sums: bool = False) -> torch.Tensor | SplitSums:
        """The base layer's output before its collective (as ParallelLinear.partial), plus this layer's LoRA (on x;
        the base may read x8, x quantized per token). sums: the base's output may be its SplitSums; at decode sizes
        the LoRA is then expanded beside the base GEMM into their delta (added by their reader: decode attention, the
        next norm, or under tp that norm's fused all-reduce before the exchange), where nothing else acts on the
        output and no collective sits between shrink and expand (fully sharded LoRA keeps the add into the output)."""
        if sums and not self.rt.active():
            return self.base.partial(x, x8, sums=True)
        # x8 only where given: a wrapped LM head's partial takes x alone
        base = (lambda: self.base.partial(x)) if x8 is None else (lambda: self.base.partial(x, x8))
        if not self.rt.active():
            return base()
        ops, batch = self.rt.ops, self.rt.batch
        saved = self.saved_active(batch)
        if sums and not self.fully_sharded and x.shape[0] <= DELTA_MAX_ROWS and not (saved or self.epilogue):
            delta, y = self.rt.beside(lambda: self._delta(x), lambda: self.base.partial(x, x8, sums=True), x.device,
                                      x.shape[0])
            # a GEMM that did not split K: its output as the one share
            return replace(y, delta=delta) if isinstance(y, SplitSums) else SplitSums(y[None], None, None, y.dtype,
                                                                                      delta)
        u, z = self.rt.beside(lambda: ops.shrink(x, self.lora_a, self.scales, batch),  # [S, T, r_local] float32
                              base, x.device, x.shape[0])
        if self.fully_sharded:
            # One collective for every slice of a packed layer: the slices travel together in u.
            u = comm.all_gather(u, self.tp, dim=-1) if self.spec.kind == "column" else comm.all_reduce(u, self.tp)
        self._expand(u, z)
        if saved:
            ops.saved_logits(x, self.saved_table, saved, batch, z)
        if self.epilogue:
            # z holds a column layer's bias; a row layer adds its own after the all-reduce.
            base_bias = getattr(self.base, "bias", None) if self.spec.kind == "column" else None
            ops.lora_epilogue(z, self.dora_g, self.lora_bias, batch, base_bias=base_bias)
        return z


class LoRAEmbedding(SlotBuffers, SavedCopies, nn.Module):
    """Multi-LoRA over the vocab-parallel embedding. A^T [L, V/p, r] is split by vocab like the base table and
    B [L, H, r] kept whole, so each rank adds its partial delta before the base all-reduce: no extra collective in
    either sharding mode."""

    def __init__(self, base: VocabParallelEmbedding, rt: LoRARuntime, saved: bool = False):
        super().__init__()
        self.base, self.rt = base, rt
        self.init_saved(base, rt.max_loras, saved)  # modules_to_save copies (tp_lora.lora.saved)
        self.saved_at = 3
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_a_t = nn.Parameter(torch.zeros(rt.max_loras, base.weight.shape[0], rt.max_rank, dtype=dtype,
                                                 device=device), requires_grad=False)
        self.lora_b = nn.Parameter(torch.zeros(rt.max_loras, base.hidden, rt.max_rank, dtype=dtype,
                                               device=device), requires_grad=False)
        self.register_buffer("scales", torch.zeros(1, rt.max_loras, dtype=torch.float32, device=device))

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        return [self.lora_a_t.data[slot], self.lora_b.data[slot], self.scales[:, slot]] + self.saved_views(slot)

    def write(self, views: list[torch.Tensor], slice_idx: int, a: torch.Tensor, b: torch.Tensor, scale: float,
              copy: Copy = copy_into) -> None:
        """a: PEFT's lora_embedding_A [r, vocab]; b: lora_embedding_B [hidden, r]."""
        r = a.shape[0]
        copy(_first(views[0], 1, r), take(a.t(), (self.base.vocab_start, self.base.vocab_end), 0))
        copy(_first(views[1], 1, r), b)
        views[2][0] = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        z = self.base.partial(ids)
        if self.rt.active():
            ops, batch = self.rt.ops, self.rt.batch
            saved = self.saved_active(batch)
            if saved:
                ops.saved_embedding(ids, self.saved_table, saved, batch, z, self.base.vocab_start)
            u = ops.embedding_shrink(ids, self.lora_a_t, self.scales, batch, self.base.vocab_start)
            ops.expand(u, [self.lora_b], batch, z)
        return self.base.finish(z)


def wrap(base: nn.Module, rt: LoRARuntime, module_paths: list[str], fused: bool = False,
         saved: bool = False) -> nn.Module:
    """Wrap a base layer and register the PEFT module paths its slices answer to (q/k/v -> slices 0/1/2); fused: one
    path answering for every slice (qkv_proj); saved: room for modules_to_save copies (embedding, LM head)."""
    layer = LoRAEmbedding(base, rt, saved) if isinstance(base, VocabParallelEmbedding) else LoRALinear(base, rt, saved)
    if fused:
        (path,) = module_paths
        rt.targets[path] = (layer, FUSED)
        return layer
    for slice_idx, path in enumerate(module_paths):
        rt.targets[path] = (layer, slice_idx)
    return layer


def maybe_wrap(base: nn.Module, rt: LoRARuntime | None, paths: list[str], targets: set[str] | None,
               fused: bool = False) -> nn.Module:
    """Wrap when LoRA is on and some adapter targets one of the layer's modules (targets None = wrap all); fused:
    one module path answering for every slice (Phi-3's qkv_proj)."""
    if rt is None:
        return base
    if targets is not None and not any(p.rsplit(".", 1)[-1] in targets for p in paths):
        return base
    table = isinstance(base, (VocabParallelEmbedding, ParallelLMHead))
    saved = table and targets is not None and any(SAVED + p.rsplit(".", 1)[-1] in targets for p in paths)
    return wrap(base, rt, paths, fused, saved)


def module_shapes(rt: LoRARuntime) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) of the full (unsharded) module, for adapter validation."""
    shapes = {}
    for path, (layer, s) in rt.targets.items():
        if isinstance(layer, LoRAEmbedding):
            shapes[path] = (layer.base.vocab, layer.base.hidden)
        elif hasattr(layer, "module_shape"):  # layers whose targets are not LinearSpec slices (MoE experts)
            shapes[path] = layer.module_shape(s)
        else:
            out = layer.spec.out_features if s == FUSED else layer.spec.slices[s].width
            shapes[path] = (layer.spec.in_features, out)
    return shapes

