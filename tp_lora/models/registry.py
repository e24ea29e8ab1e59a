"""config.json -> model class."""
from __future__ import annotations

from tp_lora.config import ConfigError
from tp_lora.layers.quant import quant_config
from tp_lora.models.llama import SUPPORTED, CausalLM

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def build(hf: dict, tp, dtype, device, rt, targets, quantization: str | None = None):
    """quantization: the run's option (None or "fp8": quantize at load); the checkpoint's quantization_config is
    read either way (tp_lora.layers.quant)."""
    kind = hf.get("model_type")
    quant = quant_config(hf, quantization)
    if kind in SUPPORTED:
        return CausalLM(hf, tp, dtype, device, rt, targets, quant=quant)
    if kind in MOE_TYPES:
        from tp_lora.models import moe  # noqa: PLC0415 - MoE support is optional weight
        return moe.build(hf, tp, dtype, device, rt, targets, quant)
    raise ConfigError(f"model_type={kind!r} is not supported (expected one of {SUPPORTED + MOE_TYPES})")
