"""Multi-LoRA over a rank's experts: per slot, per local expert A/B stacks for w1, w3 (gate, up) and w2 (down),
cut per rank exactly like the expert weights (sharding.py's column / row rules applied to each expert).

For a pair (token t, expert e) of adapter a:
    gate_up += s (x A13_{a,e}^T) B13_{a,e}^T,   down += s (h A2_{a,e}^T) B2_{a,e}^T.
Where the LoRA math sits relative to the moe-tp group's final all-reduce (see ARCHITECTURE.md; experts partitioned
over the EP group need no LoRA collective of their own):
  w1/w3 default         A whole, B split on I                shrink + expand (one fused launch)    none
  w1/w3 fully sharded   A split on rank, B split on I        shrink -> all_gather(u) -> expand     1 all-gather (w1+w3)
  w2 default            A split on I, B whole                fused, into the partial sum           none
  w2 fully sharded      A split on I, B split on H           shrink -> all_reduce(u) -> expand     1 all-reduce
The fused launch runs after its base GEMM (it adds into the GEMM's output); the fully sharded shrinks run beside the
base GEMMs on a side stream (LoRARuntime.beside).
"""
from __future__ import annotations

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.moe import Experts
from tp_lora.lora.layers import Copy, LoRARuntime, SlotBuffers, copy_into, pad_rank
from tp_lora.ops.fp8 import FP8_DTYPE
from tp_lora.ops.fused import Rows8
from tp_lora.ops.moe_layout import MoEPlan
from tp_lora.sharding import row_lora_out_offset, shard_lora_a, shard_lora_b

# Target kinds: one expert's w1 (gate) / w3 (up) / w2 (down), or PEFT's fused gate_up (one A for both, B [2I, r]).
KINDS = ("w1", "w3", "w2", "w13")


class LoRAExperts(SlotBuffers, nn.Module):
    """Buffers: lora_a13[s] [L, E, r_a, H], lora_b13[s] [L, E, I_local, r] for s in (w1, w3),
    lora_a2 [L, E, r, I_local], lora_b2 [L, E, H_b, r] (H_b = H, or H / moe_tp when fully sharded),
    scales [S + 1, L, E] (row S is w2). E = this rank's experts; r_a = r / moe_tp when fully sharded.
    lora.dtype=fp8: the B stacks are float8_e4m3 with per-output-channel float32 scales b13_scales[s] [L, E, I_local]
    and b2_scales [L, E, H_b] (1 for empty slots, so their zeros stay exact zeros), as the dense layers' B."""

    def __init__(self, base: Experts, rt: LoRARuntime):
        super().__init__()
        self.base, self.rt = base, rt
        tp = base.tp
        self.tp = tp
        self.fully_sharded = rt.fully_sharded and tp.size > 1
        if self.fully_sharded and rt.max_rank % tp.size:
            raise ValueError(f"lora.fully_sharded needs lora.max_rank ({rt.max_rank}) divisible by the moe-tp size "
                             f"({tp.size})")
        L, R, E, H = rt.max_loras, rt.max_rank, base.num_local, base.hidden
        il = base.i1 - base.i0
        r_a = R // tp.size if self.fully_sharded else R
        h_b = H // tp.size if self.fully_sharded else H
        dtype, device = base.dtype, base.w13.device  # the activations' dtype (the weights may be fp8)

        b_dtype = FP8_DTYPE if rt.fp8 else dtype

        def zeros(*shape, dtype=dtype):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        self.lora_a13 = nn.ParameterList([zeros(L, E, r_a, H) for _ in range(base.slices)])
        self.lora_b13 = nn.ParameterList([zeros(L, E, il, R, dtype=b_dtype) for _ in range(base.slices)])
        self.lora_a2 = zeros(L, E, R, il)
        self.lora_b2 = zeros(L, E, h_b, R, dtype=b_dtype)
        self.b13_scales = [torch.ones(L, E, il, dtype=torch.float32, device=device) for _ in range(base.slices)] \
            if rt.fp8 else None
        self.b2_scales = torch.ones(L, E, h_b, dtype=torch.float32, device=device) if rt.fp8 else None
        self.unit_views = base.slices + 1 if rt.fp8 else 0
        self.register_buffer("scales", torch.zeros(base.slices + 1, L, E, dtype=torch.float32, device=device))
        self.out_offset = row_lora_out_offset(base.down_spec, tp.rank, tp.size) if self.fully_sharded else 0

    def module_shape(self, key: tuple[str, int]) -> tuple[int, int]:
        """(in_features, out_features) of the full module a target key names."""
        kind, _ = key
        h, i = self.base.hidden, self.base.inter
        return {"w1": (h, i), "w3": (h, i), "w2": (i, h), "w13": (h, self.base.slices * i)}[kind]

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """[A13_s for s] + [B13_s for s] + [A2, B2, scales] (+ [fp8 channel scales of B13_s for s] + [of B2]),
        each [E, ...] (scales [S + 1, E])."""
        fp8 = [] if self.b2_scales is None else [bs[slot] for bs in self.b13_scales] + [self.b2_scales[slot]]
        return ([a.data[slot] for a in self.lora_a13] + [b.data[slot] for b in self.lora_b13]
                + [self.lora_a2.data[slot], self.lora_b2.data[slot], self.scales[:, slot]] + fp8)

    def write(self, views: list[torch.Tensor], key: tuple[str, int], a: torch.Tensor, b: torch.Tensor,
              scale: float, copy: Copy = copy_into) -> None:
        """One expert's LoRA, given whole: a [r, in], b [out, r]; key = (kind, global expert id). Experts other
        ranks hold are skipped: each rank keeps only its experts' slices."""
        kind, expert = key
        if kind not in KINDS:
            raise ValueError(f"MoE LoRA target kind {kind!r}: expected one of {KINDS}")
        if not self.base.holds(expert):
            return
        e = expert - self.base.e0
        n = self.base.slices
        a13, b13, (a2, b2, scales) = views[:n], views[n:2 * n], views[2 * n:2 * n + 3]
        b13_sc, b2_sc = (views[2 * n + 3:3 * n + 3], views[3 * n + 3]) if self.b2_scales is not None else (None, None)
        dev = scales.device
        a, b = pad_rank(a, 0, self.rt.max_rank, dev), pad_rank(b, 1, self.rt.max_rank, dev)
        size = (self.tp.rank, self.tp.size, self.fully_sharded)
        if kind == "w2":
            spec = self.base.down_spec
            copy(a2[e], shard_lora_a(spec, a, *size))
            copy(b2[e], shard_lora_b(spec, 0, b, *size), None if b2_sc is None else b2_sc[e])
            scales[n, e] = scale
            return
        spec = self.base.up_spec
        if kind == "w13":
            parts = list(enumerate(b.chunk(n, 0)))
        else:
            s = 0 if kind == "w1" else 1
            if s >= n:
                raise ValueError(f"{kind} targets the up projection of a non-gated expert")
            parts = [(s, b)]
        for s, bs in parts:
            copy(a13[s][e], shard_lora_a(spec, a, *size))
            copy(b13[s][e], shard_lora_b(spec, s, bs, *size), None if b13_sc is None else b13_sc[s][e])
            scales[s, e] = scale

    def takes_rows8(self, x: torch.Tensor) -> bool:
        return self.base.takes_rows8(x)

    def forward(self, x: torch.Tensor, plan: MoEPlan, x8: Rows8 | None = None) -> torch.Tensor:
        """x [N, H] the dispatched tokens -> [C, H] in pair order, partial over moe-tp, with each pair's adapter. The
        LoRA ops read the base GEMMs' routing plan (its LoRA block table): no second sort. x8: x quantized per token,
        which the base experts read in a step without adapters (SparseMoE.takes_rows8 asks for it then only)."""
        base, rt, ops = self.base, self.rt, self.rt.ops
        if not plan.any_lora:  # the same on every moe-tp rank: they dispatched the same tokens
            return base(x, plan, x8)
        if not self.fully_sharded:  # no collective between shrink and expand: one fused launch after each GEMM
            z = base.up(x, plan, plan.token)  # both read the pairs' tokens where they lie
            ops.moe_lora_fused(x, list(self.lora_a13), self.scales[:base.slices], list(self.lora_b13), plan, z,
                               b_scales=self.b13_scales, rows=plan.token)
            h = base.act(z)
            y = base.down(h, plan)
            ops.moe_lora_fused(h, [self.lora_a2], self.scales[base.slices:], [self.lora_b2], plan, y,
                               b_scales=None if self.b2_scales is None else [self.b2_scales])
            return y
        xp = x[plan.token]
        u, z = rt.beside(lambda: ops.moe_lora_shrink(xp, list(self.lora_a13), self.scales[:base.slices], plan),
                         lambda: base.up(xp, plan), xp.device, xp.shape[0] // base.num_experts)
        u = comm.all_gather(u, self.tp, dim=-1)  # w1 and w3 travel together
        ops.moe_lora_expand(u, list(self.lora_b13), plan, z, b_scales=self.b13_scales)
        h = base.act(z)
        u, y = rt.beside(lambda: ops.moe_lora_shrink(h, [self.lora_a2], self.scales[base.slices:], plan),
                         lambda: base.down(h, plan), h.device, h.shape[0] // base.num_experts)
        u = comm.all_reduce(u, self.tp)
        ops.moe_lora_expand(u, [self.lora_b2], plan, y, offset=self.out_offset,
                            b_scales=None if self.b2_scales is None else [self.b2_scales])
        return y


def wrap_experts(base: Experts, rt: LoRARuntime, paths: dict[str, tuple[str, int]]) -> LoRAExperts:
    """Wrap and register PEFT module paths -> (kind, global expert) for the slot table and adapter validation."""
    layer = LoRAExperts(base, rt)
    for path, key in paths.items():
        rt.targets[path] = (layer, key)
    return layer
