"""MoE pure pieces: token chunks, expert mesh groups, config checks, routing pairs, byte packing, the router's
normalisation rules, PEFT target_parameters reshapes, and adapter / checkpoint shape errors."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tp_lora import distributed as comm
from tp_lora.config import ConfigError, RunConfig, validate
from tp_lora.layers.moe import Router
from tp_lora.ops.moe_pack import pack_tokens, unpack_tokens
from tp_lora.lora.adapter import load_peft_adapter, validate_adapter
from tp_lora.lora.layers import LoRARuntime, module_shapes
from tp_lora.lora.peft_format import AdapterError
from tp_lora.models.moe import MoECausalLM
from tp_lora.models.moe_step import validate_moe
from tp_lora.ops import torch_ref
from tp_lora.ops.batch import build_lora_batch
from tp_lora.ops.fp8 import FP8_DTYPE, quantize_fp8_per_channel
from tp_lora.ops.moe_layout import LORA_BLOCK
from tp_lora.ops.moe_plan import build_plan
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


def test_plan_groups_by_expert_then_slot():
    ids = torch.tensor([[2, 0], [3, 2], [0, 1], [-1, -1]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.0, 0.0]])
    slots = torch.tensor([1, -1, 1, 0], dtype=torch.int32)
    p = build_plan(ids, w, slots, expert_start=2, num_local=2, max_loras=2, lora=True)  # experts 2, 3 are local
    assert p.num_pairs == 8  # static capacity: 4 tokens x min(k=2, 2 local experts)
    # expert 2: token 1 (no adapter) then token 0 (slot 1); expert 3: token 1; then the pairs of other ranks.
    assert p.token[:3].tolist() == [1, 0, 1]
    assert p.pos.tolist() == [[1, -1], [2, 0], [-1, -1], [-1, -1]]  # token 0's expert 2 is pair 1, ...
    assert p.expert.tolist() == [0, 0, 1] + [2] * 5 and p.slot.tolist() == [-1, 1, -1] + [-1] * 5
    assert p.expert_ends.tolist() == [2, 3] and p.expert_ends.dtype == torch.int32
    assert [b for b in p.groups.tolist() if b[3]] == [[0, 1, 1, 1]]
    assert build_plan(ids, w, slots, 2, 2, 2, lora=False).groups.shape == (0, 4)  # no LoRA this step: no blocks


def _plan_cases():
    """(name, topk ids [N, k], expert_start, num_local) edge cases over 8 global experts."""
    g = torch.Generator().manual_seed(3)
    rand = torch.rand(40, 8, generator=g).topk(3, -1).indices
    return [("random", rand, 0, 8), ("half_of_the_experts", rand, 4, 4),
            ("all_to_one_expert", torch.tensor([[5, 0, 1]] * 37), 0, 8),
            ("rank_receives_nothing", torch.tensor([[0, 1, 2]] * 9), 4, 4),
            ("padding_rows", torch.full((6, 3), -1), 0, 8), ("no_tokens", torch.zeros(0, 3, dtype=torch.long), 0, 8),
            ("one_local_expert", rand, 7, 1)]


@pytest.mark.parametrize("name,ids,e0,n_local", _plan_cases(), ids=[c[0] for c in _plan_cases()])
def test_plan_covers_each_local_pair_once_in_expert_slot_order(name, ids, e0, n_local):
    n, k, L = ids.shape[0], ids.shape[1], 3
    g = torch.Generator().manual_seed(len(name))
    slots = torch.randint(-1, L, (n,), generator=g, dtype=torch.int32)
    w = torch.rand(n, k, generator=g)
    p = build_plan(ids, w, slots, e0, n_local, L, lora=True)
    want = sorted((int(ids[t, j]) - e0, int(slots[t]), t, j) for t in range(n) for j in range(k)
                  if e0 <= ids[t, j] < e0 + n_local)
    used = int(p.expert_ends[-1]) if n_local else 0
    assert p.num_pairs == n * min(k, n_local) and used == len(want)
    got = [(int(p.expert[i]), int(p.slot[i]), int(p.token[i])) for i in range(used)]
    assert got == [(e, s, t) for e, s, t, _ in want]  # stable: tokens in order inside an (expert, slot) group
    pos = [(int(p.pos[t, j]), t) for *_, t, j in want]  # every local pair's row, in pair order, of its token
    assert [r for r, _ in pos] == list(range(used)) and all(int(p.token[r]) == t for r, t in pos)
    assert int((p.pos >= 0).sum()) == used
    counts = torch.bincount(torch.tensor([e for e, *_ in want], dtype=torch.long), minlength=n_local)
    assert p.expert_ends.tolist() == torch.cumsum(counts, 0).tolist()
    # LoRA blocks: each pair with an adapter in exactly one block of its (expert, slot), none longer than the limit.
    seen = []
    for e, s, start, count in p.groups.tolist():
        assert 0 <= count <= LORA_BLOCK
        for i in range(start, start + count):
            assert (int(p.expert[i]), int(p.slot[i])) == (e, s)
            seen.append(i)
    assert sorted(seen) == [i for i in range(used) if p.slot[i] >= 0]


def test_plan_has_no_host_sync_or_data_dependent_shape():
    """Shapes depend on (N, k, E, L) only: two routings of the same sizes give plans of identical shapes."""
    shapes = set()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 8, (11, 2), generator=g)
        ids[:, 1] = (ids[:, 0] + 1) % 8
        p = build_plan(ids, torch.rand(11, 2, generator=g), torch.randint(-1, 4, (11,), generator=g), 0, 8, 4, True)
        shapes.add(tuple(tuple(getattr(p, f).shape) for f in ("token", "pos", "weight", "expert_ends", "groups")))
    assert len(shapes) == 1


def test_pack_unpack_is_exact():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[5, 300], [0, 1], [7, 2]])
    w = torch.rand(3, 2)
    tags = torch.tensor([2, -1, 0], dtype=torch.int32)
    packed = pack_tokens(x, ids, w, tags, rows=5)
    x2, ids2, w2, t2 = unpack_tokens(packed, 8, torch.bfloat16, 2, True)
    assert torch.equal(x2[:3], x) and torch.equal(w2[:3], w) and torch.equal(t2[:3], tags)
    assert ids2[:3].tolist() == ids.tolist() and ids2[3:].tolist() == [[-1, -1]] * 2  # padding routes nowhere
    assert packed.dtype == torch.float32  # whole 4-byte words: what the peer all-gather moves


def test_pack_unpack_odd_widths():
    """A row of hidden bytes that is no whole number of words (bf16 x 7, fp32 x 3 with no tags): padded, exact."""
    g = torch.Generator().manual_seed(1)
    for dtype, h, tags in ((torch.bfloat16, 7, torch.tensor([1, -1], dtype=torch.int32)), (torch.float32, 3, None)):
        x = torch.randn(2, h, generator=g).to(dtype)
        ids, w = torch.tensor([[3, 1, 0], [2, 2, 5]]), torch.rand(2, 3, generator=g)
        x2, ids2, w2, t2 = unpack_tokens(pack_tokens(x, ids, w, tags, rows=4), h, dtype, 3, tags is not None)
        assert torch.equal(x2[:2], x) and torch.equal(w2[:2], w) and ids2[:2].tolist() == ids.tolist()
        assert ids2[2:].tolist() == [[-1] * 3] * 2 and (t2 is None) == (tags is None)
        assert t2 is None or torch.equal(t2[:2], tags)


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


def test_target_parameters_adapters_load_from_many_threads(tmp_path):
    """The adapter cache reads adapters on several threads at once: every read of a target_parameters adapter
    succeeds while plain ones load beside it (a refusal lifted for one read must not be lifted or restored for
    another), and a plain adapter with target_parameters is still refused by load_adapter."""
    import threading

    from tp_lora.lora.adapter import load_adapter
    e, r, h, i = 4, 2, 16, 8
    _write(tmp_path / "experts", {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": [],
                                  "target_parameters": ["mlp.experts.down_proj"]},
           {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(e * r, i),
            "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(h, e * r)})
    _write(tmp_path / "plain", {"peft_type": "LORA", "r": r, "lora_alpha": 4, "target_modules": ["o_proj"]},
           {"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.randn(r, h),
            "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight": torch.randn(h, r)})
    errors, start = [], threading.Barrier(8)

    def read(k):
        start.wait()
        for _ in range(40):
            try:
                load_peft_adapter(tmp_path / ("experts" if k % 2 else "plain"))
            except Exception as err:  # noqa: BLE001 - collected, asserted below
                errors.append(err)
    threads = [threading.Thread(target=read, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} of 320 concurrent reads failed, first: {errors[0]}"
    with pytest.raises(AdapterError, match="target_parameters"):
        load_adapter(tmp_path / "experts")


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


def _block_with_lora(hf, seed, ops, fp8=False):
    """A single-process Mixtral-shaped SparseMoE, random weights, slot 0 LoRA on every expert's w1/w3/w2 (rank 4),
    slot 1 on w2 only. fp8: B stored as e4m3 (lora.dtype=fp8); the returned deltas use B as quantized."""
    from tp_lora.models.moe import SparseMoE
    from tp_lora.models.moe_step import MoEShape, MoEStep
    g = torch.Generator().manual_seed(seed)
    rt = LoRARuntime(2, 4, False, ops, fp8=fp8)
    block = SparseMoE(hf, MoEShape.from_hf(hf), 0, comm.single_process(), MoEStep(), torch.float32, "cpu", rt, None)
    ex = block.experts.base
    for p in (ex.w13, ex.w2, block.gate.weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    h, i = hf["hidden_size"], hf["intermediate_size"]
    lora = {}
    for e in range(hf["num_local_experts"]):
        for slot, kinds in ((0, ("w1", "w3", "w2")), (1, ("w2",))):
            for kind in kinds:
                fin, fout = (i, h) if kind == "w2" else (h, i)
                a, b = torch.randn(4, fin, generator=g) * fin ** -0.5, torch.randn(fout, 4, generator=g)
                block.experts.write(block.experts.slot_views(slot), (kind, e), a, b, 0.5 + slot)
                if fp8:  # the fp8 values times their channel scales, as the kernels read them
                    q, qs = quantize_fp8_per_channel(b)
                    b = q.float() * qs.unsqueeze(-1)
                lora[slot, kind, e] = (0.5 + slot) * b @ a
    return block, rt, lora


def _expected(block, lora, x, slots):
    """Per token, per top-k pair: the expert MLP with the token's adapter merged into the expert's weights."""
    ex = block.experts.base
    il = ex.inter
    ids, w = block.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, s = int(ids[t, j]), int(slots[t])
            w1, w3, w2 = ex.w13[e, :il], ex.w13[e, il:], ex.w2[e]
            if s >= 0:
                zero = torch.zeros_like
                w1 = w1 + lora.get((s, "w1", e), zero(w1))
                w3 = w3 + lora.get((s, "w3", e), zero(w3))
                w2 = w2 + lora.get((s, "w2", e), zero(w2))
            out[t] += w[t, j] * ((torch.nn.functional.silu(x[t] @ w1.t()) * (x[t] @ w3.t())) @ w2.t())
    return out


@pytest.mark.parametrize("routing", ["random", "all_to_one_expert", "topk_ties", "one_token", "no_tokens"])
def test_block_matches_per_token_expert_math(routing):
    """The grouped path (plan -> grouped GEMMs -> LoRA blocks -> combine) against the per-token, per-expert math,
    with experts that receive nothing, one expert receiving every token, and tied router logits (the Triton LoRA
    kernels are checked against the torch ops on the same plans in tests/kernels/test_moe_lora_kernel.py)."""
    hf = _hf(num_local_experts=8, num_experts_per_tok=3, hidden_size=32, intermediate_size=16)
    block, rt, lora = _block_with_lora(hf, 7, torch_ref)
    n = {"one_token": 1, "no_tokens": 0}.get(routing, 13)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 32, generator=g)
    gate = block.gate.weight.data
    if routing == "all_to_one_expert":  # expert 5 wins every token by a wide margin; experts 0-2 and 6-7 get none
        x = x.abs()
        gate[5] = 100.0
        gate[[0, 1, 2, 6, 7]] = -100.0
    if routing == "topk_ties":  # experts 1, 4 and 6 have identical logits on every token
        gate[4] = gate[6] = gate[1]
    slots = torch.randint(-1, 2, (n,), generator=g)
    rt.batch = build_lora_batch(slots.tolist(), 2, "cpu")
    block.step.owned, block.step.rows, block.step.slots, block.step.batch = (0, n), n, rt.batch.token_slot, rt.batch
    with torch.no_grad():
        got = block(x)
        want = _expected(block, lora, x, slots)
    assert got.shape == (n, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _run_block(block, rt, x, slots):
    rt.batch = build_lora_batch(slots.tolist(), 2, "cpu")
    block.step.owned, block.step.rows, block.step.slots, block.step.batch = (0, len(x)), len(x), rt.batch.token_slot, \
        rt.batch
    with torch.no_grad():
        return block(x)


def test_graph_padding_rows_route_nowhere():
    """A forward over a graph's padded rows (step.valid real ones, as a replayed mixed or decode step runs it): the
    real rows equal the forward over them alone, and the padding reaches no expert (no pair, zero output)."""
    hf = _hf(num_local_experts=8, num_experts_per_tok=2, hidden_size=32, intermediate_size=16)
    block, rt, _ = _block_with_lora(hf, 9, torch_ref)
    g = torch.Generator().manual_seed(3)
    real, padded = 11, 16
    x = torch.randn(padded, 32, generator=g)
    slots = torch.randint(-1, 2, (padded,), generator=g)
    slots[real:] = -1
    want = _run_block(block, rt, x[:real], slots[:real])
    block.step.valid = torch.tensor([real], dtype=torch.int32)  # the mixed graph's cu_q[-1:] is int32
    try:
        got = _run_block(block, rt, x, slots)
    finally:
        block.step.valid = None
    torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[real:], torch.zeros(padded - real, 32))


def test_block_fp8_expert_lora():
    """lora.dtype=fp8 on the experts: every expert B is e4m3 with per-output-channel scales (empty slots: scale 1).
    The block equals the per-token math with B as quantized, and its LoRA effect is within the dense fp8 bound
    (tests/unit/test_fp8_lora.py: 5% relative) of the float32 adapter's."""
    hf = _hf(num_local_experts=8, num_experts_per_tok=2, hidden_size=32, intermediate_size=16)
    block8, rt8, lora8 = _block_with_lora(hf, 3, torch_ref, fp8=True)
    block, rt, _ = _block_with_lora(hf, 3, torch_ref)
    ex = block8.experts
    assert all(b.dtype == FP8_DTYPE for b in list(ex.lora_b13) + [ex.lora_b2])
    assert ex.lora_a2.dtype == torch.float32 and ex.b2_scales.shape == (2, 8, 32)
    assert (ex.b13_scales[0][1] == 1).all() and (ex.lora_b13[0][1].float() == 0).all()  # slot 1: no w1 LoRA
    n = 17
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 32, generator=g)
    slots = torch.randint(-1, 2, (n,), generator=g)
    slots[:2] = torch.tensor([0, 1])
    got8, got = _run_block(block8, rt8, x, slots), _run_block(block, rt, x, slots)
    base = _run_block(block, rt, x, torch.full((n,), -1))
    with torch.no_grad():
        torch.testing.assert_close(got8, _expected(block8, lora8, x, slots), rtol=1e-4, atol=1e-4)
    has = slots >= 0
    err = float((got8[has] - got[has]).norm() / (got[has] - base[has]).norm())
    assert 0 < err < 0.05, err
    assert torch.equal(got8[~has], got[~has])  # tokens without an adapter: no LoRA at all


def test_graph_capture_follows_the_layout():
    """CUDA graphs only where a step has no host sync: not a chunked shared expert with LoRA, not where the
    expert GEMMs fall back to the loop. EP over DP replicas is capturable: counts agreed before the forward, fixed
    capacity (its graph sizing: test_ep_dp_graph_sizing)."""
    from tp_lora.ops.grouped_mm import torch_grouped_available
    grouped = torch_grouped_available(torch.device("cpu"), torch.float32, 16, 16)

    def model(kind="mixtral", ep=1, attn="dp", lora=False):
        ps = comm.single_process()
        ps.ep, ps.ep_attention = comm.Group("ep", 0, ep, tuple(range(ep))), attn
        hf = _hf() if kind == "mixtral" else _hf(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=8,
                                                 shared_expert_intermediate_size=8)
        return MoECausalLM(hf, ps, rt=LoRARuntime(2, 8, False, torch_ref) if lora else None, targets=None)

    def safe(m):
        return m.graph_blocker is None
    assert safe(model()) == grouped and safe(model(ep=2, attn="tp", lora=True)) == grouped
    assert safe(model("qwen2_moe", lora=True)) == grouped  # whole batch: the shared expert reads rt.batch
    assert safe(model(ep=2, attn="dp")) == grouped
    assert safe(model("qwen2_moe", ep=2, attn="dp", lora=True)) == grouped
    assert "shared expert" in model("qwen2_moe", ep=2, attn="tp", lora=True).graph_blocker
    assert safe(model("qwen2_moe", ep=2, attn="tp")) == grouped
    if not grouped:  # the reason names the expert weight and its shard
        assert "w13 shard" in model().graph_blocker


def test_ep_dp_graph_sizing():
    """EP over DP replicas: a graph covers the EP group's capacity and LoRA flag (agreed by lockstep),
    not the rank's own, and dispatch rows round up to the graph sizes in use, so graphed and eager peers agree."""
    from tp_lora.models.moe_step import capacity
    assert [capacity(n, (1, 2, 4, 8)) for n in (0, 1, 3, 8, 9)] == [1, 1, 4, 8, 9]
    assert capacity(5, ()) == 5

    def model(ep, attn):
        ps = comm.single_process()
        ps.ep, ps.ep_attention = comm.Group("ep", 0, ep, tuple(range(ep))), attn
        return MoECausalLM(_hf(), ps, rt=LoRARuntime(2, 8, False, torch_ref), targets=None)

    m = model(2, "dp")
    m.pad_to_graph_sizes((1, 2, 4))
    assert m.step.buckets == (1, 2, 4)
    m.step.counts, m.step.lora = [1, 3], True
    assert m.graph_batch(1, False) == (4, True)  # the largest count, 3, rounded up to a size
    m.step.counts = [5, 0]
    assert m.graph_batch(1, False) == (5, True)  # past the largest size: no graph holds it (every rank eager)
    with m.graph_rows(torch.ones(1, dtype=torch.long)):
        assert m.step.valid is not None
    assert m.step.valid is None and m.step.counts is None  # a replay spends the stashed counts
    with pytest.raises(RuntimeError, match="lockstep"):
        m.graph_batch(1, False)
    other = model(2, "tp")
    other.pad_to_graph_sizes((1, 2, 4))
    assert other.step.buckets == () and other.graph_batch(3, False) == (3, False)
