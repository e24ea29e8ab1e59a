"""Every sharded layer x both LoRA sharding modes x adapter mixes, on 2 and 4 gloo ranks, against the unsharded
math y = x W^T + b + s_a (x A_a^T) B_a^T computed independently on each rank from the same full tensors."""
import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_lora.layers.linear import ParallelLinear, column_spec, qkv_spec, replicated_spec, row_spec
from tp_lora.lora.layers import LoRARuntime, wrap
from tp_lora.ops import get_backend
from tp_lora.ops.batch import build_lora_batch
from tp_lora.testing import enough_devices, run_ranks, backend_under_test, device_under_test

H, L, R = 16, 4, 8  # hidden, slots, max_rank


def _mixes(t: int, gen: torch.Generator) -> dict[str, list[int]]:
    return {
        "mixed_with_none": torch.randint(-1, L, (t,), generator=gen).tolist(),
        "all_one_adapter": [2] * t,
        "every_slot": [i % L for i in range(t)],
        "no_adapter": [-1] * t,
    }


def _layer_kinds(tp_size: int):
    """(name, spec, factory(tp) -> base layer, input kind)"""
    kv = 2 if tp_size <= 2 else 1  # tp=4 with one KV head exercises replication
    return [
        ("column", column_spec(H, 24), lambda tp, d: ParallelLinear(column_spec(H, 24), tp, True, device=d)),
        ("merged", column_spec(H, 12, 20), lambda tp, d: ParallelLinear(column_spec(H, 12, 20), tp, device=d)),
        ("qkv", qkv_spec(H, 4, kv, 4), lambda tp, d: ParallelLinear(qkv_spec(H, 4, kv, 4), tp, True, device=d)),
        ("row", row_spec(32, H), lambda tp, d: ParallelLinear(row_spec(32, H), tp, True, device=d)),
        ("replicated", replicated_spec(H, 12), lambda tp, d: ParallelLinear(replicated_spec(H, 12), tp, device=d)),
        ("lm_head", column_spec(H, 32), lambda tp, d: ParallelLMHead(32, H, tp, device=d)),
    ]


def _check_layers(ps: comm.ParallelState, fully_sharded: bool, seed: int) -> int:
    tp, dev = ps.tp, ps.device
    ops = get_backend(backend_under_test(), str(dev))
    gen = torch.Generator().manual_seed(seed)  # same stream on every rank: every rank knows the full tensors
    checked = 0
    for name, spec, make in _layer_kinds(tp.size):
        widths = spec.out_widths
        w = [torch.randn(o, spec.in_features, generator=gen) for o in widths]
        bias = [torch.randn(o, generator=gen) for o in widths]
        # Adapters of different ranks (1..R), padded into the slots; slice 1 of a packed layer left empty in slot 3.
        ranks = [1, 3, R, 5]
        a = [[torch.randn(ranks[j], spec.in_features, generator=gen) for _ in widths] for j in range(L)]
        b = [[torch.randn(o, ranks[j], generator=gen) for o in widths] for j in range(L)]
        scale = [0.5, 2.0, 1.0 / 3, 1.5]
        base = make(tp, dev)
        if isinstance(base, ParallelLMHead):
            base.load(w[0])
        else:
            for s in range(len(widths)):
                base.load_slice(s, w[s], bias[s] if base.bias is not None else None)
        rt = LoRARuntime(L, R, fully_sharded, ops)
        layer = wrap(base, rt, [f"m{s}" for s in range(len(widths))])
        for j in range(L):
            for s in range(len(widths)):
                if j == 3 and s == 1:
                    continue
                layer.write(layer.slot_views(j), s, a[j][s], b[j][s], scale[j])
        for mix, slots in _mixes(7, gen).items():
            x = torch.randn(7, spec.in_features, generator=gen)
            ref = []
            for s, o in enumerate(widths):
                y = x @ w[s].t()
                if not isinstance(base, ParallelLMHead) and base.bias is not None:
                    y = y + bias[s]
                for t, slot in enumerate(slots):
                    if slot >= 0 and not (slot == 3 and s == 1):
                        y[t] += scale[slot] * (x[t] @ a[slot][s].t()) @ b[slot][s].t()
                ref.append(y)
            rt.batch = build_lora_batch(slots, L, dev)
            comm.STATS.reset()
            if spec.kind == "row":
                i0, i1 = spec.in_range(tp.rank, tp.size)
                out = layer(x[:, i0:i1].to(dev)).cpu()
                expected = ref[0]
            else:
                out = layer(x.to(dev)).cpu()
                if isinstance(base, ParallelLMHead):
                    expected = ref[0]
                else:
                    expected = torch.cat([ref[s][:, r0:r1] for s, (r0, r1) in
                                          enumerate(spec.slice_ranges(tp.rank, tp.size))], -1)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4,
                                       msg=lambda m: f"{name}/{mix}/fully_sharded={fully_sharded}: {m}")
            multi = tp.size > 1
            extra = comm.STATS.total() - (1 if multi and (spec.kind == "row" or isinstance(base, ParallelLMHead))
                                          else 0)
            want = 1 if (multi and fully_sharded and rt.active() and spec.kind != "replicated") else 0
            assert extra == want, f"{name}/{mix}: {extra} LoRA collectives, expected {want}"
            checked += 1
    # Vocab-parallel embedding with LoRA: A^T split by vocab, B whole, no extra collective.
    vocab = 32
    emb_w = torch.randn(vocab, H, generator=gen)
    emb = VocabParallelEmbedding(vocab, H, tp, device=dev)
    emb.load(emb_w)
    rt = LoRARuntime(L, R, fully_sharded, ops)
    layer = wrap(emb, rt, ["embed"])
    ea = [torch.randn(4, vocab, generator=gen) for _ in range(L)]
    eb = [torch.randn(H, 4, generator=gen) for _ in range(L)]
    for j in range(L):
        layer.write(layer.slot_views(j), 0, ea[j], eb[j], 0.25 * (j + 1))
    for mix, slots in _mixes(9, gen).items():
        ids = torch.randint(0, vocab, (9,), generator=gen)
        ref = emb_w[ids].clone()
        for t, slot in enumerate(slots):
            if slot >= 0:
                ref[t] += 0.25 * (slot + 1) * ea[slot][:, ids[t]] @ eb[slot].t()
        rt.batch = build_lora_batch(slots, L, dev)
        comm.STATS.reset()
        torch.testing.assert_close(layer(ids.to(dev)).cpu(), ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"embedding/{mix}: {m}")
        assert comm.STATS.total() == (1 if tp.size > 1 else 0)
        checked += 1
    return checked


def _all_modes(ps, seed):
    return [_check_layers(ps, fully, seed) for fully in (False, True)]


@pytest.mark.parametrize("world", [2, 4])
def test_layers_match_unsharded_math(world):
    if not enough_devices(world):
        pytest.skip(f"{world} ranks need {world} GPUs")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
    counts = run_ranks(_all_modes, world, seed)
    assert counts == [4 * 6 + 4] * 2


def test_layers_single_process():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    assert _all_modes(comm.single_process(device_under_test()), seed) == [4 * 6 + 4] * 2
