"""Per-step metadata reaches the device intact, in one asynchronous copy per dtype, without a host sync."""
import pytest
import torch

from tp_lora.hostcopy import to_device
from tp_lora.models.attention import build_attn_meta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_to_device_keeps_values_shapes_and_order_without_host_sync():
    gen = torch.Generator().manual_seed(0)
    host = [torch.randint(0, 100, (3, 4), generator=gen), torch.rand(5, generator=gen) > 0.5,
            torch.randint(0, 100, (7,), generator=gen), torch.empty(0, dtype=torch.long),
            torch.randn(2, 2, generator=gen)]
    to_device(host, "cuda")  # warm the pinned-memory cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = to_device(host, "cuda")
        build_attn_meta([[3], [0], [5]], [4, 0, 9], [1, 6, 1], 16, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for h, d in zip(host, dev):
        assert d.is_cuda and d.dtype == h.dtype and d.shape == h.shape
        assert torch.equal(d.cpu(), h)
