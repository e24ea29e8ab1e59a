"""Every test process: under parallel pytest workers on CUDA, each process takes a bounded share of its GPU
(tp_lora.testing.share_gpus) and hands back what a test left cached, so that the other workers' engines find it free."""
import gc

import pytest
import torch

from tp_lora.testing import share_gpus, workers_share_gpus


def pytest_configure(config):
    share_gpus()


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    if workers_share_gpus():
        gc.collect()
        torch.cuda.empty_cache()
