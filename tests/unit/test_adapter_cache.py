"""The adapter cache's read-ahead: a prefetched adapter is the one a direct read gives, a bad file fails the same
way, and read-ahead is bounded."""
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora import distributed as comm
from tp_lora.assets import model_module_shapes, write_random_adapter, write_tiny_llama
from tp_lora.lora import cache as cache_mod
from tp_lora.lora.peft_format import AdapterError
from tp_lora.lora.cache import AdapterCache
from tp_lora.models.checkpoint import load_hf_config


@pytest.fixture
def zoo(tmp_path):
    write_tiny_llama(tmp_path / "m", num_hidden_layers=2, seed=3)
    paths = {}
    for i in range(12):
        paths[f"a{i}"] = str(tmp_path / "a" / f"a{i}")
        write_random_adapter(paths[f"a{i}"], tmp_path / "m", r=4 + i % 3, seed=i)
    broken = str(tmp_path / "a" / "a5" / "adapter_model.safetensors")
    tensors = load_file(broken)
    next(iter(tensors.values()))[0, 0] = float("nan")  # registers (the header is fine); fails when read
    save_file(tensors, broken)
    return paths, model_module_shapes(load_hf_config(tmp_path / "m"))


def _cache(zoo):
    paths, shapes = zoo
    c = AdapterCache(paths, max_cpu_loras=4, dtype=torch.float32, group=comm.Group("tp"))
    c.attach_model(shapes, max_rank=8)
    return c


def test_prefetched_adapters_equal_direct_reads_and_bad_files_fail_alike(zoo):
    direct, ahead = _cache(zoo), _cache(zoo)
    ahead.prefetch(["a1", "a5", "nope", "a2"])
    for read in list(ahead._staged.values()):
        read.result(timeout=60)
    for name in ("a1", "a2"):
        want, got = direct.fetch(name), ahead.fetch(name)
        assert got.modules.keys() == want.modules.keys()
        for key, m in want.modules.items():
            assert torch.equal(got.modules[key].a, m.a) and torch.equal(got.modules[key].b, m.b)
            assert got.modules[key].scale == m.scale
    with pytest.raises(AdapterError) as want_err:
        direct.fetch("a5")
    with pytest.raises(AdapterError) as got_err:
        ahead.fetch("a5")
    assert str(got_err.value) == str(want_err.value)
    assert ahead.stats.prefetched == 3 and ahead.stats.host_misses == 3
    assert "a5" in ahead.bad and not ahead._staged
    ahead.close()


def test_read_ahead_is_bounded_and_skips_what_is_in_memory(zoo, monkeypatch):
    monkeypatch.setattr(cache_mod, "PREFETCH_DEPTH", 6)
    c = _cache(zoo)
    c.fetch("a0")
    c.prefetch([f"a{i}" for i in range(12)] * 2)
    assert "a0" not in c._staged
    assert len(c._staged) == cache_mod.PREFETCH_DEPTH
    assert list(c._staged) == [f"a{i}" for i in range(1, 1 + cache_mod.PREFETCH_DEPTH)]
    c.forget()
    assert not c._staged and not c.host
    c.close()


def _hold_reader(c, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(go, started): the reader thread sets started and waits before each read ahead until go is set."""
    go, started, read = threading.Event(), threading.Event(), c._read_ahead

    def held(info):
        started.set()
        return go.wait(30) and read(info)

    monkeypatch.setattr(c, "_read_ahead", held)
    return go, started


def test_fetch_reads_an_adapter_still_queued_for_read_ahead_itself(zoo, monkeypatch):
    """The step loop does not wait behind the reader's queue: an adapter whose read ahead has not started is read by
    fetch, while the reader goes on with the one it has (here held)."""
    direct, ahead = _cache(zoo), _cache(zoo)
    go, started = _hold_reader(ahead, monkeypatch)
    ahead.prefetch(["a1", "a2"])
    assert started.wait(30), "the reader did not start a1's read"
    queued = ahead._staged["a2"]
    t0 = time.perf_counter()
    got, want = ahead.fetch("a2"), direct.fetch("a2")
    assert time.perf_counter() - t0 < 10, "fetch waited for the reader"
    assert queued.cancelled() and ahead.stats.prefetched == 0
    go.set()
    for key, m in want.modules.items():
        assert torch.equal(got.modules[key].a, m.a) and torch.equal(got.modules[key].b, m.b)
    assert ahead.fetch("a1") is not None and ahead.stats.prefetched == 1  # its read had started: waited for
    ahead.close()


def test_wait_any_reads_a_queued_adapter_itself_then_waits(zoo, monkeypatch):
    """wait_any (the step loop with nothing to run) reads the first adapter whose read ahead has not started itself,
    beside the reader's own read (held); with every read under way it waits for one."""
    c = _cache(zoo)
    go, started = _hold_reader(c, monkeypatch)
    c.prefetch(["a1", "a2"])
    assert started.wait(30), "the reader did not start a1's read"
    queued = c._staged["a2"]
    assert not c.ready("a1") and not c.ready("a2")
    c.wait_any(["a1", "a2"])
    assert queued.cancelled() and c.ready("a2"), "a2 was read here, not by the reader"
    go.set()
    for _ in range(100):
        if c.ready("a1"):
            break
        c.wait_any(["a1"])
    assert c.ready("a1") and c.stats.read_seconds > 0
    for name in ["a1", "a2"]:
        assert c.fetch(name) is not None
    c.close()


def test_host_tier_keeps_the_adapter_fetched_most_often_lately(zoo):
    """4 host entries: a hot adapter fetched between one-off adapters stays (least recently used, it would be
    evicted by the fourth one-off); the one-offs go least recently used first; unregistering forgets its count."""
    c = _cache(zoo)
    for _ in range(3):
        c.fetch("a0")
    for name in ("a1", "a2", "a3", "a4", "a6"):
        c.fetch(name)
    assert list(c.host) == ["a0", "a3", "a4", "a6"] and c.stats.host_evictions == 2
    misses = c.stats.host_misses
    c.fetch("a0")
    assert c.stats.host_misses == misses
    c.remove("a0")
    assert c.popularity["a0"] == 0.0
    c.close()
