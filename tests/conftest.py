"""Every test process: under parallel pytest workers on CUDA, each worker sees the GPUs in its own rotated order
(tp_lora.testing.spread_gpus) and takes a bounded share of its GPU (share_gpus); every test process hands back what a
test left cached, so that other workers' engines and the ranks later tests spawn find it free.
Under pytest-xdist's `--dist loadgroup` a test runs in its module's group (as `--dist loadfile` would: a file's module
fixtures and rank pools are made once) unless it names a group of its own (`xdist_group`): a long test then runs
beside the rest of its file.
TP_LORA_TEST_FAILURES=path: each failure's report is appended there as it happens (a run cut short by a time limit
keeps what failed and why; pytest prints the reports only at the end)."""
import gc
import os

import pytest
import torch

from tp_lora.testing import share_gpus, spread_gpus


def pytest_configure(config):
    spread_gpus()
    share_gpus()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_runtest_logreport(report):
    path = os.environ.get("TP_LORA_TEST_FAILURES")
    if path and report.failed and not hasattr(report, "node"):  # once, in the process that runs the test
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # for the ranks a later test spawns on its GPUs
        gc.collect()
        torch.cuda.empty_cache()
