"""Fill a CausalLM from a HF checkpoint, each rank reading only the slices it holds."""
from __future__ import annotations

import torch
from torch import nn

from tp_lora.models.checkpoint import CheckpointReader


def base_of(m: nn.Module) -> nn.Module:
    """The base parallel layer under a LoRA wrapper (or m itself)."""
    return getattr(m, "base", m)


def _load_packed(reader: CheckpointReader, layer: nn.Module, names: list[str]) -> None:
    layer = base_of(layer)
    for s, name in enumerate(names):
        bias = reader.get_slice(name + ".bias") if reader.has(name + ".bias") else None
        layer.load_slice(s, reader.get_slice(name + ".weight"), bias)


def _load_fused_or_packed(reader: CheckpointReader, layer: nn.Module, fused: str, names: list[str]) -> None:
    """A packed layer from one fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) when the checkpoint has it,
    else from one tensor per slice."""
    if not reader.has(fused + ".weight"):
        _load_packed(reader, layer, names)
        return
    bias = reader.get_slice(fused + ".bias") if reader.has(fused + ".bias") else None
    base_of(layer).load_fused(reader.get_slice(fused + ".weight"), bias)


def _load_norm(reader: CheckpointReader, norm: nn.Module, name: str) -> None:
    w = reader.get(name)
    if tuple(w.shape) != tuple(norm.weight.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)}, expected {tuple(norm.weight.shape)}")
    norm.weight.data.copy_(w)


def load_dense_layer(reader: CheckpointReader, layer: nn.Module, i: int) -> None:
    """Attention and norms of decoder layer i (the MLP of dense models too: MoE models load their own)."""
    p = f"model.layers.{i}."
    _load_norm(reader, layer.input_layernorm, p + "input_layernorm.weight")
    _load_norm(reader, layer.post_attention_layernorm, p + "post_attention_layernorm.weight")
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # Gemma
        if hasattr(layer, name):
            _load_norm(reader, getattr(layer, name), p + name + ".weight")
    attn = layer.self_attn
    _load_fused_or_packed(reader, attn.qkv_proj, p + "self_attn.qkv_proj",
                          [p + f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")])
    _load_packed(reader, attn.o_proj, [p + "self_attn.o_proj"])
    if getattr(attn, "q_norm", None) is not None:
        _load_norm(reader, attn.q_norm, p + "self_attn.q_norm.weight")
        _load_norm(reader, attn.k_norm, p + "self_attn.k_norm.weight")
    if hasattr(layer.mlp, "gate_up_proj"):
        _load_fused_or_packed(reader, layer.mlp.gate_up_proj, p + "mlp.gate_up_proj",
                              [p + "mlp.gate_proj", p + "mlp.up_proj"])
        _load_packed(reader, layer.mlp.down_proj, [p + "mlp.down_proj"])
    else:
        layer.mlp.load(reader, p + "mlp.")


@torch.no_grad()
def load_weights(model: nn.Module, reader: CheckpointReader) -> None:
    base_of(model.embed_tokens).load(reader.get_slice("model.embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        load_dense_layer(reader, layer, i)
    _load_norm(reader, model.norm, "model.norm.weight")
    if not model.tied:
        base_of(model.lm_head).load(reader.get_slice("lm_head.weight"))
