"""RoPE tables of the families against transformers' own: Phi-3's longrope beyond original_max_position_embeddings
(the part the tiny parity prompts do not reach) and Gemma 3's per-layer-type bases; unknown types refused."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tp_lora.config import ConfigError  # noqa: E402
from tp_lora.models.llama import Rotary  # noqa: E402


def test_longrope_short_then_long_factors_match_transformers():
    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, original_max_position_embeddings=32,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 5000.0,
                                                   "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                   "long_factor": [2.0, 3.0, 5.0, 8.0]})
    rope = Rotary(cfg.to_dict(), 16, None, "cpu")
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=33)
    assert rope.rotary_dim == 8 and rope.attention_factor == pytest.approx(factor) and factor > 1
    pos = torch.tensor([0, 5, 31, 32, 100])
    cos, sin = rope(pos, torch.float32)
    for i, p in enumerate(pos.tolist()):
        inv = short if p < 32 else long  # per token: positions from original_max_position_embeddings on use long
        emb = torch.cat([p * inv, p * inv])
        torch.testing.assert_close(cos[i, 0], emb.cos() * factor, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[i, 0], emb.sin() * factor, rtol=1e-5, atol=1e-5)


def test_gemma3_sliding_layers_have_their_own_base():
    cfg = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=2,
                                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 100.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 10000.0}})
    for layer_type in ("sliding_attention", "full_attention"):
        kind = cfg.rope_parameters[layer_type]["rope_type"]
        ref, _ = ROPE_INIT_FUNCTIONS.get(kind, type(transformers.Gemma3ForCausalLM(cfg).model.rotary_emb)
                                         .compute_default_rope_parameters)(cfg, "cpu", layer_type=layer_type)
        torch.testing.assert_close(Rotary(cfg.to_dict(), 16, layer_type, "cpu").inv_freq, ref)


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ConfigError, match="'yarn'"):
        Rotary({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 16, None, "cpu")
