"""FP8 on one GPU: the engine with fp8 weights (each format) and an fp8 KV cache against the bf16 engine on the
dequantized weights: greedy agreement rate and the largest logprob drift (a small random Llama).

    python scripts/gpu_fp8_check.py
"""
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "distributed")]
from _fp8_checkpoints import write_fp8  # noqa: E402

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.assets import write_random_adapter, write_tiny_llama  # noqa: E402
from tp_lora.config import RunConfig  # noqa: E402
from tp_lora.engine.engine import Engine  # noqa: E402
from tp_lora.engine.requests import Request  # noqa: E402


def run(ps, model, adapters, quant=None, kv="auto"):
    cfg = RunConfig()
    cfg.device, cfg.dtype, cfg.quantization, cfg.lora.max_rank = "cuda", "bfloat16", quant, 16
    cfg.scheduler.kv_cache_dtype = kv
    engine = Engine(cfg, ps, model, adapters)
    reqs = [Request(i, id=i, adapter=["a", None][i % 2], prompt_token_ids=list(range(3 + i, 40 + 5 * i)),
                    max_new_tokens=16, ignore_eos=True) for i in range(16)]
    out = [(r.output_token_ids, r.logprobs) for r in engine.generate(reqs)]
    engine.close()
    return out


def compare(name, got, want):
    same = sum(a == b for (t, _), (w, _) in zip(got, want) for a, b in zip(t, w))
    total = sum(len(t) for t, _ in want)
    first = [next((j for j, (a, b) in enumerate(zip(t, w)) if a != b), len(t)) for (t, _), (w, _) in zip(got, want)]
    drift = max(abs(a - b) for (t, lp), (w, wlp), f in zip(got, want, first) for a, b in zip(lp[:f], wlp[:f]))
    print(f"{name}: {same}/{total} tokens agree, largest logprob drift before a divergence {drift:.3f}")


def main():
    ps = comm.single_process("cuda")
    d = tempfile.mkdtemp()
    src = write_tiny_llama(d + "/src", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=512)
    write_random_adapter(d + "/ad/a", src, r=8, seed=1)
    for fmt in ("block", "channel", "tensor"):
        write_fp8(src, f"{d}/{fmt}", f"{d}/{fmt}-ref", fmt, block=32)
        compare(f"{fmt} fp8 weights vs bf16 on the dequantized weights", run(ps, f"{d}/{fmt}", d + "/ad"),
                run(ps, f"{d}/{fmt}-ref", d + "/ad"))
    compare("quantization=fp8 vs its dequantized twin", run(ps, src, d + "/ad", "fp8"),
            run(ps, f"{d}/channel-ref", d + "/ad"))
    compare("kv_cache_dtype=fp8 vs bf16 cache", run(ps, src, d + "/ad", kv="fp8"), run(ps, src, d + "/ad"))


if __name__ == "__main__":
    main()
