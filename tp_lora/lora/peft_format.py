"""PEFT's LoRA adapter format and rules: file and key names, adapter_config.json (read and validated), and which
modules an adapter targets with which rank and scale.

On disk (PEFT `save_pretrained`): adapter_config.json + adapter_model.safetensors with keys
    base_model.model.<module>.lora_A.weight            [r, in]
    base_model.model.<module>.lora_B.weight            [out, r]
    base_model.model.<module>.lora_embedding_A         [r, vocab]     (embeddings: parameters, no ".weight")
    base_model.model.<module>.lora_embedding_B         [hidden, r]
    base_model.model.<module>.lora_magnitude_vector    [out]          (use_dora: DoRA's magnitude m)
    base_model.model.<module>.lora_B.bias              [out]          (lora_bias)
    base_model.model.<lm_head | model.embed_tokens>.weight   [vocab, hidden]   (modules_to_save: a whole copy)
(the adapter name, e.g. ".default", may appear before ".weight" / at the end in files written by other tools).

Per module PEFT takes (tuners/lora/model.py `_create_and_replace`, utils/other.py `get_pattern_key`):
    r     = rank_pattern[first key k in order with re.match(rf"(.*\\.)?({k})$", module)]  else config r
    alpha = alpha_pattern[same rule]                                                        else lora_alpha
    scale = alpha / sqrt(r) if use_rslora else alpha / r
and the forward is y += scale * (x A^T) B^T (embeddings: scale * B[:, A[:, ids]]^T); with lora_bias
y += scale * ((x A^T) B^T + b); with DoRA y = g * (x W^T + scale * (x A^T) B^T) (+ the base bias), g = m / ||W +
scale * B A|| per output row (the norm over the input dim); modules_to_save replace the whole module.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
from typing import Any, Iterable, Optional

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT's name for all linear layers but the output head; saved configs usually hold the expanded list instead.
ALL_LINEAR = "all-linear"
EMBEDDING_MODULES = ("embed_tokens",)
# modules_to_save this runtime serves (per-adapter whole copies, tp_lora.lora.saved); AdapterInfo.targets names them
# SAVED + short name, so the model wraps the layer with room for the copies.
SAVABLE = {"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"}
SAVED = "saved:"
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
                  r"(?:\.(?P<adapter>[^.]+))??(?P<weight>\.weight)?$")
# DoRA's magnitude ("M") and lora_bias's bias ("bias") of a linear module, with or without the adapter name.
_EXTRA = re.compile(r"^(?P<module>.+)\.(?:(?P<m>lora_magnitude_vector)(?:\.[^.]+)?(?:\.weight)?|"
                    r"lora_B(?:\.[^.]+)?\.bias)$")


class AdapterError(ValueError):
    """An adapter that cannot be used; the engine fails only the requests that name it."""


class AdapterFileNotFoundError(AdapterError, FileNotFoundError):
    """A missing adapter file: both an AdapterError and a FileNotFoundError."""


def _err(name: str, msg: str) -> AdapterError:
    return AdapterError(f"adapter {name!r}: {msg}")


# ---- PEFT's matching rules ----------------------------------------------------------------------------------
def pattern_key(pattern_keys: Iterable[str], module: str) -> str:
    """The rank_pattern / alpha_pattern key that applies to `module`: the first key k (in the dict's order) with
    re.match(rf"(.*\\.)?({k})$", module), else `module` itself (PEFT's get_pattern_key)."""
    for k in pattern_keys:
        if re.match(rf"(.*\.)?({k})$", module):
            return k
    return module


def module_rank_alpha(config: dict, module: str) -> tuple[int, float]:
    """(r, alpha) PEFT gives `module` (a base-model path such as "model.layers.0.self_attn.q_proj")."""
    rp, ap = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    r = rp.get(pattern_key(rp.keys(), module), config.get("r", 8))
    alpha = ap.get(pattern_key(ap.keys(), module), config.get("lora_alpha", 8))
    return r, alpha


def lora_scale(r: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def is_targeted(config: dict, module: str) -> bool:
    """Whether PEFT's target_modules / exclude_modules / layers_to_transform select `module`
    (tuners_utils.check_target_module_exists)."""
    ex = config.get("exclude_modules")
    if ex:
        if isinstance(ex, str):
            if re.fullmatch(ex, module):
                return False
        elif module in ex or any(module.endswith(f".{e}") for e in ex):
            return False
    tm = config.get("target_modules")
    if tm is None:
        return True  # PEFT fills in per-architecture defaults; the tensors say what was trained
    if isinstance(tm, str):
        if tm == ALL_LINEAR:
            return module.rsplit(".", 1)[-1] not in ("lm_head",) + EMBEDDING_MODULES
        return re.fullmatch(tm, module) is not None
    if module in tm:
        return True
    if not any(module.endswith(f".{t}") for t in tm):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    pattern = config.get("layers_pattern")
    m = None
    if not pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for p in [pattern] if isinstance(pattern, str) else pattern:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
            if m:
                break
    if m is None:
        return False
    idx = int(m.group("idx"))
    return idx == layers if isinstance(layers, int) else idx in layers


# ---- config -------------------------------------------------------------------------------------------------
# Options that change the forward (or add weights) beyond y += s x A^T B^T; name -> why they are refused.
_TRUTHY_REJECT = {
    "fan_in_fan_out": "fan_in_fan_out=true is for Conv1D (GPT-2 style) layers, not Llama-family linears",
    "layer_replication": "layer_replication changes the model's layer stack",
    "trainable_token_indices": "trainable_token_indices stores trained embedding rows",
    "target_parameters": "target_parameters (LoRA on nn.Parameter experts) is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after invocation tokens",
    "use_qalora": "QALoRA pools the input before lora_A",
    "use_bdlora": "BD-LoRA (block-diagonal factors) is not supported",
    "kasa_config": "KaSA adds singular-value weights between A and B",
    "monteclora_config": "MonteCLoRA samples the adapter",
    "arrow_config": "Arrow routing mixes adapters per token",
}


def read_adapter_config(path: str, name: Optional[str] = None, allow: tuple[str, ...] = ()) -> dict:
    """adapter_config.json of adapter dir `path`, validated (LoRA only, no option that changes the math; `allow`:
    refused options the caller handles itself). Returns the dict as read."""
    path = os.fspath(path)
    name = name or os.path.basename(os.path.normpath(path))
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise AdapterFileNotFoundError(f"adapter {name!r}: directory {path} does not exist")
    if not os.path.isfile(cfg_path):
        raise AdapterFileNotFoundError(f"adapter {name!r}: {cfg_path} not found (a PEFT adapter dir holds "
                                       f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _err(name, f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise _err(name, f"{cfg_path} holds a JSON {type(cfg).__name__}, expected an object")

    def bad(option: str, value: Any, expected: str) -> AdapterError:
        return _err(name, f"{cfg_path}: {option}={value!r}, expected {expected}")

    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise bad("peft_type", peft_type, "'LORA' (only LoRA adapters are supported)")
    for option, why in _TRUTHY_REJECT.items():
        if cfg.get(option) and option not in allow:
            raise bad(option, cfg[option], f"false/empty: {why}")
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise bad("lora_bias", cfg["lora_bias"], "false with use_dora=true (PEFT refuses the pair too)")
    if cfg.get("use_dora") and cfg.get("target_parameters"):
        raise bad("use_dora", True, "false with target_parameters: PEFT defines no DoRA for fused expert parameters")
    saved = cfg.get("modules_to_save") or []
    if not isinstance(saved, list) or not all(isinstance(x, str) for x in saved):
        raise bad("modules_to_save", saved, "a list of module names")
    for module in saved:
        if module.rsplit(".", 1)[-1] not in SAVABLE:
            raise bad("modules_to_save", saved, f"only {sorted(SAVABLE)}: a whole trained copy of {module!r} "
                                                f"cannot be served beside other adapters")
    if cfg.get("bias", "none") != "none":
        raise bad("bias", cfg["bias"], "'none' (trained biases of the base layers are not supported)")
    r = cfg.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise bad("r", r, "a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise bad("lora_alpha", alpha, "a number")
    for option in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(option)
        if pat is None:
            continue
        if not isinstance(pat, dict):
            raise bad(option, pat, "an object {module pattern: value}")
        for k, v in pat.items():
            ok = isinstance(v, int) and v > 0 if option == "rank_pattern" else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok:
                raise bad(f"{option}[{k!r}]", v, "a positive integer" if option == "rank_pattern" else "a number")
            try:
                re.compile(k)
            except re.error as e:
                raise bad(f"{option} key", k, f"a valid regular expression ({e})") from e
    for option in ("target_modules", "exclude_modules", "layers_pattern"):
        v = cfg.get(option)
        if v is None:
            continue
        if isinstance(v, list):
            if not all(isinstance(x, str) for x in v):
                raise bad(option, v, "a list of module names (strings) or a regex string")
            regexes = v if option == "layers_pattern" else []
        elif isinstance(v, str):
            regexes = [] if v == ALL_LINEAR else [v]
        else:
            raise bad(option, v, "a list of module names or a regex string")
        for rx in regexes:
            try:
                re.compile(rx)
            except re.error as e:
                raise bad(option, rx, f"a valid regular expression ({e})") from e
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) or (
            isinstance(layers, list) and all(isinstance(i, int) for i in layers))):
        raise bad("layers_to_transform", layers, "a layer index or a list of them")
    return cfg


# ---- tensor keys --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1 << 16)  # adapters of one deployment repeat the same few hundred keys
def parse_key(key: str) -> Optional[tuple[str, str]]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A[.default].weight' -> (module path, 'A' | 'B');
    None for anything else (a linear LoRA without ".weight", an embedding LoRA with it, other tensors)."""
    k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    m = _KEY.match(k)
    if m is None:
        return None
    kind = m.group("kind")
    embedding = kind.startswith("lora_embedding")
    if embedding == bool(m.group("weight")):
        return None  # linear LoRAs are modules (".weight"), embedding LoRAs are bare parameters
    return m.group("module"), {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B"}[kind]


def parse_extra_key(key: str) -> Optional[tuple[str, str]]:
    """'base_model.model.<module>.lora_magnitude_vector' -> (module, 'M'); '<module>.lora_B.bias' -> (module,
    'bias'); None for anything else."""
    k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    m = _EXTRA.match(k)
    return None if m is None else (m.group("module"), "M" if m.group("m") else "bias")


def saved_module(config: dict, k: str) -> Optional[str]:
    """The model path ("lm_head", "model.embed_tokens") when key `k` (PEFT prefix stripped) is the whole copy of a
    module the config's modules_to_save names, else None."""
    short = k.removesuffix(".weight").rsplit(".", 1)[-1]
    if not k.endswith(".weight") or short not in SAVABLE:
        return None
    if not any(m.rsplit(".", 1)[-1] == short for m in config.get("modules_to_save") or []):
        return None
    return SAVABLE[short] if k.removesuffix(".weight") == SAVABLE[short] else None


def is_embedding_copy(k: str) -> bool:
    """'model.embed_tokens[.base_layer].weight' / 'lm_head[.base_layer].weight': a base table PEFT's
    save_embedding_layers wrote beside the LoRA (the model's own table, or a resized one)."""
    if not k.endswith(".weight"):
        return False
    module = k[: -len(".weight")].removesuffix(".base_layer")
    return module.rsplit(".", 1)[-1] in EMBEDDING_MODULES + ("lm_head",)



def check_extras(name: str, cfg: dict, weights: str, extras: dict[str, set[str]], modules: dict[str, bool]) -> None:
    """DoRA magnitudes and lora_B biases (extras: module -> {"M", "bias"}) against the config and the file's LoRA
    modules (module -> whether it is an embedding): each needs its option on, a linear module of its own, and with
    use_dora every linear module has its magnitude."""
    for module, which in sorted(extras.items()):
        for w in sorted(which):
            option, what = ("use_dora", "DoRA magnitude (lora_magnitude_vector)") if w == "M" else \
                ("lora_bias", "lora_B bias")
            if not cfg.get(option):
                raise _err(name, f"{weights}: module {module!r} has a {what}, which needs {option}=true in "
                                 f"{CONFIG_FILE} (it has {cfg.get(option)!r})")
        if module not in modules:
            raise _err(name, f"{weights}: {module!r} has a DoRA magnitude / lora_B bias but no lora_A / lora_B")
        if modules[module]:
            raise _err(name, f"{weights}: embedding module {module!r} has {sorted(which)}: DoRA and lora_bias apply "
                             f"to linear layers only here")
    if cfg.get("use_dora"):
        for module, embedding in sorted(modules.items()):
            if not embedding and "M" not in extras.get(module, ()):
                raise _err(name, f"{weights}: module {module!r} lacks its DoRA magnitude (lora_magnitude_vector) "
                                 f"but {CONFIG_FILE} has use_dora=true")
