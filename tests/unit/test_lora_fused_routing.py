"""Which LoRA ops a layer calls: in the default (not fully sharded) mode nothing sits between shrink and expand, so the
layer makes one shrink_expand call (one fused launch at decode sizes on the Triton backend) and no shrink / expand."""
from types import SimpleNamespace

import torch

from tp_lora import distributed as comm
from tp_lora.layers.linear import ParallelLinear, qkv_spec
from tp_lora.lora.batch import build_lora_batch
from tp_lora.lora.layers import LoRARuntime, wrap
from tp_lora.ops import torch_ref


def _recording_ops(calls: list[str]) -> SimpleNamespace:
    def rec(name):
        def fn(*a, **k):
            calls.append(name)
            return getattr(torch_ref, name)(*a, **k)
        return fn
    return SimpleNamespace(**{n: rec(n) for n in ("shrink", "expand", "shrink_expand", "embedding_shrink")})


def test_default_mode_calls_the_fused_op_once():
    gen = torch.Generator().manual_seed(0)
    tp = comm.single_process().tp
    spec = qkv_spec(16, 4, 2, 4)
    calls = []
    rt = LoRARuntime(max_loras=3, max_rank=4, fully_sharded=False, ops=_recording_ops(calls))
    base = ParallelLinear(spec, tp, True, device="cpu")
    layer = wrap(base, rt, ["q", "k", "v"])
    for s, width in enumerate(spec.out_widths):
        base.load_slice(s, torch.randn(width, 16, generator=gen), torch.randn(width, generator=gen))
        layer.set_slot(1, s, torch.randn(4, 16, generator=gen), torch.randn(width, 4, generator=gen), 0.5)
    x = torch.randn(5, 16, generator=gen)
    rt.batch = build_lora_batch([1, -1, 1, 1, -1], 3, "cpu")
    out = layer(x)
    assert calls == ["shrink_expand"]
    rt.batch = build_lora_batch([-1] * 5, 3, "cpu")
    base = layer(x)
    delta = torch.cat([(x @ a.t()) @ b.t() * 0.5 for a, b in
                       zip([layer.lora_a[s][1] for s in range(3)], [layer.lora_b[s][1] for s in range(3)])], -1)
    has = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)
    torch.testing.assert_close(out[has], base[has] + delta[has])
    torch.testing.assert_close(out[~has], base[~has])
