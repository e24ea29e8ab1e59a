"""Base MoE pieces, no LoRA knowledge: the replicated router and the experts a rank holds (the rows an all-gather
carries between EP ranks: tp_lora.ops.moe_pack).

Expert sharding: a rank holds experts [e0, e1) of the EP group's split and, of each, intermediate rows [i0, i1) of
the moe-tp group's split: w1/w3 are column-parallel (rows of I), w2 row-parallel (columns of I), so a rank's
expert output is a partial sum over the moe-tp group.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.linear import column_spec, row_spec, store_rows
from tp_lora.layers.quant import FP8Scheme
from tp_lora.ops.fp8 import FP8_DTYPE, quantize_fp8_per_channel
from tp_lora.ops.fused import Rows8, act_mul, moe_topk
from tp_lora.ops.grouped_mm import experts_take_rows8, grouped_mm
from tp_lora.ops.mm16 import mm16
from tp_lora.ops.moe_layout import MoEPlan
from tp_lora.sharding import even_range, expert_range, take, take_nd


class Router(nn.Module):
    """Replicated gate: logits in the model dtype, softmax in float32, top-k, optional renormalisation of the top-k
    weights (Mixtral always, Qwen-MoE when norm_topk_prob). Qwen rounds the weights to the model dtype, Mixtral keeps
    them in float32 (as transformers does)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, weights_in_model_dtype: bool,
                 dtype=torch.float32, device: Any = "cpu"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: expected 1..num_experts ({num_experts})")
        self.top_k, self.renormalize, self.round_weights = top_k, renormalize, weights_in_model_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, H] -> topk ids [n, k] int64, weights [n, k] float32; rows from valid[0] on (a CUDA graph's padding)
        get ids -1."""
        logits = mm16(x, self.weight, sums=True)  # at decode sizes the K shares, summed by the top-k kernel
        return moe_topk(logits, self.top_k, self.renormalize, self.round_weights, valid)


class Experts(nn.Module):
    """This rank's experts: w13 [E_local, S * I_local, H] (S = 2 gate|up slices when gated, 1 otherwise) and
    w2 [E_local, H, I_local]. `forward(xp, plan)` computes every pair's expert MLP in pair order (one grouped GEMM
    for gate_up, one for down), as a partial sum over the moe-tp group.

    quant: w13 / w2 are float8_e4m3fn with float32 scales w13_scale [E_local, S * I_local] / w2_scale [E_local, H]
    per output channel, or [..., in_local / block_k] per block; tp_lora.ops.grouped_mm takes them as they are (the
    Triton kernel reads the fp8 bytes; elsewhere they are dequantised to the activations' dtype)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, ep: comm.Group, moe_tp: comm.Group,
                 gated: bool = True, dtype=torch.float32, device: Any = "cpu", quant: FP8Scheme | None = None):
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.gated = num_experts, hidden, inter, gated
        self.dtype, self.quant = dtype, quant
        self.ep, self.tp = ep, moe_tp
        self.e0, self.e1 = expert_range(num_experts, ep.rank, ep.size)
        self.i0, self.i1 = even_range(inter, moe_tp.rank, moe_tp.size, "moe intermediate size")
        # The per-expert slicing is that of a dense MLP's gate_up / down: weights and LoRA reuse sharding.py's rules.
        self.up_spec = column_spec(hidden, *((inter, inter) if gated else (inter,)))
        self.down_spec = row_spec(inter, hidden)
        n, il = self.e1 - self.e0, self.i1 - self.i0
        self.slices = 2 if gated else 1
        wdtype = FP8_DTYPE if quant is not None else dtype
        self.w13 = nn.Parameter(torch.empty(n, self.slices * il, hidden, dtype=wdtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden, il, dtype=wdtype, device=device), requires_grad=False)
        self.block_k = quant.block[1] if quant is not None and quant.block is not None else None
        for name, w in (("w13_scale", self.w13), ("w2_scale", self.w2)):
            shape = w.shape[:2] if self.block_k is None else (*w.shape[:2], -(-w.shape[2] // self.block_k))
            self.register_buffer(name, None if quant is None else
                                 torch.ones(shape, dtype=torch.float32, device=device))

    @property
    def num_local(self) -> int:
        return self.e1 - self.e0

    def holds(self, expert: int) -> bool:
        return self.e0 <= expert < self.e1

    def load_expert(self, expert: int, up: list[Any], down: Any, up_scales: list[Any] | None = None,
                    down_scale: Any = None, names: tuple[str, ...] = ()) -> None:
        """One expert from per-expert tensors: up = [w1 [I, H], w3 [I, H]] (or [w1] when not gated), down = w2 [H, I]
        (tensors or lazy safetensors slices: only this rank's rows / columns are read); fp8 checkpoints: their whole
        scale tensors up_scales / down_scale. names: the checkpoint names of up + [down], for messages."""
        e = expert - self.e0
        il = self.i1 - self.i0
        names = names or tuple(f"expert {expert} up slice {s}" for s in range(len(up))) + (f"expert {expert} down",)
        rows, full_h = (self.i0, self.i1), (0, self.hidden)
        for s, w in enumerate(up):
            store_rows(self.w13.data[e, s * il:(s + 1) * il], self._scale_rows("w13_scale", e, s * il, il),
                       take(w, rows, 0), rows, self.inter, full_h, self.hidden, self.quant,
                       up_scales[s] if up_scales else None, names[s])
        store_rows(self.w2.data[e], self._scale_rows("w2_scale", e, 0, self.hidden), take(down, full_h, 0), full_h,
                   self.hidden, rows, self.inter, self.quant, down_scale, names[-1])

    def _scale_rows(self, name: str, e: int, row0: int, rows: int) -> torch.Tensor | None:
        scale = getattr(self, name)
        return None if scale is None else scale.data[e, row0:row0 + rows]

    def load_fused(self, gate_up: Any, down: Any) -> None:
        """All local experts from fused 3D tensors: gate_up [E, S*I, H] (gate rows, then up rows), down [E, H, I]."""
        il, inter = self.i1 - self.i0, self.inter
        experts = (self.e0, self.e1)
        if self.quant is not None and not self.quant.at_load:
            raise ValueError("fused 3D expert tensors (experts.gate_up_proj [E, 2I, H]) in an fp8 checkpoint are not "
                             "supported: expected per-expert tensors (experts.N.gate_proj.weight + its scale)")
        for s in range(self.slices):
            part = take_nd(gate_up, [experts, (s * inter + self.i0, s * inter + self.i1), None])
            self._store_fused(self.w13.data[:, s * il:(s + 1) * il], "w13_scale", s * il, part, (0, self.hidden),
                              f"fused gate_up_proj slice {s}")
        whole = None if self.quant is None else (0, inter)  # quantized over whole rows, then cut
        down_part = take_nd(down, [experts, None, whole or (self.i0, self.i1)])
        self._store_fused(self.w2.data, "w2_scale", 0, down_part, (self.i0, self.i1) if whole else (0, il),
                          "fused down_proj")

    def _store_fused(self, dst: torch.Tensor, scale_name: str, row0: int, src: torch.Tensor, cols: tuple[int, int],
                     what: str) -> None:
        """dst [E_local, rows, cols] from src [E_local, rows, *] (columns `cols` kept), quantized per output channel
        at load when the layer is fp8."""
        if src.dtype == FP8_DTYPE:
            raise ValueError(f"{what}: the checkpoint holds float8_e4m3fn weights, but config.json's "
                             f"quantization_config leaves the experts unquantized (or has none)")
        if self.quant is None:
            _copy(dst, take(src, cols, 2), what)
            return
        q, scale = quantize_fp8_per_channel(src.to(dst.device))
        _copy(dst, take(q, cols, 2), what)
        _copy(getattr(self, scale_name).data[:, row0:row0 + dst.shape[1]], scale, f"{what} scale")

    def takes_rows8(self, x: torch.Tensor) -> bool:
        """Whether forward(x, plan, x8) reads x8, x quantized per token (fp8 per-channel experts)."""
        return experts_take_rows8(x, self.w13, self.block_k)

    def up(self, x: torch.Tensor, plan: MoEPlan, rows: torch.Tensor | None = None, act: bool = False,
           x8: Rows8 | None = None) -> torch.Tensor:
        """x [C, H] in pair order (rows None), or the dispatched tokens [N, H] read at rows [C] -> [C, S * I_local]
        (rows past the plan's last expert undefined); act (gated experts): act(z) [C, I_local] in the GEMM. x8: x
        quantized per token (takes_rows8)."""
        return grouped_mm(x, self.w13, plan.expert_ends, self.w13_scale, self.block_k, rows, self.num_experts,
                          gated=act, x8=x8)

    def act(self, z: torch.Tensor) -> torch.Tensor:
        return act_mul(z, "silu") if self.gated else F.silu(z)

    def down(self, h: torch.Tensor, plan: MoEPlan) -> torch.Tensor:
        """h [C, I_local] in pair order -> [C, H] (partial over moe-tp)."""
        return grouped_mm(h, self.w2, plan.expert_ends, self.w2_scale, self.block_k, experts=self.num_experts)

    def forward(self, x: torch.Tensor, plan: MoEPlan, x8: Rows8 | None = None) -> torch.Tensor:
        """x [N, H] the dispatched tokens -> [C, H] in pair order (the plan's gather inside the first GEMM); x8: x
        quantized per token (takes_rows8)."""
        if self.gated:  # silu(gate) * up in the first GEMM's epilogue
            return self.down(self.up(x, plan, plan.token, act=True, x8=x8), plan)
        return self.down(self.act(self.up(x, plan, plan.token, x8=x8)), plan)


def _copy(dst: torch.Tensor, src: Any, what: str) -> None:
    src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
