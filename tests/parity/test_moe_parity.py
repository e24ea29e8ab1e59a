"""MoE against the outside world: random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints saved by transformers, LoRA
adapters in both PEFT MoE formats, greedy tokens and their logprobs from launch/generate.py in several parallel layouts
matching transformers + PEFT running each request alone with its adapter (_parity.check_matches).

Adapter formats:
  target_parameters  made by PEFT itself (get_peft_model with target_parameters=[mlp.experts.gate_up_proj,
                     mlp.experts.down_proj], init_lora_weights=False): one lora_A [E*r, in] / lora_B [out, E*r] per
                     fused expert parameter.
  per expert         the transformers-4 layout (`...experts.N.w1.lora_A.weight`), which PEFT cannot create on
                     transformers 5 (no per-expert modules) but still loads, converting it to target_parameters. It is
                     written here by hand. Its oracle is transformers with each expert's s * B @ A merged into
                     the base weights, and PEFT's conversion is checked against that merge where PEFT applies it.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402

from tp_lora.testing import listen_port  # noqa: E402

from _parity import check_matches, hf_greedy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW_TOKENS = 6
E, TOP_K, H, MOE_I = 8, 2, 64, 32
KINDS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=E, intermediate_size=MOE_I)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=E, moe_intermediate_size=MOE_I, intermediate_size=96,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=E, moe_intermediate_size=MOE_I, intermediate_size=96, norm_topk_prob=True)),
}
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def _make_model(kind: str, root):
    cfg_cls, cls, extra = KINDS[kind]
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    cfg = cfg_cls(vocab_size=128, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, eos_token_id=1, bos_token_id=0, num_experts_per_tok=TOP_K,
                  tie_word_embeddings=False, **extra)
    model = cls(cfg)
    with torch.no_grad():  # default init (std 0.02) gives flat logits and near-tied routers: make both decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "bias" in name:
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    path = root / kind
    model.save_pretrained(path, safe_serialization=True)  # transformers 5 writes per-expert tensors
    return path


def _peft_adapter(kind: str, model_dir, out_dir, lc):
    cls = KINDS[kind][1]
    pm = peft.get_peft_model(cls.from_pretrained(model_dir), lc)
    with torch.no_grad():  # PEFT's init_lora_weights=False B is small: scale it so adapters move greedy tokens
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)
    pm.save_pretrained(out_dir)


def _per_expert_adapter(kind: str, model_dir, out_dir, r: int, alpha: float, seed: int):
    """The transformers-4 per-expert layout, by hand: every expert's w1/w3/w2 (or gate/up/down_proj) + k_proj."""
    g = torch.Generator().manual_seed(seed)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    names = EXPERT_NAMES[kind]
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    moe_layers = [i for i in range(cfg["num_hidden_layers"]) if i not in (cfg.get("mlp_only_layers") or [])]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or H // cfg["num_attention_heads"])
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"base_model.model.model.layers.{i}."
        t[p + "self_attn.k_proj.lora_A.weight"] = torch.randn(r, H, generator=g) * H ** -0.5
        t[p + "self_attn.k_proj.lora_B.weight"] = torch.randn(kv, r, generator=g) * 0.5
        if i not in moe_layers:
            continue
        for e in range(E):
            for n, (fin, fout) in zip(names, ((H, MOE_I), (H, MOE_I), (MOE_I, H))):
                t[f"{p}{block}.experts.{e}.{n}.lora_A.weight"] = torch.randn(r, fin, generator=g) * fin ** -0.5
                t[f"{p}{block}.experts.{e}.{n}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.5
    os.makedirs(out_dir, exist_ok=True)
    save_file(t, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(names) + ["k_proj"],
               "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
               "base_model_name_or_path": str(model_dir)},
              open(os.path.join(out_dir, "adapter_config.json"), "w"))
    return t


def _make(kind: str, root):
    model_dir = _make_model(kind, root)
    adapters = root / f"{kind}-adapters"
    attn = ["q_proj", "v_proj", "o_proj"]
    shared = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
              "shared_expert_gate"] if kind == "qwen2_moe" else []
    _peft_adapter(kind, model_dir, adapters / "tp", peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, target_modules=attn + shared,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    _peft_adapter(kind, model_dir, adapters / "dn", peft.LoraConfig(
        r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False, target_modules=["o_proj"],
        target_parameters=["mlp.experts.down_proj"]))
    pe = _per_expert_adapter(kind, model_dir, adapters / "pe", r=16, alpha=16, seed=7)
    gen = torch.Generator().manual_seed(1)
    reqs = [{"id": f"r{i}", "adapter": a, "max_new_tokens": NEW_TOKENS,
             "prompt_token_ids": torch.randint(2, 128, (int(n),), generator=gen).tolist()}
            for i, (a, n) in enumerate(zip(["tp", None, "pe", "dn", "tp", "pe"], [5, 9, 3, 12, 1, 7]))]
    req_path = root / f"{kind}-requests.jsonl"
    req_path.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    return model_dir, adapters, req_path, reqs, pe


def _reference(kind, model_dir, adapter_dir, reqs, pe: dict | None = None):
    """Each request alone: transformers + PEFT. The per-expert adapter's oracle is the manual merge, checked against
    PEFT wherever PEFT converts that format (it does for Mixtral and Qwen3-MoE; for Qwen2-MoE, whose shared expert and
    dense layers also have gate/up/down_proj modules, PEFT 0.21 targets those instead and drops the expert weights).
    -> {id: hf_greedy's (tokens through EOS, their logprobs, every step's)}, how many PEFT conversions were checked."""
    cls = KINDS[kind][1]
    out, peft_checked = {}, 0
    for r in reqs:
        ids = torch.tensor([r["prompt_token_ids"]])
        model = cls.from_pretrained(model_dir, dtype=torch.float32)
        if r["adapter"] is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dir / r["adapter"])
        greedy = hf_greedy(model, ids, NEW_TOKENS, eos_token_id=1)
        if r["adapter"] == "pe":
            merged = _merged_reference(kind, model_dir, pe, 16, 16, ids)
            if model.peft_config["default"].target_parameters:
                assert greedy[0] == merged[0], \
                    f"PEFT's per-expert conversion disagrees with the manual merge ({r['id']})"
                peft_checked += 1
            greedy = merged
        out[r["id"]] = greedy
    return out, peft_checked


def _merged_reference(kind, model_dir, pe: dict, r: int, alpha: float, ids):
    """The per-expert adapter by hand: s * B @ A added to each expert's slice of the fused 3D parameters."""
    cls = KINDS[kind][1]
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    s = alpha / r
    g, u, d = EXPERT_NAMES[kind]
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = f"base_model.model.model.layers.{i}."
            k = layer.self_attn.k_proj
            k.weight += s * pe[p + "self_attn.k_proj.lora_B.weight"] @ pe[p + "self_attn.k_proj.lora_A.weight"]
            if not hasattr(layer.mlp, "experts"):
                continue
            ex = layer.mlp.experts
            for e in range(E):
                q = f"{p}{block}.experts.{e}."
                delta = {n: s * pe[q + n + ".lora_B.weight"] @ pe[q + n + ".lora_A.weight"] for n in (g, u, d)}
                ex.gate_up_proj[e, :MOE_I] += delta[g]
                ex.gate_up_proj[e, MOE_I:] += delta[u]
                ex.down_proj[e] += delta[d]
    return hf_greedy(model, ids, NEW_TOKENS, eos_token_id=1)


def _fused_copy(model_dir, out_dir):
    """The same checkpoint with transformers 5's fused expert tensors (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) in place of per-expert ones."""
    os.makedirs(out_dir, exist_ok=True)
    t = load_file(os.path.join(model_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    names = EXPERT_NAMES[cfg["model_type"]]
    out = {}
    for k, v in t.items():
        if ".experts." not in k:
            out[k.replace("block_sparse_moe.", "mlp.")] = v
    for i in range(cfg["num_hidden_layers"]):
        for block in ("block_sparse_moe", "mlp"):
            p = f"model.layers.{i}.{block}.experts."
            if p + f"0.{names[0]}.weight" not in t:
                continue
            g, u, d = [torch.stack([t[f"{p}{e}.{n}.weight"] for e in range(E)]) for n in names]
            out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([g, u], 1).contiguous()
            out[f"model.layers.{i}.mlp.experts.down_proj"] = d.contiguous()
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def _generate(model_dir, adapter_dir, req_path, out_path, layout: str, fully: bool):
    args = [f"model.path={model_dir}", f"lora.adapter_dir={adapter_dir}", f"requests={req_path}",
            f"output={out_path}", "device=cpu", "dtype=float32", f"lora.fully_sharded={str(fully).lower()}",
            "lora.max_loras=3", "lora.max_rank=16", f"parallel={layout}"]
    script = os.path.join(ROOT, "launch", "generate.py")
    ranks = {"tp1": 1, "tp2": 2, "ep2": 2, "tp2_ep2": 2, "ep2_tp2": 4}[layout]
    if ranks == 1:
        cmd = [sys.executable, script] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={listen_port()}", script] + args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(ln) for ln in open(out_path)]
    return {ln["id"]: (ln["output_token_ids"], ln["logprobs"]) for ln in lines}, [ln["id"] for ln in lines]


RUNS = {"mixtral": [("tp1", False), ("tp2", True), ("ep2", False), ("tp2_ep2", True), ("ep2_tp2", True)],
        "qwen2_moe": [("tp1", False), ("tp2", False), ("ep2", True), ("tp2_ep2", False)],
        "qwen3_moe": [("tp1", False), ("tp2_ep2", True)]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_moe_generate_matches_transformers_peft(tmp_path, kind):
    model_dir, adapter_dir, req_path, reqs, pe = _make(kind, tmp_path)
    expected, peft_checked = _reference(kind, model_dir, adapter_dir, reqs, pe)
    if kind != "qwen2_moe":
        assert peft_checked == 2, "PEFT no longer converts the per-expert format: check its oracle"
    base_only, _ = _reference(kind, model_dir, adapter_dir, [dict(r, adapter=None) for r in reqs])
    for name in ("tp", "pe", "dn"):
        assert any(expected[r["id"]][0] != base_only[r["id"]][0] for r in reqs if r["adapter"] == name), \
            f"adapter {name} did not change any greedy output: the test would not see a LoRA bug in it"

    runs = [(model_dir, layout, fully) for layout, fully in RUNS[kind]]
    if kind == "mixtral":  # the fused 3D checkpoint layout, read per rank, in one and two processes
        fused = _fused_copy(model_dir, tmp_path / "fused")
        runs += [(fused, "tp1", False), (fused, "ep2", True)]
    for i, (mdir, layout, fully) in enumerate(runs):
        got, order = _generate(mdir, adapter_dir, req_path, tmp_path / f"out-{i}.jsonl", layout, fully)
        assert order == [r["id"] for r in reqs], "output lines must follow request order"
        check_matches([got[i] for i in order], [expected[i] for i in order],
                      f"{os.path.basename(str(mdir))} parallel={layout} fully_sharded={fully}")
