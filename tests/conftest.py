"""Every test process: under parallel pytest workers on CUDA, each process takes a bounded share of each GPU
(tp_lora.testing.share_gpus)."""
from tp_lora.testing import share_gpus


def pytest_configure(config):
    share_gpus()
