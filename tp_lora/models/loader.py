"""Fill a CausalLM from a HF checkpoint, each rank reading only the slices it holds (and, for fp8 layers, the whole
scale tensors: small, cut per rank by tp_lora.sharding.scale_part)."""
from __future__ import annotations

import torch
from torch import nn

from tp_lora.models.checkpoint import CheckpointError, CheckpointReader


def base_of(m: nn.Module) -> nn.Module:
    """The base parallel layer under a LoRA wrapper (or m itself)."""
    return getattr(m, "base", m)


def weight_scale(reader: CheckpointReader, layer: nn.Module, name: str) -> torch.Tensor | None:
    """The whole scale tensor of module `name` when `layer` holds checkpoint fp8 weights (its scheme's scale
    names, first present), else None (the layer refuses an fp8 weight without it)."""
    quant = getattr(layer, "quant", None)
    if quant is None or quant.at_load:
        return None
    found = next((name + "." + n for n in quant.scale_names if reader.has(name + "." + n)), None)
    return reader.get(found) if found is not None else None


def _load_packed(reader: CheckpointReader, layer: nn.Module, names: list[str]) -> None:
    layer = base_of(layer)
    for s, name in enumerate(names):
        bias = reader.get_slice(name + ".bias") if reader.has(name + ".bias") else None
        layer.load_slice(s, reader.get_slice(name + ".weight"), bias, weight_scale(reader, layer, name),
                         name + ".weight")


def _load_fused_or_packed(reader: CheckpointReader, layer: nn.Module, fused: str, names: list[str]) -> None:
    """A packed layer from one fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj) when the checkpoint has it,
    else from one tensor per slice."""
    if not reader.has(fused + ".weight"):
        _load_packed(reader, layer, names)
        return
    bias = reader.get_slice(fused + ".bias") if reader.has(fused + ".bias") else None
    base_of(layer).load_fused(reader.get_slice(fused + ".weight"), bias, weight_scale(reader, base_of(layer), fused))


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
    attn.kv_scales = tuple(_kv_scale(reader, p + "self_attn.", x) for x in "kv")
    if hasattr(layer.mlp, "gate_up_proj"):
        _load_fused_or_packed(reader, layer.mlp.gate_up_proj, p + "mlp.gate_up_proj",
                              [p + "mlp.gate_proj", p + "mlp.up_proj"])
        _load_packed(reader, layer.mlp.down_proj, [p + "mlp.down_proj"])
    else:
        layer.mlp.load(reader, p + "mlp.")


KV_SCALE_NAMES = ("{x}_scale", "{x}_proj.output_scale")  # llm-compressor / vLLM, AutoFP8


def _kv_scale(reader: CheckpointReader, prefix: str, x: str) -> float:
    """The fp8 KV cache scale of K (x="k") or V in this attention layer: one positive value per tensor, 1.0 when the
    checkpoint has none."""
    name = next((prefix + n.format(x=x) for n in KV_SCALE_NAMES if reader.has(prefix + n.format(x=x))), None)
    if name is None:
        return 1.0
    t = reader.get(name)
    if t.numel() != 1:
        raise CheckpointError(f"{name} has shape {tuple(t.shape)} in {reader.source}: expected one value (per-tensor "
                              f"KV cache scales; per-head scales are not supported)")
    value = float(t.float().reshape(()))
    if not (value > 0 and value < float("inf")):
        raise CheckpointError(f"{name} = {value} in {reader.source}: expected a positive finite scale")
    return value


def _unquantized(reader: CheckpointReader, name: str):
    """A lazy slice of a tensor that is always read in the model's dtype (embeddings, LM head): fp8 is refused."""
    sl = reader.get_slice(name)
    if sl.get_dtype() == "F8_E4M3":
        raise CheckpointError(f"{name} is float8_e4m3fn in {reader.source}: fp8 embeddings / LM heads are not "
                              f"supported (expected them left unquantized, e.g. quantization_config ignore lm_head)")
    return sl


@torch.no_grad()
def load_weights(model: nn.Module, reader: CheckpointReader) -> None:
    base_of(model.embed_tokens).load(_unquantized(reader, "model.embed_tokens.weight"))
    for i, layer in enumerate(model.layers):
        load_dense_layer(reader, layer, i)
    _load_norm(reader, model.norm, "model.norm.weight")
    if not model.tied:
        base_of(model.lm_head).load(_unquantized(reader, "lm_head.weight"))
