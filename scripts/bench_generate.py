"""End-to-end decode benchmark: our engine with 32 distinct adapters, without adapters, and transformers + PEFT with
`adapter_names`, on the same GPU in the same run.

    python scripts/bench_generate.py --out DIR                      # one GPU
    torchrun --nproc_per_node=2 scripts/bench_generate.py --out DIR --tp 2 --no-hf
    python scripts/bench_generate.py --out DIR --model qwen3-8b       # another family at a real model's shape

Model (--model): llama (default): Llama-shaped, 16 layers, hidden 2048, 32 query / 8 KV heads; qwen3-8b, gemma2-9b,
phi3-mini: those models' shapes (FAMILY_SHAPES), written by transformers. Random bf16 weights (once under --cache).
Workload: batch 32, 32 distinct rank-16 adapters on all seven projections, 128-token prompts, 64 new tokens.
Prints a table and writes bench_generate.json into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.assets import write_random_adapter, write_tiny_llama  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Other families at a real model's shape: (transformers config class, its arguments, LoRA target modules).
FAMILY_SHAPES = {
    "qwen3-8b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False),
                 TARGETS),
    "gemma2-9b": ("Gemma2Config", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0), TARGETS),
    "phi3-mini": ("Phi3Config", dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                     sliding_window=2047, tie_word_embeddings=False),
                  ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
}
SMOKE = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024)


def make_family_assets(name: str, model: str, adapters: str, n_adapters: int, rank: int, smoke: bool) -> None:
    """A FAMILY_SHAPES model saved by transformers (random weights, on the GPU when there is one) and random PEFT
    adapters on its projections (PEFT names the modules: Phi-3's are fused)."""
    import peft
    import transformers
    cls, kw, targets = FAMILY_SHAPES[name]
    paths = [os.path.join(adapters, f"a{i:03d}") for i in range(n_adapters)]
    if os.path.exists(os.path.join(model, "config.json")) and all(
            os.path.exists(os.path.join(p, "adapter_model.safetensors")) for p in paths):
        return
    if smoke:
        kw = dict(kw, **SMOKE, num_attention_heads=4, num_key_value_heads=2 if kw["num_key_value_heads"] < 32 else 4,
                  **({"head_dim": 64} if "head_dim" in kw else {}))
    cfg = getattr(transformers, cls)(**kw, eos_token_id=1, bos_token_id=0, pad_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(model)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                 init_lora_weights=False))
    gen = torch.Generator(device).manual_seed(0)
    for path in paths:
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_A" in n:
                    p.normal_(0, p.shape[1] ** -0.5, generator=gen)
                elif "lora_B" in n:
                    p.normal_(0, 0.02, generator=gen)
        pm.save_pretrained(path)
    del pm, hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_assets(cache: str, n_adapters: int, rank: int, smoke: bool, family: str = "llama") -> tuple[str, str]:
    if family != "llama":
        model = os.path.join(cache, f"{family}{'-smoke' if smoke else ''}")
        adapters = os.path.join(cache, f"{family}-adapters{'-smoke' if smoke else ''}-{n_adapters}x{rank}")
        make_family_assets(family, model, adapters, n_adapters, rank, smoke)
        return model, adapters
    shape = dict(SHAPE, num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024) if smoke \
        else SHAPE
    model = os.path.join(cache, "model-smoke" if smoke else "model")
    adapters = os.path.join(cache, f"adapters{'-smoke' if smoke else ''}-{n_adapters}x{rank}")
    if not os.path.exists(os.path.join(model, "config.json")):
        write_tiny_llama(model, dtype=torch.bfloat16, max_position_embeddings=4096, **shape)
    for i in range(n_adapters):
        path = os.path.join(adapters, f"a{i:03d}")
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            write_random_adapter(path, model, r=rank, lora_alpha=2 * rank, seed=i, target_modules=TARGETS,
                                 dtype=torch.bfloat16)
    return model, adapters


def requests(n: int, prompt_len: int, new: int, vocab: int, with_adapters: bool) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    return [Request(i, id=i, adapter=f"a{i % 32:03d}" if with_adapters else None,
                    prompt_token_ids=torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(),
                    max_new_tokens=new, ignore_eos=True) for i in range(n)]


def run_ours(ps, model, adapters, args, vocab) -> dict:
    cfg = RunConfig()
    cfg.parallel.tp_size = ps.tp.size
    cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    cfg.lora.max_loras, cfg.lora.max_rank = 32, args.rank
    cfg.lora.fully_sharded = args.fully_sharded
    cfg.lora.kernel = args.kernel
    cfg.cuda_graphs = not args.no_graphs
    cfg.scheduler.max_batch_size = args.batch
    cfg.scheduler.max_tokens_per_step = args.batch * args.prompt
    engine = Engine(cfg, ps, model, adapters)
    out = {}
    for label, with_ad in (("no_adapters", False), ("adapters", True)):
        reqs = requests(args.batch, args.prompt, args.new, vocab, with_ad)
        engine.generate(requests(args.batch, args.prompt, 4, vocab, with_ad))  # warm-up: compile, capture
        runs = []
        for _ in range(args.reps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = engine.generate(reqs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
            assert all(len(r.output_token_ids) == args.new for r in res), [r.error for r in res]
        sec = sorted(runs)[len(runs) // 2]
        out[label] = dict(seconds=sec, tokens_per_s=args.batch * args.new / sec)
    return out


def run_hf(model, adapters, args, vocab) -> dict:
    import peft
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16).cuda().eval()
    names = [f"a{i:03d}" for i in range(32)]
    pm = peft.PeftModel.from_pretrained(hf, os.path.join(adapters, names[0]), adapter_name=names[0])
    for n in names[1:]:
        pm.load_adapter(os.path.join(adapters, n), adapter_name=n)
    reqs = requests(args.batch, args.prompt, args.new, vocab, True)
    ids = torch.tensor([r.prompt_token_ids for r in reqs], device="cuda")
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
              adapter_names=[r.adapter for r in reqs])
    with torch.no_grad():
        pm.generate(**kw, max_new_tokens=2, min_new_tokens=2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pm.generate(**kw, max_new_tokens=args.new, min_new_tokens=args.new)
        torch.cuda.synchronize()
    sec = time.perf_counter() - t0
    return dict(seconds=sec, tokens_per_s=args.batch * args.new / sec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/tp_lora/bench"))
    p.add_argument("--model", default="llama", choices=["llama"] + list(FAMILY_SHAPES))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel", default="chunked", choices=["sorted", "chunked"])
    p.add_argument("--fully-sharded", action="store_true")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.prompt, args.new, args.reps = 4, 8, 4, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps = comm.init_parallel(args.tp, device)
    model, adapters = make_assets(args.cache + f"-r{ps.rank}" if device == "cpu" and ps.world.size > 1
                                  else args.cache, 32, args.rank, args.smoke, args.model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", model=args.model, tp=ps.tp.size,
                  fully_sharded=args.fully_sharded, kernel=args.kernel, cuda_graphs=not args.no_graphs,
                  workload=dict(batch=args.batch, prompt=args.prompt, new=args.new, rank=args.rank, adapters=32),
                  ours=run_ours(ps, model, adapters, args, vocab))
    if ps.is_driver and not args.no_hf and device == "cuda":
        result["transformers_peft"] = run_hf(model, adapters, args, vocab)
    comm.shutdown()
    if not ps.is_driver:
        return
    ours = result["ours"]
    ratio = ours["adapters"]["tokens_per_s"] / ours["no_adapters"]["tokens_per_s"]
    result["adapters_vs_no_adapters"] = ratio
    print(f"| engine | tokens/s | seconds |\n|---|---|---|")
    for k, v in ours.items():
        print(f"| tp_lora {k} | {v['tokens_per_s']:.0f} | {v['seconds']:.3f} |")
    if "transformers_peft" in result:
        hf = result["transformers_peft"]
        result["speedup_vs_hf"] = ours["adapters"]["tokens_per_s"] / hf["tokens_per_s"]
        print(f"| transformers+PEFT adapter_names | {hf['tokens_per_s']:.0f} | {hf['seconds']:.3f} |")
        print(f"speedup vs transformers+PEFT: {result['speedup_vs_hf']:.1f}x (target >= 10x) "
              f"{'PASS' if result['speedup_vs_hf'] >= 10 else 'FAIL'}")
    print(f"with adapters / without: {ratio:.2f} (target >= 0.80) {'PASS' if ratio >= 0.8 else 'FAIL'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_generate.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
