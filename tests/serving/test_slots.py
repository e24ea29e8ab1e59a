"""Slot images: an adapter's host image copied into a used slot leaves exactly what emptying the slot and writing
the adapter module by module leaves (untargeted modules, rank padding and the slot's previous adapter included), with
B in the model dtype and in fp8; on CUDA from page-locked memory first, then again from the pageable host tier."""
import dataclasses
import json
import math
import os
import shutil
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine
from tp_lora.lora.adapter import AdapterError, load_peft_adapter
from tp_lora.lora.layers import LoRALinear, module_shapes
from tp_lora.lora import cache as cache_module, slots as slots_module
from tp_lora.lora.slots import SlotTable
from tp_lora.testing import device_under_test

from _serving import make_requests, serving_cfg, write_random_adapter


@pytest.mark.parametrize("lora_dtype", ["auto", "fp8"])
def test_image_load_equals_module_by_module_writes(bundle, lora_dtype):
    model, adapters = bundle
    cfg = serving_cfg(max_loras=3)
    cfg.lora.dtype = lora_dtype
    cfg.device = device_under_test()
    if cfg.device == "cuda":  # the pinned, asynchronous path, in the dtype GPU users run
        cfg.dtype = "bfloat16"
    engine = Engine(cfg, comm.single_process(cfg.device), model, adapters)
    slots = engine.registry.slots
    for v in slots.views(0):  # poison: whatever the load does not overwrite shows
        v.fill_(7.0)
    # Each load reuses slot 0: a bigger rank after a smaller one, other targets, embeddings, then a single module.
    for name in ["r4", "r16", "emb", "a9"]:
        assert name not in engine.bad_adapters
        image = engine.registry.cache.fetch(name)
        assert (image.pinned is not None) == (cfg.device == "cuda")  # a fresh image loads from page-locked memory
        slots.load(0, image)
        assert image.pinned is None
        slots.load(1, image)  # a reload from the host tier: from pageable memory, the same contents
        for layer in slots.layers:
            layer.clear(layer.slot_views(2))
        adapter = load_peft_adapter(os.path.join(adapters, name), name=name, dtype=engine.registry.cache.dtype)
        for path, m in adapter.modules.items():
            layer, key = engine.runner.rt.targets[path]
            layer.write(layer.slot_views(2), key, m.a, m.b, m.scale)
        got, want = slots.views(0), slots.views(2)
        assert len(got) == len(want) > 0
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype, f"{name}: view {i}"
            if cfg.device == "cuda" and lora_dtype == "fp8":
                # Images quantize on the host, layer.write on the device: CUDA divides by a scalar via its reciprocal,
                # so a channel scale may differ in the last bit and an fp8 value by one step (1/8 relative).
                torch.testing.assert_close(g.float(), w.float(), rtol=0.13, atol=0.01, msg=f"{name}: view {i}")
            else:
                assert torch.equal(g.float(), w.float()), f"{name}: view {i} differs"
        assert slots.names[0] == name
        assert all(torch.equal(a, b) for a, b in zip(slots.views(1), got)), f"{name}: reload differs"


def test_pooled_images_are_recycled_and_start_empty(bundle):
    """Images live in pooled host memory: an entry freed by a dropped image is reused, and an image built in it (after
    a bigger adapter with other targets) equals one built in new memory; with the pool empty images still build."""
    model, adapters = bundle
    engine = Engine(serving_cfg(max_loras=3), comm.single_process("cpu"), model, adapters)
    table = SlotTable(engine.runner.rt, host_images=1)
    read = {name: load_peft_adapter(os.path.join(adapters, name), name=name, dtype=engine.registry.cache.dtype)
            for name in ("r16", "emb", "a9")}
    first = table.image(read["r16"])
    assert table._pool.free == []
    spill = table.image(read["emb"])  # the pool is empty: new memory
    assert all(b.data_ptr() != p.data_ptr() for b, p in zip(spill.blocks.values(), table._pool.entries[0][0].values()))
    del first
    assert table._pool.free == [0]
    pooled = table.image(read["a9"])
    assert all(b.data_ptr() == p.data_ptr() for b, p in zip(pooled.blocks.values(), table._pool.entries[0][0].values()))
    fresh = SlotTable(engine.runner.rt).image(read["a9"])
    for dtype, block in fresh.blocks.items():
        assert torch.equal(pooled.blocks[dtype], block)


def _poison_free_images(table: SlotTable) -> None:
    """Fill the pool's free entries with finite garbage: what a replay does not write shows."""
    for i in table._pool.free:
        for block in table._pool.entries[i][0].values():
            block.view(torch.uint8).fill_(0x41)


@pytest.mark.parametrize("max_gaps", [slots_module.MAX_GAPS, 0])
def test_read_plans_rebuild_images_exactly(bundle, tmp_path, monkeypatch, max_gaps):
    """After the first file of a layout (same safetensors header, size and adapter_config.json), reads build the
    image by its plan: the same image a full read makes (rank padding included), in a pool entry holding another
    image, whether the plan copies only the template's parts the file does not cover or (max_gaps=0) all of it; a
    NaN still fails the adapter with the full read's message; a config with other scales, or a truncated file, goes
    through a full read."""
    monkeypatch.setattr(slots_module, "MAX_GAPS", max_gaps)
    model, _ = bundle
    root = tmp_path / "adapters"
    for i in range(3):
        write_random_adapter(root / f"p{i}", model, r=16, lora_alpha=32, seed=i)
    write_random_adapter(root / "alpha", model, r=16, lora_alpha=8, seed=5)  # same tensors' layout, other scale
    for i in range(2):  # rank 8 under lora.max_rank 16: the images' rank padding comes from the template
        write_random_adapter(root / f"q{i}", model, r=8, lora_alpha=16, seed=10 + i)
    shutil.copytree(root / "p0", root / "nan")
    weights = root / "nan" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end + 40:header_end + 44] = struct.pack("<f", float("nan"))
    weights.write_bytes(bytes(data))
    shutil.copytree(root / "p0", root / "nan_end")  # in the file's last value: a screen must cover it all
    weights = root / "nan_end" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = struct.pack("<f", float("nan"))
    weights.write_bytes(bytes(data))
    engine = Engine(serving_cfg(max_loras=2, max_cpu_loras=8), comm.single_process(), model, str(root))
    cache = engine.registry.cache

    def full_read(name):
        adapter = load_peft_adapter(str(root / name), name=name, dtype=cache.dtype)
        return engine.registry.slots.image(adapter)

    first = cache.fetch("p0")
    assert first.plan is not None and len(cache._plans) == 1
    # Full rank: only the scales are the template's (a run per layer); max_gaps=0 copies the whole template.
    assert (first.plan.gaps is None) == (max_gaps == 0)
    assert first.plan.gaps is None or 0 < len(first.plan.gaps) <= len(engine.registry.slots.layers)
    assert len(first.plan.screen) == 1  # the file's tensors lie back to back: one norm screens them
    for name in ["p1", "p2", "alpha"]:
        _poison_free_images(engine.registry.slots)
        image = cache.fetch(name)
        assert (image.plan is first.plan) == (name != "alpha"), name
        want = full_read(name)
        assert image.blocks.keys() == want.blocks.keys()
        for dtype in want.blocks:
            assert torch.equal(image.blocks[dtype], want.blocks[dtype]), f"{name}: {dtype} block differs"
    assert len(cache._plans) == 2
    small = cache.fetch("q0")
    assert small.plan is not None
    _poison_free_images(engine.registry.slots)
    got, want = cache.fetch("q1"), full_read("q1")
    assert got.plan is small.plan
    for dtype in want.blocks:
        assert torch.equal(got.blocks[dtype], want.blocks[dtype]), f"q1: {dtype} block differs"
    for name in ("nan", "nan_end"):
        with pytest.raises(AdapterError, match="NaN/Inf"):
            cache.fetch(name)
    # Same header, fewer bytes: not the plan's file any more.
    weights = root / "p2" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    cache.forget()
    with pytest.raises(AdapterError, match="truncated"):
        cache.fetch("p2")


def test_a_smaller_rank_overwrites_a_bigger_ones_padding(bundle):
    """Writing an adapter's module fills its r rank columns and zeroes the rest: a slot that held a bigger rank
    ends up as if it had been cleared first (images rely on it too: a read plan's template carries the zeros)."""
    model, adapters = bundle
    engine = Engine(serving_cfg(max_loras=2), comm.single_process(), model, adapters)
    gen = torch.Generator().manual_seed(0)
    shapes = module_shapes(engine.runner.rt)
    checked = 0
    for path, (layer, key) in engine.runner.rt.targets.items():
        if not isinstance(layer, LoRALinear):
            continue
        fin, fout = shapes[path]
        a16, b16 = torch.randn(16, fin, generator=gen), torch.randn(fout, 16, generator=gen)
        a4, b4 = torch.randn(4, fin, generator=gen), torch.randn(fout, 4, generator=gen)
        for slot in (0, 1):
            layer.clear(layer.slot_views(slot))
        layer.write(layer.slot_views(0), key, a16, b16, 2.0)
        layer.write(layer.slot_views(0), key, a4, b4, 0.5)
        layer.write(layer.slot_views(1), key, a4, b4, 0.5)
        for got, want in zip(layer.slot_views(0), layer.slot_views(1)):
            assert torch.equal(got, want), path
        checked += 1
    assert checked >= 7


def _set_first_value(weights, value: float) -> None:
    """Overwrite the first float32 of a safetensors file's data (the first tensor's first element)."""
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end:header_end + 4] = struct.pack("<f", value)
    weights.write_bytes(bytes(data))


@pytest.mark.parametrize("slot_dtype,lora_dtype", [("bfloat16", "auto"), ("float16", "auto"), ("bfloat16", "fp8"),
                                                    ("float32", "fp8")])
def test_read_plans_cast_files_into_the_slots_dtype(bundle, tmp_path, slot_dtype, lora_dtype):
    """fp32 files (PEFT's default) for 16-bit or fp8 slots: the first file of a layout records a plan that casts (and
    quantizes B to fp8) as it copies, later files replay it, and both give the image of the file read in the slots'
    dtype and written module by module, bit for bit. A value beyond fp16's range fails the adapter (a full read and
    a replayed plan alike) instead of becoming Inf."""
    model, _ = bundle
    root = tmp_path / "adapters"
    for i in range(3):
        write_random_adapter(root / f"p{i}", model, r=16, lora_alpha=32, seed=i, dtype=torch.float32)
    shutil.copytree(root / "p1", root / "big")
    _set_first_value(root / "big" / "adapter_model.safetensors", 1e6)
    shutil.copytree(root / "p1", root / "big_first")
    _set_first_value(root / "big_first" / "adapter_model.safetensors", -1e6)
    cfg = serving_cfg(max_loras=2, max_cpu_loras=8)
    cfg.dtype, cfg.lora.dtype = slot_dtype, lora_dtype
    engine = Engine(cfg, comm.single_process(), model, str(root))
    cache = engine.registry.cache
    images = [cache.fetch(name) for name in ("p0", "p1", "p2")]
    plan = images[0].plan
    assert plan is not None and all(image.plan is plan for image in images)
    assert plan.dst, "the plan copies no tensor of the file"
    assert len(plan.qsrc) == (len(plan.dst) if lora_dtype == "fp8" else 0)  # fp8: each A copied, each B quantized
    slots = engine.registry.slots
    for name, image in zip(("p0", "p1", "p2"), images):
        # Module by module, straight into a slot, from the file's fp32 tensors (fp8 quantizes those, not a cast).
        for layer in slots.layers:
            layer.clear(layer.slot_views(1))
        adapter = load_peft_adapter(str(root / name), name=name, dtype=torch.float32)
        for path, m in adapter.modules.items():
            layer, key = engine.runner.rt.targets[path]
            layer.write(layer.slot_views(1), key, m.a, m.b, m.scale)
        slots.load(0, image)
        for i, (got, want) in enumerate(zip(slots.views(0), slots.views(1))):
            assert torch.equal(got.float(), want.float()), f"{name}: view {i} differs"
    if slot_dtype == "float16":
        free = len(engine.registry.slots._pool.free)
        with pytest.raises(AdapterError, match=r"'big'.*1 values .* beyond the range of the slots' torch.float16"):
            cache.fetch("big")  # replays p0's plan: the screen sends it to the full read, which names it
        cache.forget()
        cache._plans.clear()
        with pytest.raises(AdapterError, match=r"'big_first'.*beyond the range"):
            cache.fetch("big_first")  # no plan yet: the full read
        assert len(engine.registry.slots._pool.free) == free  # the failed reads gave their pool entries back
    else:  # bfloat16 holds 1e6
        assert cache.fetch("big").plan is images[0].plan


def test_reads_waited_on_take_read_threads_and_reads_ahead_one(bundle, monkeypatch):
    """A read the step loop does itself runs on parallel.read_threads threads, file and torch ops alike, and so does
    a read ahead while the step loop waits for reads; other reads ahead, beside the steps, run on one. The step
    loop's own count is left as it was."""
    model, adapters = bundle
    cfg = serving_cfg(max_loras=2)
    cfg.parallel.read_threads = 3
    engine = Engine(cfg, comm.single_process(), model, adapters)
    cache = engine.registry.cache
    assert cache.read_threads == 3
    seen = {}
    read_image = cache._read_image

    def spy(info, threads):
        seen[info.name] = (threads, torch.get_num_threads())
        return read_image(info, threads)

    monkeypatch.setattr(cache, "_read_image", spy)
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    cache.fetch("r16")  # nothing read ahead: the step loop reads it, and so waits for a read
    assert seen["r16"] == (3, 3) and torch.get_num_threads() == before and cache._waited >= t0
    cache._waited = -math.inf  # as if that wait were long past
    cache.prefetch(["a9"])
    cache._staged["a9"].result()
    monkeypatch.setattr(cache_module, "BEHIND_S", 3600.0)  # "lately", however slow the machine
    cache.wait_any(["emb"], timeout=0)  # the step loop reads emb itself: it is waiting for reads
    assert seen["a9"] == (1, 1) and seen["emb"] == (3, 3) and cache._waited >= t0
    cache.prefetch(["r4"])
    cache._staged["r4"].result()
    assert seen["r4"] == (3, 3)
    assert cache.fetch("a9") is not None and cache.stats.prefetched == 1


def test_graphs_captured_before_a_dora_adapter_are_dropped(bundle, tmp_path):
    """A layer that gains work when a DoRA adapter first enters a slot (its epilogue) bumps the LoRA runtime's layout,
    and the runner drops the CUDA graphs captured without it before its next step."""
    model, adapters = bundle
    shutil.copytree(os.path.join(adapters, "r8"), tmp_path / "plain")
    shutil.copytree(os.path.join(adapters, "r8"), tmp_path / "dora")
    weights = tmp_path / "dora" / "adapter_model.safetensors"
    t = load_file(str(weights))
    for key in [k for k in t if k.endswith("lora_B.weight")]:
        t[key.replace("lora_B.weight", "lora_magnitude_vector")] = torch.ones(t[key].shape[0])
    save_file(t, str(weights))
    cfg_path = tmp_path / "dora" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(dict(cfg, use_dora=True)))
    engine = Engine(serving_cfg(), comm.single_process(), model, str(tmp_path))
    req = make_requests(1)[0]
    engine.generate([dataclasses.replace(req, adapter="plain")])
    rt, before = engine.runner.rt, engine.runner.rt.layout
    engine.runner.graphs[("captured", "before")] = None
    engine.generate([dataclasses.replace(req, adapter="dora")])
    assert rt.layout > before and not engine.runner.graphs
