"""A batch whose graph buffers are bound to buffers of a graph's and refreshed with a new batch's host copies computes
exactly what the new batch computes directly: what a CUDA-graph replay relies on (checked here without a graph,
under the interpreter on CPU)."""
import pytest
import torch

from tp_lora.ops.batch import build_lora_batch


@pytest.mark.parametrize("scheme", ["sorted", "chunked"])
def test_refreshed_static_batch_matches_direct(device, scheme):
    from tp_lora.ops import triton as ops
    ops.set_scheme(scheme)
    t, slots_n, r, h = 12, 4, 8, 32
    a = [torch.randn(slots_n, r, h, device=device)]
    b = [torch.randn(slots_n, 24, r, device=device)]
    scales = torch.rand(1, slots_n, device=device)
    x = torch.randn(t, h, device=device)
    static = build_lora_batch([0] * t, slots_n, device)  # the capture-time mix
    bound = [torch.full_like(buf, -5) for buf in ops.graph_buffers(static)]
    ops.bind_graph_buffers(static, bound)
    assert [buf.data_ptr() for buf in ops.graph_buffers(static)] == [buf.data_ptr() for buf in bound]
    for _ in range(3):
        mix = torch.randint(-1, slots_n, (t,)).tolist()
        new = build_lora_batch(mix, slots_n, device)
        for buf, host in zip(bound, ops.step_buffers(mix, static)):
            assert host.device.type == "cpu"
            buf.copy_(host)
        want_u = ops.shrink(x, a, scales, new)
        got_u = ops.shrink(x, a, scales, static)
        torch.testing.assert_close(got_u, want_u, rtol=0, atol=0)
        want = torch.zeros(t, 24, device=device)  # expand adds into out: a NaN start would hide a stale batch
        got = want.clone()
        ops.expand(want_u, b, new, want)
        ops.expand(got_u, b, static, got)
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refresh_refuses_another_size(device):
    from tp_lora.ops import triton as ops
    static = build_lora_batch([0] * 4, 4, device)
    with pytest.raises(ValueError, match="captured for 4 tokens"):
        ops.step_buffers([0] * 5, static)
    with pytest.raises(ValueError, match="graph buffers are"):
        ops.bind_graph_buffers(static, [torch.zeros(5, dtype=torch.int32, device=device)] * 3)
