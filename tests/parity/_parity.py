"""What the parity tests share: transformers + PEFT as the oracle (each request alone), our engine over the same
requests in one process group, and the comparison that tolerates only near-ties of fresh random models."""
import torch

from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.testing import backend_under_test, device_under_test


def randomize(model) -> None:
    """Weights that make logits far from flat: transformers' default init (std 0.02) gives near-uniform logits, and
    norms at 1 / biases at 0 would hide a wrong norm or bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.2, 0.3)
            elif "bias" in name:
                p.normal_(0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)


def hf_greedy(model, ids, new_tokens: int, eos_token_id: int | None = None):
    """A transformers model's greedy continuation of ids [1, P], in check_matches' expected form: (tokens, their
    logprobs, every step's logprobs [V] from the raw logits). Stops after eos_token_id, or (None) runs new_tokens."""
    stop = dict(min_new_tokens=new_tokens) if eos_token_id is None else dict(eos_token_id=eos_token_id)
    with torch.no_grad():
        g = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                  **stop)
    tokens = g.sequences[0, ids.shape[1]:].tolist()
    full = [torch.log_softmax(lg[0].float(), -1) for lg in g.logits]
    return tokens, [f[t].item() for f, t in zip(full, tokens)], full


def peft_reference(model_dir, adapter_dir, reqs, new_tokens: int):
    """transformers + PEFT, each (adapter, prompt) alone: hf_greedy's (tokens, logprobs, every step's logprobs)
    per request."""
    import peft
    import transformers
    out = []
    for adapter, prompt in reqs:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation="eager")
        if adapter is not None:
            model = peft.PeftModel.from_pretrained(model, adapter_dir / adapter)
        out.append(hf_greedy(model, torch.tensor([prompt]), new_tokens))
    return out


def ours(ps, model_dir, adapter_dir, reqs, modes, max_loras: int, max_rank: int, new_tokens: int):
    """Our engine in this process group, once per LoRA mode (fully_sharded values): [(tokens, logprobs) per request]
    per mode."""
    results = []
    for fully in modes:
        cfg = RunConfig()
        cfg.device, cfg.dtype, cfg.lora.backend = device_under_test(), "float32", backend_under_test()
        cfg.lora.max_loras, cfg.lora.max_rank, cfg.lora.fully_sharded = max_loras, max_rank, fully
        cfg.generation.ignore_eos = True
        engine = Engine(cfg, ps, str(model_dir), str(adapter_dir))
        try:
            got = engine.generate([Request(i, id=i, adapter=a, prompt_token_ids=p, max_new_tokens=new_tokens)
                                   for i, (a, p) in enumerate(reqs)])
        finally:
            engine.close()
        assert all(r.error is None for r in got), [r.error for r in got]
        results.append([(r.output_token_ids, r.logprobs) for r in got])
    return results


def check_matches(got, expected, what):
    """Same greedy tokens and logprobs within 1e-3. Fresh random models can have near-ties: a different token is
    accepted only where transformers gives it within 1e-3 of its own choice, and the request is compared up to
    there (the continuations differ)."""
    for i, ((tokens, lps), (ref_tokens, ref_lps, ref_full)) in enumerate(zip(got, expected)):
        assert len(tokens) == len(ref_tokens), f"{what}: request {i}: {len(tokens)} tokens"
        for pos, (t, r, lp, ref_lp) in enumerate(zip(tokens, ref_tokens, lps, ref_lps)):
            assert abs(lp - ref_full[pos][t].item()) < 1e-3, \
                f"{what}: request {i}: logprob of token {pos} differs by {abs(lp - ref_full[pos][t].item()):.2e}"
            if t != r:
                gap = (ref_lp - ref_full[pos][t]).item()
                assert gap < 1e-3, f"{what}: request {i}: tokens {tokens} != transformers + PEFT {ref_tokens}"
                break
