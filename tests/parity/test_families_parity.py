"""Model families against the outside world: for Qwen3 (dense), Phi-3 and Gemma 2 / Gemma 3 text, a tiny random
checkpoint saved by transformers (windows shorter than the prompts, RoPE scaling on where the family has it) and
random PEFT adapters (init_lora_weights=False, every projection; Phi-3's fused qkv_proj / gate_up_proj; embed_tokens
and lm_head, tied or not, in the second adapter) give the greedy tokens and logprobs of transformers + PEFT running
each request alone, at tp=1 and over real ranks at tp=2 and tp=4 (one run on the ranks per size for both LoRA modes).
TP_LORA_TEST_DEVICE=cuda / TP_LORA_TEST_BACKEND=triton run the same on GPUs (tp=4 where 4 are visible)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.testing import device_under_test, enough_devices, run_ranks  # noqa: E402

from _parity import check_matches, ours, peft_reference, randomize  # noqa: E402

NEW_TOKENS = 5
WINDOW = 4  # shorter than every prompt below: a wrong window changes the logits
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=0, pad_token_id=0)
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {
    # head_dim 32 != hidden / heads; linear RoPE scaling; tied embeddings; a window on layer 1 only (layer_types)
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True,
                                              use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                              rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 5000.0}),
    # partial rotary, longrope (short factors: every position below original_max_position_embeddings), a window
    # on every layer, fused qkv_proj / gate_up_proj tensors
    "phi3": lambda: transformers.Phi3Config(**COMMON, sliding_window=WINDOW, tie_word_embeddings=False,
                                            original_max_position_embeddings=32, rope_parameters={
                                                "rope_type": "longrope", "rope_theta": 5000.0,
                                                "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                "long_factor": [2.0, 3.0, 5.0, 8.0]}),
    # sliding / global layers, attention and final soft-caps small enough to bite, query_pre_attn_scalar, GeLU-tanh
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # its own RoPE base for sliding layers, linear scaling on global ones, q/k norm
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
}
TARGETS = {"qwen3": LINEAR, "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "gemma2": LINEAR,
           "gemma3_text": LINEAR}


def _make(kind: str, root):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[kind](), dtype=torch.float32)
    randomize(model)
    model_dir = root / kind
    model.save_pretrained(model_dir, safe_serialization=True)
    specs = {"a": peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=TARGETS[kind]),
             "b": peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, init_lora_weights=False,
                                  target_modules=TARGETS[kind][::2] + ["embed_tokens", "lm_head"])}
    for name, lc in specs.items():
        pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                 lc)
        with torch.no_grad():  # PEFT's init_lora_weights=False B is small: scale it so adapters move greedy tokens
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        pm.save_pretrained(root / f"{kind}-adapters" / name)
    gen = torch.Generator().manual_seed(1)
    reqs = [(a, torch.randint(2, 128, (n,), generator=gen).tolist())
            for a, n in zip(["a", None, "b", "a"], [11, 6, 13, 9])]
    return model_dir, root / f"{kind}-adapters", reqs








@pytest.mark.parametrize("kind", list(FAMILIES))
def test_family_matches_transformers_peft(tmp_path, kind):
    model_dir, adapter_dir, reqs = _make(kind, tmp_path)
    expected = peft_reference(model_dir, adapter_dir, reqs, NEW_TOKENS)
    engine_args, limits = (model_dir, adapter_dir, reqs), (3, 16, NEW_TOKENS)
    base_only = peft_reference(model_dir, adapter_dir, [(None, p) for _, p in reqs], NEW_TOKENS)
    assert any(e[0] != b[0] for e, b, (a, _) in zip(expected, base_only, reqs) if a), \
        "adapters did not change any greedy output: the test would not see a LoRA bug"
    check_matches(ours(comm.single_process(device_under_test()), *engine_args, [False], *limits)[0], expected,
                  "tp=1")
    sizes = [tp for tp in (2, 4) if enough_devices(tp)]  # tp=4: KV heads replicated, one query head per rank
    if not sizes:
        pytest.skip("tp=2 needs 2 GPUs")
    for tp in sizes:
        for fully, got in zip([False, True], run_ranks(ours, tp, *engine_args, [False, True], *limits)):
            check_matches(got, expected, f"tp={tp} fully_sharded={fully}")
