"""PEFT LoRA adapters: what load_adapter returns equals what PEFT itself builds (weights, scaling, pattern rules),
both for adapters we write and adapters PEFT saves; every unsupported option and broken file fails clearly."""
import json
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora.assets import model_module_shapes, write_random_adapter, write_tiny_llama
from tp_lora.lora.adapter import LoRAAdapter, ModuleLoRA, discover_adapters, load_adapter, validate_adapter
from tp_lora.lora.peft_format import AdapterError, is_targeted, module_rank_alpha, pattern_key, read_adapter_config
from tp_lora.models.checkpoint import load_hf_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.tuners.lora import Embedding as PeftEmbedding, LoraLayer  # noqa: E402

PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("model") / "tiny"), seed=5)


@pytest.fixture(scope="module")
def shapes(model_dir):
    return model_module_shapes(load_hf_config(model_dir))


@pytest.fixture
def good_adapter(model_dir, tmp_path):
    return write_random_adapter(str(tmp_path / "good"), model_dir, r=8, lora_alpha=16, seed=1)


def _hf(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir)


def _peft_modules(pm) -> dict:
    """module path (no PEFT prefix) -> (A, B, scaling) of a PEFT model's 'default' adapter."""
    out = {}
    for name, mod in pm.named_modules():
        if not isinstance(mod, LoraLayer) or "default" not in mod.scaling:
            continue
        path = name.removeprefix(PREFIX)
        if isinstance(mod, PeftEmbedding):
            a, b = mod.lora_embedding_A["default"], mod.lora_embedding_B["default"]
        else:
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        out[path] = (a.detach(), b.detach(), mod.scaling["default"])
    return out


def _assert_same(ours, theirs):
    assert sorted(ours.modules) == sorted(theirs)
    for path, m in ours.modules.items():
        a, b, s = theirs[path]
        assert torch.equal(m.a, a), path
        assert torch.equal(m.b, b), path
        assert m.scale == pytest.approx(s, rel=1e-12), path
    assert ours.rank == max(m.rank for m in ours.modules.values())


# ---- PEFT as the oracle ------------------------------------------------------------------------------------------
def test_written_adapter_loads_in_peft_identically(model_dir, tmp_path):
    path = write_random_adapter(str(tmp_path / "ad"), model_dir, r=8, lora_alpha=16, seed=2,
                                rank_pattern={"o_proj": 4, r"layers\.1\.self_attn\.q_proj": 2},
                                alpha_pattern={"down_proj": 32, "model.layers.0.mlp.up_proj": 3},
                                include_embedding=True, include_lm_head=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(_hf(model_dir), path)
    theirs = _peft_modules(pm)
    ours = load_adapter(path, name="ad")
    _assert_same(ours, theirs)
    m = ours.modules
    assert m["model.layers.0.self_attn.o_proj"].rank == 4 and m["model.layers.1.self_attn.q_proj"].rank == 2
    assert m["model.layers.0.self_attn.q_proj"].rank == 8
    assert m["model.layers.1.mlp.down_proj"].scale == 4.0 and m["model.layers.0.mlp.up_proj"].scale == 3 / 8
    assert m["model.layers.1.self_attn.o_proj"].scale == 4.0  # default alpha 16 over the pattern's rank 4
    assert m["model.embed_tokens"].embedding and m["model.embed_tokens"].a.shape == (8, 256)
    assert m["lm_head"].a.shape == (8, 64) and m["lm_head"].b.shape == (256, 8)
    validate_adapter(ours, model_module_shapes(load_hf_config(model_dir)), max_rank=8)


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_saved_adapter_reads_the_same(model_dir, tmp_path, use_rslora):
    lc = peft.LoraConfig(r=8, lora_alpha=12, init_lora_weights=False, use_rslora=use_rslora,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                         "embed_tokens", "lm_head"],
                         rank_pattern={"layers.1.self_attn.q_proj": 4, "down_proj": 2, "^lm_head": 16},
                         alpha_pattern={"v_proj": 7, "embed_tokens": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(_hf(model_dir), lc)
        pm.save_pretrained(str(tmp_path / "saved"))
    keys = load_file(str(tmp_path / "saved" / "adapter_model.safetensors"))
    assert any(k.endswith("embed_tokens.base_layer.weight") for k in keys)  # PEFT saves the table too
    ours = load_adapter(str(tmp_path / "saved"))
    theirs = _peft_modules(pm)
    _assert_same(ours, theirs)
    s = ours.modules
    assert s["model.layers.1.self_attn.q_proj"].rank == 4 and s["model.layers.0.self_attn.q_proj"].rank == 8
    assert s["lm_head"].rank == 16 and s["model.layers.0.mlp.down_proj"].rank == 2
    expect = 7 / (8 ** 0.5) if use_rslora else 7 / 8
    assert s["model.layers.0.self_attn.v_proj"].scale == pytest.approx(expect)
    assert ours.saved_base_weights  # recorded, not used
    validate_adapter(ours, model_module_shapes(load_hf_config(model_dir)), max_rank=16)


def test_module_forward_matches_peft(model_dir, tmp_path):
    """The orientation of every tensor: delta = scale * (x A^T) B^T, and for the embedding
    scale * B[:, A[:, ids]]^T, equal PEFT's own forward."""
    path = write_random_adapter(str(tmp_path / "ad"), model_dir, r=4, lora_alpha=8, seed=4, include_embedding=True,
                                target_modules=("q_proj", "down_proj"), use_rslora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(_hf(model_dir), path)
    ours = load_adapter(path)
    lm = pm.base_model.model.model
    x = torch.randn(5, 64)
    q, m = lm.layers[1].self_attn.q_proj, ours.modules["model.layers.1.self_attn.q_proj"]
    torch.testing.assert_close(q(x), q.base_layer(x) + m.scale * (x @ m.a.t()) @ m.b.t())
    ids = torch.tensor([0, 7, 255, 7])
    e, m = lm.embed_tokens, ours.modules["model.embed_tokens"]
    torch.testing.assert_close(e(ids), e.base_layer(ids) + m.scale * m.a.t()[ids] @ m.b.t())


def test_pattern_key_matches_peft():
    from peft.utils.other import get_pattern_key
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.10.mlp.down_proj",
               "lm_head", "model.embed_tokens", "model.layers.1.self_attn.qq_proj"]
    patterns = [{"q_proj": 4}, {"layers.1.self_attn.q_proj": 2, "q_proj": 4},
                {"q_proj": 4, "layers.1.self_attn.q_proj": 2}, {"^model.layers.0.self_attn.q_proj": 3}, {r"layers\.1\d*\..*": 5}, {"proj": 9}, {"embed_tokens": 1},
                {"down_proj|lm_head": 6}, {}]
    for pat in patterns:
        for mod in modules:
            assert pattern_key(pat.keys(), mod) == get_pattern_key(pat.keys(), mod), (pat, mod)
            got = module_rank_alpha({"r": 8, "lora_alpha": 16, "rank_pattern": pat, "alpha_pattern": pat}, mod)
            want = pat.get(get_pattern_key(pat.keys(), mod), 8), pat.get(get_pattern_key(pat.keys(), mod), 16)
            assert got == want, (pat, mod)


def test_is_targeted_matches_peft():
    from peft.tuners.tuners_utils import check_target_module_exists
    modules = list(model_module_shapes({"hidden_size": 8, "intermediate_size": 8, "vocab_size": 8,
                                        "num_attention_heads": 2, "num_hidden_layers": 3}))
    configs = [dict(target_modules=["q_proj", "v_proj"]), dict(target_modules=r".*layers\.[01]\..*(q|down)_proj"),
               dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
               dict(target_modules=["q_proj"], layers_to_transform=1, layers_pattern="layers"),
               dict(target_modules=["q_proj", "model.embed_tokens", "lm_head"]),
               dict(target_modules=["q_proj", "k_proj"], exclude_modules=["model.layers.1.self_attn.k_proj"]),
               dict(target_modules=["q_proj", "k_proj"], exclude_modules=r".*\.1\..*")]
    for kw in configs:
        lc = peft.LoraConfig(**kw)
        raw = {k: (sorted(v) if isinstance(v, set) else v) for k, v in lc.to_dict().items()}
        for mod in modules:
            assert is_targeted(raw, mod) == bool(check_target_module_exists(lc, mod)), (kw, mod)


# ---- key spellings ---------------------------------------------------------------------------------------------------
def test_key_spellings_adapter_infix_and_no_prefix(good_adapter, tmp_path):
    ref = load_adapter(good_adapter)
    tensors = load_file(os.path.join(good_adapter, "adapter_model.safetensors"))
    for variant, rename in {
        "infix": lambda k: k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight",
                                                                                         ".lora_B.default.weight"),
        "noprefix": lambda k: k.removeprefix(PREFIX),
        "named": lambda k: k.removeprefix(PREFIX).replace(".weight", ".myname.weight"),
    }.items():
        d = tmp_path / variant
        d.mkdir()
        shutil.copy(os.path.join(good_adapter, "adapter_config.json"), d)
        save_file({rename(k): v for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
        got = load_adapter(str(d))
        assert got.name == variant and sorted(got.modules) == sorted(ref.modules)
        for k, m in ref.modules.items():
            assert torch.equal(got.modules[k].a, m.a) and torch.equal(got.modules[k].b, m.b)


def test_embedding_key_with_adapter_name(model_dir, tmp_path):
    path = write_random_adapter(str(tmp_path / "e"), model_dir, r=4, include_embedding=True, target_modules=())
    f = os.path.join(path, "adapter_model.safetensors")
    t = load_file(f)
    save_file({k + ".default": v for k, v in t.items()}, f)
    m = load_adapter(path).modules
    assert list(m) == ["model.embed_tokens"] and m["model.embed_tokens"].a.shape == (4, 256)


def test_dtype(good_adapter):
    ad = load_adapter(good_adapter, dtype=torch.bfloat16)
    assert all(m.a.dtype == torch.bfloat16 and m.b.dtype == torch.bfloat16 for m in ad.modules.values())


# ---- config rejections -------------------------------------------------------------------------------------------
def _edit_config(path, **changes):
    f = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(f))
    cfg.update(changes)
    json.dump(cfg, open(f, "w"))


@pytest.mark.parametrize("option,value", [
    ("bias", "all"), ("bias", "lora_only"), ("fan_in_fan_out", True), ("peft_type", "IA3"),
    ("peft_type", "LOHA"), ("modules_to_save", ["score"]), ("modules_to_save", "lm_head"),
    ("layer_replication", [[0, 2]]),
    ("trainable_token_indices", [1, 2]), ("target_parameters", ["mlp.experts.gate_up_proj"]),
    ("alora_invocation_tokens", [5, 6]), ("r", 0), ("r", "8"), ("rank_pattern", {"q_proj": 0}),
    ("rank_pattern", ["q_proj"]), ("lora_alpha", "x"), ("alpha_pattern", {"(": 2}), ("exclude_modules", "(["),
    ("target_modules", 5), ("target_modules", ["q_proj", 3]), ("layers_to_transform", "0"),
])
def test_rejected_options_name_adapter_and_option(good_adapter, option, value):
    _edit_config(good_adapter, **{option: value})
    with pytest.raises(AdapterError) as e:
        load_adapter(good_adapter, name="bad-one")
    msg = str(e.value)
    assert "'bad-one'" in msg and option in msg and "adapter_config.json" in msg, msg
    with pytest.raises(AdapterError):
        read_adapter_config(good_adapter)


def test_dora_and_lora_bias_configs_checked_against_the_tensors(good_adapter):
    """use_dora without magnitude vectors, or with lora_bias, is refused naming the option; lora_bias without bias
    tensors reads (a zero bias)."""
    _edit_config(good_adapter, use_dora=True)
    with pytest.raises(AdapterError, match=r"lacks its DoRA magnitude \(lora_magnitude_vector\) but "
                                           r"adapter_config.json has use_dora=true"):
        load_adapter(good_adapter, name="bad-one")
    _edit_config(good_adapter, lora_bias=True)
    with pytest.raises(AdapterError, match="lora_bias"):
        read_adapter_config(good_adapter)
    _edit_config(good_adapter, use_dora=False)
    assert all(m.bias is None and m.magnitude is None for m in load_adapter(good_adapter).modules.values())


def test_accepted_harmless_options(good_adapter):
    _edit_config(good_adapter, modules_to_save=None, use_dora=False, bias="none", lora_dropout=0.1,
                 init_lora_weights="gaussian", unknown_future_key=1, rank_pattern=None, alpha_pattern=None)
    assert len(load_adapter(good_adapter).modules) == 14


def test_rank_disagreeing_with_config(good_adapter):
    _edit_config(good_adapter, r=16)
    with pytest.raises(AdapterError, match=r"rank 8 but adapter_config.json gives it r=16"):
        load_adapter(good_adapter)
    _edit_config(good_adapter, r=8, rank_pattern={"v_proj": 4})
    with pytest.raises(AdapterError, match=r"v_proj' has rank 8 .* r=4"):
        load_adapter(good_adapter)


def test_weights_for_untargeted_module(good_adapter):
    _edit_config(good_adapter, target_modules=["q_proj", "k_proj"])
    with pytest.raises(AdapterError, match="target_modules.*does not select"):
        load_adapter(good_adapter)
    _edit_config(good_adapter, target_modules="all-linear")
    load_adapter(good_adapter)
    _edit_config(good_adapter, target_modules=r".*\.(q|k|v|o|gate|up|down)_proj")
    load_adapter(good_adapter)


# ---- broken files ----------------------------------------------------------------------------------------------
def test_malformed_json(good_adapter):
    open(os.path.join(good_adapter, "adapter_config.json"), "w").write('{"r": 8, ')
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        load_adapter(good_adapter)


def test_missing_files(good_adapter, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_adapter(str(tmp_path / "nope"))
    w = os.path.join(good_adapter, "adapter_model.safetensors")
    os.rename(w, os.path.join(good_adapter, "adapter_model.bin"))
    with pytest.raises(AdapterError, match="adapter_model.safetensors not found; adapter_model.bin is present but "
                                           "pickled weights are not supported") as e:
        load_adapter(good_adapter)
    assert isinstance(e.value, FileNotFoundError)
    os.remove(os.path.join(good_adapter, "adapter_config.json"))
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found"):
        load_adapter(good_adapter)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_safetensors(good_adapter, damage):
    w = os.path.join(good_adapter, "adapter_model.safetensors")
    data = open(w, "rb").read()
    data = {"truncate": data[: len(data) // 2], "garbage": b"\x08\0\0\0\0\0\0\0{garbage" + data[17:],
            "empty": b""}[damage]
    open(w, "wb").write(data)
    with pytest.raises(AdapterError, match="adapter_model.safetensors .* not a readable safetensors file"):
        load_adapter(good_adapter, name="x")


def test_unknown_tensor_and_half_pairs(good_adapter):
    w = os.path.join(good_adapter, "adapter_model.safetensors")
    t = load_file(w)
    key = PREFIX + "model.layers.0.self_attn.q_proj"
    save_file(dict(t, **{key + ".lora_magnitude_vector": torch.ones(64)}), w)
    with pytest.raises(AdapterError,
                       match=r"q_proj. has a DoRA magnitude \(lora_magnitude_vector\), which needs use_dora=true"):
        load_adapter(good_adapter)
    save_file({k: v for k, v in t.items() if k != key + ".lora_B.weight"}, w)
    with pytest.raises(AdapterError, match="q_proj' has lora_A but no lora_B"):
        load_adapter(good_adapter)
    t[key + ".lora_B.weight"] = torch.zeros(64, 4)
    save_file(t, w)
    with pytest.raises(AdapterError, match="lora_A \\(8, 64\\) has rank 8 but lora_B \\(64, 4\\) has rank 4"):
        load_adapter(good_adapter)


# ---- validate_adapter --------------------------------------------------------------------------------------------
def test_validate_rank_above_max(good_adapter, shapes):
    ad = load_adapter(good_adapter, name="big")
    validate_adapter(ad, shapes, max_rank=8)
    with pytest.raises(AdapterError, match=r"'big'.*'model\.layers\.\d\..*' has rank 8 > lora\.max_rank=4"):
        validate_adapter(ad, shapes, max_rank=4)


def test_validate_module_the_model_lacks(good_adapter, shapes):
    ad = load_adapter(good_adapter, name="other")
    fewer = {k: v for k, v in shapes.items() if not k.startswith("model.layers.1.")}
    with pytest.raises(AdapterError, match=r"'other'.*model\.layers\.1\..*which this model lacks.*another model"):
        validate_adapter(ad, fewer, max_rank=16)


def test_validate_wrong_shapes(good_adapter, shapes):
    ad = load_adapter(good_adapter, name="wide")
    wider = dict(shapes, **{"model.layers.1.self_attn.k_proj": (128, 32)})
    with pytest.raises(AdapterError, match=r"'wide'.*k_proj': A \(8, 64\) / B \(32, 8\) do not fit the model's "
                                           r"A \(8, 128\) / B \(32, 8\).*built for another model\?"):
        validate_adapter(ad, wider, max_rank=16)
    taller = dict(shapes, **{"model.layers.0.mlp.up_proj": (64, 100)})
    with pytest.raises(AdapterError, match=r"up_proj': A \(8, 64\) / B \(128, 8\) do not fit the model's "
                                           r"A \(8, 64\) / B \(100, 8\)"):
        validate_adapter(ad, taller, max_rank=16)


def test_validate_rank_mismatch_and_non_finite(shapes):
    mod = "model.layers.0.self_attn.q_proj"
    bad = LoRAAdapter("m", "/x", 4, {}, {mod: ModuleLoRA(torch.zeros(4, 64), torch.zeros(64, 2), 1.0)})
    with pytest.raises(AdapterError, match="disagree on the rank"):
        validate_adapter(bad, shapes, 16)
    for value in (float("nan"), float("inf"), -float("inf")):
        b = torch.zeros(64, 4)
        b[3, 1] = value
        ad = LoRAAdapter("n", "/x", 4, {}, {mod: ModuleLoRA(torch.zeros(4, 64), b, 1.0)})
        with pytest.raises(AdapterError, match="'n'.*q_proj.*lora_B has 1 NaN/Inf"):
            validate_adapter(ad, shapes, 16)


def test_validate_resized_vocabulary(good_adapter, shapes):
    ad = load_adapter(good_adapter)
    ad.saved_base_weights = {"model.embed_tokens.base_layer.weight": (300, 64)}
    with pytest.raises(AdapterError, match="300 rows but the model's vocabulary has 256"):
        validate_adapter(ad, shapes, 16)


def test_errors_are_value_errors():
    assert issubclass(AdapterError, ValueError)


# ---- discovery ---------------------------------------------------------------------------------------------------
def test_discover_adapters(model_dir, tmp_path):
    root = tmp_path / "ads"
    for n in ("zeta", "alpha", "mid"):
        write_random_adapter(str(root / n), model_dir, r=2)
    (root / "not-an-adapter").mkdir()
    (root / ".hidden").mkdir()
    (root / ".hidden" / "adapter_config.json").write_text("{}")
    (root / "README.md").write_text("x")
    found = discover_adapters(str(root))
    assert list(found) == ["alpha", "mid", "zeta"]
    assert found["mid"] == os.path.join(str(root), "mid")
    assert discover_adapters(str(root / "alpha")) == {"alpha": str(root / "alpha")}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        discover_adapters(str(tmp_path / "absent"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_count_nonfinite_is_exact(dtype):
    from tp_lora.lora.adapter import count_nonfinite
    t = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert count_nonfinite(t) == 0
    big = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)  # finite, but its sum overflows
    assert count_nonfinite(big) == 0
    t[0, 3], t[1, 7], t[3, 299] = float("nan"), float("inf"), -float("inf")
    assert count_nonfinite(t) == 3
    assert count_nonfinite(t[1:, 1::2]) == 2  # a strided view: the inf at [1, 7] and the -inf at [3, 299]
