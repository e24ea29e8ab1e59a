"""One Llama decoder layer's decode step on the GPU (the llama-2048 bench shape, batch 32, context 128): with the
fused ops its launches that are neither GEMMs, attention nor LoRA number at most MAX_OTHER (printed beside the torch
path's), it matches the torch path, and a CUDA graph of it replays the eager result for new inputs."""
import collections
import re

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tp_lora import distributed as comm
from tp_lora.models.attention import build_attn_meta
from tp_lora.models.llama import CausalLM
from tp_lora.ops import fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HF = dict(model_type="llama", vocab_size=1024, hidden_size=2048, intermediate_size=5632, num_hidden_layers=1,
          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5)
BATCH, CONTEXT, BLOCK = 32, 128, 16
MAX_OTHER = 6  # two add + norms, RoPE + cache write, act * up (4), and two to spare
BIG = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk|_decode_kernel|shrink|expand|lora", re.I)


def _setup():
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = CausalLM(HF, comm.single_process("cuda").tp, torch.bfloat16, "cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * scale + (1.0 if "norm" in name else 0.0))
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(BATCH)]
    meta = build_attn_meta(tables, [CONTEXT] * BATCH, [1] * BATCH, BLOCK, "cuda")
    cache = model.new_cache(BATCH * per_seq, BLOCK)
    for t in cache.k + cache.v:
        t.normal_(generator=gen)
    cos, sin = model.rotary["full_attention"](meta.positions, model.dtype)
    x = torch.randn(BATCH, HF["hidden_size"], generator=gen, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(BATCH, HF["hidden_size"], generator=gen, device="cuda", dtype=torch.bfloat16)
    layer = model.layers[0]
    return lambda: layer(x, residual, cos, sin, cache, meta), x, residual


def _kernels(step) -> list[str]:
    step()  # compile / autotune outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


@torch.no_grad()
def test_decode_layer_kernel_count(monkeypatch):
    step, _, _ = _setup()
    counts = {}
    for use in (False, None):  # the torch path, then the default (fused on CUDA)
        monkeypatch.setattr(fused, "KERNELS", use)
        names = _kernels(step)
        other = [n for n in names if not BIG.search(n)]
        counts[use] = other
        print(f"\n{'fused' if use is None else 'torch'}: {len(names)} kernels, {len(other)} neither GEMM, attention "
              f"nor LoRA:")
        for name, n in collections.Counter(other).most_common():
            print(f"  {n} x {name[:100]}")
    assert len(counts[None]) <= MAX_OTHER < len(counts[False]), counts[None]


@torch.no_grad()
def test_fused_layer_matches_torch_path_and_replays_in_a_graph(monkeypatch):
    step, x, residual = _setup()
    monkeypatch.setattr(fused, "KERNELS", False)
    want = step()
    monkeypatch.setattr(fused, "KERNELS", None)
    got = step()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2)  # bfloat16 roundings a step apart, through GEMMs
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    x.normal_()
    residual.normal_()
    eager = step()
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(static, eager):
        torch.testing.assert_close(g, e)
