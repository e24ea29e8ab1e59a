"""tp_lora.lora.stfile against the safetensors library: same tensors for every dtype (unaligned offsets included),
with and without buffer reuse, and a named error for a file whose header lies about a tensor's size."""
import contextlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora.lora import stfile


def _random(shape, dtype, gen):
    x = torch.randn(shape, generator=gen) * 4
    return x.to(torch.int64).to(dtype) if not dtype.is_floating_point else x.to(dtype)


def test_read_tensors_matches_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tensors = {"u8": _random((3,), torch.uint8, gen),  # 3 bytes: the tensors after it start unaligned
               "f64": _random((2, 5), torch.float64, gen), "bf16": _random((7, 3), torch.bfloat16, gen),
               "f16": _random((4,), torch.float16, gen), "fp8": _random((5, 2), torch.float8_e4m3fn, gen),
               "f32": _random((3, 3), torch.float32, gen), "i32": _random((6,), torch.int32, gen),
               "empty": torch.zeros(0, 4)}
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    want = load_file(path)
    for reuse in (False, True, True):
        with stfile.reusing_buffer() if reuse else contextlib.nullcontext():
            got = stfile.read_tensors(path)
            assert set(got) == set(want)
            for k, w in want.items():
                assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
                assert torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)), k


def test_wrong_tensor_size_is_named(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(4, 4)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["a"]["shape"] = [4, 8]  # twice the bytes its offsets give
    body = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(body) == n
    path.write_bytes(raw[:8] + body + raw[8 + n:])
    with pytest.raises(stfile.SafetensorsError, match=r"tensor 'a' \(F32 \[4, 8\]\) needs 128 bytes"):
        stfile.read_tensors(str(path))


def test_a_file_read_in_pieces_is_the_file(tmp_path, monkeypatch):
    """A read in pieces on several threads gives the file's bytes; a file shorter than its size was when the read
    began (cut while being read) is named, however the pieces fall."""
    monkeypatch.setattr(stfile, "MIN_PIECE", 1000)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tensors = {f"t{i}": torch.randn(37, 11 + i, generator=gen) for i in range(9)}
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    size = len(open(path, "rb").read())
    assert size // stfile.MIN_PIECE >= 4
    for threads in (1, 3, 4):
        raw = stfile.read_file(path, threads)
        assert bytes(raw.data.numpy()) == open(path, "rb").read()
    real = stfile.os.path.getsize
    monkeypatch.setattr(stfile.os.path, "getsize", lambda p: real(p) + 3 * stfile.MIN_PIECE)
    with pytest.raises(stfile.SafetensorsError, match=rf"read {size} of its {size + 3000} bytes"):
        stfile.read_file(path, 4)
