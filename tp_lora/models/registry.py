"""config.json -> model class."""
from __future__ import annotations

from tp_lora.config import ConfigError
from tp_lora.models.llama import SUPPORTED, CausalLM

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def build(hf: dict, tp, dtype, device, rt, targets):
    kind = hf.get("model_type")
    if kind in SUPPORTED:
        return CausalLM(hf, tp, dtype, device, rt, targets)
    if kind in MOE_TYPES:
        from tp_lora.models import moe  # noqa: PLC0415 - MoE support is optional weight
        return moe.build(hf, tp, dtype, device, rt, targets)
    raise ConfigError(f"model_type={kind!r} is not supported (expected one of {SUPPORTED + MOE_TYPES})")
