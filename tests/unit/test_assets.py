"""The embedded default assets are real HF / PEFT artefacts: transformers and PEFT load them unchanged, they are
deterministic, greedy decoding on them is varied, adapters visibly change it, and the bundle installs atomically."""
import filecmp
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from tp_lora import assets
from tp_lora.assets import ensure_default_assets, write_random_adapter, write_tiny_llama
from tp_lora.lora.adapter import discover_adapters, load_adapter, validate_adapter
from tp_lora.models.checkpoint import CheckpointReader

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _hf(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    return model.eval(), info


def _greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw", [
    dict(),
    dict(model_type="qwen2", shards=3, tie_word_embeddings=True),
    dict(attention_bias=True, shards=2, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500.0),
    dict(model_type="mistral", num_key_value_heads=4),
])
def test_tiny_model_loads_in_transformers(tmp_path, kw):
    path = write_tiny_llama(str(tmp_path / "m"), **kw)
    model, info = _hf(path)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expect_arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(kw.get("model_type"),
                                                                                      "LlamaForCausalLM")
    assert type(model).__name__ == expect_arch
    ours = CheckpointReader(path)
    sd = model.state_dict()
    for name in ours.keys():
        assert torch.equal(sd[name], ours.get(name)), name
    if kw.get("tie_word_embeddings"):
        assert not ours.has("lm_head.weight")
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if kw.get("model_type") == "qwen2":
        assert ours.has("model.layers.0.self_attn.q_proj.bias") and not ours.has("model.layers.0.self_attn.o_proj.bias")
    if kw.get("attention_bias"):
        assert ours.has("model.layers.1.self_attn.o_proj.bias")


def test_logits_varied_and_greedy_does_not_collapse(tmp_path):
    model, _ = _hf(write_tiny_llama(str(tmp_path / "m")))
    prompt = [1, 17, 42, 99, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    assert logits.std(-1).min() > 1.0  # not flat
    assert len(set(logits.argmax(-1).tolist())) >= 4  # depends on the position's token
    out = _greedy(model, prompt, 24)
    assert len(set(out)) >= 8, out
    assert out[0] != out[1] or out[1] != out[2], out


def test_deterministic_and_seeded(tmp_path):
    a = write_tiny_llama(str(tmp_path / "a"), seed=7, shards=2)
    b = write_tiny_llama(str(tmp_path / "b"), seed=7, shards=2)
    c = write_tiny_llama(str(tmp_path / "c"), seed=8, shards=2)
    for f in os.listdir(a):
        assert filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False), f
    one = write_tiny_llama(str(tmp_path / "one"), seed=7)
    ra, rc, r1 = CheckpointReader(a), CheckpointReader(c), CheckpointReader(one)
    for k in ra.keys():
        assert torch.equal(ra.get(k), r1.get(k))  # shard count does not change the weights
    assert not torch.equal(ra.get("model.embed_tokens.weight"), rc.get("model.embed_tokens.weight"))
    x = write_random_adapter(str(tmp_path / "x"), a, seed=1)
    y = write_random_adapter(str(tmp_path / "y"), a, seed=1)
    assert filecmp.cmp(os.path.join(x, "adapter_model.safetensors"), os.path.join(y, "adapter_model.safetensors"),
                       shallow=False)


def test_dtype_bfloat16(tmp_path):
    path = write_tiny_llama(str(tmp_path / "m"), dtype=torch.bfloat16)
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(os.path.join(path, "model.safetensors")).values())
    ad = write_random_adapter(str(tmp_path / "a"), path, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(os.path.join(ad, "adapter_model.safetensors")).values())


def test_adapter_format_matches_peft_save(tmp_path):
    """Key names, shapes and config fields are those PEFT's own save_pretrained produces for the same config."""
    path = write_tiny_llama(str(tmp_path / "m"))
    ours = write_random_adapter(str(tmp_path / "ours"), path, r=4, lora_alpha=8, rank_pattern={"o_proj": 2},
                                include_embedding=True, include_lm_head=True)
    lc = peft.LoraConfig(r=4, lora_alpha=8, rank_pattern={"o_proj": 2}, init_lora_weights=False,
                         target_modules=list(assets.ATTN_MODULES + assets.MLP_MODULES) + ["embed_tokens", "lm_head"])
    model, _ = _hf(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(model, lc).save_pretrained(str(tmp_path / "peft"))
    mine = load_file(os.path.join(ours, "adapter_model.safetensors"))
    theirs = {k: v for k, v in load_file(str(tmp_path / "peft" / "adapter_model.safetensors")).items()
              if "base_layer" not in k}  # PEFT also saves the embedding tables themselves
    assert {k: tuple(v.shape) for k, v in mine.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    cm = json.load(open(os.path.join(ours, "adapter_config.json")))
    ct = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    for key in ("peft_type", "r", "lora_alpha", "rank_pattern", "alpha_pattern", "bias", "use_rslora", "use_dora",
                "fan_in_fan_out", "modules_to_save"):
        assert cm[key] == ct[key], key
    assert sorted(cm["target_modules"]) == sorted(ct["target_modules"])
    assert set(cm) <= set(ct)


def test_adapter_changes_greedy_output_in_peft(tmp_path):
    path = write_tiny_llama(str(tmp_path / "m"))
    ad = write_random_adapter(str(tmp_path / "a"), path, r=4, lora_alpha=8, seed=3)
    base, _ = _hf(path)
    prompt = [1, 5, 9, 200]
    ref = _greedy(base, prompt, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned = peft.PeftModel.from_pretrained(_hf(path)[0], ad).eval()
    out = _greedy(tuned, prompt, 12)
    assert sum(a != b for a, b in zip(out, ref)) >= 3, (out, ref)
    a = load_adapter(ad)
    assert all(m.a.count_nonzero() == m.a.numel() for m in a.modules.values())
    assert all(m.b.count_nonzero() == m.b.numel() for m in a.modules.values())


def test_unknown_target_module(tmp_path):
    path = write_tiny_llama(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="qkv_proj"):
        write_random_adapter(str(tmp_path / "a"), path, target_modules=("qkv_proj",))


# ---- the default bundle -----------------------------------------------------------------------------------------
def test_default_bundle(tmp_path):
    paths = ensure_default_assets(str(tmp_path / "bundle"))
    assert set(paths) == {"model", "adapter_dir", "requests"}
    model, info = _hf(paths["model"])
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = model.config
    for tp in (1, 2, 4, 8):  # every shipped parallel layout fits
        assert cfg.num_attention_heads % tp == 0 and cfg.intermediate_size % tp == 0 and cfg.vocab_size % tp == 0
        assert cfg.num_key_value_heads % tp == 0 or tp % cfg.num_key_value_heads == 0
    tok = transformers.AutoTokenizer.from_pretrained(paths["model"])  # HF reads the tokenizer: lossless, fits
    text = '{"key": [1, 2.5]} na\u00efve \u2014 \u65e5\u672c\u8a9e \U0001F9EA'
    assert len(tok) == cfg.vocab_size and tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    found = discover_adapters(paths["adapter_dir"])
    assert list(found) == ["alpha", "beta", "gamma"]
    reqs = [json.loads(line) for line in open(paths["requests"])]
    assert 6 <= len(reqs) <= 12 and len({r["id"] for r in reqs}) == len(reqs)
    assert None in {r["adapter"] for r in reqs} and {r["adapter"] for r in reqs} - {None} == set(found)
    for r in reqs:
        assert set(r) == {"id", "adapter", "prompt_token_ids", "max_new_tokens"}
        assert all(0 <= t < cfg.vocab_size for t in r["prompt_token_ids"]) and r["max_new_tokens"] >= 1
    shapes = assets.model_module_shapes(cfg.to_dict())
    ranks = {}
    for name, path in found.items():
        ad = load_adapter(path)
        validate_adapter(ad, shapes, max_rank=16)  # the default lora.max_rank
        ranks[name] = ad.rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tuned = peft.PeftModel.from_pretrained(_hf(paths["model"])[0], path).eval()
        r = next(r for r in reqs if r["adapter"] == name)
        assert _greedy(tuned, r["prompt_token_ids"], 8) != _greedy(model, r["prompt_token_ids"], 8), name
    assert ranks == {"alpha": 8, "beta": 16, "gamma": 4}
    assert load_adapter(found["beta"]).config["use_rslora"] is True
    assert "model.embed_tokens" in load_adapter(found["gamma"]).modules


def test_bundle_is_skipped_when_present(tmp_path):
    root = str(tmp_path / "b")
    paths = ensure_default_assets(root)
    stamp = os.stat(os.path.join(paths["model"], "model.safetensors")).st_mtime_ns
    assert ensure_default_assets(root) == paths
    assert os.stat(os.path.join(paths["model"], "model.safetensors")).st_mtime_ns == stamp
    assert sorted(os.listdir(tmp_path)) == ["b"]  # no temp dirs left behind


def test_default_root_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_LORA_HOME", str(tmp_path / "home"))
    paths = ensure_default_assets()
    assert paths["model"] == str(tmp_path / "home" / assets.BUNDLE_VERSION / "model")
    monkeypatch.delenv("TP_LORA_HOME")
    assert assets.default_root().endswith(os.path.join(".cache", "tp_lora", assets.BUNDLE_VERSION))


def test_stale_bundle_replaced_foreign_dir_kept(tmp_path):
    root = tmp_path / "stale"
    (root / "model").mkdir(parents=True)
    (root / "bundle.json").write_text('{"version": "default-v0"}')
    paths = ensure_default_assets(str(root))
    assert os.path.exists(os.path.join(paths["model"], "config.json"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a tp_lora asset bundle"):
        ensure_default_assets(str(mine))
    assert (mine / "precious.txt").read_text() == "keep"


def test_concurrent_writers(tmp_path):
    """Four processes at once, started fresh as torchrun starts its ranks (a fork of this process could hang: torch's
    thread pool does not survive fork)."""
    root = str(tmp_path / "race")
    code = "import json, sys; from tp_lora.assets import ensure_default_assets as e; print(json.dumps(e(sys.argv[1])))"
    procs = [subprocess.Popen([sys.executable, "-c", code, root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    results = [json.loads(out) for out, _ in outs]
    assert all(r == results[0] for r in results), results
    assert sorted(os.listdir(tmp_path)) == ["race"]
    assert list(discover_adapters(results[0]["adapter_dir"])) == ["alpha", "beta", "gamma"]
    CheckpointReader(results[0]["model"])
