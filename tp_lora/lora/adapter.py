"""PEFT LoRA adapters on disk -> per-module tensors and scalings (LoRAAdapter), with PEFT's own rules
(tp_lora.lora.peft_format), and their checks against the model they will run on (shapes, ranks, NaN/Inf)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from tp_lora.lora import stfile
from tp_lora.lora.peft_format import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, AdapterError,
                                      AdapterFileNotFoundError, check_extras, is_embedding_copy, is_targeted,
                                      lora_scale, module_rank_alpha, parse_extra_key, parse_key,
                                      read_adapter_config, saved_module)


@dataclass
class ModuleLoRA:
    """LoRA of one target module of one adapter: delta = scale * (x a^T) b^T.

    a: [r, in]   (embeddings: lora_embedding_A as stored, [r, vocab])
    b: [out, r]  (embeddings: lora_embedding_B as stored, [hidden, r])
    magnitude: [out], DoRA's m (use_dora): y = g * (x W^T + delta), g = m / ||W + scale * b a|| per output row
    bias: [out], lora_B's bias (lora_bias): delta = scale * ((x a^T) b^T + bias)
    """
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    embedding: bool = False
    magnitude: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # max over modules
    config: dict  # adapter_config.json as read
    modules: dict[str, ModuleLoRA] = field(default_factory=dict)  # base-model module path -> LoRA
    # Base-layer copies PEFT saves next to embedding LoRAs (name -> shape); unused, but their shape tells a vocab
    # resized during training apart from this model's.
    saved_base_weights: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # modules_to_save: model path ("lm_head", "model.embed_tokens") -> the adapter's whole copy [vocab, hidden]
    saved: dict[str, torch.Tensor] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"LoRAAdapter({self.name!r}, rank={self.rank}, {len(self.modules)} modules, path={self.path!r})"


def _err(name: str, msg: str) -> AdapterError:
    return AdapterError(f"adapter {name!r}: {msg}")


# ---- weights ------------------------------------------------------------------------------------------------
def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        alt = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(path, f))]
        extra = (f"; {alt[0]} is present but pickled weights are not supported (convert: load with PEFT and "
                 f"save_pretrained(dir, safe_serialization=True))" if alt else "")
        raise AdapterFileNotFoundError(f"adapter {name!r}: {weights} not found{extra}")
    try:
        return stfile.read_tensors(weights)
    except stfile.SafetensorsError as e:
        raise _err(name, f"{weights} is not a readable safetensors file (corrupt or truncated?): {e.detail}") from e


def _as(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """t in dtype, contiguous; t itself when it already is (each torch call costs the reader GIL time). dtype None
    keeps the file's dtype, float8 widened to float32: a slot image then casts as it copies, and the tensors stay
    views of the file's bytes, which is what lets a read plan replay the read (tp_lora.lora.slots)."""
    if dtype is None:
        dtype = torch.float32 if t.element_size() == 1 else t.dtype
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def load_adapter(path: str, name: Optional[str] = None, dtype: Optional[torch.dtype] = torch.float32) -> LoRAAdapter:
    """Read a PEFT LoRA adapter dir. Each module's scale follows PEFT (rank_pattern / alpha_pattern / use_rslora);
    the rank the config implies must match the tensors (PEFT itself would fail to load them otherwise)."""
    path = os.fspath(path)
    name = name or os.path.basename(os.path.normpath(path))
    try:
        return _load(path, name, dtype)
    except (AdapterError, FileNotFoundError):
        raise
    except Exception as e:  # anything else still fails only this adapter, with its name on it
        raise _err(name, f"cannot be read from {path}: {type(e).__name__}: {e}") from e


def _load(path: str, name: str, dtype: Optional[torch.dtype]) -> LoRAAdapter:
    cfg = read_adapter_config(path, name)
    weights = os.path.join(path, WEIGHTS_FILE)
    tensors = _read_tensors(name, path)
    if not tensors:
        raise _err(name, f"{weights} holds no tensors")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, bool] = {}
    base_copies: dict[str, tuple[int, ...]] = {}
    extras: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"M": magnitude, "bias": lora_B's bias}
    saved: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        parsed = parse_key(key)
        if parsed is None:
            k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
            extra, copy_of = parse_extra_key(key), saved_module(cfg, k)
            if extra is not None:
                _check_extra(name, key, t)
                extras.setdefault(extra[0], {})[extra[1]] = t
                continue
            if copy_of is not None:
                if t.dim() != 2 or not t.is_floating_point():
                    raise _err(name, f"{weights}: modules_to_save copy {key!r} has shape {tuple(t.shape)} / dtype "
                                     f"{t.dtype}, expected a 2-dim floating [vocab, hidden] table")
                saved[copy_of] = _as(t, dtype)
                continue
            if is_embedding_copy(k):
                base_copies[k] = tuple(t.shape)  # PEFT saves whole embedding tables beside embedding LoRAs
                continue
            hint = (" (DoRA magnitude)" if "lora_magnitude_vector" in key else
                    " (lora_bias)" if ".lora_B" in key and key.endswith(".bias") else "")
            raise _err(name, f"{weights}: tensor {key!r}{hint} is not a LoRA weight this runtime understands "
                             f"(expected <module>.lora_A.weight / lora_B.weight / lora_embedding_A / lora_embedding_B)")
        module, which = parsed
        if which in parts.setdefault(module, {}):
            raise _err(name, f"{weights}: module {module!r} has two lora_{which} tensors (several adapter names "
                             f"in one file?)")
        if t.dim() != 2:
            raise _err(name, f"{weights}: tensor {key!r} has shape {tuple(t.shape)}, expected 2 dims")
        if not (t.is_floating_point()):
            raise _err(name, f"{weights}: tensor {key!r} has dtype {t.dtype}, expected a floating type")
        parts[module][which] = t
        kinds[module] = "embedding" in key

    check_extras(name, cfg, weights, {m: set(ex) for m, ex in extras.items()},
                 {m: kinds.get(m, False) for m in parts})
    use_rslora = bool(cfg.get("use_rslora", False))
    modules: dict[str, ModuleLoRA] = {}
    for module in sorted(parts):
        ab = parts[module]
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _err(name, f"{weights}: module {module!r} has lora_{set(ab).pop()} but no lora_{missing}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise _err(name, f"{weights}: module {module!r}: lora_A {tuple(a.shape)} has rank {a.shape[0]} but "
                             f"lora_B {tuple(b.shape)} has rank {b.shape[1]} (expected A [r, in], B [out, r])")
        if not is_targeted(cfg, module):
            raise _err(name, f"{weights} has LoRA weights for {module!r}, which target_modules="
                             f"{cfg.get('target_modules')!r} does not select (PEFT would not load them)")
        r, alpha = module_rank_alpha(cfg, module)
        if a.shape[0] != r:
            raise _err(name, f"{weights}: module {module!r} has rank {a.shape[0]} but {CONFIG_FILE} gives it "
                             f"r={r} (r / rank_pattern mismatch)")
        ex = extras.get(module, {})
        modules[module] = ModuleLoRA(_as(a, dtype), _as(b, dtype), lora_scale(r, alpha, use_rslora),
                                     embedding=kinds[module], magnitude=_opt(ex.get("M"), dtype),
                                     bias=_opt(ex.get("bias"), dtype))
    if not modules and not saved:
        raise _err(name, f"{weights} holds no LoRA weights (keys: {sorted(tensors)[:4]}...)")
    rank = max((m.rank for m in modules.values()), default=0)
    return LoRAAdapter(name=name, path=path, rank=rank, config=cfg, modules=modules, saved_base_weights=base_copies,
                       saved=saved)


def _check_extra(name: str, key: str, t: torch.Tensor) -> None:
    """A DoRA magnitude / lora_B bias tensor: 1-dim floating."""
    if t.dim() != 1 or not t.is_floating_point():
        raise _err(name, f"tensor {key!r} has shape {tuple(t.shape)} / dtype {t.dtype}, expected a 1-dim floating "
                         f"[out] vector")


def _opt(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return None if t is None else _as(t, dtype)


def discover_adapters(adapter_dir: str) -> dict[str, str]:
    """name -> path of every subdirectory of adapter_dir holding adapter_config.json, sorted by name.
    adapter_dir itself counts too when it holds one (named after its basename; PEFT's save_pretrained of a
    multi-adapter model writes the default adapter there and the others in subdirectories)."""
    if not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"adapter directory {adapter_dir} does not exist")
    adapter_dir = os.fspath(adapter_dir)
    found = {}
    for entry in sorted(os.listdir(adapter_dir)):
        sub = os.path.join(adapter_dir, entry)
        if not entry.startswith(".") and os.path.isfile(os.path.join(sub, CONFIG_FILE)):
            found[entry] = sub
    if os.path.isfile(os.path.join(adapter_dir, CONFIG_FILE)):
        found.setdefault(os.path.basename(os.path.normpath(adapter_dir)), adapter_dir)
    return dict(sorted(found.items()))


# Exponent bits of each float format: a value is NaN or Inf exactly when all of them are set.
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN/Inf values in t (torch.isfinite on bf16 CPU tensors is slow): one float32 sum settles the common case (any
    NaN/Inf makes it non-finite), and integer bit tests count exactly when it is not (finite values can overflow the
    sum too)."""
    if t.numel() == 0 or (t.is_floating_point() and math.isfinite(float(torch.sum(t, dtype=torch.float32)))):
        return 0
    if t.dtype not in _EXPONENT:
        return int((~torch.isfinite(t)).sum())
    itype, mask = _EXPONENT[t.dtype]
    return int(((t.contiguous().view(itype) & mask) == mask).sum())


def range_limits(dtypes: list[torch.dtype]) -> torch.Tensor:
    """The largest finite value of each dtype: finite_flags' bounds for tensors cast into them."""
    return torch.tensor([torch.finfo(d).max for d in dtypes], dtype=torch.float64)


def finite_flags(tensors: list[torch.Tensor], limits: Optional[torch.Tensor] = None) -> list[bool]:
    """Per tensor: False when it may hold a NaN/Inf, or with `limits` (range_limits of the dtype each is cast into) a
    value that becomes one in the cast. One batched norm bounds every value of a tensor; a norm can also overflow or
    pass the bound on values that fit, so an exact count (count_nonfinite) settles the flagged ones."""
    norms = torch.stack(torch._foreach_norm(tensors)).double()  # stack promotes mixed dtypes
    return (torch.isfinite(norms) if limits is None else norms <= limits).tolist()


def _check_finite(adapter: LoRAAdapter) -> None:
    """Raise for the first module holding a NaN/Inf. One batched norm per adapter screens every tensor (a NaN/Inf
    makes its norm non-finite); only the flagged ones are counted exactly (a norm can overflow on finite values)."""
    named = [(module, what, t) for module, m in adapter.modules.items()
             for what, t in (("lora_A", m.a), ("lora_B", m.b), ("lora_magnitude_vector", m.magnitude),
                             ("lora_B bias", m.bias))
             if t is not None] + [(module, "modules_to_save copy", t) for module, t in adapter.saved.items()]
    if not named:
        return
    flags = finite_flags([t for _, _, t in named])
    for (module, what, t), ok in zip(named, flags):
        bad = 0 if ok else count_nonfinite(t)
        if bad:
            raise _err(adapter.name, f"module {module!r}: {what} has {bad} NaN/Inf values")


def validate_adapter(adapter: LoRAAdapter, module_shapes: dict[str, tuple[int, int]], max_rank: int) -> None:
    """Check an adapter against the model it will run on.

    module_shapes: module path -> (in_features, out_features) of every module that can carry a LoRA
    ("model.embed_tokens": (vocab, hidden)). Raises AdapterError naming the adapter and module.
    """
    n = adapter.name
    for module, m in adapter.modules.items():
        a, b = m.a, m.b
        if m.rank > max_rank:
            raise _err(n, f"module {module!r} has rank {m.rank} > lora.max_rank={max_rank} (raise lora.max_rank "
                          f"to at least {adapter.rank})")
        if module not in module_shapes:
            near = sorted(k for k in module_shapes if k.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1])
            hint = (f"; the model has e.g. {near[:2]}" if near else
                    f"; the model's LoRA targets end in {sorted({k.rsplit('.', 1)[-1] for k in module_shapes})}")
            raise _err(n, f"has weights for module {module!r}, which this model lacks (or has no LoRA on) — built "
                          f"for another model?{hint}")
        fin, fout = module_shapes[module]
        if a.shape[0] != b.shape[1]:
            raise _err(n, f"module {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} disagree on the rank")
        want_a, want_b = (m.rank, fin), (fout, m.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise _err(n, f"module {module!r}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the model's "
                          f"A {want_a} / B {want_b} (in={fin}, out={fout}) — built for another model?")
        if not math.isfinite(m.scale):
            raise _err(n, f"module {module!r}: scale {m.scale} is not finite")
        for what, v in (("lora_magnitude_vector", m.magnitude), ("lora_B bias", m.bias)):
            if v is not None and tuple(v.shape) != (fout,):
                raise _err(n, f"module {module!r}: {what} has shape {tuple(v.shape)}, expected ({fout},) (out)")
    for module, t in adapter.saved.items():
        if module in adapter.modules:
            raise _err(n, f"{module!r} has both a LoRA and a modules_to_save copy: expected one of them")
        want = module_shapes.get(module)
        if want is None:
            raise _err(n, f"modules_to_save copy of {module!r}: this model has no room for it (lora.lora_embeddings"
                          f"=false, or the model was built before the adapter was registered)")
        want = want if module != "lm_head" else (want[1], want[0])  # lm_head: (in=hidden, out=vocab)
        if tuple(t.shape) != tuple(want):
            raise _err(n, f"modules_to_save copy of {module!r} has shape {tuple(t.shape)} but the model's is "
                          f"{tuple(want)}: a vocabulary resized in training (resize_token_embeddings) is refused; "
                          f"serve it on a base model with that vocabulary")
    _check_finite(adapter)
    vocab = (module_shapes["model.embed_tokens"][0] if "model.embed_tokens" in module_shapes else
             module_shapes["lm_head"][1] if "lm_head" in module_shapes else None)
    for key, shape in adapter.saved_base_weights.items():
        if vocab is not None and len(shape) == 2 and shape[0] != vocab:
            raise _err(n, f"saved {key!r} has {shape[0]} rows but the model's vocabulary has {vocab}: the adapter "
                          f"was trained with a resized vocabulary — built for another model?")


# ---- PEFT target_parameters (fused 3D MoE experts) ----------------------------------------------------------
# PEFT's ParamWrapper puts one LoRA on a whole [E, out, in] expert parameter (tuners/lora/layer.py): lora_A [E*r, in]
# with the expert as the slow axis (A.reshape(E, r, in)), lora_B [out, E*r] with the expert as the fast axis
# (B.reshape(out, r, E)), delta_e = scale * B[:, :, e] @ A[e]. Several targeted parameters of one module nest: the
# first in the module's parameter order is the innermost wrapper, so its keys carry the most ".base_layer" parts.
EXPERT_PARAM_ORDER = ("gate_up_proj", "down_proj")  # registration order of transformers' fused experts


def _targeted_params(cfg: dict, container: str) -> list[str]:
    """The parameters of module `container` that target_parameters selects, in PEFT's wrapping order."""
    found = []
    for t in cfg.get("target_parameters") or []:
        mod, _, param = t.rpartition(".")
        if not mod or container == mod or container.endswith("." + mod):
            found.append(param)
    unknown = [p for p in found if p not in EXPERT_PARAM_ORDER]
    if unknown:
        raise ValueError(f"target_parameters selects {unknown} of {container!r}; only fused expert parameters "
                         f"{EXPERT_PARAM_ORDER} are supported")
    return [p for p in EXPERT_PARAM_ORDER if p in found]


def expert_param_modules(name: str, cfg: dict, container: str, depth_ab: dict[int, dict[str, torch.Tensor]],
                         dtype: Optional[torch.dtype] = torch.float32) -> dict[str, ModuleLoRA]:
    """One module's target_parameters LoRAs -> per-expert modules "{container}.{e}.{param}" with a [r, in],
    b [out, r]. depth_ab: number of ".base_layer" parts in the key -> {"A": lora_A, "B": lora_B}."""
    params = _targeted_params(cfg, container)
    if len(params) != len(depth_ab):
        raise _err(name, f"{container!r} has LoRA weights at {len(depth_ab)} nesting depths but target_parameters="
                         f"{cfg.get('target_parameters')!r} selects {params or 'none'} of it")
    use_rslora = bool(cfg.get("use_rslora", False))
    out: dict[str, ModuleLoRA] = {}
    for i, param in enumerate(params):
        depth = len(params) - 1 - i  # the first wrapped parameter is the innermost
        ab = depth_ab.get(depth)
        if ab is None or set(ab) != {"A", "B"}:
            raise _err(name, f"{container}: no complete lora_A / lora_B pair for parameter {param!r} (expected at "
                             f"nesting depth {depth}, i.e. {'.base_layer' * depth or 'no .base_layer'})")
        a, b = ab["A"], ab["B"]
        r, alpha = module_rank_alpha(cfg, f"{container}.{param}")
        if a.shape[0] % r or b.shape[1] != a.shape[0]:
            raise _err(name, f"{container}.{param}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"the [E*r, in] / [out, E*r] shapes of r={r} per expert")
        experts = a.shape[0] // r
        a_e = a.reshape(experts, r, a.shape[1])
        b_e = b.reshape(b.shape[0], r, experts).permute(2, 0, 1)
        scale = lora_scale(r, alpha, use_rslora)
        for e in range(experts):
            out[f"{container}.{e}.{param}"] = ModuleLoRA(_as(a_e[e], dtype), _as(b_e[e], dtype),
                                                         scale)
    return out


def load_peft_adapter(path: str, name: Optional[str] = None, dtype: Optional[torch.dtype] = torch.float32
                      ) -> LoRAAdapter:
    """load_adapter, plus PEFT's target_parameters format for fused MoE experts: each targeted [E, out, in] parameter
    becomes E per-expert modules "<experts module>.<e>.<param>" (e.g. model.layers.0.mlp.experts.3.gate_up_proj with
    a [r, H], b [2I, r]), so the model and validate_adapter see ordinary per-module LoRAs."""
    path = os.fspath(path)
    name = name or os.path.basename(os.path.normpath(path))
    # read_adapter_config refuses target_parameters because load_adapter cannot map them; this loader can.
    cfg = read_adapter_config(path, name, allow=("target_parameters",))
    if not cfg.get("target_parameters"):
        return load_adapter(path, name, dtype)
    if not isinstance(cfg["target_parameters"], list) or not all(isinstance(t, str) for t in cfg["target_parameters"]):
        raise _err(name, f"target_parameters={cfg['target_parameters']!r}: expected a list of parameter names")
    try:
        return _load_with_params(path, name, cfg, dtype)
    except (AdapterError, FileNotFoundError):
        raise
    except Exception as e:
        raise _err(name, f"cannot be read from {path}: {type(e).__name__}: {e}") from e


def _load_with_params(path: str, name: str, cfg: dict, dtype: Optional[torch.dtype]) -> LoRAAdapter:
    weights = os.path.join(path, WEIGHTS_FILE)
    tensors = _read_tensors(name, path)
    module_parts: dict[str, dict[str, torch.Tensor]] = {}
    param_parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    embedding: set[str] = set()
    base_copies: dict[str, tuple[int, ...]] = {}
    for key, t in tensors.items():
        parsed = parse_key(key)
        if parsed is None:
            k = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
            if is_embedding_copy(k):
                base_copies[k] = tuple(t.shape)
                continue
            raise _err(name, f"{weights}: tensor {key!r} is not a LoRA weight this runtime understands")
        module, which = parsed
        if "lora_embedding" in key:
            embedding.add(module)
        if t.dim() != 2 or not t.is_floating_point():
            raise _err(name, f"{weights}: tensor {key!r} has shape {tuple(t.shape)} / dtype {t.dtype}, expected a "
                             f"2-dim floating tensor")
        depth = module.count(".base_layer")
        container = module.replace(".base_layer", "")
        if _targeted_params(cfg, container):
            param_parts.setdefault(container, {}).setdefault(depth, {})[which] = t
        else:
            module_parts.setdefault(module, {})[which] = t
    modules: dict[str, ModuleLoRA] = {}
    use_rslora = bool(cfg.get("use_rslora", False))
    for module in sorted(module_parts):
        ab = module_parts[module]
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise _err(name, f"{weights}: module {module!r} needs lora_A [r, in] and lora_B [out, r] of one rank, "
                             f"got {({k: tuple(v.shape) for k, v in ab.items()})}")
        if not is_targeted(cfg, module):
            raise _err(name, f"{weights} has LoRA weights for {module!r}, which target_modules="
                             f"{cfg.get('target_modules')!r} does not select (PEFT would not load them)")
        r, alpha = module_rank_alpha(cfg, module)
        if ab["A"].shape[0] != r:
            raise _err(name, f"{weights}: module {module!r} has rank {ab['A'].shape[0]} but {CONFIG_FILE} gives it "
                             f"r={r} (r / rank_pattern mismatch)")
        modules[module] = ModuleLoRA(_as(ab["A"], dtype), _as(ab["B"], dtype),
                                     lora_scale(r, alpha, use_rslora), embedding=module in embedding)
    for container in sorted(param_parts):
        modules.update(expert_param_modules(name, cfg, container, param_parts[container], dtype))
    if not modules:
        raise _err(name, f"{weights} holds no LoRA weights")
    return LoRAAdapter(name=name, path=path, rank=max(m.rank for m in modules.values()), config=cfg, modules=modules,
                       saved_base_weights=base_copies)
