"""Which part of a full tensor each rank holds: pure functions of (rank, size).

Base-weight loaders and LoRA slot setters both call these, so a weight and its adapter are always cut alike.
Every function returns index ranges; `take` applies them to a torch tensor or to a lazy safetensors slice, so a
rank reads only the bytes it keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

Range = tuple[int, int]


def even_range(n: int, rank: int, size: int, what: str = "dimension") -> Range:
    """[start, stop) of rank's equal part of n items."""
    if n % size:
        raise ValueError(f"{what} of size {n} is not divisible by {size} ranks")
    step = n // size
    return rank * step, (rank + 1) * step


def unit_range(units: int, rank: int, size: int, what: str = "heads") -> Range:
    """Units (e.g. KV heads) rank holds. With fewer units than ranks each unit is replicated on size/units
    consecutive ranks (a KV head shared by the query heads of those ranks)."""
    if units % size == 0:
        return even_range(units, rank, size, what)
    if size % units == 0:
        u = rank // (size // units)
        return u, u + 1
    raise ValueError(f"{units} {what} cannot be split over {size} ranks: one must divide the other")


@dataclass(frozen=True)
class OutSlice:
    """One packed slice of a layer's output dim: `units` groups of `unit_size` features (heads x head_dim for
    q/k/v, features x 1 otherwise). `replicable` slices (KV heads) may have fewer units than ranks."""
    units: int
    unit_size: int = 1
    replicable: bool = False

    @property
    def width(self) -> int:
        return self.units * self.unit_size

    def local_range(self, rank: int, size: int) -> Range:
        """Rows of this slice rank holds, relative to the slice's start."""
        if self.replicable:
            u0, u1 = unit_range(self.units, rank, size)
        else:
            u0, u1 = even_range(self.units, rank, size, "output features")
        return u0 * self.unit_size, u1 * self.unit_size


@dataclass(frozen=True)
class LinearSpec:
    """How one linear layer is split over the TP group.

    kind: 'column' (output dim split, per slice), 'row' (input dim split, partial sums reduced) or 'replicated'.
    slices: the packed output slices (q, k, v / gate, up / a single one).
    """
    kind: str
    in_features: int
    slices: tuple[OutSlice, ...]

    def __post_init__(self):
        if self.kind not in ("column", "row", "replicated"):
            raise ValueError(f"LinearSpec.kind={self.kind!r}: expected column, row or replicated")

    @property
    def out_features(self) -> int:
        return sum(s.width for s in self.slices)

    @property
    def out_widths(self) -> tuple[int, ...]:
        return tuple(s.width for s in self.slices)

    def slice_ranges(self, rank: int, size: int) -> list[Range]:
        """Per slice, the rows rank holds relative to that slice (all rows unless column-parallel)."""
        if self.kind != "column":
            return [(0, s.width) for s in self.slices]
        return [s.local_range(rank, size) for s in self.slices]

    def local_out_widths(self, rank: int, size: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.slice_ranges(rank, size))

    def fused_rows(self, slice_idx: int, rank: int, size: int) -> Range:
        """Rows rank holds of slice `slice_idx` inside a fused checkpoint tensor, the slices concatenated on the
        output dim (Phi-3's qkv_proj [q+k+v, in], gate_up_proj [2I, in])."""
        start = sum(self.out_widths[:slice_idx])
        a, b = self.slice_ranges(rank, size)[slice_idx]
        return start + a, start + b

    def in_range(self, rank: int, size: int) -> Range:
        if self.kind != "row":
            return 0, self.in_features
        return even_range(self.in_features, rank, size, "input features")


def take(t: Any, rng: Range, dim: int) -> torch.Tensor:
    """t[..., a:b, ...] on `dim`; t may be a tensor or a safetensors slice (read lazily)."""
    a, b = rng
    index = (slice(None),) * dim + (slice(a, b),)
    return t[index]


def shard_weight(spec: LinearSpec, slice_idx: int, full: Any, rank: int, size: int) -> torch.Tensor:
    """This rank's part of one slice's full weight [out_s, in] (or bias [out_s])."""
    part = take(full, spec.slice_ranges(rank, size)[slice_idx], 0)
    if spec.kind == "row" and len(getattr(full, "shape", None) or full.get_shape()) == 2:
        part = take(part, spec.in_range(rank, size), 1)
    return part


def shard_lora_a(spec: LinearSpec, a: torch.Tensor, rank: int, size: int, fully_sharded: bool) -> torch.Tensor:
    """LoRA A [r, in] (r already padded to max_rank). Row layers split A on the input dim like their weight;
    fully sharded column layers split it on the rank dim (S-LoRA); otherwise it is kept whole."""
    if spec.kind == "row":
        return take(a, spec.in_range(rank, size), 1)
    if spec.kind == "column" and fully_sharded:
        return take(a, even_range(a.shape[0], rank, size, "lora.max_rank"), 0)
    return a


def shard_lora_b(spec: LinearSpec, slice_idx: int, b: torch.Tensor, rank: int, size: int,
                 fully_sharded: bool) -> torch.Tensor:
    """LoRA B [out_s, r]. Column layers split it like their weight's rows; fully sharded row layers split it on the
    output dim (this rank then writes only its slice of the partial sum); otherwise it is kept whole."""
    if spec.kind == "column":
        return take(b, spec.slice_ranges(rank, size)[slice_idx], 0)
    if spec.kind == "row" and fully_sharded:
        return take(b, even_range(b.shape[0], rank, size, "output features"), 0)
    return b


def row_lora_out_offset(spec: LinearSpec, rank: int, size: int) -> int:
    """Column where a fully sharded row layer's expand starts in the [T, O] partial sum."""
    return even_range(spec.out_features, rank, size, "output features")[0]


def vocab_range(vocab: int, rank: int, size: int) -> Range:
    return even_range(vocab, rank, size, "vocab_size")


def expert_range(num_experts: int, rank: int, size: int) -> Range:
    return even_range(num_experts, rank, size, "num_experts")


def take_nd(t: Any, ranges: Sequence[Range | None]) -> torch.Tensor:
    """t[a0:b0, a1:b1, ...] (None = the whole dim) in one index, so a lazy safetensors slice reads only that block
    (e.g. this rank's experts x intermediate rows of a fused [E, 2I, H] expert tensor)."""
    return t[tuple(slice(None) if r is None else slice(*r) for r in ranges)]


def token_chunk(num_tokens: int, rank: int, size: int) -> Range:
    """[start, stop) of rank's contiguous share of num_tokens replicated tokens: ceil(num_tokens / size) each, the
    last shares short or empty, so every rank pads to the same ceil(num_tokens / size) rows."""
    step = -(-num_tokens // size)
    return min(rank * step, num_tokens), min((rank + 1) * step, num_tokens)


def block_range(rng: Range, block: int, total: int, what: str) -> Range:
    """The blocks of `block` items holding items [a, b) of `total`; a range that would split a block (its start not
    on a block boundary, its end neither on one nor at the end) is refused, naming `what` and the sizes."""
    a, b = rng
    if a % block or (b % block and b != total):
        raise ValueError(f"{what}: this rank's part [{a}, {b}) of {total} would split a scale block of {block}; "
                         f"choose a tp_size / ep_size whose shards are multiples of the block")
    return a // block, -(-b // block)


def scale_part(scale: torch.Tensor, rows: Range, rows_total: int, cols: Range, cols_total: int,
               block: tuple[int, int] | None, what: str) -> torch.Tensor:
    """The scales of weight rows [rows) x columns [cols) of a [rows_total, cols_total] fp8 tensor, in a quantized
    layer's form: per channel [n] (the checkpoint's [rows_total], [rows_total, 1], or one per tensor repeated), or per
    block [n, blocks of cols] (checkpoint [ceil(rows_total / bn), ceil(cols_total / bk)]; each block's scale
    repeated on its rows). A missing dimension or a wrong shape is refused, naming `what` and the shapes."""
    shape, n = tuple(scale.shape), rows[1] - rows[0]
    if block is None:
        if scale.numel() == 1 and len(shape) <= 2:
            return scale.float().reshape(1).expand(n).clone()
        if shape not in ((rows_total,), (rows_total, 1)):
            raise ValueError(f"{what}: scale of shape {shape}, expected ({rows_total},) or ({rows_total}, 1) per "
                             f"output channel, or one per tensor")
        return take(scale, rows, 0).float().reshape(n)
    bn, bk = block
    want = (-(-rows_total // bn), -(-cols_total // bk))
    if shape != want:
        raise ValueError(f"{what}: scale of shape {shape}, expected {want} for a [{rows_total}, {cols_total}] weight "
                         f"in blocks of {list(block)}")
    r0, r1 = block_range(rows, bn, rows_total, f"{what} rows")
    c0, c1 = block_range(cols, bk, cols_total, f"{what} columns")
    return take_nd(scale, [(r0, r1), (c0, c1)]).float().repeat_interleave(bn, 0)[:n]  # rows[0] is on a boundary


def shard_scale(spec: LinearSpec, slice_idx: int, scale: torch.Tensor, block: tuple[int, int] | None, rank: int,
                size: int, what: str) -> torch.Tensor:
    """This rank's scales of one slice's fp8 weight [out_s, in], cut like shard_weight cuts the weight."""
    out_s = spec.slices[slice_idx].width
    return scale_part(scale, spec.slice_ranges(rank, size)[slice_idx], out_s, spec.in_range(rank, size),
                      spec.in_features, block, what)
