"""Slot images: an adapter's host image copied into a used slot leaves exactly what emptying the slot and writing
the adapter module by module leaves (untargeted modules, rank padding and the slot's previous adapter included), with
B in the model dtype and in fp8, padded and packed; on CUDA from page-locked memory first, then again from the
pageable host tier."""
import math
import os
import shutil
import struct
import time

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine
from tp_lora.lora.adapter import AdapterError, load_peft_adapter
from tp_lora.lora.layers import LoRALinear, module_shapes
from tp_lora.lora import cache as cache_module, slots as slots_module
from tp_lora.lora.slots import SlotTable
from tp_lora.testing import device_under_test

from _serving import serving_cfg, write_random_adapter


@pytest.mark.parametrize("lora_dtype", ["auto", "fp8"])
def test_image_load_equals_module_by_module_writes(bundle, lora_dtype):
    model, adapters = bundle
    cfg = serving_cfg(max_loras=3)
    cfg.lora.dtype = lora_dtype
    cfg.device = device_under_test()
    if cfg.device == "cuda":  # the pinned, asynchronous path, in the dtype GPU users run
        cfg.dtype = "bfloat16"
    engine = Engine(cfg, comm.single_process(cfg.device), model, adapters)
    slots = engine.slots
    for v in slots.views(0):  # poison: whatever the load does not overwrite shows
        v.fill_(7.0)
    # Each load reuses slot 0: a bigger rank after a smaller one, other targets, embeddings, then a single module;
    # last r4 again, read by the plan its first read made: a packed image, its rank padding made on the device.
    for i, name in enumerate(["r4", "r16", "emb", "a9", "r4"]):
        assert name not in engine.bad_adapters
        if i == 4:
            engine.cache.forget()
        image = engine.cache.fetch(name)
        assert image.packed == (i == 4)
        assert (image.pinned is not None) == (cfg.device == "cuda")  # a fresh image loads from page-locked memory
        slots.load(0, image)
        assert image.pinned is None
        slots.load(1, image)  # a reload from the host tier: from pageable memory, the same contents
        for layer in slots.layers:
            layer.clear(layer.slot_views(2))
        adapter = load_peft_adapter(os.path.join(adapters, name), name=name, dtype=engine.cache.dtype)
        for path, m in adapter.modules.items():
            layer, key = engine.rt.targets[path]
            layer.set_slot(2, key, m.a, m.b, m.scale)
        got, want = slots.views(0), slots.views(2)
        assert len(got) == len(want) > 0
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype, f"{name}: view {i}"
            if cfg.device == "cuda" and lora_dtype == "fp8":
                # Images quantize on the host, set_slot on the device: CUDA divides by a scalar via its reciprocal,
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
    table = SlotTable(engine.rt, host_images=1)
    read = {name: load_peft_adapter(os.path.join(adapters, name), name=name, dtype=engine.cache.dtype)
            for name in ("r16", "emb", "a9")}
    first = table.image(read["r16"])
    assert table._pool.free == []
    spill = table.image(read["emb"])  # the pool is empty: new memory
    assert all(b.data_ptr() != p.data_ptr() for b, p in zip(spill.blocks.values(), table._pool.entries[0][0].values()))
    del first
    assert table._pool.free == [0]
    pooled = table.image(read["a9"])
    assert all(b.data_ptr() == p.data_ptr() for b, p in zip(pooled.blocks.values(), table._pool.entries[0][0].values()))
    fresh = SlotTable(engine.rt).image(read["a9"])
    for dtype, block in fresh.blocks.items():
        assert torch.equal(pooled.blocks[dtype], block)


def _poison_free_images(table: SlotTable) -> None:
    """Fill the pool's free entries with finite garbage: what a replay does not write shows."""
    for i in table._pool.free:
        for block in table._pool.entries[i][0].values():
            block.view(torch.uint8).fill_(0x41)


def _loaded_alike(table: SlotTable, got, want, label: str) -> None:
    """Images `got` and `want` loaded into slots 0 and 1 (poisoned first: what a load does not write shows) leave the
    same contents."""
    for slot, image in ((0, got), (1, want)):
        for v in table.views(slot):
            v.fill_(12.0)
        table.packed_by[slot] = None  # written here, not by load
        table.load(slot, image)
    for i, (g, w) in enumerate(zip(table.views(0), table.views(1))):
        assert torch.equal(g.float(), w.float()), f"{label}: view {i} differs"


@pytest.mark.parametrize("max_marks", [slots_module.MAX_MARKS, 0])
def test_read_plans_rebuild_images_exactly(bundle, tmp_path, monkeypatch, max_marks):
    """After the first file of a layout (same safetensors header, size and adapter_config.json), reads build a packed
    image by its plan, in a pool entry holding another image: loaded into a used slot, it leaves what a full read's
    image leaves (rank padding included), and holds only the file's values and the layout's scales. A NaN still
    fails the adapter with the full read's message; a config with other scales, a truncated file, or (max_marks=0) a
    layout whose first image differs from an empty slot in more places than a plan packs goes through a full read."""
    monkeypatch.setattr(slots_module, "MAX_MARKS", max_marks)
    model, _ = bundle
    root = tmp_path / "adapters"
    for i in range(3):
        write_random_adapter(root / f"p{i}", model, r=16, lora_alpha=32, seed=i)
    write_random_adapter(root / "alpha", model, r=16, lora_alpha=8, seed=5)  # same tensors' layout, other scale
    for i in range(3):  # rank 8 under lora.max_rank 16: the images' rank padding is made on the device
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
    cache = engine.cache

    def full_read(name):
        adapter = load_peft_adapter(str(root / name), name=name, dtype=cache.dtype)
        return engine.slots.image(adapter)

    first = cache.fetch("p0")
    assert (first.plan is not None) == (max_marks > 0) and len(cache._plans) == (max_marks > 0)
    slots = engine.slots
    if first.plan is not None:
        # Full rank: the file's values and a scale per module; nothing else of the padded image is packed.
        plan = first.plan
        weights = sum(math.prod(sp[3]) for sp in plan.dst)
        assert set(plan.head) == {torch.float32} and plan.head[torch.float32].numel() <= len(plan.dst) // 2
        assert sum(plan.sizes.values()) == weights + plan.head[torch.float32].numel()
        assert len(plan.screen) == 1  # the file's tensors lie back to back: one norm screens them
    for name in ["p1", "p2", "alpha"]:
        _poison_free_images(slots)
        image = cache.fetch(name)
        replayed = image.plan is not None and image.plan is first.plan
        assert replayed == (name != "alpha" and max_marks > 0) and image.packed == replayed, name
        _loaded_alike(slots, image, full_read(name), name)
    assert len(cache._plans) == (2 if max_marks else 0)
    small = cache.fetch("q0")
    assert (small.plan is not None) == (max_marks > 0)
    _poison_free_images(slots)
    got = cache.fetch("q1")
    assert got.plan is small.plan and got.packed == (max_marks > 0)
    if got.packed:  # rank 8 of 16: the packed image is half the padded one's weights
        padded = sum(b.numel() for b in full_read("q1").blocks.values())
        assert sum(b.numel() for b in got.blocks.values()) < 0.6 * padded
    _loaded_alike(slots, got, full_read("q1"), "q1")
    # Into slot 0, which holds q1 packed by the same plan: not emptied first, and nothing of q1 is left.
    assert slots.packed_by[0] is (got.plan if got.packed else None)
    slots.load(0, cache.fetch("q2"))
    for v in slots.views(1):
        v.fill_(12.0)
    slots.packed_by[1] = None
    slots.load(1, full_read("q2"))
    for i, (g, w) in enumerate(zip(slots.views(0), slots.views(1))):
        assert torch.equal(g.float(), w.float()), f"q2 after q1: view {i} differs"
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
    shapes = module_shapes(engine.rt)
    checked = 0
    for path, (layer, key) in engine.rt.targets.items():
        if not isinstance(layer, LoRALinear):
            continue
        fin, fout = shapes[path]
        a16, b16 = torch.randn(16, fin, generator=gen), torch.randn(fout, 16, generator=gen)
        a4, b4 = torch.randn(4, fin, generator=gen), torch.randn(fout, 4, generator=gen)
        for slot in (0, 1):
            layer.clear(layer.slot_views(slot))
        layer.set_slot(0, key, a16, b16, 2.0)
        layer.set_slot(0, key, a4, b4, 0.5)
        layer.set_slot(1, key, a4, b4, 0.5)
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
    cache = engine.cache
    images = [cache.fetch(name) for name in ("p0", "p1", "p2")]
    plan = images[0].plan
    assert plan is not None and all(image.plan is plan for image in images)
    assert len(plan.qsrc) == (len(plan.dst) if lora_dtype == "fp8" else 0) > 0 or lora_dtype == "auto"
    slots = engine.slots
    for name, image in zip(("p0", "p1", "p2"), images):
        # Module by module, straight into a slot, from the file's fp32 tensors (fp8 quantizes those, not a cast).
        for layer in slots.layers:
            layer.clear(layer.slot_views(1))
        adapter = load_peft_adapter(str(root / name), name=name, dtype=torch.float32)
        for path, m in adapter.modules.items():
            layer, key = engine.rt.targets[path]
            layer.set_slot(1, key, m.a, m.b, m.scale)
        slots.load(0, image)
        for i, (got, want) in enumerate(zip(slots.views(0), slots.views(1))):
            assert torch.equal(got.float(), want.float()), f"{name}: view {i} differs"
    if slot_dtype == "float16":
        free = len(engine.slots._pool.free)
        with pytest.raises(AdapterError, match=r"'big'.*1 values .* beyond the range of the slots' torch.float16"):
            cache.fetch("big")  # replays p0's plan: the screen sends it to the full read, which names it
        cache.forget()
        cache._plans.clear()
        with pytest.raises(AdapterError, match=r"'big_first'.*beyond the range"):
            cache.fetch("big_first")  # no plan yet: the full read
        assert len(engine.slots._pool.free) == free  # the failed reads gave their pool entries back
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
    cache = engine.cache
    assert cache.read_threads == 3
    seen = {}
    read_image = cache._read_image

    def spy(info, threads):
        seen[info.name] = (threads, torch.get_num_threads())
        return read_image(info, threads)

    monkeypatch.setattr(cache, "_read_image", spy)
    before = torch.get_num_threads()
    cache.fetch("r16")  # nothing read ahead: the step loop reads it
    assert seen["r16"] == (3, 3) and torch.get_num_threads() == before
    cache._waited = -math.inf  # as if that wait were long past
    cache.prefetch(["a9"])
    cache._staged["a9"].result()
    monkeypatch.setattr(cache_module, "BEHIND_S", 3600.0)  # "lately", however slow the machine
    t0 = time.perf_counter()
    cache.wait_any(["emb"], timeout=0)  # the step loop reads emb itself: it is waiting for reads
    assert seen["a9"] == (1, 1) and seen["emb"] == (3, 3) and cache._waited >= t0
    cache.prefetch(["r4"])
    cache._staged["r4"].result()
    assert seen["r4"] == (3, 3)
    assert cache.fetch("a9") is not None and cache.stats.prefetched == 1
