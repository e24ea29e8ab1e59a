"""Bad inputs fail alone: every malformed adapter (config, safetensors header or data, shapes, dtypes, NaN / Inf,
a file rewritten or removed after start) ends in an error for the requests that name it, and every malformed
request line in an error line, while the other requests get exactly their tokens. Also at two ranks when only one
rank reads a corrupt file (they must agree, not hang), and a random byte-flip fuzz."""
import json
import os
import random
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from tp_lora import distributed as comm
from tp_lora.engine.engine import Engine
from tp_lora.engine.requests import Request
from tp_lora.request_files import parse_request
from tp_lora.testing import run_ranks

from _serving import serving_cfg, write_random_adapter

GOOD = ("good1", "good2")
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _edit_config(path, **changes):
    cfg = json.loads(open(os.path.join(path, CONFIG)).read())
    cfg.update(changes)
    open(os.path.join(path, CONFIG), "w").write(json.dumps(cfg))


def _edit_tensors(path, fn):
    from safetensors.torch import load_file
    t = load_file(os.path.join(path, WEIGHTS))
    save_file(fn(dict(t)), os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def _first(t, kind="lora_A"):
    return next(k for k in sorted(t) if kind in k)


def _truncate(path, frac=None, keep=None):
    f = os.path.join(path, WEIGHTS)
    data = open(f, "rb").read()
    open(f, "wb").write(data[:keep if keep is not None else int(len(data) * frac)])


def _patch_bytes(path, offset, data):
    f = os.path.join(path, WEIGHTS)
    raw = bytearray(open(f, "rb").read())
    raw[offset:offset + len(data)] = data
    open(f, "wb").write(bytes(raw))


def _header_len(path):
    return struct.unpack("<Q", open(os.path.join(path, WEIGHTS), "rb").read(8))[0]


# name -> (corruption applied before start, expected words in the error)
AT_START = {
    "cfg_truncated": (lambda p: open(os.path.join(p, CONFIG), "w").write('{"r": 4, "lora_al'), "not valid JSON"),
    "cfg_list": (lambda p: open(os.path.join(p, CONFIG), "w").write("[1, 2]"), "expected an object"),
    "cfg_r_string": (lambda p: _edit_config(p, r="four"), "r='four'"),
    "cfg_r_negative": (lambda p: _edit_config(p, r=-3), "r=-3"),
    "cfg_ia3": (lambda p: _edit_config(p, peft_type="IA3"), "peft_type"),
    "cfg_dora": (lambda p: _edit_config(p, use_dora=True), "DoRA"),
    "cfg_targets_int": (lambda p: _edit_config(p, target_modules=5), "target_modules"),
    "cfg_r_mismatch": (lambda p: _edit_config(p, r=7), "r=7"),
    "st_half": (lambda p: _truncate(p, 0.5), "truncated"),
    "st_4_bytes": (lambda p: _truncate(p, keep=4), "too short"),
    "st_header_len": (lambda p: _patch_bytes(p, 0, struct.pack("<Q", 1 << 40)), "header length"),
    "st_header_json": (lambda p: _patch_bytes(p, 8, b"\x00\xff{{"), "not valid JSON"),
    "st_garbage": (lambda p: open(os.path.join(p, WEIGHTS), "wb").write(os.urandom(300)), "adapter_model"),
    "st_empty": (lambda p: open(os.path.join(p, WEIGHTS), "wb").write(b""), "too short"),
    "st_int_dtype": (lambda p: _edit_tensors(p, lambda t: {k: (v * 100).to(torch.int32) for k, v in t.items()}),
                     "dtype I32"),
    "st_wrong_in": (lambda p: _edit_tensors(p, lambda t: {**t, _first(t): torch.zeros(4, 65)}), "do not fit"),
    "st_3d": (lambda p: _edit_tensors(p, lambda t: {**t, _first(t): torch.zeros(4, 64, 1)}), "2 dims"),
    "st_missing_b": (lambda p: _edit_tensors(p, lambda t: {k: v for k, v in t.items() if k != _first(t, "lora_B")}),
                     "no lora_B"),
    "st_rank_mismatch": (lambda p: _edit_tensors(p, lambda t: {**t, _first(t, "lora_B"): torch.zeros(
        t[_first(t, "lora_B")].shape[0], 3)}), "rank"),
    "st_foreign_key": (lambda p: _edit_tensors(p, lambda t: {**t, "base_model.model.x.lora_magnitude_vector":
                                                             torch.zeros(3)}), "needs use_dora=true"),
    "st_no_weights_file": (lambda p: os.remove(os.path.join(p, WEIGHTS)), "not found"),
    "st_too_big_rank": (None, "lora.max_rank=16"),  # written with r=32 below
    "st_extra_layer": (lambda p: _edit_tensors(p, lambda t: {
        **t, "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.7.mlp.up_proj.lora_B.weight": torch.zeros(128, 4)}), "lacks"),
}
# Corruptions a header cannot show: found at the first read, on every rank.
AT_LOAD = {
    "nan_a": (lambda p: _edit_tensors(p, lambda t: {**t, _first(t): torch.full_like(t[_first(t)], float("nan"))}),
              "NaN/Inf"),
    "inf_b": (lambda p: _edit_tensors(p, lambda t: {**t, _first(t, "lora_B"): t[_first(t, "lora_B")].index_fill(
        0, torch.tensor([0]), float("inf"))}), "NaN/Inf"),
    "ff_data": (lambda p: _patch_bytes(p, 8 + _header_len(p) + 16, b"\xff" * 64), "NaN/Inf"),
}
# Changed after start (registration saw a good file).
AFTER_START = {
    "rewritten_rank": (lambda p, model: write_random_adapter(p, model, r=8, seed=99), "changed since"),
    "removed": (lambda p, model: shutil.rmtree(p), "does not exist"),
    "now_nan": (lambda p, model: AT_LOAD["nan_a"][0](p), "NaN/Inf"),
}


@pytest.fixture(scope="module")
def zoo(bundle, tmp_path_factory):
    model, _ = bundle
    root = tmp_path_factory.mktemp("zoo")
    clean, dirty = root / "clean", root / "dirty"
    for i, name in enumerate(GOOD):
        write_random_adapter(clean / name, model, r=4, lora_alpha=8, seed=i)
    shutil.copytree(clean, dirty)
    for i, (name, (corrupt, _)) in enumerate({**AT_START, **AT_LOAD, **AFTER_START}.items()):
        path = str(dirty / name)
        write_random_adapter(path, model, r=32 if name == "st_too_big_rank" else 4, lora_alpha=8, seed=10 + i)
        if corrupt is not None and name not in AFTER_START:
            corrupt(path)
    return model, str(clean), str(dirty)


def _requests(names):
    gen = torch.Generator().manual_seed(5)
    return [Request(i, id=f"r{i}", adapter=a, prompt_token_ids=torch.randint(3, 256, (3 + i % 5,), generator=gen)
                    .tolist(), max_new_tokens=3 + i % 3, ignore_eos=True) for i, a in enumerate(names)]


def test_every_bad_adapter_fails_only_its_requests(zoo):
    model, clean, dirty = zoo
    names = [GOOD[0], None, *AT_START, GOOD[1], *AT_LOAD, *AFTER_START, GOOD[0], "no_such_adapter", GOOD[1]]
    reqs = _requests(names)
    ref = Engine(serving_cfg(), comm.single_process(), model, clean).generate(
        [r for r in reqs if r.adapter in GOOD + (None,)])
    ref = {r.request.index: r.output_token_ids for r in ref}
    engine = Engine(serving_cfg(max_loras=2, max_cpu_loras=2), comm.single_process(), model, dirty)
    assert set(engine.bad_adapters) == set(AT_START), sorted(set(engine.bad_adapters) ^ set(AT_START))
    for name, (change, _) in AFTER_START.items():
        change(os.path.join(dirty, name), model)
    results = engine.generate(reqs)
    expected = {**{k: v[1] for k, v in {**AT_START, **AT_LOAD, **AFTER_START}.items()},
                "no_such_adapter": "unknown adapter"}
    for res in results:
        a = res.request.adapter
        if a in expected:
            assert res.error and f"adapter {a!r}" in res.error and expected[a] in res.error, (a, res.error)
        else:
            assert res.error is None and res.output_token_ids == ref[res.request.index], (a, res.error)
    assert set(AT_LOAD) | set(AFTER_START) <= set(engine.bad_adapters)
    # A later run fails them at once, without touching the files again.
    again = engine.generate(_requests(list(AT_LOAD)))
    assert all("failed to load" in r.error for r in again)


BAD_LINES = {
    '{"id": "t", "adapter": null, "prompt_token_ids": [1, 2': "malformed JSON",
    'null': "expected a JSON object",
    '"text"': "expected a JSON object",
    '{"id": "s", "prompt_token_ids": ["a", 2]}': "list of integers",
    '{"id": "f", "prompt_token_ids": [1.5]}': "list of integers",
    '{"id": "b", "prompt_token_ids": [true]}': "list of integers",
    '{"id": "n", "prompt_token_ids": [-1]}': "outside the vocabulary",
    '{"id": "v", "prompt_token_ids": [256]}': "outside the vocabulary",
    '{"id": "e", "prompt_token_ids": []}': "empty prompt",
    '{"id": "m"}': "expected 'prompt_token_ids'",
    '{"id": "z", "prompt_token_ids": [1], "max_new_tokens": 0}': "positive integer",
    '{"id": "s2", "prompt_token_ids": [1], "max_new_tokens": "5"}': "positive integer",
    '{"id": "l", "prompt_token_ids": [1], "max_new_tokens": 100000}': "exceeds the context",
    '{"id": "t2", "prompt_token_ids": [1], "temperature": -1}': "temperature",
    '{"id": "a", "adapter": 5, "prompt_token_ids": [1]}': "'adapter' must be a name",
    '{"id": "u", "adapter": "ghost", "prompt_token_ids": [1]}': "unknown adapter 'ghost'",
}


def test_bad_request_lines_fail_alone(zoo):
    model, clean, _ = zoo
    good = ['{"id": "ok1", "adapter": "good1", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4, "ignore_eos": true}',
            '{"id": "ok2", "adapter": null, "prompt_token_ids": [9], "max_new_tokens": 3, "ignore_eos": true}']
    lines = [good[0], *BAD_LINES, good[1]]
    reqs = [parse_request(i, ln, 8) for i, ln in enumerate(lines)]
    engine = Engine(serving_cfg(), comm.single_process(), model, clean)
    results = engine.generate(reqs)
    ref = engine.generate([parse_request(0, good[0], 8), parse_request(1, good[1], 8)])
    assert [r.output_token_ids for r in (results[0], results[-1])] == [r.output_token_ids for r in ref]
    for res, (line, words) in zip(results[1:-1], BAD_LINES.items()):
        assert res.error and words in res.error, (line, res.error)
        assert "id" in res.to_json()


def _split_view(ps, model, dirty, corrupt_copy):
    """Rank 1 alone reads a corrupt copy of good2: both ranks must fail good2, identically, and run the rest."""
    engine = Engine(serving_cfg(tp=2, max_loras=2, max_cpu_loras=1), ps, model, dirty)
    if ps.tp.rank == 1:
        engine.registry.cache.infos[GOOD[1]].path = corrupt_copy
    reqs = _requests([GOOD[0], GOOD[1], None, "nan_a", GOOD[1], GOOD[0]])
    out = [(r.request.index, r.output_token_ids, r.error) for r in engine.generate(reqs)]
    views = comm.all_gather_object(out, ps.tp)
    assert views[0] == views[1], "the ranks disagree"
    return out


def test_ranks_agree_when_only_one_reads_a_corrupt_file(zoo, tmp_path):
    model, clean, dirty = zoo
    corrupt = tmp_path / "good2"
    shutil.copytree(os.path.join(dirty, GOOD[1]), corrupt)
    AT_LOAD["nan_a"][0](str(corrupt))
    out = run_ranks(_split_view, 2, model, dirty, str(corrupt), timeout_s=60)
    names = [GOOD[0], GOOD[1], None, "nan_a", GOOD[1], GOOD[0]]
    ref = Engine(serving_cfg(), comm.single_process(), model, clean).generate(
        [r for r in _requests(names) if r.adapter in (GOOD[0], None)])
    ref = {r.request.index: r.output_token_ids for r in ref}
    for idx, tokens, err in out:
        if names[idx] in (GOOD[1], "nan_a"):
            assert err and f"'{names[idx]}'" in err and "NaN/Inf" in err, err
        else:
            assert err is None and tokens == ref[idx]


def test_random_byte_flips_never_crash_the_engine(zoo, tmp_path):
    """Seeded byte flips anywhere in adapter files: each variant either loads (and runs) or fails its requests
    with an error naming it."""
    model, clean, _ = zoo
    rng = random.Random(0)
    for i in range(24):
        path = tmp_path / f"flip{i}"
        shutil.copytree(os.path.join(clean, GOOD[i % 2]), path)
        target = os.path.join(path, WEIGHTS if i % 3 else CONFIG)
        raw = bytearray(open(target, "rb").read())
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(min(len(raw), 200)) if rng.random() < 0.6 else rng.randrange(len(raw))
            raw[pos] = rng.randrange(256)
        open(target, "wb").write(bytes(raw))
    engine = Engine(serving_cfg(max_loras=2, max_cpu_loras=2), comm.single_process(), model, str(tmp_path))
    names = sorted(os.listdir(tmp_path))
    results = engine.generate(_requests(names + [None]))
    for res in results[:-1]:
        if res.error is not None:
            assert f"adapter {res.request.adapter!r}" in res.error, res.error
        else:
            assert len(res.output_token_ids) == res.request.max_new_tokens
    assert results[-1].error is None
