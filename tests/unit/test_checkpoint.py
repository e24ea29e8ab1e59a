"""CheckpointReader and load_hf_config: single-file and sharded checkpoints, lazy partial reads, clear errors."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_lora.assets import write_tiny_llama
from tp_lora.models import checkpoint
from tp_lora.models.checkpoint import CheckpointError, CheckpointReader, load_hf_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    single = write_tiny_llama(str(root / "single"), seed=3)
    sharded = write_tiny_llama(str(root / "sharded"), seed=3, shards=3)
    return single, sharded


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return str(dst)


# ---- load_hf_config -----------------------------------------------------------------------------------------------
def test_config_reads_dir_and_file(dirs):
    cfg = load_hf_config(dirs[0])
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 64
    assert load_hf_config(os.path.join(dirs[0], "config.json")) == cfg


def test_config_missing_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        load_hf_config(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path))


def test_config_corrupt_json_names_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected an object"):
        load_hf_config(str(tmp_path))


def test_config_transformers5_rope_parameters(tmp_path):
    # transformers >= 5 saves rope settings only under rope_parameters
    rp = {"rope_theta": 5000.0, "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_parameters": rp}))
    cfg = load_hf_config(str(tmp_path))
    assert cfg["rope_theta"] == 5000.0
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 4.0
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 7.0, "rope_type": "default"}}))
    cfg = load_hf_config(str(tmp_path))
    assert cfg["rope_theta"] == 7.0 and cfg.get("rope_scaling") is None


# ---- reading --------------------------------------------------------------------------------------------------
def test_single_file_matches_safetensors(dirs):
    ref = load_file(os.path.join(dirs[0], "model.safetensors"))
    r = CheckpointReader(dirs[0])
    assert r.keys() == sorted(ref)
    for k, v in ref.items():
        assert r.has(k) and k in r
        assert r.shape(k) == tuple(v.shape)
        assert torch.equal(r.get(k), v)
    assert not r.has("model.layers.9.mlp.up_proj.weight")


def test_sharded_equals_unsharded(dirs):
    single, sharded = CheckpointReader(dirs[0]), CheckpointReader(dirs[1])
    index = json.load(open(os.path.join(dirs[1], "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) == 3
    assert not os.path.exists(os.path.join(dirs[1], "model.safetensors"))
    assert sharded.keys() == single.keys()
    assert len({sharded.file_of(k) for k in sharded.keys()}) == 3
    for k in single.keys():
        assert torch.equal(sharded.get(k), single.get(k)), k


def test_get_slice_reads_rows_and_cols(dirs):
    r = CheckpointReader(dirs[1])
    name = "model.layers.1.mlp.down_proj.weight"  # [64, 128]
    full = r.get(name)
    sl = r.get_slice(name)
    assert not isinstance(sl, torch.Tensor)
    assert tuple(sl.get_shape()) == (64, 128)
    assert torch.equal(sl[8:16], full[8:16])
    assert torch.equal(sl[:, 32:96], full[:, 32:96])
    assert torch.equal(sl[8:16, 32:96], full[8:16, 32:96])


def test_get_slice_never_materialises_whole_tensor(dirs):
    """A rank's partial read goes through the lazy slice: the whole-tensor read path is never touched."""
    r = CheckpointReader(dirs[0])

    class NoWholeReads:
        def __init__(self, h):
            self.h = h

        def get_slice(self, name):
            return self.h.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"whole tensor {name} read")

    r._handles = {f: NoWholeReads(h) for f, h in r._handles.items()}
    part = r.get_slice("model.embed_tokens.weight")[64:128]
    assert part.shape == (64, 64)
    with pytest.raises(CheckpointError, match="whole tensor"):
        r.get("model.embed_tokens.weight")


def test_shard_files_opened_once(dirs, monkeypatch):
    calls = []
    real = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda p, **kw: calls.append(p) or real(p, **kw))
    r = CheckpointReader(dirs[1])
    for k in r.keys():
        r.get_slice(k)[:1]
        r.get(k)
    assert len(calls) == 3 and len(set(calls)) == 3


def test_accepts_a_safetensors_file_and_pathlike(dirs):
    import pathlib
    r = CheckpointReader(os.path.join(dirs[0], "model.safetensors"))
    assert r.has("lm_head.weight")
    assert CheckpointReader(pathlib.Path(dirs[0])).keys() == r.keys()


# ---- errors --------------------------------------------------------------------------------------------------
def test_missing_dir_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointReader(str(tmp_path / "absent"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CheckpointReader(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*only safetensors"):
        CheckpointReader(str(tmp_path))


def test_missing_tensor_names_tensor_and_file(dirs):
    r = CheckpointReader(dirs[1])
    for fn in (r.get, r.get_slice, r.shape):
        with pytest.raises(CheckpointError, match=r"'model\.layers\.7\.mlp\.up_proj\.weight'.*index\.json") as e:
            fn("model.layers.7.mlp.up_proj.weight")
        assert "same ending" in str(e.value)


def test_corrupt_header(dirs, tmp_path):
    d = _copy(dirs[0], tmp_path)
    f = os.path.join(d, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"#garbage#")
    with pytest.raises(CheckpointError, match="model.safetensors.*not a readable safetensors file"):
        CheckpointReader(d)


def test_truncated_file(dirs, tmp_path):
    d = _copy(dirs[0], tmp_path)
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(d)


def test_index_pointing_to_missing_shard(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    os.remove(os.path.join(d, "model-00002-of-00003.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"index\.json maps tensor '.*' to shard model-00002-of-00003"):
        CheckpointReader(d)


def test_index_corrupt_or_inconsistent(dirs, tmp_path):
    d = _copy(dirs[1], tmp_path)
    idx = os.path.join(d, "model.safetensors.index.json")
    good = json.load(open(idx))
    open(idx, "w").write("{")
    with pytest.raises(CheckpointError, match="index.*not valid JSON"):
        CheckpointReader(d)
    json.dump({"metadata": {}}, open(idx, "w"))
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(d)
    bad = dict(good)
    bad["weight_map"] = dict(good["weight_map"], **{"lm_head.weight": "model-00001-of-00003.safetensors"})
    json.dump(bad, open(idx, "w"))
    with pytest.raises(CheckpointError, match="'lm_head.weight' to model-00001-of-00003.*does not contain it"):
        CheckpointReader(d)


def test_plain_safetensors_file_without_metadata(tmp_path):
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    r = CheckpointReader(str(tmp_path))
    assert r.keys() == ["w"] and r.get_slice("w")[1:3].shape == (2, 4)
