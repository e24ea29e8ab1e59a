"""FP8 weight formats: what a checkpoint's `quantization_config` (or `quantization=fp8`) says each linear layer holds.

Formats read (anything else is refused at start, naming what was found):
  quant_method "fp8" (HF / Qwen3-*-FP8, DeepSeek): float8_e4m3fn weights with `weight_scale_inv` per
      weight_block_size block ([128, 128]) or, without a block size, `weight_scale_inv` / `weight_scale` per tensor or
      per output channel; activation_scheme dynamic. Unquantized modules: `ignored_layers` / `modules_to_not_convert`.
  quant_method "compressed-tensors", format "float-quantized" (llm-compressor's FP8 / FP8-dynamic): one config group
      of 8-bit float weights, strategy channel / tensor / block with `weight_scale`; input activations dynamic (per
      token or per tensor) or none. Unquantized modules: `ignore` (names or "re:" patterns).
  quantization=fp8 on a 16/32-bit checkpoint: each linear weight quantized at load, one scale per output channel
      (lm_head, embeddings, routers and Qwen2-MoE's one-column shared_expert_gate stay in the checkpoint's dtype).

A quantized layer keeps fp8 weights and float32 scales, per output channel [rows] or per block [rows, in / block_k]
(a block's scale repeated on each of its block_n rows, so packed slices and replicated KV heads cut anywhere a block
boundary lies); per-tensor scales are stored per channel (the same value on every row: exact).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from tp_lora.config import ConfigError

CT_FORMATS = ("float-quantized",)
QUANT_AT_LOAD_SKIP = ("shared_expert_gate",)  # a [1, H] gate: nothing to gain, and no fp8 GEMM of one column


@dataclass(frozen=True)
class FP8Scheme:
    """How one layer's weights are stored. block: (block_n, block_k) for block scales, None for per-channel.
    at_load: the checkpoint holds 16/32-bit weights, quantized per channel while loading; else fp8 + scales."""
    block: Optional[tuple[int, int]] = None
    at_load: bool = False
    scale_names: tuple[str, ...] = ("weight_scale",)  # tensor suffixes that may hold the scale, first found wins


@dataclass(frozen=True)
class QuantConfig:
    """The scheme of every quantized module, and which modules stay unquantized."""
    scheme: FP8Scheme
    ignore: tuple[str, ...] = ()
    source: str = ""  # the config's description, for messages

    def for_module(self, paths: list[str]) -> Optional[FP8Scheme]:
        """The scheme of a layer answering to these module paths (a packed layer's slices: q/k/v), None when it
        stays unquantized. Slices of one packed layer quantized differently are refused."""
        ignored = [self.ignored(p) for p in paths]
        if any(ignored) and not all(ignored):
            raise ConfigError(f"{self.source}: modules {paths} are one packed layer here, but only "
                              f"{[p for p, i in zip(paths, ignored) if i]} are left unquantized")
        return None if ignored[0] else self.scheme

    def ignored(self, path: str) -> bool:
        if self.scheme.at_load and path.rsplit(".", 1)[-1] in QUANT_AT_LOAD_SKIP:
            return True
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], path) or re.fullmatch(pat[3:], path + ".weight"):
                    return True
            elif path == pat or path.endswith("." + pat):
                return True
        return False


def quant_config(hf: dict, quantization: Optional[str]) -> Optional[QuantConfig]:
    """The QuantConfig of a config.json (its `quantization_config`) and the run's `quantization` option (None or
    "fp8"); None for an unquantized model. Unsupported formats raise ConfigError naming what was found."""
    qc = hf.get("quantization_config")
    if qc is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise ConfigError(f"quantization={quantization!r}: expected null or fp8")
        return QuantConfig(FP8Scheme(at_load=True), source="quantization=fp8")
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json quantization_config={qc!r}: expected an object")
    method = qc.get("quant_method")
    if method == "fp8":
        parsed = _hf_fp8(qc)
    elif method == "compressed-tensors":
        parsed = _compressed_tensors(qc)
    else:
        raise ConfigError(f"config.json quantization_config.quant_method={method!r} is not supported (expected fp8 "
                          f"or compressed-tensors float-quantized); refusing to load its weights as plain floats")
    if quantization not in (None, "fp8"):
        raise ConfigError(f"quantization={quantization!r}: expected null or fp8")
    return parsed


def _hf_fp8(qc: dict) -> QuantConfig:
    src = "quantization_config (quant_method fp8)"
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{src}: fmt={fmt!r} is not supported (expected e4m3)")
    act = qc.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"{src}: activation_scheme={act!r} is not supported (expected dynamic: activations are "
                          f"quantized per token at run time; static input scales are not read)")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig(FP8Scheme(_block(block, src), scale_names=("weight_scale_inv", "weight_scale")),
                       ignore, src)


def _compressed_tensors(qc: dict) -> QuantConfig:
    src = "quantization_config (compressed-tensors)"
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise ConfigError(f"{src}: format={fmt!r} is not supported (expected one of {CT_FORMATS})")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{src}: {len(groups)} config_groups: expected exactly one (every Linear alike)")
    (name, group), = groups.items()
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ConfigError(f"{src}: config_groups.{name}.targets={targets}: expected ['Linear']")
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("symmetric", True), w.get("dynamic", False)) != (8, "float", True,
                                                                                                  False):
        raise ConfigError(f"{src}: config_groups.{name}.weights={w}: expected num_bits 8, type float, symmetric, "
                          f"not dynamic")
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor", "block"):
        raise ConfigError(f"{src}: weights strategy={strategy!r}: expected channel, tensor or block")
    block = _block(w.get("block_structure"), src) if strategy == "block" else None
    if strategy == "block" and block is None:
        raise ConfigError(f"{src}: weights strategy block without block_structure")
    a = group.get("input_activations")
    if a is not None and (a.get("num_bits"), a.get("type"), a.get("dynamic"), a.get("strategy")) not in (
            (8, "float", True, "token"), (8, "float", True, "tensor"), (8, "float", True, "group")):
        raise ConfigError(f"{src}: config_groups.{name}.input_activations={a}: expected dynamic 8-bit float "
                          f"activations (or none); static activation scales are not supported")
    return QuantConfig(FP8Scheme(block, scale_names=("weight_scale",)), tuple(qc.get("ignore") or ()), src)


def _block(block, src: str) -> Optional[tuple[int, int]]:
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                       for b in block)):
        raise ConfigError(f"{src}: block size {block!r}: expected [block_n, block_k] positive integers")
    return int(block[0]), int(block[1])
