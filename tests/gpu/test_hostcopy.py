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


def test_a_stream_waits_for_the_host_flag_then_reads_what_the_host_wrote():
    import time
    from tp_lora.streamwait import host_flag
    flag = host_flag(torch.device("cuda"))
    assert flag is not None, "the driver cannot make a stream wait on host memory here"
    src = torch.zeros(4096, dtype=torch.int32, pin_memory=True)
    dst = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    for number in (1, 2, 3):
        flag.wait(torch.cuda.current_stream(), number)
        dst.copy_(src, non_blocking=True)  # queued before the host writes src: it must read it after the flag
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the copy ran before the host raised the flag"
        src.fill_(number)
        flag.raise_to(number)
        done.synchronize()
        assert torch.equal(dst.cpu(), torch.full((4096,), number, dtype=torch.int32))
