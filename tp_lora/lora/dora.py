"""DoRA's per-output scale g = m / ||W + s * B A|| (the norm over the input dim, PEFT's get_weight_norm), computed on
the device when an adapter enters a slot, from the slot's A, B and scale and the layer's base weight.

Where each rank's slot holds only part of what the norm needs, one small collective per layer completes it:
  column, default        W rows, A whole, B rows            local
  column, fully sharded  A split on rank                    all-gather of A [r/p, in] -> [r, in]
  row, default           W and A split on in, B whole       partial sums of squares, all-reduce [out]
  row, fully sharded     ... and B split on out             all-gather of B [out/p, r], then as default
"""
from __future__ import annotations

import torch

from tp_lora import distributed as comm
from tp_lora.lora.layers import LoRALinear
from tp_lora.ops.fp8 import dequantize

ROW_CHUNK = 4096  # rows of W + s * B A formed at a time (a [ROW_CHUNK, in] float32 temporary)


def squared_norms(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [O, K], a [r, K], b [O, r], scale a 0-dim tensor -> [O] float32: sum over K of (w + scale * b @ a)^2."""
    a = a.float()
    out = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for lo in range(0, w.shape[0], ROW_CHUNK):
        hi = min(lo + ROW_CHUNK, w.shape[0])
        out[lo:hi] = (w[lo:hi].float() + scale * (b[lo:hi].float() @ a)).square().sum(1)
    return out


def _w(layer: LoRALinear, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the base weight this rank holds, in float32 where it is fp8 (times its weight_scale)."""
    w, scale = layer.base.weight[lo:hi], getattr(layer.base, "weight_scale", None)
    return w if scale is None else dequantize(w, scale[lo:hi], layer.base.block_k)


def _b(layer: LoRALinear, s: int, slot: int) -> torch.Tensor:
    """Slot's B of slice s in float32 (fp8: times its channel scales)."""
    b = layer.lora_b[s][slot].float()
    return b if layer.b_scales is None else b * layer.b_scales[s][slot].unsqueeze(-1)


def refresh(layer: LoRALinear, slot: int) -> None:
    """Turn the magnitude m the slot copy left in layer.dora_g[slot] into g where the slot's slice is DoRA (its
    dora flag is 1); other slices keep 1. Every rank of the layer's TP group calls it for the same slot."""
    g = layer.dora_g[slot]
    if layer.spec.kind == "row":
        a = layer.lora_a[0][slot]
        b = _b(layer, 0, slot)
        if layer.fully_sharded:
            b = comm.all_gather(b, layer.tp, dim=0)
        norm2 = squared_norms(_w(layer, 0, layer.base.weight.shape[0]), a, b, layer.scales[0, slot])
        if layer.tp.size > 1:
            norm2 = comm.all_reduce(norm2, layer.tp)
        g.copy_(torch.where(layer.dora[0, slot] > 0, g / norm2.sqrt(), g))
        return
    a_all = [layer.lora_a[s][slot] for s in range(len(layer.lora_a))]
    if layer.fully_sharded:  # one gather for every slice of a packed layer
        a_all = comm.all_gather(torch.stack(a_all), layer.tp, dim=1).unbind(0)
    for s, a in enumerate(a_all):
        lo, hi = layer.columns(s)
        norm2 = squared_norms(_w(layer, lo, hi), a, _b(layer, s, slot), layer.scales[s, slot])
        g[lo:hi] = torch.where(layer.dora[s, slot] > 0, g[lo:hi] / norm2.sqrt(), g[lo:hi])
