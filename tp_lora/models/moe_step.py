"""The MoE blocks' facts outside the blocks: what config.json says about them (MoEShape, checked against the layout
by validate_moe before any collective) and the per-step dispatch facts every block of a model reads (MoEStep, filled
by prepare_step: the tokens this rank routes, the rows of an EP dispatch, the adapters' slots)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tp_lora import distributed as comm
from tp_lora.config import ConfigError
from tp_lora.lora.layers import LoRARuntime
from tp_lora.ops.batch import LoRABatch, build_lora_batch
from tp_lora.sharding import token_chunk

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass
class MoEShape:
    """What a config.json says about the MoE blocks."""
    model_type: str
    num_experts: int
    top_k: int
    inter: int  # per-expert intermediate size
    renormalize: bool
    shared_inter: int  # 0 = no shared expert
    moe_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict) -> MoEShape:
        kind = hf.get("model_type")
        if kind not in MOE_TYPES:
            raise ConfigError(f"model_type={kind!r} is not an MoE model (expected one of {MOE_TYPES})")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf.get('hidden_act')!r} is not supported (expected silu)")
        n = hf["num_hidden_layers"]
        if kind == "mixtral":
            return cls(kind, hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"], True, 0,
                       tuple(range(n)))
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts:
            raise ConfigError(f"{kind}: config.json has num_experts={experts!r}; dense layers only are not an MoE")
        only_mlp = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        layers = tuple(i for i in range(n) if i not in only_mlp and (i + 1) % step == 0)
        shared = hf.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
        return cls(kind, experts, hf["num_experts_per_tok"], hf["moe_intermediate_size"],
                   bool(hf.get("norm_topk_prob", False)), shared or 0, layers)


def validate_moe(hf: dict, ps: comm.ParallelState) -> MoEShape:
    """Layout checks against config.json; raised on every rank before the model's first collective."""
    shape = MoEShape.from_hf(hf)
    ep, mtp = ps.ep.size, ps.moe_tp.size
    if shape.num_experts % ep:
        raise ConfigError(f"parallel.ep_size={ep} does not divide the model's {shape.num_experts} experts")
    if shape.inter % mtp:
        raise ConfigError(f"the model's expert intermediate size {shape.inter} is not divisible by the {mtp} ranks "
                          f"each expert is split over (parallel.tp_size)")
    if shape.shared_inter % mtp:
        raise ConfigError(f"the model's shared_expert_intermediate_size={shape.shared_inter} is not divisible by "
                          f"the {mtp} ranks each expert is split over (parallel.tp_size)")
    if hf.get("model_type") == "qwen2_moe" and hf.get("use_sliding_window"):
        raise ConfigError("qwen2_moe with use_sliding_window=true (per-layer windows) is not supported")
    return shape


@dataclass
class MoEStep:
    """Per-step facts every MoE block of a model reads (set once per forward, like LoRARuntime.batch)."""
    owned: tuple[int, int] = (0, 0)  # tokens [c0, c1) of the step this rank owns: all of them but under EP/TP,
    # whose replicated tokens are split in chunks (each rank's shared expert runs over its own)
    rows: int = 0  # EP over DP replicas: rows each rank contributes to the dispatch all-gather (max over the group)
    slots: torch.Tensor | None = None  # [tokens] int32 adapter slot per token of the step (None: no LoRA runtime)
    batch: LoRABatch | None = None  # LoRA metadata of the owned tokens (shared expert; None without one)
    shared_expert: bool = False  # whether a block has a shared expert (set by SparseMoE; it reads `batch`)
    counts: list[int] | None = field(default=None)  # token counts of the EP group, stashed by lockstep()
    lora: bool = False  # EP over DP replicas: whether any token of the group has an adapter (agreed with the counts)
    # EP over DP replicas: row counts a dispatch's rows are rounded up to (the runner's CUDA-graph sizes, decode and
    # mixed, while it replays graphs), so a rank replaying a graph and one stepping eagerly exchange equal buffers.
    buckets: tuple[int, ...] = ()
    valid: torch.Tensor | None = None  # [1] int on the device: the real rows of a graph's padded ones (None: all)


def capacity(tokens: int, buckets: tuple[int, ...]) -> int:
    """Rows per rank of an EP-over-DP dispatch whose largest rank has `tokens`: the smallest bucket holding them, else
    `tokens` (every rank computes it from the same counts; past the largest bucket no graph has that size and the
    whole group steps eagerly, every token dispatched: none is ever dropped)."""
    return next((b for b in buckets if b >= tokens), tokens)


def prepare_step(step: MoEStep, ps: comm.ParallelState, rt: LoRARuntime | None, num_tokens: int, device) -> None:
    """Fill `step` for a forward over num_tokens tokens (rt.batch, if any, describes them). EP over DP replicas needs
    the EP group's token counts and LoRA flag: those stashed by lockstep, else exchanged here (one collective); a
    forward over a graph's padded rows (step.valid set) needs neither: its rows are the capacity the group agreed."""
    if ps.ep.size > 1 and ps.ep_attention == "tp":
        step.owned, step.rows = token_chunk(num_tokens, ps.ep.rank, ps.ep.size), 0
    elif ps.ep.size > 1 and step.valid is not None:
        step.owned, step.rows = (0, num_tokens), num_tokens
    elif ps.ep.size > 1:
        if step.counts is None:
            step.counts, step.lora = comm.all_gather_counts(num_tokens, ps.ep, device, rt is not None and rt.active())
        counts = step.counts
        if counts[ps.ep.rank] != num_tokens:
            raise RuntimeError(f"lockstep announced {counts[ps.ep.rank]} tokens for this rank's step, but the forward "
                               f"has {num_tokens}")
        step.owned, step.rows = (0, num_tokens), capacity(max(counts), step.buckets)
    else:
        step.owned, step.rows = (0, num_tokens), num_tokens
    step.counts = None
    c0, c1 = step.owned
    if rt is None:
        step.slots = step.batch = None
    elif rt.batch is None or rt.batch.num_tokens != num_tokens:
        raise RuntimeError(f"the LoRA batch describes {None if rt.batch is None else rt.batch.num_tokens} tokens, "
                           f"the MoE step {num_tokens}")
    else:
        step.slots = rt.batch.token_slot
        if (c0, c1) == (0, num_tokens):
            step.batch = rt.batch
        elif step.shared_expert:  # a chunk's batch is built on the host (a sync)
            step.batch = build_lora_batch(rt.batch.token_slot[c0:c1].cpu(), rt.max_loras, device)
        else:
            step.batch = None
