"""MoE pure pieces: token chunks, expert mesh groups, config checks, routing pairs, byte packing, the router's
normalisation rules, PEFT target_parameters reshapes, and adapter / checkpoint shape errors."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, validate
from tp_lora.layers.moe import Router, pack_tokens, unpack_tokens
from tp_lora.lora.adapter import AdapterError, load_peft_adapter, validate_adapter
from tp_lora.lora.layers import LoRARuntime, module_shapes
from tp_lora.models.moe import MoECausalLM, validate_moe
from tp_lora.ops import torch_ref
from tp_lora.ops.moe_ref import build_pairs
from tp_lora.sharding import take_nd, token_chunk


def test_token_chunk_covers_every_token_once():
    for n in range(0, 11):
        for size in (1, 2, 3, 4):
            parts = [token_chunk(n, r, size) for r in range(size)]
            assert [i for a, b in parts for i in range(a, b)] == list(range(n))
            assert all(b - a <= -(-n // size) for a, b in parts)


def test_take_nd_reads_one_block():
    t = torch.arange(4 * 6 * 5).reshape(4, 6, 5)
    torch.testing.assert_close(take_nd(t, [(1, 3), (2, 4), None]), t[1:3, 2:4, :])


def test_expert_mesh_groups():
    assert comm.expert_mesh_groups(4, 2, 2, "dp") == [(0, 2), (1, 3)]  # ep over replicas, moe-tp = tp
    assert comm.expert_mesh_groups(4, 1, 2, "dp") == [(0, 1), (2, 3)]
    assert comm.expert_mesh_groups(4, 4, 4, "tp") == [(0, 1, 2, 3)]
    assert comm.expert_mesh_groups(2, 2, 1, "dp") == [(0,), (1,)]
    with pytest.raises(ValueError, match="ep_size=2 must equal parallel.tp_size=4"):
        comm.expert_mesh_groups(4, 4, 2, "tp")
    with pytest.raises(ValueError, match="must divide the 3 data-parallel replicas"):
        comm.expert_mesh_groups(3, 1, 2, "dp")


@pytest.mark.parametrize("tp,ep,attn,world,msg", [
    (2, 4, "tp", 4, "must equal parallel.tp_size=2"),
    (1, 3, "dp", 4, "must divide the 4 data-parallel replicas"),
    (1, 2, "xx", 2, "ep_attention='xx'"),
    (1, 0, "dp", 1, "ep_size=0"),
])
def test_config_rejects_bad_expert_layouts(tp, ep, attn, world, msg):
    cfg = RunConfig()
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = tp, ep, attn
    with pytest.raises(ConfigError, match=msg):
        validate(cfg, world)


def _hf(**kw):
    hf = {"model_type": "mixtral", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
          "intermediate_size": 8, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    hf.update(kw)
    return hf


def test_validate_moe_names_the_offending_value():
    ps = comm.single_process()
    ps.ep = comm.Group("ep", 0, 3, (0, 1, 2))
    with pytest.raises(ConfigError, match="ep_size=3 does not divide the model's 4 experts"):
        validate_moe(_hf(), ps)
    ps = comm.single_process()
    ps.moe_tp = comm.Group("tp", 0, 3, (0, 1, 2))
    with pytest.raises(ConfigError, match="intermediate size 8 is not divisible by the 3 ranks"):
        validate_moe(_hf(), ps)
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        validate_moe(_hf(hidden_act="gelu"), comm.single_process())


def test_build_pairs_groups_by_expert_then_slot():
    ids = torch.tensor([[2, 0], [3, 2], [0, 1], [-1, -1]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.0, 0.0]])
    slots = torch.tensor([1, -1, 1, 0], dtype=torch.int32)
    p = build_pairs(ids, w, slots, expert_start=2, num_local=2, max_loras=2)  # experts 2, 3 are local
    assert p.token.tolist() == [1, 0, 1]  # expert 2: token 1 (no adapter) then token 0 (slot 1); expert 3: token 1
    assert p.expert.tolist() == [0, 0, 1] and p.slot.tolist() == [-1, 1, -1]
    torch.testing.assert_close(p.weight, torch.tensor([0.3, 0.6, 0.7]))
    assert p.host_expert_counts == (2, 1)
    assert p.host_groups == ((0, 1, 1, 1),) and p.groups.tolist() == [[0, 1, 1, 1]]


def test_pack_unpack_is_exact():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[5, 300], [0, 1], [7, 2]])
    w = torch.rand(3, 2)
    tags = torch.tensor([2, -1, 0], dtype=torch.int32)
    packed = pack_tokens(x, ids, w, tags, rows=5)
    x2, ids2, w2, t2 = unpack_tokens(packed, 8, torch.bfloat16, 2, True)
    assert torch.equal(x2[:3], x) and torch.equal(w2[:3], w) and torch.equal(t2[:3], tags)
    assert ids2[:3].tolist() == ids.tolist() and ids2[3:].tolist() == [[-1, -1]] * 2  # padding routes nowhere


def test_router_normalisation_follows_the_model():
    torch.manual_seed(0)
    x = torch.randn(5, 16)
    for renorm in (True, False):
        r = Router(16, 8, 2, renorm, weights_in_model_dtype=False)
        r.weight.data.normal_()
        ids, w = r(x)
        probs = torch.softmax(x @ r.weight.t(), -1)
        top, want_ids = probs.topk(2, -1)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, top / top.sum(-1, keepdim=True) if renorm else top)


def _model_with_lora():
    rt = LoRARuntime(2, 8, False, torch_ref)
    model = MoECausalLM(_hf(), comm.single_process(), rt=rt, targets=None)
    return model, rt


def test_expert_module_shapes_for_both_formats():
    _, rt = _model_with_lora()
    shapes = module_shapes(rt)
    assert shapes["model.layers.0.block_sparse_moe.experts.3.w1"] == (16, 8)
    assert shapes["model.layers.0.block_sparse_moe.experts.3.w2"] == (8, 16)
    assert shapes["model.layers.0.mlp.experts.3.gate_up_proj"] == (16, 16)
    assert shapes["model.layers.0.mlp.experts.3.down_proj"] == (8, 16)


def _write(path, cfg, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_target_parameters_reshape_is_peft_paramwrapper(tmp_path):
    """Expert index: slow axis of lora_A [E*r, in], fast axis of lora_B [out, E*r]."""
    e, r, h, i = 4, 2, 16, 8
    a = torch.randn(e * r, i)
    b = torch.randn(h, e * r)
    _write(tmp_path / "ad", {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": [],
                             "target_parameters": ["mlp.experts.down_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": a,
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": b})
    ad = load_peft_adapter(tmp_path / "ad")
    for k in range(e):
        m = ad.modules[f"model.layers.0.mlp.experts.{k}.down_proj"]
        torch.testing.assert_close(m.a, a[k * r:(k + 1) * r])
        torch.testing.assert_close(m.b, b[:, k::e])
        assert m.scale == 2.0
    _, rt = _model_with_lora()
    validate_adapter(ad, module_shapes(rt), 8)  # fits the model


def test_adapter_shape_errors_are_clear(tmp_path):
    _, rt = _model_with_lora()
    shapes = module_shapes(rt)
    # An adapter for a model with hidden 32: the expert's A does not fit.
    _write(tmp_path / "wide", {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": [],
                               "target_parameters": ["mlp.experts.gate_up_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(8, 32),
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(16, 8)})
    with pytest.raises(AdapterError, match=r"experts.0.gate_up_proj.*do not fit the model's A \(2, 16\)"):
        validate_adapter(load_peft_adapter(tmp_path / "wide"), shapes, 8)
    # 8 experts' worth of LoRA for a 4-expert model.
    _write(tmp_path / "many", {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [],
                               "target_parameters": ["mlp.experts.down_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(8, 8),
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(16, 8)})
    with pytest.raises(AdapterError, match=r"experts.4.down_proj.*which this model lacks"):
        validate_adapter(load_peft_adapter(tmp_path / "many"), shapes, 8)
    # lora_A rows not a multiple of r.
    _write(tmp_path / "ragged", {"peft_type": "LORA", "r": 3, "lora_alpha": 1, "target_modules": [],
                                 "target_parameters": ["mlp.experts.down_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(8, 8),
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(16, 8)})
    with pytest.raises(AdapterError, match=r"\[E\*r, in\] / \[out, E\*r\] shapes of r=3"):
        load_peft_adapter(tmp_path / "ragged")
    # Two nesting depths but only one targeted parameter.
    _write(tmp_path / "nest", {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": [],
                               "target_parameters": ["mlp.experts.down_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(4, 8),
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(16, 4),
            "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight": torch.randn(4, 16),
            "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight": torch.randn(16, 4)})
    with pytest.raises(AdapterError, match="nesting depths"):
        load_peft_adapter(tmp_path / "nest")


def test_checkpoint_shape_errors_are_clear():
    model, _ = _model_with_lora()

    class Reader:
        t = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(4, 16),
             "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 12, 16),
             "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 16, 8)}

        def has(self, n):
            return n in self.t

        def get(self, n):
            return self.t[n]

        get_slice = get

        def shape(self, n):
            return tuple(self.t[n].shape)

    reader = Reader()
    reader.t["model.layers.0.mlp.gate.weight"] = reader.t.pop("model.layers.0.block_sparse_moe.gate.weight")
    with pytest.raises(ValueError, match=r"gate_up_proj: checkpoint shape \(4, 12, 16\), expected \(4, 16, 16\)"):
        model.layers[0].mlp.load(reader, "model.layers.0.mlp.")
    with pytest.raises(ValueError, match="experts of model.layers.0.block_sparse_moe not found"):
        class Per(Reader):
            t = {"model.layers.0.block_sparse_moe.gate.weight": torch.zeros(4, 16)}
        model.layers[0].mlp.load(Per(), "model.layers.0.mlp.")
