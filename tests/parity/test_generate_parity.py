"""The outside world as the oracle: checkpoints made by transformers, adapters made by PEFT (init_lora_weights=False),
greedy tokens and their logprobs from launch/generate.py (tp=1, and tp=2 in both LoRA modes) match transformers + PEFT
running each request alone with its adapter (_parity.check_matches)."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tp_lora.testing import listen_port  # noqa: E402

from _parity import check_matches, hf_greedy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW_TOKENS = 8


def _make(kind: str, root):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=5000.0, tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random init of norms is all ones: perturb so a wrong norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if "bias" in name:
                p.normal_(0, 0.1)
    model_dir = root / kind
    model.save_pretrained(model_dir, safe_serialization=True)
    specs = {
        "all": peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]),
        "rs": peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                              target_modules=["q_proj", "v_proj", "down_proj"],
                              rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3}),
        "head": peft.LoraConfig(r=16, lora_alpha=16, init_lora_weights=False,
                                target_modules=["embed_tokens", "lm_head", "up_proj"]),
    }
    for name, lc in specs.items():
        base = type(model).from_pretrained(model_dir)
        pm = peft.get_peft_model(base, lc)
        with torch.no_grad():  # PEFT's random init of B is small for lora; scale it up so outputs really move
            for n, p in pm.named_parameters():
                if "lora_B" in n or "lora_embedding_B" in n:
                    p.mul_(4.0)
        pm.save_pretrained(root / f"{kind}-adapters" / name)
    gen = torch.Generator().manual_seed(1)
    reqs = [{"id": f"r{i}", "adapter": a, "max_new_tokens": NEW_TOKENS,
             "prompt_token_ids": torch.randint(2, 128, (int(n),), generator=gen).tolist()}
            for i, (a, n) in enumerate(zip(["all", None, "rs", "head", "all", "head"], [5, 9, 3, 12, 1, 7]))]
    req_path = root / f"{kind}-requests.jsonl"
    req_path.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    return model_dir, root / f"{kind}-adapters", req_path, reqs


def _reference(model_dir, adapter_dir, reqs, kind):
    """Each request alone, transformers (+ PEFT): {id: (tokens through EOS, their logprobs, every step's)}."""
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    out = {}
    for r in reqs:
        model = cls.from_pretrained(model_dir, torch_dtype=torch.float32)
        if r["adapter"] is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dir / r["adapter"])
        out[r["id"]] = hf_greedy(model, torch.tensor([r["prompt_token_ids"]]), NEW_TOKENS, eos_token_id=1)
    return out


def _generate(model_dir, adapter_dir, req_path, out_path, tp: int, fully: bool):
    args = [f"model.path={model_dir}", f"lora.adapter_dir={adapter_dir}", f"requests={req_path}",
            f"output={out_path}", "device=cpu", "dtype=float32", f"lora.fully_sharded={str(fully).lower()}",
            "lora.max_loras=3", "lora.max_rank=16"]
    script = os.path.join(ROOT, "launch", "generate.py")
    if tp == 1:
        cmd = [sys.executable, script] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
               f"--master_port={listen_port()}", script, f"parallel=tp{tp}"] + args
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(ln) for ln in open(out_path)]
    return {ln["id"]: (ln["output_token_ids"], ln["logprobs"]) for ln in lines}, [ln["id"] for ln in lines]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_matches_transformers_peft(tmp_path, kind):
    model_dir, adapter_dir, req_path, reqs = _make(kind, tmp_path)
    expected = _reference(model_dir, adapter_dir, reqs, kind)
    base_only = _reference(model_dir, adapter_dir, [dict(r, adapter=None) for r in reqs], kind)
    assert any(expected[r["id"]][0] != base_only[r["id"]][0] for r in reqs if r["adapter"]), \
        "adapters did not change any greedy output: the test would not see a LoRA bug"
    for tp, fully in [(1, False), (2, False), (2, True)]:
        got, order = _generate(model_dir, adapter_dir, req_path, tmp_path / f"out-{tp}-{fully}.jsonl", tp, fully)
        assert order == [r["id"] for r in reqs], "output lines must follow request order"
        check_matches([got[i] for i in order], [expected[i] for i in order], f"tp={tp} fully_sharded={fully}")
