"""The KV cache's budget on CUDA stays under a process's allocator limit (torch.cuda.set_per_process_memory_fraction):
what lets several processes share one GPU (parallel test workers, co-located services)."""
import pytest
import torch

from tp_lora.engine.kv_pool import kv_budget_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_budget_stays_under_the_process_memory_limit():
    dev = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.get_per_process_memory_fraction(dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    held = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # reserved by this process
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (2 << 30) / total), dev)
        limited = kv_budget_bytes(dev, 0.8, None)
        allowed = int(torch.cuda.get_per_process_memory_fraction(dev) * total) - torch.cuda.memory_reserved(dev)
        assert 0 < limited <= 0.8 * allowed + 1, (limited, allowed)
        kv = torch.empty(limited, dtype=torch.uint8, device=dev)  # the budget fits under the limit
        del kv
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        assert kv_budget_bytes(dev, 0.8, None) > limited  # only the device's free memory bounds it now
        assert kv_budget_bytes(dev, 0.8, 100) == 100 << 20  # kv_cache_mb caps either way
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)
        del held
