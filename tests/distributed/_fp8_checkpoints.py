"""FP8 checkpoints in the published formats, written from a float32 one, and the dequantized float32 twin that is
their reference: HF fp8 with weight_block_size (weight_scale_inv per block), compressed-tensors float-quantized per
channel and per tensor (weight_scale). The quantization here is written independently of tp_lora.ops.fp8."""
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
MAX = 448.0
# Linear weights of decoder layers (attention, dense MLP, per-expert experts); routers, norms, embeddings and
# lm_head stay float32.
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
                       r"block_sparse_moe\.experts\.\d+\.w[123]|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight")


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / MAX, torch.ones_like(amax))


def quantize(w: torch.Tensor, fmt: str, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float32 -> (fp8 [N, K], the scale tensor as the format stores it, the dequantized float32 w)."""
    n, k = w.shape
    if fmt == "block":
        pad = torch.zeros(-(-n // block) * block, -(-k // block) * block)
        pad[:n, :k] = w.abs()
        amax = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block).amax(dim=(1, 3))
        scale = _scale(amax)
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    elif fmt == "channel":
        scale = _scale(w.abs().amax(dim=1, keepdim=True))  # [N, 1], as llm-compressor writes it
        full = scale.expand(n, k)
    else:  # tensor
        scale = _scale(w.abs().amax().reshape(1))
        full = scale.expand(n, k)
    q = (w / full).clamp(-MAX, MAX).to(FP8)
    return q, scale, q.float() * full


def quant_config(fmt: str, block: int) -> dict:
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block], "ignored_layers": ["lm_head"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": fmt, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


def write_fp8(src: str, dst: str, ref: str, fmt: str, block: int = 16) -> None:
    """dst: src's model in format fmt (block | channel | tensor); ref: the same dequantized, float32, unquantized."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    q_t, r_t = {}, {}
    scale_name = "weight_scale_inv" if fmt == "block" else "weight_scale"
    for name, w in tensors.items():
        if QUANTIZED.fullmatch(name):
            q, scale, deq = quantize(w.float(), fmt, block)
            q_t[name], q_t[name[:-len("weight")] + scale_name], r_t[name] = q, scale, deq
        else:
            q_t[name] = r_t[name] = w
    for path, t, c in ((dst, q_t, {**cfg, "quantization_config": quant_config(fmt, block)}), (ref, r_t, cfg)):
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)


def edit(src: str, dst: str, drop: str | None = None, reshape: str | None = None, config: dict | None = None) -> str:
    """A copy of checkpoint src without tensor `drop`, with tensor `reshape` flattened, or config.json updated."""
    shutil.copytree(src, dst)
    if drop or reshape:
        t = load_file(os.path.join(src, "model.safetensors"))
        t.pop(drop, None)
        if reshape:
            t[reshape] = t[reshape].reshape(-1).contiguous()
        save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if config:
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**cfg, **config}, f)
    return dst
