import json
import threading

import pytest
import torch

from tp_lora import distributed as comm
from tp_lora.assets import write_tiny_llama
from tp_lora.config import ConfigError, RunConfig, validate, validate_for_model
from tp_lora.engine.adapters import MAX_READ_THREADS, read_threads
from tp_lora.engine.engine import Engine, host_threads
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.requests import request_error
from tp_lora.request_files import OutputWriter, parse_request
from tp_lora.threadlocal import torch_threads


def _cfg(**kw):
    cfg = RunConfig()
    for key, value in kw.items():
        obj = cfg
        *path, last = key.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg


@pytest.mark.parametrize("kw, msg", [
    (dict(parallel__tp_size=3), "tp_size=3 does not divide the 4 launched"),
    (dict(lora__fully_sharded=True, lora__max_rank=6, parallel__tp_size=4), "max_rank=6 must be divisible"),
    (dict(lora__backend="cuda"), "lora.backend='cuda'"),
    (dict(dtype="fp16"), "dtype='fp16'"),
    (dict(lora__max_loras=0), "lora.max_loras=0"),
    (dict(scheduler__admit_batch=0), r"scheduler.admit_batch=0: expected >= 1"),
    (dict(parallel__host_threads=-1), r"parallel.host_threads=-1: expected >= 0"),
    (dict(parallel__read_threads=-2), r"parallel.read_threads=-2: expected >= 0"),
])
def test_bad_values_are_named(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(_cfg(**kw), world_size=4)


def test_host_threads_are_one_on_cuda_unless_set():
    """On CUDA the automatic setting is one torch thread per process, whatever OMP_NUM_THREADS says; an explicit
    value wins; CPU runs keep torch's own (their model computes on them)."""
    assert host_threads(0, "cuda") == 1
    assert host_threads(3, "cuda") == 3
    assert host_threads(0, "cpu") is None
    assert host_threads(2, "cpu") == 2


def test_read_threads_are_the_ranks_cores_less_one_on_cuda():
    """A read the step loop waits on gets the rank's share of the host's cores less one, at most MAX_READ_THREADS,
    and one when the share is one core; an explicit value wins; CPU runs leave the reading thread's own count."""
    assert read_threads(0, "cuda", cores=16, local_ranks=1) == MAX_READ_THREADS
    assert read_threads(0, "cuda", cores=16, local_ranks=4) == 3
    assert read_threads(0, "cuda", cores=8, local_ranks=8) == 1
    assert read_threads(5, "cuda", cores=2, local_ranks=1) == 5
    assert read_threads(0, "cpu", cores=16, local_ranks=1) is None


def test_torch_threads_are_set_for_the_calling_thread_only():
    """The reader's threads do not become the step loop's: torch's count is per thread once a thread has set it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    inside, done = threading.Event(), threading.Event()
    seen = []

    def read():
        with torch_threads(2):
            torch.ones(1 << 20).sum()  # a parallel region on this thread
            seen.append(torch.get_num_threads())
            inside.set()
            done.wait(10)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=read)
    try:
        t.start()
        assert inside.wait(10)
        assert torch.get_num_threads() == 1  # while the reader runs on 2
        torch.ones(1 << 20).sum()
        assert torch.get_num_threads() == 1
    finally:
        done.set()
        t.join()
        torch.set_num_threads(old)
    assert seen == [2, 1]
    with torch_threads(None):
        assert torch.get_num_threads() == old


@pytest.mark.parametrize("key, value", [("num_attention_heads", 6), ("intermediate_size", 30), ("vocab_size", 250)])
def test_model_shapes_must_split(key, value):
    hf = dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=32, vocab_size=256)
    hf[key] = value
    with pytest.raises(ConfigError, match=f"{key}={value}"):
        validate_for_model(hf, 4)


def test_kv_heads_may_be_replicated():
    validate_for_model(dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=32, vocab_size=256), 4)
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        validate_for_model(dict(num_attention_heads=12, num_key_value_heads=3, intermediate_size=32, vocab_size=256), 4)


@pytest.mark.parametrize("line, msg", [
    ("{not json", "malformed JSON"),
    ('{"id": 1, "prompt_token_ids": []}', "empty prompt"),
    ('{"id": 1, "prompt_token_ids": [1, "a"]}', "list of integers"),
    ('{"id": 1, "prompt_token_ids": [1], "max_new_tokens": 0}', "positive integer"),
    ('{"id": 1, "prompt": "hello"}', "needs a tokenizer"),
    ('[1, 2]', "expected a JSON object"),
    ('{"id": 1, "prompt_token_ids": [1], "logit_bias": {"x": 1}}', "logit_bias"),
    ('{"id": 1, "prompt_token_ids": [1], "presence_penalty": "high"}', "presence_penalty"),
    ('{"id": 1, "prompt_token_ids": [1], "stop_token_ids": 5}', "stop_token_ids"),
    ('{"id": 1, "prompt_token_ids": [1], "min_tokens": 1.5}', "min_tokens"),
    ('{"id": 1, "prompt_token_ids": [1], "seed": -3}', "seed"),
    ('{"id": 1, "prompt_token_ids": [1], "top_p": "all"}', "top_p"),
    ('{"id": 1, "prompt_token_ids": [1], "n": 0}', "'n' must be an integer from 1 to 16"),
    ('{"id": 1, "prompt_token_ids": [1], "n": 17}', "'n' must be an integer from 1 to 16"),
    ('{"id": 1, "prompt_token_ids": [1], "n": 3, "best_of": 2}', "'best_of' (2) must be at least 'n' (3)"),
    ('{"id": 1, "prompt_token_ids": [1], "logprobs": 2, "temprature": 1}', "unknown field(s) ['logprobs', "
                                                                          "'temprature']"),
])
def test_bad_request_lines_become_errors(line, msg):
    req = parse_request(0, line, 8)
    assert req.error and msg in req.error


def test_request_lines_carry_sampling_fields_and_logit_rules():
    req = parse_request(0, '{"id": 1, "prompt_token_ids": [1, 2], "max_new_tokens": 5, "top_p": 0.9, "seed": 4, '
                           '"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, '
                           '"logit_bias": {"7": -100}, "min_tokens": 2, "stop_token_ids": [3, 9]}', 8)
    assert req.error is None
    assert (req.top_p, req.seed, req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == \
        (0.9, 4, 0.5, -1.0, 1.2)
    assert req.logit_bias == {7: -100.0} and req.min_tokens == 2 and req.stop_token_ids == [3, 9]
    assert "min_tokens=2" in request_error(parse_request(0, '{"prompt_token_ids": [1], "max_new_tokens": 1, '
                                                            '"min_tokens": 2}', 8), 64, 50, False)
    assert "logit_bias token id 70" in request_error(parse_request(0, '{"prompt_token_ids": [1], '
                                                                      '"logit_bias": {"70": 1}}', 8), 64, 50, False)


def test_writer_flushes_each_line_and_ends_in_request_order(tmp_path):
    path = tmp_path / "out.jsonl"
    w = OutputWriter(str(path))
    reqs = [Request(i, id=f"r{i}", prompt_token_ids=[1]) for i in range(3)]
    for i in (2, 0, 1):
        w.write(Result(reqs[i], output_token_ids=[i]))
        assert len(path.read_text().splitlines()) == [2, 0, 1].index(i) + 1  # on disk before close
    w.close()
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["r0", "r1", "r2"]


def test_an_adapter_dir_without_adapters_is_refused_before_any_collective(tmp_path):
    """A set lora.adapter_dir that holds no PEFT adapter (a typo'd level, an empty directory) is a ConfigError naming
    it, raised by every rank before the model is built, not a run of the base model alone."""
    model = write_tiny_llama(str(tmp_path / "model"), seed=0)
    (tmp_path / "adapters" / "not-an-adapter").mkdir(parents=True)
    (tmp_path / "adapters" / "not-an-adapter" / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"lora.adapter_dir={tmp_path / 'adapters'} holds no adapter"):
        Engine(RunConfig(), comm.single_process("cpu"), model, str(tmp_path / "adapters"))
