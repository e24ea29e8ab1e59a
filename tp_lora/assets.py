"""The embedded default the main job runs on with no download: a tiny random Llama and random PEFT LoRA adapters,
written in the real on-disk formats (HF config.json + safetensors, PEFT adapter_config.json + safetensors), so
transformers and PEFT load them unchanged and serve as the oracle in tests.

Everything is deterministic in `seed`: the same call writes the same bytes. Weights are drawn in float32 with
scales that keep activations O(1) (std 1/sqrt(fan_in), norms near 1), so logits vary from token to token and
greedy decoding does not settle on one token; adapters move outputs by about half the base signal so their
effect on greedy tokens is visible.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Iterable, Optional, Union

import torch
from safetensors.torch import save_file

from tp_lora.lora.peft_format import lora_scale, module_rank_alpha
from tp_lora.models.checkpoint import load_hf_config

BUNDLE_VERSION = "default-v3"  # v3: a lossless tokenizer (all 256 bytes) and a vocab of 320
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _draw(g: torch.Generator, *shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32) * std + mean


def tiny_llama_config(*, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=False,
                      model_type="llama", rope_theta=10000.0, rope_scaling=None, dtype=torch.float32,
                      max_position_embeddings=2048) -> dict:
    """config.json of a Llama-family model, in the transformers 4.x layout that every 4.x / 5.x release reads."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r}: expected one of {sorted(ARCHITECTURES)}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_attention_heads={num_attention_heads}, num_key_value_heads="
                         f"{num_key_value_heads}: heads must divide hidden_size and kv heads must divide heads")
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": _dtype_name(dtype),
    }
    if model_type == "qwen2":  # q/k/v always carry a bias in Qwen2; no attention_bias switch
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_hidden_layers)
    else:
        cfg.update(attention_bias=attention_bias, mlp_bias=False)
        if model_type == "mistral":
            cfg["sliding_window"] = None
    return cfg


def tiny_llama_tensors(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF-named weights for a config from tiny_llama_config, drawn in float32 in a fixed order, then cast to dtype
    one by one (so a large benchmark model never holds a float32 copy of the whole)."""
    g = torch.Generator().manual_seed(seed)

    def _normal(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return _draw(g, *shape, std=std, mean=mean).to(dtype)

    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg["model_type"] != "qwen2" and cfg.get("attention_bias", False)
    t = {"model.embed_tokens.weight": _normal(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = _normal(h, std=0.1, mean=1.0)
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            t[p + f"self_attn.{name}.weight"] = _normal(rows, h, std=h ** -0.5)
            if qkv_bias:
                t[p + f"self_attn.{name}.bias"] = _normal(rows, std=0.1)
        t[p + "self_attn.o_proj.weight"] = _normal(h, heads * hd, std=(heads * hd) ** -0.5)
        if o_bias:
            t[p + "self_attn.o_proj.bias"] = _normal(h, std=0.1)
        t[p + "post_attention_layernorm.weight"] = _normal(h, std=0.1, mean=1.0)
        t[p + "mlp.gate_proj.weight"] = _normal(inter, h, std=h ** -0.5)
        t[p + "mlp.up_proj.weight"] = _normal(inter, h, std=h ** -0.5)
        t[p + "mlp.down_proj.weight"] = _normal(h, inter, std=inter ** -0.5)
    t["model.norm.weight"] = _normal(h, std=0.1, mean=1.0)
    # Drawn even when tied, so tying does not shift the other weights; std 2/sqrt(h) gives logits of std ~2.
    lm_head = _normal(v, h, std=2 * h ** -0.5)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = lm_head
    return t


def write_tiny_llama(path: str, *, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=False,
                     model_type="llama", rope_theta=10000.0, rope_scaling=None, seed=0, shards=1,
                     dtype=torch.float32, max_position_embeddings=2048) -> str:
    """A HF model dir at `path`: config.json + model.safetensors (shards == 1) or model-0000k-of-0000n.safetensors
    + model.safetensors.index.json. Returns path. Files are written whole (temp name, then rename) and
    config.json last, so a dir holding config.json is complete."""
    path = os.fspath(path)
    cfg = tiny_llama_config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                            num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                            num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
                            attention_bias=attention_bias, model_type=model_type, rope_theta=rope_theta,
                            rope_scaling=rope_scaling, dtype=dtype, max_position_embeddings=max_position_embeddings)
    tensors = tiny_llama_tensors(cfg, seed, dtype)
    os.makedirs(path, exist_ok=True)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if shards <= 1:
        _save_tensors(tensors, os.path.join(path, "model.safetensors"), meta)
        _write_json(os.path.join(path, "config.json"), cfg)
        return path
    names = list(tensors)  # model order: embed, layers, norm, head
    if shards > len(names):
        raise ValueError(f"shards={shards}: the model has only {len(names)} tensors")
    weight_map, start = {}, 0
    for k in range(shards):
        stop = start + len(names) // shards + (k < len(names) % shards)
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        _save_tensors({n: tensors[n] for n in names[start:stop]}, os.path.join(path, fname), meta)
        weight_map.update({n: fname for n in names[start:stop]})
        start = stop
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(os.path.join(path, "model.safetensors.index.json"),
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(os.path.join(path, "config.json"), cfg)
    return path


def model_module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) of every module a LoRA may target in a Llama-family config
    ("model.embed_tokens": (vocab, hidden); "lm_head": (hidden, vocab))."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    per_layer = {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd),
                 "self_attn.v_proj": (h, kv * hd), "self_attn.o_proj": (heads * hd, h),
                 "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter), "mlp.down_proj": (inter, h)}
    shapes = {"model.embed_tokens": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
    shapes["lm_head"] = (h, v)
    return shapes


def adapter_config(*, r=8, lora_alpha=16, target_modules: Iterable[str] = (), use_rslora=False,
                   rank_pattern=None, alpha_pattern=None, base_model_name_or_path=None) -> dict:
    """adapter_config.json as PEFT's LoraConfig.save_pretrained writes it (keys every PEFT >= 0.10 reads)."""
    return {
        "alpha_pattern": dict(alpha_pattern or {}),
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": dict(rank_pattern or {}),
        "revision": None,
        "target_modules": sorted(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }


def write_random_adapter(path: str, model_dir_or_config: Union[str, dict], *, r=8, lora_alpha=16,
                         target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                         use_rslora=False, rank_pattern=None, alpha_pattern=None, seed=0, include_embedding=False,
                         include_lm_head=False, dtype=torch.float32, strength: float = 0.5,
                         base_model_name_or_path: Optional[str] = None) -> str:
    """A PEFT LoRA adapter dir at `path` (adapter_config.json + adapter_model.safetensors) for the model at
    model_dir_or_config (a HF model dir or its config dict). Every module's rank follows rank_pattern as PEFT
    would; A and B are non-zero, with |scale * B A x| about `strength` * |x| whatever the scale. Returns path."""
    path = os.fspath(path)
    if isinstance(model_dir_or_config, dict):
        cfg = model_dir_or_config
    else:
        cfg = load_hf_config(model_dir_or_config)
        base_model_name_or_path = base_model_name_or_path or os.path.abspath(model_dir_or_config)
    unknown = [t for t in target_modules if t not in ATTN_MODULES + MLP_MODULES]
    if unknown:
        raise ValueError(f"target_modules {unknown}: expected names from {ATTN_MODULES + MLP_MODULES}")
    targets = list(target_modules) + ["embed_tokens"] * include_embedding + ["lm_head"] * include_lm_head
    acfg = adapter_config(r=r, lora_alpha=lora_alpha, target_modules=targets, use_rslora=use_rslora,
                          rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                          base_model_name_or_path=base_model_name_or_path)
    shapes = model_module_shapes(cfg)
    modules = [m for m in shapes if m.rsplit(".", 1)[-1] in targets]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        fin, fout = shapes[module]
        mr, alpha = module_rank_alpha(acfg, module)
        scale = lora_scale(mr, alpha, use_rslora)
        key = "base_model.model." + module
        if module == "model.embed_tokens":
            # A's columns are looked up by token id, so they are O(1) themselves.
            a = _draw(g, mr, fin)
            names = (key + ".lora_embedding_A", key + ".lora_embedding_B")
        else:
            a = _draw(g, mr, fin, std=fin ** -0.5)
            names = (key + ".lora_A.weight", key + ".lora_B.weight")
        b = _draw(g, fout, mr, std=strength / (scale * math.sqrt(mr)))
        tensors[names[0]], tensors[names[1]] = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    _write_json(os.path.join(path, "adapter_config.json"), acfg)
    _save_tensors(tensors, os.path.join(path, "adapter_model.safetensors"), {"format": "pt"})
    return path


# ---- a tiny tokenizer -------------------------------------------------------------------------------------------
TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. A small model speaks in short words: hello world, good "
    "morning, thank you, see you soon. Adapters change how it speaks; the base model stays the same. "
    "Every request picks an adapter by name, or none for the base; tokens stream back one by one until "
    "a stop string, the end token or the length limit. Numbers 0123456789 and symbols (+-*/=%#@&) appear too. "
    "Many LoRA adapters share one server: vLLM and SGLang serve them this way, and so do we. "
    'Replies may be JSON: {"name": "ada", "tags": ["red", "blue"], "n": 1.5, "ok": true, "x": null}. '
    "Caf\u00e9, na\u00efve, \u00fcber, fa\u00e7ade; \u65e5\u672c\u8a9e\u3067\u3059; \u00a1Hola! \U0001F642\n")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
MIN_TOKENIZER_VOCAB = len(SPECIAL_TOKENS) + 256  # the specials and one token per byte
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def write_tiny_tokenizer(path: str, vocab_size: int = 320) -> str:
    """tokenizer.json (HF `tokenizers` format) + tokenizer_config.json with a chat template at `path`: a byte-level
    BPE of `vocab_size` tokens (<unk>=0, <s>=1 prepended to every encoding, </s>=2), one token per byte (ids 3..258)
    and merges trained on TOKENIZER_TEXT, deterministically. Lossless: any Unicode text decodes back to itself
    (the specials' own spellings in the text excepted, read as those tokens); multi-byte characters outside the
    merges span several tokens, so the model's output exercises incremental detokenization."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    if vocab_size < MIN_TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level tokenizer needs at least {MIN_TOKENIZER_VOCAB} "
                         f"tokens ({len(SPECIAL_TOKENS)} specials and 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer text yields {tok.get_vocab_size()} tokens, not vocab_size={vocab_size}")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f"tokenizer.json.tmp-{os.getpid()}")
    tok.save(tmp)
    os.replace(tmp, os.path.join(path, "tokenizer.json"))
    _write_json(os.path.join(path, "tokenizer_config.json"),
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE})
    return path


# ---- the default bundle ---------------------------------------------------------------------------------------
# Sized so every shipped layout runs on it: 8 query heads and 2 KV heads split over tp 1..8 (KV heads replicated
# beyond 2), vocab / intermediate divisible by 8; head_dim 16 suits tensor-core kernels.
DEFAULT_MODEL = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, seed=0)
DEFAULT_ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, seed=1, rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 32}),
    "beta": dict(r=16, lora_alpha=16, use_rslora=True, seed=2),
    "gamma": dict(r=4, lora_alpha=8, seed=3, target_modules=("q_proj", "v_proj", "down_proj"),
                  include_embedding=True, include_lm_head=True),
}
DEFAULT_REQUESTS = [
    {"id": "req-0", "adapter": "alpha", "prompt_token_ids": [1, 17, 42, 99, 7], "max_new_tokens": 16},
    {"id": "req-1", "adapter": None, "prompt_token_ids": [1, 17, 42, 99, 7], "max_new_tokens": 16},
    {"id": "req-2", "adapter": "beta", "prompt_token_ids": [1, 200, 3, 64, 128, 5, 77, 31], "max_new_tokens": 12},
    {"id": "req-3", "adapter": "gamma", "prompt_token_ids": [1, 250, 11], "max_new_tokens": 20},
    {"id": "req-4", "adapter": "alpha", "prompt_token_ids": [1, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99],
     "max_new_tokens": 8},
    {"id": "req-5", "adapter": None, "prompt_token_ids": [1, 5], "max_new_tokens": 24},
    {"id": "req-6", "adapter": "beta", "prompt_token_ids": [1, 17, 42, 99, 7], "max_new_tokens": 16},
    {"id": "req-7", "adapter": "gamma", "prompt_token_ids": [1, 33, 66, 99, 132, 165, 198], "max_new_tokens": 10},
]


def default_root() -> str:
    """$TP_LORA_HOME/<BUNDLE_VERSION>, else ~/.cache/tp_lora/<BUNDLE_VERSION>: versioned, so a changed bundle never
    reuses an older one's files."""
    home = os.environ.get("TP_LORA_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tp_lora")
    return os.path.join(home, BUNDLE_VERSION)


BUNDLE_ENTRIES = ("model", "adapters", "requests.jsonl", "bundle.json")


def _bundle_paths(root: str) -> dict:
    return {"model": os.path.join(root, "model"), "adapter_dir": os.path.join(root, "adapters"),
            "requests": os.path.join(root, "requests.jsonl")}


def _bundle_complete(root: str) -> bool:
    try:
        with open(os.path.join(root, "bundle.json"), encoding="utf-8") as f:
            ok = json.load(f).get("version") == BUNDLE_VERSION
    except (OSError, ValueError, AttributeError):
        return False
    return ok and all(os.path.exists(p) for p in _bundle_paths(root).values())


def _write_bundle(tmp: str, final_root: str) -> None:
    model = os.path.join(tmp, "model")
    write_tiny_llama(model, **DEFAULT_MODEL)
    write_tiny_tokenizer(model, DEFAULT_MODEL["vocab_size"])
    cfg = load_hf_config(model)
    for name, kw in DEFAULT_ADAPTERS.items():
        write_random_adapter(os.path.join(tmp, "adapters", name), cfg,
                             base_model_name_or_path=os.path.join(final_root, "model"), **kw)
    with open(os.path.join(tmp, "requests.jsonl"), "w", encoding="utf-8") as f:
        for req in DEFAULT_REQUESTS:
            f.write(json.dumps(req) + "\n")
    # Written last: its presence marks a complete bundle.
    _write_json(os.path.join(tmp, "bundle.json"), {"version": BUNDLE_VERSION, "model": DEFAULT_MODEL,
                                                    "adapters": sorted(DEFAULT_ADAPTERS)})


def ensure_default_assets(root: Optional[str] = None) -> dict:
    """The default bundle (tiny Llama at model/, adapters alpha / beta / gamma under adapters/, requests.jsonl),
    written on first use under root (default: default_root()). An existing dir at root that is not a bundle is
    never overwritten.

    Safe to call from several processes at once (every torchrun rank does): each writes a private temp dir and
    renames it into place; the first rename wins and the others discard theirs. Returns {model, adapter_dir,
    requests} paths.
    """
    root = os.path.abspath(os.fspath(root) if root else default_root())
    paths = _bundle_paths(root)
    if _bundle_complete(root):
        return paths
    parent = os.path.dirname(root)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(root)}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the installed bundle is an ordinary readable dir
    try:
        _write_bundle(tmp, root)
        for _ in range(10):
            try:
                os.replace(tmp, root)  # atomic; fails if another writer already put a non-empty dir there
                return paths
            except OSError:
                if _bundle_complete(root):
                    return paths
                if os.path.isdir(root):  # stale or partial (an older version, a killed writer): move it aside
                    foreign = set(os.listdir(root)) - set(BUNDLE_ENTRIES)
                    if foreign:
                        raise FileExistsError(f"{root} exists and is not a tp_lora asset bundle (it holds "
                                              f"{sorted(foreign)[:5]}); pass another root or remove it")
                    stale = tempfile.mkdtemp(prefix=f".{os.path.basename(root)}.stale-", dir=parent)
                    try:
                        os.replace(root, os.path.join(stale, "old"))
                    except OSError:
                        pass  # another writer moved it first
                    shutil.rmtree(stale, ignore_errors=True)
        raise OSError(f"could not install the default assets at {root} (kept being replaced concurrently)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _save_tensors(tensors: dict, path: str, metadata: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)
