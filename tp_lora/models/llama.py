"""Llama-family decoder over tensor-parallel layers, built from a HF config.json: Llama, Mistral, Qwen2, Qwen3, Phi-3
(fused qkv / gate_up modules, longrope), Gemma 2 / Gemma 3 text ((1 + w) norms, soft-caps, per-layer windows and
RoPE bases).

Module names mirror transformers' so a PEFT module path ("model.layers.3.self_attn.q_proj") maps onto a
(LoRA layer, slice) of this model: q/k/v are slices of one packed qkv_proj, gate/up of one gate_up_proj.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tp_lora import distributed as comm
from tp_lora.config import ConfigError
from tp_lora.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_lora.layers.linear import ParallelLinear, column_spec, qkv_spec, row_spec
from tp_lora.layers.quant import FP8Scheme, QuantConfig
from tp_lora.lora.layers import LoRARuntime, maybe_wrap
from tp_lora.models.attention import AttnMeta, KVCache, decodes_only, rope_attend
from tp_lora.ops.fp8 import ACT8_GROUP, FP8_DTYPE, empty_rows8
from tp_lora.ops.fused import ACTIVATIONS, Rows8, act_mul, add_rms_norm, reduce_add_rms_norm
from tp_lora.ops.paged_attention import rope_kernel_takes
from tp_lora.ops.split_sums import SplitSums
from tp_lora.sharding import unit_range

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")  # per-head RMSNorm on q and k
GEMMA_TYPES = ("gemma2", "gemma3_text")  # (1 + weight) norms, scaled embeddings, norms around attention and MLP
FUSED_TYPES = ("phi3",)  # checkpoints and PEFT adapters name one qkv_proj and one gate_up_proj module


class RMSNorm(nn.Module):
    """offset (Gemma): the weight is stored as w - 1 and applied, in float32, as (1 + w). In float32 and cast back
    as transformers does (tp_lora.ops.fused.rms_norm_ref): bit-parity in low precision."""

    def __init__(self, dim: int, eps: float, dtype, device, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps, self.offset)[0]

    def with_residual(self, x: torch.Tensor, residual: torch.Tensor | None, first: RMSNorm | None = None,
                      reduce: comm.Group | None = None, scatter: bool = False, feeds: nn.Module | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, Rows8 | None]:
        """(norm(x + residual), x + residual, None) in one pass; residual None: (norm(x), x, None). first: a norm of
        the same eps and offset applied to x before the add (Gemma's post-attention norm), in the same pass. reduce:
        x is a row-parallel layer's partial output, summed over this group first (fused with the rest where it can
        be); scatter: x holds every rank's rows (EP experts' sums), of which this rank's chunk is summed. feeds: the
        layer the normed rows go to; where it reads them quantized (an fp8 layer's takes_rows8), the third item
        holds them so, from the same pass: per token, else (block-scaled layers at decode, a local norm) per 128
        columns."""
        xw = None if first is None else first.weight
        fused = reduce is not None and reduce.size > 1
        out8 = None
        if feeds is not None:  # the output's rows: the residual's, else x's (this rank's chunk of them: scatter)
            if residual is not None:
                rows = residual
            else:
                rows = x[:x.shape[0] // reduce.size] if fused and scatter else x
            out8 = rows8_for(feeds, rows, not fused)
        if fused:
            return *reduce_add_rms_norm(x, residual, self.weight, self.eps, self.offset, xw, reduce, scatter,
                                        out8), out8
        return *add_rms_norm(x, residual, self.weight, self.eps, self.offset, xw, out8), out8


def rows8_for(layer: nn.Module, rows: torch.Tensor, groups: bool = True) -> Rows8 | None:
    """Buffers for an op's output rows (rows: any tensor of their shape, dtype and device) quantized as `layer` reads
    them: per token where it takes that (takes_rows8), else with groups per ACT8_GROUP columns where it takes those
    (block-scaled fp8 layers at decode; the ACT8 GEMM without its quantization), else None."""
    if layer.takes_rows8(rows):
        return empty_rows8(rows)
    n = rows.shape[-1]
    whole = groups and n % ACT8_GROUP == 0 and n > ACT8_GROUP  # (one group's scales would read as a token's)
    return empty_rows8(rows, n, n // ACT8_GROUP) if whole and layer.takes_rows8(rows, ACT8_GROUP) else None


def rope_params(hf: dict, layer_type: str | None = None) -> dict:
    """RoPE settings {rope_theta, rope_type, factor, ...} of one layer type. Gemma 3 gives sliding layers their own
    (rope_parameters per layer type in transformers 5 configs, rope_local_base_freq in older ones)."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get(layer_type), dict):
        return dict(rp[layer_type])
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        return {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    flat = isinstance(rp, dict) and not any(isinstance(v, dict) for v in rp.values())  # transformers 5
    params = dict(rp) if flat else dict(hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):  # top level in older configs
        if key not in params and key in hf:
            params[key] = hf[key]
    return params


def rope_inv_freq(params: dict, dim: int) -> torch.Tensor:
    """Inverse frequencies [dim/2] for rope types default, linear and llama3 (longrope: see Rotary)."""
    theta = params.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / params["factor"]).float()
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (expected default, linear, llama3 or longrope)")


class Rotary(nn.Module):
    """RoPE of one layer type: cos/sin [T, 1, rotary_dim] for a step's positions (rotary_dim < head_dim with
    partial_rotary_factor: the rest of each head passes through).

    longrope (Phi-3's "su"): short_factor below original_max_position_embeddings, long_factor from there on, per
    token as vLLM does (transformers switches a whole sequence once it is longer), cos/sin times attention_factor."""

    def __init__(self, hf: dict, head_dim: int, layer_type: str | None, device):
        super().__init__()
        p = rope_params(hf, layer_type)
        self.rotary_dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
        kind = p.get("rope_type", p.get("type", "default"))
        self.attention_factor, self.original = 1.0, None
        if kind in ("longrope", "su"):
            orig = p["original_max_position_embeddings"]
            factor = p.get("factor") or hf["max_position_embeddings"] / orig
            self.attention_factor = p.get("attention_factor") or (
                1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
            base = rope_inv_freq({"rope_theta": p["rope_theta"]}, self.rotary_dim)
            short, long = (torch.tensor(p[k], dtype=torch.float32) for k in ("short_factor", "long_factor"))
            self.original = orig
            inv, long_inv = base / short, base / long
        else:
            inv, long_inv = rope_inv_freq(p, self.rotary_dim), None
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.register_buffer("long_inv_freq", None if long_inv is None else long_inv.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions.float()[:, None]
        freqs = pos * self.inv_freq[None]
        if self.long_inv_freq is not None:
            freqs = torch.where(pos >= self.original, pos * self.long_inv_freq[None], freqs)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def layer_types(hf: dict) -> list[str]:
    """'sliding_attention' or 'full_attention' per layer: the config's layer_types where the family has them
    (Qwen3, Gemma), else Gemma's rule (Gemma 2 alternates, Gemma 3 has one global layer in sliding_window_pattern),
    else one kind for every layer (Mistral and Phi-3 slide whenever sliding_window is set, Qwen2 with
    use_sliding_window)."""
    n, kind = hf["num_hidden_layers"], hf.get("model_type")
    if kind in ("qwen3",) + GEMMA_TYPES and hf.get("layer_types"):
        types = list(hf["layer_types"])
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ConfigError(f"layer_types={types}: expected {n} entries of sliding_attention / full_attention")
        return types
    if kind == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if kind == "gemma3_text":
        pattern = hf.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    slide = hf.get("sliding_window") and hf.get("use_sliding_window", kind in ("mistral", "phi3"))
    return ["sliding_attention" if slide else "full_attention"] * n


def layer_windows(hf: dict) -> list[int | None]:
    return [hf.get("sliding_window") if t == "sliding_attention" else None for t in layer_types(hf)]


def scheme(quant: QuantConfig | None, paths: list[str]) -> FP8Scheme | None:
    """The fp8 scheme of the layer answering to these module paths (None: unquantized)."""
    return None if quant is None else quant.for_module(paths)


class Attention(nn.Module):
    def __init__(self, hf: dict, idx: int, tp: comm.Group, dtype, device, rt: LoRARuntime | None, targets,
                 quant: QuantConfig | None = None):
        super().__init__()
        kind = hf.get("model_type")
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        self.head_dim = hf.get("head_dim") or hidden // heads
        self.heads = heads // tp.size
        k0, k1 = unit_range(kv, tp.rank, tp.size, "num_key_value_heads")
        self.kv_heads = k1 - k0
        self.scale = (hf["query_pre_attn_scalar"] if kind in GEMMA_TYPES else self.head_dim) ** -0.5
        self.softcap = hf.get("attn_logit_softcapping") if kind in GEMMA_TYPES else None
        windows = layer_windows(hf)  # a window shared by every layer is in the step's mask instead
        self.window = windows[idx] if len(set(windows)) > 1 else None
        bias = kind == "qwen2" or hf.get("attention_bias", False) or hf.get("qkv_bias", False)
        prefix = f"model.layers.{idx}.self_attn."
        fused = kind in FUSED_TYPES
        paths = [prefix + "qkv_proj"] if fused else [prefix + n for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = maybe_wrap(
            ParallelLinear(qkv_spec(hidden, heads, kv, self.head_dim), tp, bias, dtype, device,
                           quant=scheme(quant, paths)), rt, paths, targets, fused)
        self.o_proj = maybe_wrap(ParallelLinear(row_spec(heads * self.head_dim, hidden), tp,
                                                 hf.get("attention_bias", False) and kind != "qwen2",
                                                 dtype, device, quant=scheme(quant, [prefix + "o_proj"])), rt,
                                  [prefix + "o_proj"], targets)
        self.layer_idx = idx
        # Qwen3(-MoE), Gemma 3: RMSNorm over each head's dim on q and k before RoPE (per head, so TP needs nothing),
        # applied by rope_write_kv with these modules' weights.
        qk_norm = kind in QK_NORM_TYPES
        eps, offset = hf.get("rms_norm_eps", 1e-6), kind in GEMMA_TYPES
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, device, offset) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, device, offset) if qk_norm else None
        # An fp8 KV cache holds k / k_scale and v / v_scale (the checkpoint's self_attn.k_scale / v_scale, else 1):
        # the scores take k_scale with the softmax scale, the output v_scale.
        self.kv_scales = (1.0, 1.0)

    def forward(self, x, cos, sin, cache: KVCache, meta: AttnMeta, partial: bool = False, x8: Rows8 | None = None):
        """partial: o_proj's output before its all-reduce, possibly as SplitSums (the caller's norm reduces or sums
        it, see DecoderLayer). x8: x quantized per token (qkv_proj.takes_rows8)."""
        d = self.head_dim
        ks, vs = self.kv_scales if cache.k[self.layer_idx].dtype == FP8_DTYPE else (1.0, 1.0)
        # A step of decodes only in the decode kernel: it sums the qkv GEMM's K shares (SplitSums) itself, and
        # writes its output quantized per (row, head) where o_proj's ACT8 GEMM would quantize it so (o8).
        fused = decodes_only(meta) and rope_kernel_takes(x, d, cos.shape[-1])
        qkv = self.qkv_proj.partial(x, x8, sums=True) if fused else self.qkv_proj(x, x8)
        o8 = empty_rows8(x, self.heads * d, self.heads) if (fused and vs == 1.0
                                                            and self.o_proj.takes_rows8(x, group=d)) else None
        sums = qkv if isinstance(qkv, SplitSums) else None
        rows = qkv if sums is None else sums.parts[0]
        q, k, v = rows.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k, v = q.view(-1, self.heads, d), k.view(-1, self.kv_heads, d), v.view(-1, self.kv_heads, d)
        norm = self.q_norm is not None
        out = rope_attend(q, k, v, cos, sin, cache, self.layer_idx, meta, self.scale * ks, self.window, self.softcap,
                          self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                          self.q_norm.eps if norm else 0.0, norm and self.q_norm.offset, (ks, vs), sums, o8)
        out = out if vs == 1.0 else out * vs
        return self.o_proj.partial(out, o8, sums=True) if partial else self.o_proj(out, o8)


class MLP(nn.Module):
    def __init__(self, hf: dict, idx: int, tp: comm.Group, dtype, device, rt, targets,
                 quant: QuantConfig | None = None):
        super().__init__()
        act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"hidden_act={act!r} is not supported (expected one of {sorted(ACTIVATIONS)})")
        self.act = act
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        prefix = f"model.layers.{idx}.mlp."
        fused = hf.get("model_type") in FUSED_TYPES
        paths = [prefix + "gate_up_proj"] if fused else [prefix + "gate_proj", prefix + "up_proj"]
        self.gate_up_proj = maybe_wrap(ParallelLinear(column_spec(hidden, inter, inter), tp, False, dtype, device,
                                                      quant=scheme(quant, paths)), rt, paths, targets, fused)
        self.down_proj = maybe_wrap(ParallelLinear(row_spec(inter, hidden), tp, False, dtype, device,
                                                   quant=scheme(quant, [prefix + "down_proj"])), rt,
                                     [prefix + "down_proj"], targets)

    def takes_rows8(self, x: torch.Tensor, group: int | None = None) -> bool:
        return self.gate_up_proj.takes_rows8(x, group)

    def forward(self, x, partial: bool = False, x8: Rows8 | None = None):
        """partial: down_proj's output before its all-reduce, possibly as SplitSums (the caller's norm reduces or
        sums it, see DecoderLayer). x8: x quantized (takes_rows8); act_mul hands down_proj its rows
        quantized where it takes them (rows8_for)."""
        g = self.gate_up_proj(x, x8)
        h8 = rows8_for(self.down_proj, g[..., :g.shape[-1] // 2])
        h = act_mul(g, self.act, h8)
        return self.down_proj.partial(h, h8, sums=True) if partial else self.down_proj(h, h8)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. Gemma also norms the attention output (post_attention_layernorm) and both sides of
    the MLP (pre_ / post_feedforward_layernorm); elsewhere post_attention_layernorm is the MLP's input norm.

    The residual stream is carried beside the block's output, as vLLM does: layer(x, residual) -> (x, residual)
    with the stream = x + residual, so each residual add is fused into the norm that follows it. Under tensor
    parallelism the all-reduce that ends o_proj / down_proj joins that norm too (reduce_add_rms_norm): the layer
    returns down_proj's partial output where it defers the reduce (`defer`: the group and whether it scatters), and
    the next norm (the next layer's, or the model's final one) sums it; so does an MoE block whose last collective is
    a sum over tp (its defer_group) or EP's reduce-scatter (its defer_scatter). On one rank o_proj and down_proj
    hand on their decode GEMM's K shares (SplitSums) the same way, for the next norm to sum; under tp 16-bit ones do
    too (fp8 GEMMs sum their own), summed by the fused all-reduce, and with adapters the LoRA delta beside them (an
    unsplit output as one share). Row layers with a bias, the other MoE layouts and Gemma's post-feedforward norm
    keep it in the layer."""

    def __init__(self, hf, idx, tp, dtype, device, rt, targets, mlp: nn.Module | None = None,
                 quant: QuantConfig | None = None):
        super().__init__()
        eps, h = hf.get("rms_norm_eps", 1e-6), hf["hidden_size"]
        self.gemma = hf.get("model_type") in GEMMA_TYPES
        self.input_layernorm = RMSNorm(h, eps, dtype, device, self.gemma)
        self.self_attn = Attention(hf, idx, tp, dtype, device, rt, targets, quant)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, self.gemma)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, device, True)
            self.post_feedforward_layernorm = RMSNorm(h, eps, dtype, device, True)
        self.mlp = mlp if mlp is not None else MLP(hf, idx, tp, dtype, device, rt, targets, quant)
        self.tp = tp
        self.fuse_attn = bias_free(self.self_attn.o_proj)
        self.defer: tuple[comm.Group, bool] | None = None  # (group, scatter) of the reduce the next norm does
        dense = isinstance(self.mlp, MLP) and bias_free(self.mlp.down_proj)
        if not self.gemma and (dense or tp.size > 1 and getattr(self.mlp, "defer_group", None) is tp):
            self.defer = (tp, False)  # a row-parallel down_proj, or an MoE block whose sum ends over tp
        elif not self.gemma and getattr(self.mlp, "defer_scatter", None) is not None:
            self.defer = (self.mlp.defer_scatter, True)

    def forward(self, x, residual, cos, sin, cache, meta, x_defer: tuple[comm.Group, bool] | None = None):
        """x, residual [T, H] (residual None in the first layer: x is the stream) -> (x, residual); x_defer: x is
        the previous layer's partial output (its defer); the returned x is partial where this layer defers."""
        group, scatter = x_defer or (None, False)
        h, residual, h8 = self.input_layernorm.with_residual(x, residual, reduce=group, scatter=scatter,
                                                             feeds=self.self_attn.qkv_proj)
        h = self.self_attn(h, cos, sin, cache, meta, partial=self.fuse_attn, x8=h8)
        attn_tp = self.tp if self.fuse_attn else None
        if self.gemma:
            h, residual, h8 = self.pre_feedforward_layernorm.with_residual(
                h, residual, self.post_attention_layernorm, reduce=attn_tp, feeds=self.mlp)
            return self.post_feedforward_layernorm(self.mlp(h, x8=h8)), residual
        h, residual, h8 = self.post_attention_layernorm.with_residual(h, residual, reduce=attn_tp, feeds=self.mlp)
        return self.mlp(h, partial=bool(self.defer), x8=h8), residual


def bias_free(layer: nn.Module) -> bool:
    """Whether a (LoRA-wrapped) row-parallel layer has no bias, so its all-reduce can move past the layer."""
    return getattr(layer, "base", layer).bias is None


class CausalLM(nn.Module):
    """Llama-family causal LM. `targets`: short module names some adapter targets (q_proj, ..., embed_tokens,
    lm_head); None wraps every linear layer. `mlp_factory(idx)` lets MoE models swap the MLP. quant: the fp8 layers
    (tp_lora.layers.quant; embeddings and the LM head stay in `dtype`)."""

    def __init__(self, hf: dict, tp: comm.Group, dtype=torch.float32, device="cpu", rt: LoRARuntime | None = None,
                 targets: set[str] | None = None, mlp_factory=None, quant: QuantConfig | None = None):
        super().__init__()
        if hf.get("model_type") not in SUPPORTED and mlp_factory is None:
            raise ConfigError(f"model_type={hf.get('model_type')!r} is not supported (expected one of {SUPPORTED})")
        self.hf, self.tp, self.rt, self.quant = hf, tp, rt, quant
        vocab, hidden = hf["vocab_size"], hf["hidden_size"]
        embed = VocabParallelEmbedding(vocab, hidden, tp, dtype, device)
        self.embed_tokens = maybe_wrap(embed, rt, ["model.embed_tokens"], targets if targets is not None else set())
        self.layers = nn.ModuleList([
            DecoderLayer(hf, i, tp, dtype, device, rt, targets, mlp_factory(i) if mlp_factory else None, quant)
            for i in range(hf["num_hidden_layers"])])
        kind = hf.get("model_type")
        gemma = kind in GEMMA_TYPES
        self.norm = RMSNorm(hidden, hf.get("rms_norm_eps", 1e-6), dtype, device, gemma)
        self.tied = bool(hf.get("tie_word_embeddings", False))
        head = ParallelLMHead(vocab, hidden, tp, dtype, device, tied_to=embed if self.tied else None)
        self.lm_head = maybe_wrap(head, rt, ["lm_head"], targets if targets is not None else set())
        attn = self.layers[0].self_attn
        self.head_dim, self.kv_heads = attn.head_dim, attn.kv_heads
        # Gemma: embeddings times sqrt(hidden) rounded to the model dtype, as transformers does.
        self.embed_scale = torch.tensor(hidden ** 0.5, dtype=dtype).item() if gemma else None
        self.final_softcap = hf.get("final_logit_softcapping") if gemma else None
        # RoPE per layer type: Gemma 3's sliding layers have their own base; every other family one for all.
        self.layer_types = layer_types(hf) if kind == "gemma3_text" else ["full_attention"] * len(self.layers)
        self.rotary = nn.ModuleDict({t: Rotary(hf, self.head_dim, t if kind == "gemma3_text" else None, device)
                                     for t in sorted(set(self.layer_types))})
        windows = layer_windows(hf)
        self.sliding_window = windows[0] if len(set(windows)) == 1 else None  # per-layer windows: in Attention
        self.dtype, self.device = dtype, torch.device(device)
        self.kv_dtype = dtype  # what the KV cache holds: dtype, or float8_e4m3fn (scheduler.kv_cache_dtype=fp8)

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        return KVCache(len(self.layers), num_blocks, block_size, self.kv_heads, self.head_dim, self.kv_dtype,
                       self.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, meta: AttnMeta) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, H]."""
        tables = {t: rope(meta.positions, self.dtype) for t, rope in self.rotary.items()}
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        residual, defer = None, None
        for layer, t in zip(self.layers, self.layer_types):
            x, residual = layer(x, residual, *tables[t], cache, meta, defer)
            defer = layer.defer
        group, scatter = defer or (None, False)
        return self.norm.with_residual(x, residual, reduce=group, scatter=scatter)[0]

    def vocab_shard(self) -> tuple[int, comm.Group] | None:
        """(this rank's first token, the TP group) where logits(gather=False) leaves each TP rank its vocabulary
        shard (p > 1, a head without logits LoRA), else None."""
        head = self.lm_head
        return (head.vocab_start, self.tp) if self.tp.size > 1 and isinstance(head, ParallelLMHead) else None

    def logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (gathered over the TP group), float32; Gemma's final soft-cap applied.
        gather False where vocab_shard(): this rank's shard [N, V / p]."""
        head = self.lm_head
        logits = (head(hidden) if gather or self.vocab_shard() is None else head.partial(hidden)).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
