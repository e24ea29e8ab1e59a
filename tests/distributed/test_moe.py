"""MoE in every parallel layout x both LoRA sharding modes at 2 and 4 gloo ranks against one process.

Layouts (tp_size, ep_size, ep_attention): TP (every expert everywhere, intermediate split), EP with DP attention (each
rank its own requests: different token counts, idle ranks in lockstep), EP with TP attention (each rank routes a chunk
of the replicated tokens), EP x TP on a 2D mesh. Per layout: the MoE block alone (with routings that leave experts and
whole ranks without tokens), then a tiny Mixtral (per-expert checkpoint) and Qwen2-MoE (fused 3D checkpoint, shared
expert, a dense layer) through the Engine with adapters in PEFT's per-expert and target_parameters formats: prompt
logits within 1e-4 relative, greedy tokens identical, and the exact collectives of one forward.

Few runs on the ranks (one per world size), every case looped inside, tiny dims: the file runs in well under 3 minutes on 2 cores.
"""
import json
import os
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from tp_lora import distributed as comm
from tp_lora.config import RunConfig
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.engine.scoring import prompt_logits
from tp_lora.lora.layers import LoRARuntime
from tp_lora.models.moe import SparseMoE
from tp_lora.models.moe_step import MoEShape, MoEStep, capacity, prepare_step
from tp_lora.ops import get_backend
from tp_lora.ops.batch import build_lora_batch
from tp_lora.testing import (backend_under_test, device_under_test, enough_devices, recorded_collectives, run_ranks,
                             same_collectives)

# INTER: at tp4 an expert's shard of 8 columns is a 16-byte row, which torch's grouped GEMM (CUDA graphs) needs
V, H, HEADS, KV, E, K, INTER, SHARED, DENSE = 128, 32, 4, 2, 8, 2, 32, 24, 48
LAYERS = 2
MAX_LORAS, MAX_RANK = 4, 16
# name -> (tp_size, ep_size, ep_attention)
LAYOUTS = {2: {"tp2": (2, 1, "dp"), "ep2": (1, 2, "dp"), "tp2_ep2": (2, 2, "tp")},
           4: {"tp4": (4, 1, "dp"), "ep4": (1, 4, "dp"), "tp4_ep4": (4, 4, "tp"), "ep2_tp2": (2, 2, "dp"),
               "dp2_tp2": (2, 1, "dp")}}


# ---- tiny checkpoints and adapters in the on-disk formats ----------------------------------------------------
def moe_config(kind: str, head_dim: int = H // HEADS) -> dict:
    cfg = {"model_type": kind, "vocab_size": V, "hidden_size": H, "num_hidden_layers": LAYERS,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": head_dim, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
           "num_experts_per_tok": K, "eos_token_id": 1, "bos_token_id": 0}
    if kind == "mixtral":
        cfg.update(num_local_experts=E, intermediate_size=INTER, sliding_window=None)
    else:  # qwen2_moe: layer 1 is dense (mlp_only_layers), shared expert with its sigmoid gate, q/k/v bias
        cfg.update(num_experts=E, moe_intermediate_size=INTER, intermediate_size=DENSE, norm_topk_prob=False,
                   shared_expert_intermediate_size=SHARED, mlp_only_layers=[1], decoder_sparse_step=1,
                   qkv_bias=True, use_sliding_window=False)
    return cfg


def moe_tensors(cfg: dict, seed: int, fused: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=None):
        return torch.randn(*shape, generator=g) * (std if std is not None else shape[-1] ** -0.5)

    kind, hd = cfg["model_type"], cfg["head_dim"]
    t = {"model.embed_tokens.weight": w(V, H, std=1.0), "model.norm.weight": 1 + w(H, std=0.1),
         "lm_head.weight": w(V, H, std=2 * H ** -0.5)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(H, std=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(H, std=0.1)
        for n, rows in (("q_proj", HEADS * hd), ("k_proj", KV * hd), ("v_proj", KV * hd)):
            t[p + f"self_attn.{n}.weight"] = w(rows, H)
            if cfg.get("qkv_bias"):
                t[p + f"self_attn.{n}.bias"] = w(rows, std=0.1)
        t[p + "self_attn.o_proj.weight"] = w(H, HEADS * hd)
        if i in (cfg.get("mlp_only_layers") or []):
            for n, shape in (("gate_proj", (DENSE, H)), ("up_proj", (DENSE, H)), ("down_proj", (H, DENSE))):
                t[p + f"mlp.{n}.weight"] = w(*shape)
            continue
        m = p + ("block_sparse_moe." if kind == "mixtral" else "mlp.")
        t[m + "gate.weight"] = w(E, H, std=1.0)  # spread router logits: distinct top-k
        gate, up, down = [w(E, INTER, H), w(E, INTER, H), w(E, H, INTER)]
        if fused:
            f = p + "mlp.experts."
            t[f + "gate_up_proj"], t[f + "down_proj"] = torch.cat([gate, up], 1), down
            if kind == "mixtral":
                t[p + "mlp.gate.weight"] = t.pop(m + "gate.weight")
        else:
            names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(E):
                for n, x in zip(names, (gate[e], up[e], down[e])):
                    t[m + f"experts.{e}.{n}.weight"] = x.contiguous()
        if cfg.get("shared_expert_intermediate_size"):
            s = m + "shared_expert."
            t[s + "gate_proj.weight"], t[s + "up_proj.weight"] = w(SHARED, H), w(SHARED, H)
            t[s + "down_proj.weight"] = w(H, SHARED)
            t[m + "shared_expert_gate.weight"] = w(1, H)
    return t


def write_moe(path, kind: str, seed: int, fused: bool = False, head_dim: int = H // HEADS) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = moe_config(kind, head_dim)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in moe_tensors(cfg, seed, fused).items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def write_adapter(path, cfg: dict, seed: int, r: int, alpha: float, modules: tuple[str, ...] = (),
                  per_expert: bool = False, params: tuple[str, ...] = ()) -> None:
    """PEFT adapter dir. modules: dense module names (q_proj, o_proj, shared_expert.down_proj, ...); per_expert: the
    experts as per-expert modules (PEFT's transformers-4 layout); params: fused expert parameters in PEFT's
    target_parameters layout (lora_A [E*r, in], lora_B [out, E*r]; gate_up_proj nested innermost)."""
    g = torch.Generator().manual_seed(seed)
    kind = cfg["model_type"]
    hd = cfg["head_dim"]
    dims = {"q_proj": (H, HEADS * hd), "k_proj": (H, KV * hd), "v_proj": (H, KV * hd), "o_proj": (HEADS * hd, H),
            "shared_expert.gate_proj": (H, SHARED), "shared_expert.up_proj": (H, SHARED),
            "shared_expert.down_proj": (SHARED, H), "shared_expert_gate": (H, 1)}
    t = {}

    def ab(fin, fout, rows=r):
        return (torch.randn(rows, fin, generator=g) * fin ** -0.5,
                torch.randn(fout, rows, generator=g) * 2.0 * (r ** 0.5) / alpha)

    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    targets = list(modules)
    for i in range(LAYERS):
        p = f"base_model.model.model.layers.{i}."
        for m in modules:
            where = "self_attn." if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            if where == "mlp." and i in (cfg.get("mlp_only_layers") or []):
                continue
            a, b = ab(*dims[m])
            t[f"{p}{where}{m}.lora_A.weight"], t[f"{p}{where}{m}.lora_B.weight"] = a, b
        if i in (cfg.get("mlp_only_layers") or []):
            continue
        block = "block_sparse_moe." if kind == "mixtral" else "mlp."
        if per_expert:
            for e in range(E):
                for n, (fin, fout) in zip(names, ((H, INTER), (H, INTER), (INTER, H))):
                    a, b = ab(fin, fout)
                    t[f"{p}{block}experts.{e}.{n}.lora_A.weight"] = a
                    t[f"{p}{block}experts.{e}.{n}.lora_B.weight"] = b
        for j, param in enumerate(params):
            fin, fout = (H, 2 * INTER) if param == "gate_up_proj" else (INTER, H)
            a, b = ab(fin, fout, rows=E * r)
            nest = ".base_layer" * (len(params) - 1 - j)
            t[f"{p}mlp.experts{nest}.lora_A.weight"], t[f"{p}mlp.experts{nest}.lora_B.weight"] = a, b
    if per_expert:
        targets += list(names)
    cfg_json = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0,
                "bias": "none", "task_type": "CAUSAL_LM"}
    if params:
        cfg_json["target_parameters"] = [f"mlp.experts.{q}" for q in params]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg_json, f)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def write_adapters(root, cfg: dict, seed: int) -> str:
    shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate") \
        if cfg.get("shared_expert_intermediate_size") else ()
    write_adapter(root / "pe", cfg, seed, 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj") + shared, per_expert=True)
    write_adapter(root / "tp", cfg, seed + 1, 16, 16, ("v_proj", "o_proj"), params=("gate_up_proj", "down_proj"))
    write_adapter(root / "w2", cfg, seed + 2, 4, 8, (), params=("down_proj",))
    return str(root)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh weights every run
    out = {}
    for kind, fused in (("mixtral", False), ("qwen2_moe", True)):
        model = write_moe(root / kind, kind, seed, fused=fused)
        out[kind] = (model, write_adapters(root / f"{kind}-adapters", moe_config(kind), seed + 10))
    gen = torch.Generator().manual_seed(seed)
    adapters = ["pe", None, "tp", "w2", "pe", "tp", None]
    out["requests"] = [
        Request(i, id=i, adapter=a, prompt_token_ids=torch.randint(2, V, (int(n),), generator=gen).tolist(),
                max_new_tokens=int(m), ignore_eos=True)
        for i, (a, n, m) in enumerate(zip(adapters, torch.randint(1, 10, (7,), generator=gen),
                                          torch.randint(2, 6, (7,), generator=gen)))]
    return out


# ---- engine runs -------------------------------------------------------------------------------------------------
def _cfg(tp: int, ep: int, attn: str, fully: bool) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.tp_size, cfg.parallel.ep_size, cfg.parallel.ep_attention = tp, ep, attn
    cfg.lora.fully_sharded, cfg.lora.max_loras, cfg.lora.max_rank = fully, MAX_LORAS, MAX_RANK
    cfg.device, cfg.dtype, cfg.lora.backend = device_under_test(), "float32", backend_under_test()
    cfg.cuda_graphs = False
    return cfg


def _mine(ps: comm.ParallelState, requests):
    """The requests this rank serves: its DP replica's share (as tp_lora.app splits them)."""
    return [r for r in requests if r.index % ps.dp.size == ps.dp.rank]


def _reference(cases, requests):
    """One process: per request its prompt logits and greedy tokens."""
    ps = comm.single_process(device_under_test())
    out = {}
    for model_dir, adapter_dir in cases:
        engine = Engine(_cfg(1, 1, "dp", False), ps, model_dir, adapter_dir)
        logits = prompt_logits(engine, requests[:4])
        tokens = [r.output_token_ids for r in engine.generate(requests)]
        out[model_dir] = ([x.cpu() for x in logits], tokens)
    return out


def _engine_cases(ps_world: comm.ParallelState, world: int, cases, requests, ref, count_case):
    """Every layout x LoRA mode x model on this world; raises on the first mismatch (any rank)."""
    checked = []
    for name, (tp, ep, attn) in LAYOUTS[world].items():
        ps = comm.init_parallel(tp, str(ps_world.device))  # same process group, this layout's tp/dp groups
        for fully in (False, True):
            for model_dir, adapter_dir in cases:
                engine = Engine(_cfg(tp, ep, attn, fully), ps, model_dir, adapter_dir)
                what = f"{name} fully_sharded={fully} {os.path.basename(model_dir)}"
                ref_logits, ref_tokens = ref[model_dir]
                mine = _mine(ps, requests[:4])
                logits = prompt_logits(engine, mine)
                for r, got in zip(mine, logits):
                    want = ref_logits[r.index]
                    err = float((got.cpu() - want).abs().max() / want.abs().max())
                    assert err < 1e-4, f"{what}: request {r.index} prompt logits differ by {err:.2e}"
                for subset in (requests, requests[:3]):  # [:3] leaves a rank of ep4 with no request at all
                    mine = _mine(ps, subset)
                    engine.run_ahead = subset is requests  # steps launched before the last is read (CUDA's way)
                    with recorded_collectives() as calls:  # idle ranks ask for the busy ones' (GPUs: peer kernels)
                        results = engine.generate(mine)
                    same_collectives(calls, ps_world.world, what)
                    for r, res in zip(mine, results):
                        assert res.output_token_ids == ref_tokens[r.index], \
                            f"{what}: request {r.index} greedy tokens {res.output_token_ids} != {ref_tokens[r.index]}"
                checked.append(what)
            # The collectives of one forward, every token with an adapter targeting attention and experts.
            engine = Engine(_cfg(tp, ep, attn, fully), ps, count_case[0], count_case[1])
            reqs = [Request(i, id=i, adapter="pe", prompt_token_ids=list(range(2 + i, 14 + i))) for i in range(3)]
            comm.STATS.reset()
            prompt_logits(engine, reqs)
            want = expected_collectives(tp, ep, attn, fully)
            got = dict(comm.STATS.calls)
            assert got == want, f"{name} fully_sharded={fully}: collectives {got}, expected {want}"
            checked.append(f"{name} fully_sharded={fully} collectives")
    return checked


def expected_collectives(tp: int, ep: int, attn: str, fully: bool, layers: int = LAYERS) -> dict[str, int]:
    """One prompt forward + LM head of the Mixtral model, the LoRA targeting q/k/v/o and every expert.

    Base: embedding all-reduce, one o_proj all-reduce per layer, the logits all-gather (tp > 1). Per MoE layer:
    TP: one all-reduce. EP/DP: one packed all-gather + one reduce-scatter over ep (+ the expert partial sums'
    all-reduce over tp on the 2D mesh), and one token-count exchange per step. EP/TP: one all-reduce of the sum
    (hidden states are replicated and every rank routes every token; over tp: the decoder fuses it with the next
    norm, as it does the moe-tp sums of TP and EP x TP). Fully sharded LoRA: per layer an
    all-gather (qkv) and an all-reduce (o) over tp, and the experts' all-gather (w1|w3) and all-reduce (w2) over the
    moe-tp group when it has more than one rank (tp in the TP and EP x TP layouts; none in EP/TP, whose experts are
    whole).
    """
    c = Counter()
    moe_tp = 1 if (ep > 1 and attn == "tp") else tp
    if tp > 1:
        c["all_reduce:tp"] += 1 + layers
        c["all_gather:tp"] += 1
    if ep > 1 and attn == "dp":
        c["counts:ep"] += 1
    for _ in range(layers):
        if ep == 1:
            c["all_reduce:tp"] += tp > 1
        elif attn == "tp":
            c["all_reduce:tp"] += 1  # the sum over ep (the tp group's ranks), taken into the next norm over tp
        else:
            c["all_gather:ep"] += 1
            c["reduce_scatter:ep"] += 1
            c["all_reduce:tp"] += tp > 1
        if fully and tp > 1:
            c["all_gather:tp"] += 1
            c["all_reduce:tp"] += 1
        if fully and moe_tp > 1:
            c["all_gather:tp"] += 1
            c["all_reduce:tp"] += 1
    return {k: v for k, v in c.items() if v}


# ---- the MoE block alone -----------------------------------------------------------------------------------------
class DictReader:
    """The CheckpointReader surface the MoE loader uses, over in-memory tensors."""

    def __init__(self, tensors):
        self.t = tensors

    def has(self, name):
        return name in self.t

    def get(self, name):
        return self.t[name]

    get_slice = get

    def shape(self, name):
        return tuple(self.t[name].shape)


def _block(hf, ps, rt, tensors, layer=0):
    shape = MoEShape.from_hf(hf)
    step = MoEStep()
    block = SparseMoE(hf, shape, layer, ps, step, torch.float32, ps.device, rt, None)
    block.load(DictReader(tensors), f"model.layers.{layer}.mlp.")
    return block, step


def _set_block_lora(rt, seed, kind):
    """Per slot: slot 0 per-expert w1/w3/w2, slot 1 fused gate_up + down, slot 2 shared expert only, slot 3 empty."""
    g = torch.Generator().manual_seed(seed)
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for path, (layer, key) in rt.targets.items():
        if ".layers.0." not in path:
            continue
        fin, fout = layer.module_shape(key) if hasattr(layer, "module_shape") else (
            layer.spec.in_features, layer.spec.slices[key].width)
        leaf = path.rsplit(".", 1)[-1]
        slot = (0 if f"{block}.experts." in path and leaf in names and (kind == "mixtral" or leaf != "down_proj")
                else 1 if leaf in ("gate_up_proj", "down_proj") and ".experts." in path
                else 2 if "shared_expert" in path else None)
        if slot is None:
            continue
        r = (8, 16, 4)[slot]
        layer.write(layer.slot_views(slot), key, torch.randn(r, fin, generator=g) * fin ** -0.5,
                    torch.randn(fout, r, generator=g), 0.5 + slot)


def _gate_name(kind: str) -> str:
    return "model.layers.0." + ("block_sparse_moe." if kind == "mixtral" else "mlp.") + "gate.weight"


def _block_kinds(seed):
    """(kind, config, block weights) of the two MoE block kinds the block tests cover."""
    for kind in ("mixtral", "qwen2_moe"):
        hf = moe_config(kind)
        yield kind, hf, moe_tensors(hf, seed, fused=kind == "qwen2_moe")


def _block_cases(ps_world, world, seed):
    """The SparseMoE block in every layout x mode against the same block in one process, on routings that leave
    experts without tokens ("skewed": every token goes to experts 0 and 1) and ranks without tokens (the last DP
    rank routes none; with TP attention fewer tokens than ranks leave the last chunks empty)."""
    checked = []
    dev = ps_world.device
    ops = get_backend(backend_under_test(), str(dev))
    for kind, hf, base in _block_kinds(seed):
        g = torch.Generator().manual_seed(seed + 1)
        for routing in ("random", "skewed"):
            t = dict(base)
            sign = t[_gate_name(kind)][0].sign()
            if routing == "skewed":  # experts 2.. lose by a wide margin on every token with x . sign(w_0) > 0
                gate = t[_gate_name(kind)].clone()
                gate[2:] -= 100.0 * sign
                t[_gate_name(kind)] = gate
            tokens = {}  # DP size -> per DP rank (x, slots)
            for d in (1, 2, 4):
                counts = [world - 1] if d == 1 else [int(n) for n in torch.randint(1, 6, (d,), generator=g)]
                if d > 1:
                    counts[-1] = 0
                xs = [torch.randn(n, H, generator=g) for n in counts]
                if routing == "skewed":
                    xs = [x.abs() * sign for x in xs]
                tokens[d] = [(x, torch.randint(-1, MAX_LORAS, (x.shape[0],), generator=g)) for x in xs]
            lseed = int(torch.randint(0, 2**31 - 1, (), generator=g))
            for name, (tp, ep, attn) in LAYOUTS[world].items():
                ps = comm.init_parallel(tp, str(dev))
                comm.init_expert_parallel(ps, ep, attn)
                x, slots = tokens[ps.dp.size][ps.dp.rank]
                for fully in (False, True):
                    ys = []
                    for p in (comm.single_process(dev), ps):
                        rt = LoRARuntime(MAX_LORAS, MAX_RANK, fully, ops)
                        block, step = _block(hf, p, rt, t)
                        _set_block_lora(rt, lseed, kind)
                        rt.batch = build_lora_batch(slots.tolist(), MAX_LORAS, dev)
                        prepare_step(step, p, rt, x.shape[0], dev)  # EP over DP: exchanges the token counts
                        with torch.no_grad():
                            ys.append(block(x.to(dev)).cpu())
                    want, got = ys
                    err = float((got - want).abs().max() / max(float(want.abs().max()), 1e-6)) if want.numel() else 0
                    assert got.shape == want.shape and err < 1e-5, \
                        f"block {kind}/{routing}/{name}/fully={fully}: rel err {err:.2e}"
                    checked.append(f"{kind}/{routing}/{name}/{fully}")
    return checked


# Each world size a pytest-xdist group of its own (tests/conftest.py): the two longest multi-GPU tests run side by side.
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.xdist_group(f"moe_layouts_{w}")) for w in (2, 4)])
def test_moe_layouts_match_single_process(bundle, world):
    if not enough_devices(world):
        pytest.skip(f"{world} ranks need {world} GPUs")
    cases = [bundle["mixtral"], bundle["qwen2_moe"]]
    ref = _reference(cases, bundle["requests"])
    # The adapters must move greedy tokens, or a LoRA bug could hide.
    base = _reference([(m, None) for m, _ in cases], [Request(r.index, id=r.id, adapter=None,
                                                              prompt_token_ids=r.prompt_token_ids,
                                                              max_new_tokens=r.max_new_tokens, ignore_eos=True)
                                                      for r in bundle["requests"]])
    for (m, _), (bm, _) in zip(cases, [(m, None) for m, _ in cases]):
        changed = [i for i, r in enumerate(bundle["requests"]) if r.adapter and ref[m][1][i] != base[bm][1][i]]
        assert changed, f"{m}: adapters changed no greedy output"
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    # Two tasks, each with its own time limit: on a host whose Triton cache is cold, the kernels' first compiles
    # (the ranks' own) took the whole test past one task's limit.
    blocks = run_ranks(_block_cases, world, world, seed, tp_size=1, timeout_s=240)
    engines = run_ranks(_engine_cases, world, world, cases, bundle["requests"], ref, cases[0], tp_size=1, timeout_s=240)
    n_layouts = len(LAYOUTS[world])
    assert len(blocks) == 2 * 2 * n_layouts * 2
    assert len(engines) == n_layouts * 2 * (len(cases) + 1)


# ---- EP over DP replicas at a fixed capacity (what a CUDA graph replays) ----------------------------------------
GRAPH_SIZES = (1, 2, 4, 8, 16)


def _fixed_capacity_cases(ps_world, world, seed):
    """EP over DP replicas, the SparseMoE block with LoRA on every expert, uneven token counts per replica and one
    replica with none. Today's dispatch (rows = the group's largest count) against the fixed-capacity one: rows
    rounded up to a graph size, and half the replicas forwarding a graph's padded rows (junk beyond the `valid`
    real ones) while the others step eagerly, in the same step, then the other way round. Every replica's real rows
    must come out the same, and each rank must compute the same expert pairs (padding routed nowhere)."""
    checked = []
    dev = ps_world.device
    ops = get_backend(backend_under_test(), str(dev))
    for kind, hf, t in _block_kinds(seed):
        g = torch.Generator().manual_seed(seed + 2)
        lseed = int(torch.randint(0, 2**31 - 1, (), generator=g))
        for name, (tp, ep, attn) in LAYOUTS[world].items():
            if ep == 1 or attn != "dp":
                continue
            ps = comm.init_parallel(tp, str(dev))
            comm.init_expert_parallel(ps, ep, attn)
            counts = [int(n) for n in torch.randint(1, 7, (ps.dp.size,), generator=g)]
            counts[-1] = 0
            xs = [torch.randn(n, H, generator=g) for n in counts]
            tags = [torch.randint(-1, MAX_LORAS, (n,), generator=g) for n in counts]
            size = capacity(max(counts), GRAPH_SIZES)
            junk = torch.randn(size, H, generator=g) * 10  # whatever a graph's padding rows hold
            x, slots, n = xs[ps.dp.rank].to(dev), tags[ps.dp.rank], counts[ps.dp.rank]
            for fully in (False, True):
                rt = LoRARuntime(MAX_LORAS, MAX_RANK, fully, ops)
                block, step = _block(hf, ps, rt, t)
                _set_block_lora(rt, lseed, kind)
                pairs = []
                inner = block.experts.forward

                def counted(xp, plan, *x8, inner=inner, pairs=pairs):
                    pairs.append(int(plan.expert_ends[-1]))  # pairs on this rank's experts
                    return inner(xp, plan, *x8)

                block.experts.forward = counted
                rt.batch = build_lora_batch(slots.tolist(), MAX_LORAS, dev)
                prepare_step(step, ps, rt, n, dev)  # today: exchanges the counts, rows = their max
                with torch.no_grad():
                    want = block(x).cpu()
                want_pairs = pairs.pop()
                step.buckets = GRAPH_SIZES
                for padded_parity in (0, 1):
                    padded = ps.dp.rank % 2 == padded_parity
                    rt.batch = build_lora_batch(slots.tolist(), MAX_LORAS, dev)
                    # lockstep: counts and the LoRA flag agreed once, before the forward
                    step.counts, step.lora = comm.all_gather_counts(n, ps.ep, dev, rt.active())
                    if padded:
                        xp = torch.cat([x, junk[n:].to(dev)])
                        rt.batch = build_lora_batch(slots.tolist() + [-1] * (size - n), MAX_LORAS, dev)
                        step.valid = torch.tensor([n], device=dev)
                        prepare_step(step, ps, rt, size, dev)
                    else:
                        xp = x
                        prepare_step(step, ps, rt, n, dev)
                    assert step.rows == size, (step.rows, size)
                    with torch.no_grad():
                        got = block(xp)[:n].cpu()
                    step.valid = None
                    what = f"fixed capacity {kind}/{name}/fully={fully}/{'padded' if padded else 'eager'} ({counts})"
                    err = float((got - want).abs().max() / max(float(want.abs().max()), 1e-6)) if n else 0.0
                    assert got.shape == want.shape and err < 1e-5, f"{what}: rel err {err:.2e}"
                    assert pairs.pop() == want_pairs, f"{what}: padding rows were routed to experts"
                    checked.append(what)
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_ep_dp_fixed_capacity_matches_todays_dispatch(world):
    if not enough_devices(world):
        pytest.skip(f"{world} ranks need {world} GPUs")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    checked = run_ranks(_fixed_capacity_cases, world, world, seed, tp_size=1, timeout_s=240)
    layouts = [n for n, (_, ep, attn) in LAYOUTS[world].items() if ep > 1 and attn == "dp"]
    assert len(checked) == 2 * len(layouts) * 2 * 2


# ---- lora.dtype=fp8 on the experts -------------------------------------------------------------------------------
FP8_BOUND = 0.05  # the dense fp8 bound (tests/unit/test_fp8_lora.py): error relative to what the adapters change


def _fp8_cfg(tp: int, ep: int, attn: str, fully: bool) -> RunConfig:
    cfg = _cfg(tp, ep, attn, fully)
    cfg.lora.dtype = "fp8"
    return cfg


def _fp8_layouts(ps_world: comm.ParallelState, world: int, case, requests, want):
    """Every layout x LoRA mode with fp8 slots against one process with fp8 slots: a B row is quantized whole on
    every layout (B is cut by rows: per-channel scales are the same), so the logits agree as tightly as in fp32."""
    checked = []
    for name, (tp, ep, attn) in LAYOUTS[world].items():
        ps = comm.init_parallel(tp, str(ps_world.device))
        for fully in (False, True):
            engine = Engine(_fp8_cfg(tp, ep, attn, fully), ps, *case)
            mine = _mine(ps, requests)
            for r, got in zip(mine, prompt_logits(engine, mine)):
                err = float((got.cpu() - want[r.index]).abs().max() / want[r.index].abs().max())
                assert err < 1e-4, f"fp8 {name} fully_sharded={fully}: request {r.index} prompt logits differ by {err:.2e}"
            checked.append(f"{name} fully_sharded={fully}")
    return checked


def _expert_b(engine) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(B, its fp8 channel scales or None) of every expert LoRA stack of the model, all slots."""
    out = []
    for layer in engine.model.layers:
        ex = getattr(layer.mlp, "experts", None)
        if ex is not None and hasattr(ex, "lora_b2"):
            scales = ex.b13_scales + [ex.b2_scales] if ex.b2_scales is not None else [None] * (len(ex.lora_b13) + 1)
            out += list(zip([b.data for b in ex.lora_b13] + [ex.lora_b2.data], scales))
    return out


def test_moe_fp8_expert_lora_every_layout(bundle):
    """lora.dtype=fp8 with adapters on attention and every expert (both PEFT formats), loaded through slot images:
    every expert B in the slots is the float32 B quantized per output channel (tp_lora.ops.fp8); an expert-only
    adapter's effect on the logits is within FP8_BOUND of the float32 one's for the median of five requests
    (adapters on attention too compound the dense layers' fp8 error); and every 2-rank layout and
    LoRA mode gives the one-process fp8 logits."""
    if not enough_devices(2):
        pytest.skip("2 ranks need 2 GPUs")
    case, requests = bundle["mixtral"], bundle["requests"][:4]
    requests = requests + [Request(9, id=9, adapter="w2", prompt_token_ids=requests[0].prompt_token_ids)] + [
        Request(i, id=i, adapter="w2", prompt_token_ids=list(range(i - 5, i + 4))) for i in range(10, 14)]
    ps = comm.single_process(device_under_test())
    fp8, full = Engine(_fp8_cfg(1, 1, "dp", False), ps, *case), Engine(_cfg(1, 1, "dp", False), ps, *case)
    got = [x.cpu() for x in prompt_logits(fp8, requests)]
    ref = [x.cpu() for x in prompt_logits(full, requests)]
    for (b8, sc), (b, _) in zip(_expert_b(fp8), _expert_b(full), strict=True):
        assert b8.dtype == torch.float8_e4m3fn and sc.shape == b.shape[:-1]
        amax = b.float().abs().amax(-1)
        torch.testing.assert_close(sc, torch.where(amax > 0, amax / 448.0, 1.0), rtol=1e-6, atol=0)
        back = b8.float() * sc[..., None]
        assert float((back - b).norm() / b.norm()) < 0.05  # e4m3: 3 mantissa bits
    base = [x.cpu() for x in prompt_logits(Engine(_cfg(1, 1, "dp", False), ps, case[0], None),
                                           [Request(r.index, id=r.id, adapter=None,
                                                    prompt_token_ids=r.prompt_token_ids) for r in requests])]
    experts_only = [i for i, r in enumerate(requests) if r.adapter == "w2"]
    # Per request; the median, since a near-tied top-k that the two runs break differently (float32 GEMMs round by
    # their blocking) moves one request's logits by far more than fp8 does.
    errs = sorted(float((got[i] - ref[i]).norm() / (ref[i] - base[i]).norm()) for i in experts_only)
    assert errs[0] > 0 and errs[len(errs) // 2] < FP8_BOUND, f"fp8 expert LoRA: errors {errs} of the adapter's effect"
    want = {r.index: x for r, x in zip(requests, got)}
    checked = run_ranks(_fp8_layouts, 2, 2, case, requests, want, tp_size=1, timeout_s=240)
    assert len(checked) == len(LAYOUTS[2]) * 2


def test_moe_prefix_cache_gives_the_tokens_of_computing(bundle):
    """Prefix caching on an MoE model: requests sharing a prompt prefix per adapter (expert LoRA, PEFT 3D
    parameters, the base) give the tokens of prefix caching off."""
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(2, V, (9,), generator=gen).tolist()
    reqs = [Request(i, id=i, adapter=("pe", "tp", None)[i % 3], max_new_tokens=4, ignore_eos=True,
                    prompt_token_ids=system + torch.randint(2, V, (1 + i % 4,), generator=gen).tolist())
            for i in range(9)]
    ps = comm.single_process(device_under_test())
    out = {}
    for caching in (False, True):
        cfg = _cfg(1, 1, "dp", False)
        cfg.scheduler.kv_block_size, cfg.scheduler.prefix_caching = 4, caching
        engine = Engine(cfg, ps, *bundle["qwen2_moe"])
        # each adapter's prefix computed whole first: the later arrivals hit it however long the steps take
        res = engine.generate(reqs[:3])
        hits0 = engine.stats.prefix_hit_tokens
        res += engine.generate(reqs[3:], arrival_times=[0.02 * i for i in range(len(reqs) - 3)])
        out[caching] = [(r.output_token_ids, r.logprobs) for r in res], engine.stats.prefix_hit_tokens - hits0
    (want, _), (got, hits) = out[False], out[True]
    assert hits > 0
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        # CUDA's kernels sum a cached prefix's attention in another order than one whole prefill
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), rtol=0,
                                   atol=1e-5 if device_under_test() == "cpu" else 1e-4)
