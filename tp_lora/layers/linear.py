"""Megatron-style parallel linear layers. No LoRA knowledge.

Each layer splits its forward in two so a LoRA wrapper can add its delta in between:
`partial(x)` is what this rank computes alone, `finish(z)` the communication that completes it. An fp8 layer may
also take its input quantized (x8: per token, or per group of columns) from the op that made it, where
`takes_rows8(x, group)` says it reads it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.quant import FP8Scheme
from tp_lora.ops.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8_per_channel, takes_rows8
from tp_lora.ops.fused import Rows8
from tp_lora.ops.mm16 import mm16
from tp_lora.ops.split_sums import SplitSums
from tp_lora.sharding import LinearSpec, OutSlice, scale_part, shard_weight, take


class ParallelLinear(nn.Module):
    """y = x W^T + b for a LinearSpec over the TP group.

    column:     W [sum(local out_s), in]; y_i holds this rank's output columns (gathered if gather_output).
    row:        W [out, in/p]; x is this rank's input shard, partial sums are all-reduced, then bias added.
    replicated: the whole W on every rank.

    quant (tp_lora.layers.quant): W is float8_e4m3fn with float32 weight_scale, [rows] per output channel or
    [rows, in_local / block_k] per block; `dtype` stays the activations' (and a LoRA wrapper's) dtype.
    """

    def __init__(self, spec: LinearSpec, tp: comm.Group, bias: bool = False, dtype=torch.float32,
                 device: Any = "cpu", gather_output: bool = False, quant: FP8Scheme | None = None):
        super().__init__()
        self.spec, self.tp, self.gather_output = spec, tp, gather_output
        self.dtype, self.quant = dtype, quant
        self.local_out_widths = spec.local_out_widths(tp.rank, tp.size)
        in0, in1 = spec.in_range(tp.rank, tp.size)
        rows = sum(self.local_out_widths)
        self.weight = nn.Parameter(torch.empty(rows, in1 - in0, dtype=FP8_DTYPE if quant else dtype, device=device),
                                   requires_grad=False)
        self.block_k = quant.block[1] if quant is not None and quant.block is not None else None
        # rows per block when this rank's rows lie in whole blocks (the block-scaled GEMMs that take one scale row
        # per block need it), else None
        self.block_n = (quant.block[0] if self.block_k is not None and blocks_aligned(spec, tp.rank, tp.size,
                                                                                       quant.block[0]) else None)
        scale_shape = (rows,) if self.block_k is None else (rows, -(-(in1 - in0) // self.block_k))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device)
                             if quant is not None else None)
        bias_rows = spec.out_features if spec.kind == "row" else sum(self.local_out_widths)
        self.bias = nn.Parameter(torch.zeros(bias_rows, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    def load_slice(self, slice_idx: int, weight: Any, bias: Any = None, scale: torch.Tensor | None = None,
                   what: str = "") -> None:
        """Copy this rank's part of slice `slice_idx` from a full checkpoint tensor (or lazy safetensors slice);
        scale: the fp8 checkpoint's whole scale tensor of that slice. what: the checkpoint name, for messages."""
        row0 = sum(self.local_out_widths[:slice_idx])
        rows = self.local_out_widths[slice_idx]
        rng = self.spec.slice_ranges(self.tp.rank, self.tp.size)[slice_idx]
        self._store(row0, take(weight, rng, 0), rng, self.spec.slices[slice_idx].width, scale,
                    what or f"slice {slice_idx}")
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            if self.spec.kind == "row":
                copy_checked(self.bias.data, bias[:] if not isinstance(bias, torch.Tensor) else bias, "bias")
            else:
                copy_checked(self.bias.data[row0:row0 + rows],
                              shard_weight(self.spec, slice_idx, bias, self.tp.rank, self.tp.size), "bias")

    def load_fused(self, weight: Any, bias: Any = None, scale: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of every slice from one fused checkpoint tensor [out_features, in] (slices
        concatenated, e.g. Phi-3's qkv_proj), reading only those rows of a lazy safetensors slice."""
        shape = tuple(getattr(weight, "shape", None) or weight.get_shape())
        if self.spec.kind != "column" or shape != (self.spec.out_features, self.spec.in_features):
            raise ValueError(f"fused checkpoint tensor of shape {shape}: expected a column layer's "
                             f"{(self.spec.out_features, self.spec.in_features)} (slices {self.spec.out_widths})")
        if bias is not None and self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        row0 = 0
        for s, rows in enumerate(self.local_out_widths):
            rng = self.spec.fused_rows(s, self.tp.rank, self.tp.size)
            self._store(row0, take(weight, rng, 0), rng, self.spec.out_features, scale, f"fused slice {s}")
            if bias is not None:
                copy_checked(self.bias.data[row0:row0 + rows], take(bias, rng, 0), f"fused slice {s} bias")
            row0 += rows

    def _store(self, row0: int, src: torch.Tensor, rng: tuple[int, int], rows_total: int,
               scale: torch.Tensor | None, what: str) -> None:
        """Weight rows [row0, row0 + len(rng)) from the checkpoint's rows rng (every column: src) of a tensor of
        rows_total rows."""
        n = rng[1] - rng[0]
        store_rows(self.weight.data[row0:row0 + n],
                   None if self.quant is None else self.weight_scale.data[row0:row0 + n], src, rng, rows_total,
                   self.spec.in_range(self.tp.rank, self.tp.size), self.spec.in_features, self.quant, scale, what)

    def takes_rows8(self, x: torch.Tensor, group: int | None = None) -> bool:
        """Whether partial(x, x8) reads x8, x quantized per token (or per group columns) by its producer
        (tp_lora.ops.fp8.takes_rows8)."""
        return self.quant is not None and takes_rows8(x, self.weight, self.block_k, group)

    def partial(self, x: torch.Tensor, x8: Rows8 | None = None, sums: bool = False) -> torch.Tensor | SplitSums:
        """sums: the output may be left as the decode GEMM's SplitSums where it is whole already (one rank, or a
        column layer) or, with 16-bit weights, before a row layer's all-reduce; no bias. Its reader adds them
        (decode attention, the next norm, the fused all-reduce + norm)."""
        sums = sums and self.bias is None and (self.tp.size == 1 or self.spec.kind != "row" or self.quant is None)
        y = (mm16(x, self.weight, sums) if self.quant is None
             else fp8_linear(x, self.weight, self.weight_scale, self.block_k, self.block_n, x8, sums))
        if self.bias is not None and self.spec.kind != "row":
            y = y + self.bias
        return y

    def finish(self, z: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "row":
            z = comm.all_reduce(z, self.tp)
            return z + self.bias if self.bias is not None else z
        if self.spec.kind == "column" and self.gather_output:
            return comm.all_gather(z, self.tp, dim=-1)
        return z

    def forward(self, x: torch.Tensor, x8: Rows8 | None = None) -> torch.Tensor:
        return self.finish(self.partial(x, x8))


def blocks_aligned(spec: LinearSpec, rank: int, size: int, block_n: int) -> bool:
    """Whether a rank's weight rows lie in whole blocks of block_n rows sharing one scale row: every slice starts
    on a block boundary of its checkpoint tensor (one per slice, or the slices fused) and of the local weight."""
    row0 = 0
    for s, (a, b) in enumerate(spec.slice_ranges(rank, size)):
        if a % block_n or spec.fused_rows(s, rank, size)[0] % block_n or row0 % block_n:
            return False
        row0 += b - a
    return True


def column_spec(in_features: int, *out_features: int) -> LinearSpec:
    """Column-parallel; several out_features make a merged (packed) layer such as gate_up."""
    return LinearSpec("column", in_features, tuple(OutSlice(o) for o in out_features))


def qkv_spec(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int) -> LinearSpec:
    """Packed q/k/v; KV heads are replicated when the TP group is larger than num_kv_heads."""
    return LinearSpec("column", hidden, (OutSlice(num_heads, head_dim),
                                         OutSlice(num_kv_heads, head_dim, replicable=True),
                                         OutSlice(num_kv_heads, head_dim, replicable=True)))


def row_spec(in_features: int, out_features: int) -> LinearSpec:
    return LinearSpec("row", in_features, (OutSlice(out_features),))


def replicated_spec(in_features: int, out_features: int) -> LinearSpec:
    return LinearSpec("replicated", in_features, (OutSlice(out_features),))


def copy_checked(dst: torch.Tensor, src: Any, what: str) -> None:
    src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def store_rows(dst: torch.Tensor, dst_scale: torch.Tensor | None, src: torch.Tensor, rows: tuple[int, int],
               rows_total: int, cols: tuple[int, int], cols_total: int, quant: FP8Scheme | None,
               scale: torch.Tensor | None, what: str) -> None:
    """dst (and dst_scale) from the checkpoint's rows [rows) of a [rows_total, cols_total] weight, given with every
    column (src), columns [cols) kept: unquantized; quantized here per output channel (over whole rows, so every TP
    layout gets the scales of one process); or fp8 with the checkpoint's whole `scale` tensor. An fp8 tensor where
    the config says 16/32-bit, the other way round, or a missing scale is refused, naming `what`."""
    fp8 = src.dtype == FP8_DTYPE
    if quant is None or quant.at_load:
        if fp8:
            raise ValueError(f"{what}: the checkpoint holds float8_e4m3fn weights, but config.json's "
                             f"quantization_config leaves this layer unquantized (or has none)")
        if quant is None:
            copy_checked(dst, take(src, cols, 1), f"{what} weight")
            return
        q, s = quantize_fp8_per_channel(src.to(dst.device))
        copy_checked(dst, take(q, cols, 1), f"{what} weight")
        copy_checked(dst_scale, s, f"{what} scale")
        return
    if not fp8:
        raise ValueError(f"{what}: the checkpoint holds {src.dtype} weights where quantization_config says "
                         f"float8_e4m3fn")
    if scale is None:
        raise ValueError(f"{what}: float8_e4m3fn weight without its scale (expected a tensor named "
                         f"{' or '.join(what.rsplit('.', 1)[0] + '.' + n for n in quant.scale_names)})")
    copy_checked(dst, take(src, cols, 1), f"{what} weight")
    copy_checked(dst_scale, scale_part(scale, rows, rows_total, cols, cols_total, quant.block, what), f"{what} scale")
