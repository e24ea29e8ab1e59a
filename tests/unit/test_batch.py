import torch

from tp_lora.ops.batch import build_lora_batch


def test_groups_tokens_by_slot_stably():
    slots = torch.randint(-1, 5, (50,)).tolist()
    b = build_lora_batch(slots, 5, "cpu")
    seen = []
    for slot, start, count in zip(b.host_slot_ids, b.host_starts, b.host_counts):
        idx = b.order[start:start + count].tolist()
        assert idx == sorted(idx) and all(slots[i] == slot for i in idx)
        seen += idx
    assert sorted(seen) == [i for i, s in enumerate(slots) if s >= 0]
    assert b.slot_ids.tolist() == list(b.host_slot_ids) == sorted({s for s in slots if s >= 0})
    assert b.any_lora == any(s >= 0 for s in slots)


def test_no_adapter_fast_path_and_decode_shape():
    assert not build_lora_batch([-1, -1, -1], 4, "cpu").any_lora
    b = build_lora_batch([3], 4, "cpu")  # decode: one token per sequence, same API
    assert b.host_slot_ids == (3,) and b.host_counts == (1,) and b.host_starts == (0,)


def test_out_of_range_slot_is_named():
    import pytest
    with pytest.raises(ValueError, match=r"expected -1 or \[0, 4\)"):
        build_lora_batch([0, 4], 4, "cpu")
