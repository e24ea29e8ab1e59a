"""config.json -> model class."""
from __future__ import annotations

from tp_lora.config import ConfigError
from tp_lora.layers.quant import quant_config
from tp_lora.models.llama import SUPPORTED, CausalLM
from tp_lora.models.moe_step import MOE_TYPES
from tp_lora.ops.fp8 import FP8_DTYPE


def build(hf: dict, tp, dtype, device, rt, targets, quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """quantization: the run's option (None or "fp8": quantize at load); the checkpoint's quantization_config is
    read either way (tp_lora.layers.quant). kv_cache_dtype: auto (the model's dtype) or fp8 (the model's kv_dtype,
    what its KV caches hold)."""
    kind = hf.get("model_type")
    quant = quant_config(hf, quantization)
    if kind in SUPPORTED:
        model = CausalLM(hf, tp, dtype, device, rt, targets, quant=quant)
    elif kind in MOE_TYPES:
        from tp_lora.models import moe  # noqa: PLC0415 - MoE support is optional weight
        model = moe.build(hf, tp, dtype, device, rt, targets, quant)
    else:
        raise ConfigError(f"model_type={kind!r} is not supported (expected one of {SUPPORTED + MOE_TYPES})")
    if kv_cache_dtype == "fp8":
        model.kv_dtype = FP8_DTYPE
    return model
