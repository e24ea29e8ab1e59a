"""Megatron-style parallel linear layers. No LoRA knowledge.

Each layer splits its forward in two so a LoRA wrapper can add its delta in between:
`partial(x)` is what this rank computes alone, `finish(z)` the communication that completes it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.sharding import LinearSpec, OutSlice, shard_weight, take


class ParallelLinear(nn.Module):
    """y = x W^T + b for a LinearSpec over the TP group.

    column:     W [sum(local out_s), in]; y_i holds this rank's output columns (gathered if gather_output).
    row:        W [out, in/p]; x is this rank's input shard, partial sums are all-reduced, then bias added.
    replicated: the whole W on every rank.
    """

    def __init__(self, spec: LinearSpec, tp: comm.Group, bias: bool = False, dtype=torch.float32,
                 device: Any = "cpu", gather_output: bool = False):
        super().__init__()
        self.spec, self.tp, self.gather_output = spec, tp, gather_output
        self.local_out_widths = spec.local_out_widths(tp.rank, tp.size)
        in0, in1 = spec.in_range(tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(sum(self.local_out_widths), in1 - in0, dtype=dtype, device=device),
                                   requires_grad=False)
        bias_rows = spec.out_features if spec.kind == "row" else sum(self.local_out_widths)
        self.bias = nn.Parameter(torch.zeros(bias_rows, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None

    def load_slice(self, slice_idx: int, weight: Any, bias: Any = None) -> None:
        """Copy this rank's part of slice `slice_idx` from a full checkpoint tensor (or lazy safetensors slice)."""
        row0 = sum(self.local_out_widths[:slice_idx])
        rows = self.local_out_widths[slice_idx]
        part = shard_weight(self.spec, slice_idx, weight, self.tp.rank, self.tp.size)
        copy_checked(self.weight.data[row0:row0 + rows], part, f"slice {slice_idx} weight")
        if bias is not None:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a layer built without one")
            if self.spec.kind == "row":
                copy_checked(self.bias.data, bias[:] if not isinstance(bias, torch.Tensor) else bias, "bias")
            else:
                copy_checked(self.bias.data[row0:row0 + rows],
                              shard_weight(self.spec, slice_idx, bias, self.tp.rank, self.tp.size), "bias")

    def load_fused(self, weight: Any, bias: Any = None) -> None:
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
            copy_checked(self.weight.data[row0:row0 + rows], take(weight, rng, 0), f"fused slice {s} weight")
            if bias is not None:
                copy_checked(self.bias.data[row0:row0 + rows], take(bias, rng, 0), f"fused slice {s} bias")
            row0 += rows

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.partial(x))


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
