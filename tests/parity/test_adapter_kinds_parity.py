"""Adapters as people train them, against the outside world: on a tiny random Qwen2 checkpoint (q/k/v biases: DoRA
must leave the base bias out of its scale), random PEFT adapters of each kind — DoRA on every projection and the LM
head, lora_bias, rank 128 and rank 256 (DoRA), modules_to_save lm_head + embed_tokens (same vocabulary; a resized one
is refused) — in one batch with a plain LoRA adapter and the base model give the
greedy tokens and logprobs of transformers + PEFT running each request alone (float32, within 1e-3), at tp=1, tp=2
in both LoRA modes and tp=4 fully sharded."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tp_lora import distributed as comm  # noqa: E402
from tp_lora.testing import device_under_test, enough_devices, run_ranks  # noqa: E402

from _parity import check_matches, ours, peft_reference, randomize  # noqa: E402

NEW_TOKENS = 4
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "dora": dict(r=8, lora_alpha=16, use_dora=True, target_modules=LINEAR + ["lm_head"]),
    "bias": dict(r=8, lora_alpha=8, lora_bias=True, target_modules=LINEAR),
    "r128": dict(r=128, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "r256": dict(r=256, lora_alpha=128, use_dora=True, use_rslora=True, target_modules=["k_proj", "up_proj",
                                                                                        "down_proj"]),
    "plain": dict(r=4, lora_alpha=8, target_modules=LINEAR),
    "saved": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head",
                                                                                          "embed_tokens"]),
}
MAX_RANK = 256


def _make(root):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   eos_token_id=1, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(cfg)
    randomize(model)
    model_dir = root / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    for name, kw in ADAPTERS.items():
        pm = peft.get_peft_model(transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                 peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n and n.endswith("weight"):
                    p.mul_(4.0 / max(1.0, kw["r"] / 16) ** 0.5)  # big ranks: keep the delta's size comparable
                elif "lora_B" in n:  # lora_bias
                    p.normal_(0, 0.2)
                elif "lora_magnitude_vector" in n:  # away from ||W + s B A||, so g != 1
                    p.mul_(1.0 + 0.3 * torch.randn_like(p))
                elif "modules_to_save" in n:  # the trained copies start as the base's
                    p.add_(torch.randn_like(p) * p.std())
        pm.save_pretrained(root / "adapters" / name)
    gen = torch.Generator().manual_seed(3)
    names = ["dora", None, "bias", "r128", "saved", "r256", "plain", "dora", "saved", "bias"]
    reqs = [(a, torch.randint(2, 96, (int(n),), generator=gen).tolist())
            for a, n in zip(names, [7, 5, 9, 6, 8, 4, 3, 10, 5, 6])]
    return model_dir, root / "adapters", reqs


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(engine args, limits, transformers + PEFT's results) of the adapters' batch, made once for the module."""
    model_dir, adapter_dir, reqs = _make(tmp_path_factory.mktemp("kinds"))
    expected = peft_reference(model_dir, adapter_dir, reqs, NEW_TOKENS)
    base_only = peft_reference(model_dir, adapter_dir, [(None, p) for _, p in reqs], NEW_TOKENS)
    for name in ADAPTERS:  # each kind must move the logprobs well beyond the tolerance, or a bug in it would hide
        moved = max((e[2][0] - b[2][0]).abs().max().item()
                    for e, b, (a, _) in zip(expected, base_only, reqs) if a == name)
        assert moved > 0.05, f"adapter {name!r} barely changes the first step's logprobs ({moved:.2e})"
    return (model_dir, adapter_dir, reqs), (len(ADAPTERS), MAX_RANK, NEW_TOKENS), expected


def test_adapter_kinds_match_transformers_peft(case):
    engine_args, limits, expected = case
    check_matches(ours(comm.single_process(device_under_test()), *engine_args, [False], *limits)[0], expected,
                  "tp=1")
    for fully, got in zip([False, True], run_ranks(ours, 2, *engine_args, [False, True], *limits)):
        check_matches(got, expected, f"tp=2 fully_sharded={fully}")


def test_adapter_kinds_match_transformers_peft_at_tp4(case):
    if not enough_devices(4):
        pytest.skip("tp=4 needs 4 GPUs (gloo on CPU runs it)")
    engine_args, limits, expected = case
    check_matches(run_ranks(ours, 4, *engine_args, [True], *limits)[0], expected, "tp=4 fully_sharded=True")
