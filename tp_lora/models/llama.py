"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over tensor-parallel layers, built from a HF config.json.

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
from tp_lora.lora.layers import LoRARuntime, wrap
from tp_lora.models.attention import AttnMeta, KVCache, attend
from tp_lora.sharding import unit_range

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")  # per-head RMSNorm on q and k


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 and cast back before the weight, as transformers does: bit-parity in low precision.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(hf: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for rope_scaling types default, linear and llama3."""
    theta = hf.get("rope_theta", 10000.0)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (wavelen <= old / low) & (wavelen >= old / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (expected default, linear or llama3)")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, 1, d] (the rotate-half convention of HF checkpoints)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, hf: dict, idx: int, tp: comm.Group, dtype, device, rt: LoRARuntime | None, targets):
        super().__init__()
        hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        self.head_dim = hf.get("head_dim") or hidden // heads
        self.heads = heads // tp.size
        k0, k1 = unit_range(kv, tp.rank, tp.size, "num_key_value_heads")
        self.kv_heads = k1 - k0
        self.scale = self.head_dim ** -0.5
        bias = hf.get("model_type") == "qwen2" or hf.get("attention_bias", False) or hf.get("qkv_bias", False)
        prefix = f"model.layers.{idx}.self_attn."
        self.qkv_proj = _maybe_wrap(
            ParallelLinear(qkv_spec(hidden, heads, kv, self.head_dim), tp, bias, dtype, device), rt,
            [prefix + n for n in ("q_proj", "k_proj", "v_proj")], targets)
        self.o_proj = _maybe_wrap(ParallelLinear(row_spec(heads * self.head_dim, hidden), tp,
                                                 hf.get("attention_bias", False) and hf.get("model_type") != "qwen2",
                                                 dtype, device), rt, [prefix + "o_proj"], targets)
        self.layer_idx = idx
        # Qwen3(-MoE): RMSNorm over each head's dim on q and k before RoPE (per head, so TP needs nothing).
        qk_norm = hf.get("model_type") in QK_NORM_TYPES
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, device) if qk_norm else None

    def forward(self, x, cos, sin, cache: KVCache, meta: AttnMeta):
        qkv = self.qkv_proj(x)
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q, k = q.view(-1, self.heads, d), k.view(-1, self.kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q, cos, sin)
        k = rotate(k, cos, sin)
        out = attend(q, k, v.view(-1, self.kv_heads, d), cache, self.layer_idx, meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, hf: dict, idx: int, tp: comm.Group, dtype, device, rt, targets):
        super().__init__()
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf.get('hidden_act')!r} is not supported (expected silu)")
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        prefix = f"model.layers.{idx}.mlp."
        self.gate_up_proj = _maybe_wrap(ParallelLinear(column_spec(hidden, inter, inter), tp, False, dtype, device),
                                        rt, [prefix + "gate_proj", prefix + "up_proj"], targets)
        self.down_proj = _maybe_wrap(ParallelLinear(row_spec(inter, hidden), tp, False, dtype, device), rt,
                                     [prefix + "down_proj"], targets)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hf, idx, tp, dtype, device, rt, targets, mlp: nn.Module | None = None):
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps, dtype, device)
        self.self_attn = Attention(hf, idx, tp, dtype, device, rt, targets)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps, dtype, device)
        self.mlp = mlp if mlp is not None else MLP(hf, idx, tp, dtype, device, rt, targets)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def _maybe_wrap(base: nn.Module, rt: LoRARuntime | None, paths: list[str], targets: set[str] | None) -> nn.Module:
    """Wrap when LoRA is on and some adapter targets one of the layer's modules (targets None = wrap all)."""
    if rt is None:
        return base
    if targets is not None and not any(p.rsplit(".", 1)[-1] in targets for p in paths):
        return base
    return wrap(base, rt, paths)


class CausalLM(nn.Module):
    """Llama-family causal LM. `targets`: short module names some adapter targets (q_proj, ..., embed_tokens,
    lm_head); None wraps every linear layer. `mlp_factory(idx)` lets MoE models swap the MLP."""

    def __init__(self, hf: dict, tp: comm.Group, dtype=torch.float32, device="cpu", rt: LoRARuntime | None = None,
                 targets: set[str] | None = None, mlp_factory=None):
        super().__init__()
        if hf.get("model_type") not in SUPPORTED and mlp_factory is None:
            raise ConfigError(f"model_type={hf.get('model_type')!r} is not supported (expected one of {SUPPORTED})")
        self.hf, self.tp, self.rt = hf, tp, rt
        vocab, hidden = hf["vocab_size"], hf["hidden_size"]
        embed = VocabParallelEmbedding(vocab, hidden, tp, dtype, device)
        self.embed_tokens = _maybe_wrap(embed, rt, ["model.embed_tokens"], targets if targets is not None else set())
        self.layers = nn.ModuleList([
            DecoderLayer(hf, i, tp, dtype, device, rt, targets, mlp_factory(i) if mlp_factory else None)
            for i in range(hf["num_hidden_layers"])])
        self.norm = RMSNorm(hidden, hf.get("rms_norm_eps", 1e-6), dtype, device)
        self.tied = bool(hf.get("tie_word_embeddings", False))
        head = ParallelLMHead(vocab, hidden, tp, dtype, device, tied_to=embed if self.tied else None)
        self.lm_head = _maybe_wrap(head, rt, ["lm_head"], targets if targets is not None else set())
        attn = self.layers[0].self_attn
        self.head_dim, self.kv_heads = attn.head_dim, attn.kv_heads
        self.register_buffer("inv_freq", rope_inv_freq(hf, self.head_dim).to(device), persistent=False)
        window = hf.get("sliding_window")
        use_window = hf.get("use_sliding_window", hf.get("model_type") == "mistral")
        self.sliding_window = window if (window and use_window) else None
        self.dtype, self.device = dtype, torch.device(device)

    def new_cache(self, max_seqs: int, max_len: int) -> KVCache:
        return KVCache(len(self.layers), max_seqs, max_len, self.kv_heads, self.head_dim, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, meta: AttnMeta) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, H]."""
        freqs = meta.positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (gathered over the TP group), float32."""
        return self.lm_head(hidden).float()
