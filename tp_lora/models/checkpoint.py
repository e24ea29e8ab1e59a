"""Lazy reads of a HF checkpoint: config.json and safetensors weights, single-file or sharded.

A rank asks for a tensor by its HF name and gets a lazy safetensors slice, so indexing it (`sl[a:b]`,
`sl[:, a:b]`) reads only the rows / columns that rank keeps. Shard files are opened once (memory-mapped headers
parsed up front, so a corrupt file fails at open, naming the file, not halfway through loading a layer).
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
UNSUPPORTED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


class CheckpointError(ValueError):
    """A checkpoint that exists but cannot be read as expected (corrupt file, bad index, missing tensor)."""


def load_hf_config(path: str) -> dict:
    """config.json of a HF model dir (or the path of a config.json itself) as a dict.

    transformers >= 5 saves RoPE settings as `rope_parameters` ({rope_theta, rope_type, factor, ...}) instead of
    top-level `rope_theta` / `rope_scaling`; both spellings are accepted and the older keys filled in, so model code
    reads one form.
    """
    path = os.fspath(path)
    cfg_path = path if os.path.basename(path) == "config.json" or os.path.isfile(path) else os.path.join(
        path, "config.json")
    if not os.path.exists(cfg_path):
        where = "" if os.path.isdir(os.path.dirname(cfg_path) or ".") else " (the directory does not exist)"
        raise FileNotFoundError(f"model config {cfg_path} not found{where}: expected a HF model directory "
                                f"holding config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"model config {cfg_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"model config {cfg_path} holds a JSON {type(cfg).__name__}, expected an object")
    _normalize_rope(cfg)
    return cfg


def _normalize_rope(cfg: dict) -> None:
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict):
        return
    if "rope_theta" not in cfg and "rope_theta" in rp:
        cfg["rope_theta"] = rp["rope_theta"]
    if cfg.get("rope_scaling") is None and rp.get("rope_type", rp.get("type", "default")) != "default":
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}


def _open_safetensors(path: str, owner: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{owner}: safetensors file {path} does not exist")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError does not subclass a stdlib error; name the file for the user
        size = os.path.getsize(path)
        raise CheckpointError(f"{path} is not a readable safetensors file ({size} bytes; corrupt or truncated "
                              f"header?): {e}") from e


class CheckpointReader:
    """Tensors of one HF model dir holding `model.safetensors` or `model.safetensors.index.json` + its shards.

    `path` may also be a single .safetensors file. Names are the HF tensor names ("model.layers.0.mlp.up_proj.weight").
    """

    def __init__(self, path: str):
        path = self.path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".safetensors"):
            files = {path: None}
            self.source = path
            self._where: dict[str, str] = {}
        else:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"model directory {path} does not exist")
            single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
            if os.path.isfile(index):
                self.source = index
                self._where = self._read_index(index)
                files = {f: None for f in sorted(set(self._where.values()))}
            elif os.path.isfile(single):
                self.source = single
                self._where = {}
                files = {single: None}
            else:
                present = [f for f in UNSUPPORTED_WEIGHTS if os.path.exists(os.path.join(path, f))]
                extra = (f"; found {', '.join(present)}, but only safetensors checkpoints are supported "
                         f"(convert with transformers: model.save_pretrained(dir, safe_serialization=True))"
                         if present else "")
                raise FileNotFoundError(f"model directory {path} holds neither {SINGLE_FILE} nor {INDEX_FILE}{extra}")
        self._handles: dict[str, Any] = {f: _open_safetensors(f, self.source) for f in files}
        if not self._where:  # single file: its header is the index
            (f, h), = self._handles.items()
            self._where = {k: f for k in h.keys()}
        else:
            for f, h in self._handles.items():
                present = set(h.keys())
                listed = [k for k, v in self._where.items() if v == f and k not in present]
                if listed:
                    raise CheckpointError(f"{self.source} maps tensor {listed[0]!r} to {os.path.basename(f)}, but "
                                          f"{f} does not contain it ({len(listed)} such tensors)")

    @staticmethod
    def _read_index(index: str) -> dict[str, str]:
        """tensor name -> absolute shard path, every shard checked to exist."""
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint index {index} is not valid JSON: {e}") from e
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"checkpoint index {index} has no 'weight_map' object (tensor name -> shard file)")
        root = os.path.dirname(index)
        where = {}
        for name, shard in wm.items():
            if not isinstance(shard, str):
                raise CheckpointError(f"checkpoint index {index}: weight_map[{name!r}] = {shard!r}, expected a "
                                      f"shard file name")
            full = os.path.join(root, shard)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"checkpoint index {index} maps tensor {name!r} to shard {shard}, but "
                                        f"{full} does not exist")
            where[name] = full
        return where

    # ---- lookups -------------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return sorted(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        """The file holding tensor `name`."""
        try:
            return self._where[name]
        except KeyError:
            near = [k for k in self._where if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            hint = f"; tensors with the same ending: {near}" if near else ""
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.source} "
                                  f"({len(self._where)} tensors){hint}") from None

    def get_slice(self, name: str) -> Any:
        """Lazy slice of tensor `name`: `sl[a:b]`, `sl[:, a:b]` read only those bytes; `sl.get_shape()`."""
        f = self.file_of(name)
        try:
            return self._handles[f].get_slice(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from e

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        f = self.file_of(name)
        try:
            return self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {f}: {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({self.source!r}, {len(self._where)} tensors in {len(self._handles)} files)"
