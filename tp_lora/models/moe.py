"""Mixtral and Qwen2-MoE / Qwen3-MoE: the Llama-family decoder with a sparse MoE block in place of the MLP, in every
parallel layout (see ARCHITECTURE.md, "MoE and expert parallelism"):

  TP       ep=1: every rank holds every expert, each expert's intermediate split over tp; one all-reduce.
  EP/DP    ep over DP replicas (parallel.ep_attention=dp, tp=1): each rank routes its own requests' tokens;
           all_gather(hidden | topk ids | topk weights | adapter slot, one packed call) over ep -> the pairs routed to
           local experts -> reduce_scatter returns each rank its own tokens' sums. Ranks have different token
           counts: once per step, on the host, they exchange counts (and whether any token has an adapter) and
           pad to a fixed capacity (the max, rounded up to a CUDA-graph size when graphs replay), padding rows
           routed nowhere; `lockstep` keeps idle ranks stepping. No layer reads a device value on the host, so decode
           and mixed steps are capturable: a graph's rows are padded to that capacity, a validity count masks the rest.
  EP/TP    ep over the attention TP group (ep_attention=tp): tokens are replicated after attention (bit for bit, as
           TP's routing needs too), so every rank routes every token itself (nothing travels before the experts) and
           runs the shared expert on a 1/tp chunk of them -> local experts on all tokens' pairs -> one all_reduce
           returns the replicated sum the next attention needs.
  EP x TP  ep over DP replicas and each expert's intermediate over the tp group (2D mesh): the EP collectives run over
           ep, the expert partial sums (and fully sharded LoRA collectives) over tp.
The EP dispatch / combine take NVLink peer memory where parallel.allreduce gives the ep group it (tp_lora.distributed:
one peer all-gather kernel, a peer all-reduce; lower latency than NCCL at decode sizes, BENCHMARKS.md issue 37).

Module paths mirror transformers so PEFT adapters land: per-expert `...block_sparse_moe.experts.N.w1` (Mixtral) /
`...mlp.experts.N.gate_proj` (Qwen), PEFT target_parameters experts as `...mlp.experts.N.gate_up_proj` /
`...mlp.experts.N.down_proj` (tp_lora.lora.adapter splits them per expert), shared expert `...mlp.shared_expert.*`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tp_lora import distributed as comm
from tp_lora.layers.linear import ParallelLinear, column_spec, replicated_spec, row_spec
from tp_lora.layers.moe import Experts, Router
from tp_lora.layers.quant import QuantConfig
from tp_lora.lora.layers import LoRARuntime, maybe_wrap
from tp_lora.lora.moe import wrap_experts
from tp_lora.models.llama import CausalLM, scheme
from tp_lora.models.loader import weight_scale
from tp_lora.models.moe_step import MoEShape, MoEStep, capacity, prepare_step, validate_moe
from tp_lora.ops.batch import LoRABatch, build_lora_batch
from tp_lora.ops.fused import Rows8, moe_combine
from tp_lora.ops.grouped_mm import torch_grouped_available
from tp_lora.ops.moe_pack import pack_tokens, unpack_tokens
from tp_lora.ops.moe_plan import build_plan

# Per-expert module names on disk (transformers 4.x layout, also what transformers 5.x saves): (gate, up, down).
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
FUSED_NAMES = ("gate_up_proj", "down_proj")  # transformers 5.x fused 3D expert parameters / PEFT target_parameters


class SparseMoE(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert) over the layout in `ps`. forward(x [T, H]) -> [T, H]."""

    def __init__(self, hf: dict, shape: MoEShape, idx: int, ps: comm.ParallelState, step: MoEStep, dtype, device,
                 rt: LoRARuntime | None, targets: set[str] | None, quant: QuantConfig | None = None):
        super().__init__()
        hidden = hf["hidden_size"]
        self.shape, self.hidden, self.step, self.rt = shape, hidden, step, rt
        self.ep, self.moe_tp = ps.ep, ps.moe_tp
        self.chunked = ps.ep.size > 1 and ps.ep_attention == "tp"
        # the tp group whose sum ends the block (EP/TP: over ep, the same ranks), for DecoderLayer.defer; EP over DP
        # replicas without expert tp: the ep group whose reduce-scatter ends it
        self.defer_group = ps.tp if ps.tp.size > 1 and (self.chunked or ps.moe_tp is ps.tp) else None
        self.defer_scatter = ps.ep if ps.ep.size > 1 and not self.chunked and ps.moe_tp.size == 1 else None
        self.gate = Router(hidden, shape.num_experts, shape.top_k, shape.renormalize,
                           weights_in_model_dtype=shape.model_type != "mixtral", dtype=dtype, device=device)
        names = EXPERT_NAMES[shape.model_type]
        per_expert = f"model.layers.{idx}.{'block_sparse_moe' if shape.model_type == 'mixtral' else 'mlp'}.experts."
        experts = Experts(shape.num_experts, hidden, shape.inter, ps.ep, ps.moe_tp, True, dtype, device,
                          scheme(quant, [per_expert[:-1]]))
        self.experts = experts
        fused = f"model.layers.{idx}.mlp.experts."
        if rt is not None and (targets is None or targets & set(names + FUSED_NAMES)):
            paths = {}
            for e in range(shape.num_experts):
                for kind, n in zip(("w1", "w3", "w2"), names):
                    paths[f"{per_expert}{e}.{n}"] = (kind, e)
                paths[f"{fused}{e}.gate_up_proj"] = ("w13", e)
                paths[f"{fused}{e}.down_proj"] = ("w2", e)
            self.experts = wrap_experts(experts, rt, paths)
        self.shared_gate_up = self.shared_down = self.shared_expert_gate = None
        if shape.shared_inter:
            step.shared_expert = True
            p = f"model.layers.{idx}.mlp."
            si = shape.shared_inter
            up, down, gate = [p + "shared_expert.gate_proj", p + "shared_expert.up_proj"], \
                [p + "shared_expert.down_proj"], [p + "shared_expert_gate"]
            self.shared_gate_up = maybe_wrap(ParallelLinear(column_spec(hidden, si, si), ps.moe_tp, False, dtype,
                                                             device, quant=scheme(quant, up)), rt, up, targets)
            self.shared_down = maybe_wrap(ParallelLinear(row_spec(si, hidden), ps.moe_tp, False, dtype, device,
                                                         quant=scheme(quant, down)), rt, down, targets)
            self.shared_expert_gate = maybe_wrap(ParallelLinear(replicated_spec(hidden, 1), ps.moe_tp, False, dtype,
                                                                 device, quant=scheme(quant, gate)), rt, gate, targets)

    @property
    def base_experts(self) -> Experts:
        return getattr(self.experts, "base", self.experts)

    # ---- forward ------------------------------------------------------------------------------------------------
    def takes_rows8(self, x: torch.Tensor, group: int | None = None) -> bool:
        """Whether forward(x, partial, x8) reads x8, x quantized per token (group None: the experts take no rows
        quantized per group): fp8 per-channel experts that multiply the hidden states where they lie (not gathered
        from the EP group's replicas), in a step without adapters."""
        return (group is None and (self.chunked or self.ep.size == 1)
                and not (self.rt is not None and self.rt.active()) and self.base_experts.takes_rows8(x))

    def forward(self, x: torch.Tensor, partial: bool = False, x8: Rows8 | None = None) -> torch.Tensor:
        """partial (only with a defer_group / defer_scatter): the sum before its final reduce, which the caller does.
        x8: x quantized per token (takes_rows8)."""
        step, ex = self.step, self.base_experts
        c0, c1 = step.owned
        xs = x[c0:c1]
        # Every rank routes every row it holds: under EP/TP the hidden states are replicated, so each rank routes
        # every token as TP does (no exchange). A graph's padding rows route nowhere.
        ids, w = self.gate(x, step.valid)
        shared = self._shared(xs) if self.shared_gate_up is not None else None
        tags, xg = step.slots, x
        if self.ep.size > 1 and not self.chunked:  # one packed all-gather carries hidden, ids, weights and slots
            packed = comm.all_gather(pack_tokens(x, ids, w, tags, step.rows), self.ep, dim=0)
            xg, ids, w, tags = unpack_tokens(packed, self.hidden, x.dtype, self.shape.top_k, tags is not None)
            x8 = None  # the gathered rows are not x's (takes_rows8 never asks for them here)
        plan = build_plan(ids, w, tags, ex.e0, ex.num_local, self.rt.max_loras if self.rt is not None else 0,
                          self._expert_lora(tags))
        yp = self.experts(xg, plan, x8) if plan.num_pairs else xg[:0]
        y = moe_combine(yp, plan.pos, plan.weight)
        if self.chunked:  # own chunk's shared expert in, then one sum over ranks, replicated for the next attention
            if shared is not None:
                y[c0:c1] += shared
            return y if partial else comm.all_reduce(y, self.ep)
        if self.defer_scatter is not None and partial:  # every rank's rows, this rank's shared expert in its own
            if shared is not None:
                y[self.ep.rank * (y.shape[0] // self.ep.size):][:c1 - c0] += shared
            return y
        if self.ep.size > 1:
            y = comm.reduce_scatter(y, self.ep)[:c1 - c0]
        if shared is not None:
            y = y + shared
        if self.moe_tp.size > 1 and c1 > c0 and not partial:  # the moe-tp ranks own the same tokens: all or none
            y = comm.all_reduce(y, self.moe_tp)
        return y

    def _expert_lora(self, tags: torch.Tensor | None) -> bool:
        """Whether the expert LoRA ops run this step, the same on every rank of the EP group, decided on the host. TP
        and EP/TP: the step's LoRA batch (replicated). EP over DP replicas: the flag agreed with the token counts."""
        if tags is None or not hasattr(self.experts, "base"):
            return False
        if self.ep.size > 1 and not self.chunked:
            return self.step.lora
        return self.rt.active()

    def _shared(self, xs: torch.Tensor) -> torch.Tensor:
        """sigmoid(x g^T) * shared_expert(x), as a partial sum over moe-tp (reduced with the experts' sum)."""
        with self._lora_batch(self.step.batch):
            gate, up = self.shared_gate_up(xs).chunk(2, -1)
            h = F.silu(gate) * up
            z = self.shared_down.partial(h)  # with its LoRA when wrapped
            return torch.sigmoid(self.shared_expert_gate(xs)) * z

    @contextmanager
    def _lora_batch(self, batch: LoRABatch | None):
        """The shared expert's LoRA layers read rt.batch: point it at the owned tokens (a chunk in EP/TP)."""
        rt = self.rt
        if rt is None or batch is None or batch is rt.batch:
            yield
            return
        saved, rt.batch = rt.batch, batch
        try:
            yield
        finally:
            rt.batch = saved

    # ---- weights ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, reader, prefix: str) -> None:
        """prefix: "model.layers.{i}.mlp." (Mixtral checkpoints use "block_sparse_moe." instead of "mlp.")."""
        layer = prefix[:-len("mlp.")]
        candidates = [prefix] + ([layer + "block_sparse_moe."] if self.shape.model_type == "mixtral" else [])
        p = next((c for c in candidates if reader.has(c + "gate.weight")), None)
        if p is None:
            raise ValueError(f"MoE router weight not found: expected one of {[c + 'gate.weight' for c in candidates]}")
        E, H, inter = self.shape.num_experts, self.hidden, self.shape.inter
        _check_shape(reader, p + "gate.weight", (E, H))
        gate = reader.get(p + "gate.weight")
        if gate.dtype == torch.float8_e4m3fn:
            raise ValueError(f"{p}gate.weight is float8_e4m3fn: fp8 routers are not supported (expected the router "
                             f"left unquantized, as published fp8 MoE checkpoints do)")
        self.gate.weight.data.copy_(gate)
        ex = self.base_experts
        if reader.has(p + "experts.gate_up_proj"):
            _check_shape(reader, p + "experts.gate_up_proj", (E, 2 * inter, H))
            _check_shape(reader, p + "experts.down_proj", (E, H, inter))
            ex.load_fused(reader.get_slice(p + "experts.gate_up_proj"), reader.get_slice(p + "experts.down_proj"))
        else:
            g, u, d = EXPERT_NAMES[self.shape.model_type]
            if not reader.has(f"{p}experts.{ex.e0}.{g}.weight"):
                raise ValueError(f"experts of {p[:-1]} not found: expected {p}experts.gate_up_proj (fused) or "
                                 f"{p}experts.N.{g}.weight (per expert)")
            for e in range(ex.e0, ex.e1):  # only the experts this rank holds are read
                mods = [f"{p}experts.{e}.{n}" for n in (g, u, d)]
                w = [reader.get_slice(m + ".weight") for m in mods]
                scales = [weight_scale(reader, ex, m) for m in mods]
                ex.load_expert(e, w[:2], w[2], scales[:2], scales[2], tuple(m + ".weight" for m in mods))
        if self.shared_gate_up is not None:
            s = p + "shared_expert."
            for layer, names in ((self.shared_gate_up, [s + "gate_proj", s + "up_proj"]),
                                 (self.shared_down, [s + "down_proj"]), (self.shared_expert_gate,
                                                                         [p + "shared_expert_gate"])):
                base = getattr(layer, "base", layer)
                for i, name in enumerate(names):
                    base.load_slice(i, reader.get_slice(name + ".weight"), None, weight_scale(reader, base, name),
                                    name + ".weight")


def _check_shape(reader, name: str, want: tuple[int, ...]) -> None:
    got = reader.shape(name)
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: checkpoint shape {tuple(got)}, expected {tuple(want)} from config.json")


class MoECausalLM(CausalLM):
    """CausalLM whose MLPs are SparseMoE blocks (dense MLPs where Qwen's mlp_only_layers / decoder_sparse_step say)."""

    def __init__(self, hf: dict, ps: comm.ParallelState, dtype=torch.float32, device: Any = "cpu",
                 rt: LoRARuntime | None = None, targets: set[str] | None = None, quant: QuantConfig | None = None):
        shape = validate_moe(hf, ps)
        if hf.get("model_type") == "qwen2_moe":  # Qwen2-MoE configs before qkv_bias existed always had q/k/v biases
            hf = {**hf, "qkv_bias": hf.get("qkv_bias", True)}
        step = MoEStep()

        def mlp(i: int):
            if i not in shape.moe_layers:
                return None
            return SparseMoE(hf, shape, i, ps, step, dtype, device, rt, targets, quant)

        super().__init__(hf, ps.tp, dtype, device, rt, targets, mlp_factory=mlp, quant=quant)
        self.moe_shape, self.ps, self.step = shape, ps, step
        if hf.get("model_type") == "mixtral":  # Mixtral applies sliding_window whenever it is set
            self.sliding_window = hf.get("sliding_window") or None
        # EP over DP replicas: every rank of the EP group takes part in every step's dispatch collectives.
        self.needs_lockstep = ps.ep.size > 1 and ps.ep_attention == "dp"
        self.step_chunked = ps.ep.size > 1 and ps.ep_attention == "tp"

    @property
    def graph_blocker(self) -> str | None:
        """Why a step cannot be captured in a CUDA graph (it would sync with the host), or None: expert GEMMs past
        the Triton kernel's rows need torch's grouped GEMM (the loop fallback reads offsets on the host), and no
        chunked shared expert with LoRA (its batch is built on the host). EP over DP replicas: capturable
        (graph_batch)."""
        if self.step_chunked and self.moe_shape.shared_inter and self.rt is not None:
            return "a shared expert with LoRA under EP over the attention TP group builds its batch on the host"
        ex = next((layer.mlp.base_experts for layer in self.layers if isinstance(layer.mlp, SparseMoE)), None)
        for name, w in () if ex is None else (("w13", ex.w13), ("w2", ex.w2)):
            if not torch_grouped_available(self.device, self.dtype, w.shape[2], w.shape[1]):
                return (f"the experts' {name} shard [{w.shape[1]}, {w.shape[2]}] has no grouped GEMM here "
                        f"(torch's needs bf16 on sm90+ and rows of 16-byte multiples)")
        return None

    def _begin_step(self, num_tokens: int) -> None:
        prepare_step(self.step, self.ps, self.rt, num_tokens, self.device)

    def forward(self, input_ids: torch.Tensor, cache, meta) -> torch.Tensor:
        self._begin_step(input_ids.shape[0])
        return super().forward(input_ids, cache, meta)

    # ---- data-parallel lockstep (EP over DP replicas) ----------------------------------------------------------
    def lockstep(self, num_tokens: int, lora: bool = False) -> bool:
        """Called by the engine once per step with this rank's token count (0 = no work) and whether any of its
        tokens has an adapter. Exchanges both over the EP group (the step's only extra collective) and returns False
        when every rank is idle. An idle rank runs the MoE blocks on no tokens of its own (its experts still serve
        the others); a busy rank keeps the counts and flag for its forward (or its graph: graph_batch)."""
        if not self.needs_lockstep:
            return num_tokens > 0
        counts, any_lora = comm.all_gather_counts(num_tokens, self.ps.ep, self.device, lora)
        if max(counts) == 0:
            return False
        self.step.counts, self.step.lora = counts, any_lora
        if num_tokens == 0:
            self.idle_step()
        return True

    # ---- CUDA graphs over EP/DP replicas (the runner's hooks) ----------------------------------------------------
    def pad_to_graph_sizes(self, sizes: tuple[int, ...]) -> None:
        """The runner replays graphs of these row counts (decode batches and mixed-step tokens alike): EP over DP
        replicas rounds every step's dispatch rows up to one of them (capacity; eager steps too), so ranks replaying
        a graph and ranks stepping eagerly agree. A step whose largest rank has more tokens than the largest size
        runs eagerly on every rank of the group, each dispatching that many rows."""
        self.step.buckets = tuple(sizes) if self.needs_lockstep else ()

    def graph_batch(self, num_tokens: int, lora: bool) -> tuple[int, bool]:
        """(rows, LoRA on) of the graph for this rank's step of num_tokens tokens (`lora`: any has an adapter). EP over
        DP replicas: the group's capacity (past the largest graph size: no graph, every rank eager) and whether any
        of its tokens has an adapter (lockstep's), so every rank replays the same graph, whatever its own mix."""
        if not self.needs_lockstep:
            return num_tokens, lora
        if self.step.counts is None:
            raise RuntimeError("EP over DP replicas: a step without lockstep() agreeing on the counts first")
        return capacity(max(self.step.counts), self.step.buckets), self.step.lora

    @contextmanager
    def graph_rows(self, valid: torch.Tensor):
        """Forwards inside run over a graph's rows, `valid` ([1] integer on the device, refreshed before each replay)
        of them real tokens; on leaving, the step's stashed counts are spent (a replay runs no forward)."""
        self.step.valid = valid
        try:
            yield
        finally:
            self.step.valid, self.step.counts = None, None

    @torch.no_grad()
    def idle_step(self) -> None:
        """This rank has no tokens this step but peers of its EP group do (lockstep stashed the counts): attention is
        skipped (its collectives stay inside this rank's own replica, idle as a whole), the MoE blocks serve the
        peers' tokens, and their sums are reduce-scattered by the kernel the busy ranks' next norm runs."""
        saved = self.rt.batch if self.rt is not None else None
        if self.rt is not None:
            self.rt.batch = build_lora_batch([], self.rt.max_loras, self.device)
        try:
            self._begin_step(0)
            x = torch.zeros(0, self.hf["hidden_size"], dtype=self.dtype, device=self.device)
            for layer in self.layers:
                if isinstance(layer.mlp, SparseMoE):
                    group, scatter = layer.defer or (None, False)
                    y = layer.mlp(x, partial=scatter)
                    if scatter:  # the busy ranks' next norm reduce-scatters the sums: the same kernel, no rows kept
                        self.norm.with_residual(y, x, reduce=group, scatter=True)
        finally:
            if self.rt is not None:
                self.rt.batch = saved


def build(hf: dict, tp: comm.Group, dtype, device, rt: LoRARuntime | None, targets: set[str] | None,
          quant: QuantConfig | None = None) -> MoECausalLM:
    """Registry entry: the expert layout registered for this tp group by distributed.init_expert_parallel, or the
    TP layout (every expert on every rank of tp) when none was set up."""
    ps = comm.expert_layout(tp)
    if ps is None:
        ps = comm.ParallelState(world=tp, tp=tp, dp=comm.Group("dp"), device=torch.device(device))
    return MoECausalLM(hf, ps, dtype, device, rt, targets, quant)
