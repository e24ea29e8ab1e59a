"""Safetensors files read in one piece: the header checked against the file, the tensors as views of one buffer.

safetensors' safe_open hands out one tensor per call, a few Python-level steps each, and an adapter of a 16-layer
model holds a couple of hundred tensors. Adapter reads run beside the step loop and share its GIL,
so a read should be few Python steps: here one read into an untouched buffer (the GIL is
released while the bytes arrive; a big file in pieces on several threads) and one view per tensor. Errors are
SafetensorsError naming the file and what is wrong with it.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from tp_lora.threadlocal import setting

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
FLOAT_DTYPES = tuple(k for k, v in DTYPES.items() if v.is_floating_point)


class SafetensorsError(ValueError):
    def __init__(self, path: str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.detail = detail


def read_header(path: str) -> dict[str, dict]:
    """tensor name -> {dtype, shape, data_offsets}, each entry checked against the file's size (a truncated file
    fails here, without reading its data)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = _header_len(head, size, path)
        return _parse(f.read(n), size - 8 - n, path)


_local = threading.local()


def reusing_buffer():
    """read_tensors on this thread, inside the block, reads into one buffer kept for the thread instead of fresh
    memory, for callers done with each read's tensors before the next read (the adapter cache, which copies them
    into a slot image): faulting in a fresh buffer's pages is a good part of a read's cost."""
    return setting(_local, "reuse", True)


@dataclass
class RawFile:
    """A whole safetensors file in memory: `data` its bytes, `header` its JSON header's bytes (unparsed)."""
    path: str
    data: torch.Tensor  # uint8 [file size]
    header: bytes


def given(raw: Optional[RawFile]):
    """read_tensors(raw.path) on this thread, inside the block, takes the bytes already read instead of reading the
    file again."""
    return setting(_local, "given", raw)


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file, in header order, as views of one host buffer holding the whole file."""
    raw = getattr(_local, "given", None)
    return tensors(raw if raw is not None and raw.path == path else read_file(path))


# A file read in pieces at once: one thread's copy out of the page cache bounds a read (BENCHMARKS.md); pieces below
# MIN_PIECE are not worth a thread.
MAX_PIECES, MIN_PIECE = 8, 4 << 20
_pieces: Optional[ThreadPoolExecutor] = None
_pieces_lock = threading.Lock()


def _read_into(f, buf: memoryview, size: int, threads: int) -> int:
    """readinto(buf) of a file of `size` bytes, in up to `threads` pieces read at once (os.preadv releases the GIL):
    the bytes read, fewer than size when the file was cut short."""
    n = min(threads, MAX_PIECES, size // MIN_PIECE)
    if n <= 1:
        return f.readinto(buf)
    global _pieces
    with _pieces_lock:
        if _pieces is None:
            _pieces = ThreadPoolExecutor(MAX_PIECES, thread_name_prefix="tp_lora-file-piece")
    step = -(-size // n)
    reads = [_pieces.submit(os.preadv, f.fileno(), [buf[at:at + step]], at) for at in range(0, size, step)]
    return sum(r.result() for r in reads)


def read_file(path: str, threads: int = 1) -> RawFile:
    """The file's bytes in one read (in pieces on up to `threads` threads); only the header's length is checked
    (tensors() checks the rest)."""
    size = os.path.getsize(path)
    # Not a bytearray: that one is zeroed with the GIL held, and touching fresh pages costs more than the read.
    if getattr(_local, "reuse", False):
        if getattr(_local, "buf", None) is None or _local.buf.numel() < size:
            _local.buf = torch.empty(size, dtype=torch.uint8)
        data = _local.buf[:size]
    else:
        data = torch.empty(size, dtype=torch.uint8)
    buf = memoryview((ctypes.c_char * size).from_address(data.data_ptr())).cast("B")
    with open(path, "rb") as f:
        got = _read_into(f, buf, size, threads)
    if got != size:
        raise SafetensorsError(path, f"read {got} of its {size} bytes (changed while being read?)")
    n = _header_len(bytes(buf[:8]), size, path)
    return RawFile(path, data, bytes(buf[8:8 + n]))


def tensors(raw: RawFile) -> dict[str, torch.Tensor]:
    """The file's tensors as views of raw.data, after checking the header against the file."""
    data, size, n = raw.data, raw.data.numel(), len(raw.header)
    header = _parse(raw.header, size - 8 - n, raw.path)
    typed: dict[torch.dtype, torch.Tensor] = {}  # the whole buffer as each dtype: one view op per tensor
    out = {}
    for key, meta in header.items():
        dtype, shape = DTYPES[meta["dtype"]], meta["shape"]
        start, stop = (8 + n + o for o in meta["data_offsets"])
        width = dtype.itemsize
        if start % width:  # the format does not promise aligned tensors; typed views need them
            out[key] = data[start:stop].clone().view(dtype).view(shape)
            continue
        if dtype not in typed:
            typed[dtype] = data[:size - size % width].view(dtype)
        out[key] = typed[dtype].as_strided(shape, _contiguous_strides(shape), start // width)
    return out


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]


def _header_len(head: bytes, size: int, path: str) -> int:
    if len(head) < 8:
        raise SafetensorsError(path, f"holds {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise SafetensorsError(path, f"header length {n} does not fit the file's {size} bytes (truncated or not "
                               f"a safetensors file)")
    return n


def _parse(raw: bytes, data_bytes: int, path: str) -> dict[str, dict]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(path, f"the safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(path, f"the safetensors header is a JSON {type(header).__name__}, expected an "
                               f"object")
    header.pop("__metadata__", None)
    for key, meta in header.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("shape"), list) or \
                not isinstance(meta.get("data_offsets"), list) or len(meta["data_offsets"]) != 2:
            raise SafetensorsError(path, f"header entry {key!r} = {meta!r}, expected {{dtype, shape, "
                                   f"data_offsets}}")
        if meta.get("dtype") not in DTYPES:
            raise SafetensorsError(path, f"tensor {key!r} has dtype {meta.get('dtype')!r}, expected one of "
                                   f"{sorted(DTYPES)}")
        shape, (start, stop) = meta["shape"], meta["data_offsets"]
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SafetensorsError(path, f"tensor {key!r} has shape {shape}")
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise SafetensorsError(path, f"tensor {key!r} has data_offsets {meta['data_offsets']}")
        if stop > data_bytes:
            raise SafetensorsError(path, f"tensor {key!r} ends at byte {stop} of the data, but the file holds "
                                   f"only {data_bytes} data bytes (truncated?)")
        want = DTYPES[meta["dtype"]].itemsize * math.prod(shape)
        if stop - start != want:
            raise SafetensorsError(path, f"tensor {key!r} ({meta['dtype']} {shape}) needs {want} bytes, its "
                                   f"data_offsets give {stop - start}")
    return header

