"""The Python API: LLM(...).generate(...) gives the offline job's output lines, in one process and under torchrun
(every rank calls it, rank 0 gets the results); overrides are checked like the command line's."""
import json
import os
import subprocess
import sys

import pytest

from _server import ROOT, env_for
from tp_lora.config import ConfigError

SCRIPT = """
import json, sys
from tp_lora import LLM
reqs = json.loads(sys.argv[1])
llm = LLM(parallel={"tp_size": 2}, **{"lora.max_loras": 2})
out = llm.generate([q["prompt_token_ids"] for q in reqs], adapter=[q["adapter"] for q in reqs],
                   max_new_tokens=max(q["max_new_tokens"] for q in reqs))
with open(f"{sys.argv[2]}/rank{llm.ps.tp.rank}.json", "w") as f:
    json.dump(out, f)
llm.close()
"""


@pytest.fixture(scope="module")
def llm(home):
    from tp_lora import LLM
    os.environ["TP_LORA_HOME"], old = str(home), os.environ.get("TP_LORA_HOME")
    try:
        llm = LLM(**{"lora.max_loras": 2}, scheduler={"max_batch_size": 4})
    finally:
        os.environ.pop("TP_LORA_HOME") if old is None else os.environ.update(TP_LORA_HOME=old)
    yield llm
    llm.close()


def test_generate_gives_the_output_lines(llm, reference):
    for q, want in reference:
        got = llm.generate(q["prompt_token_ids"], adapter=q["adapter"], max_new_tokens=q["max_new_tokens"])
        assert len(got) == 1 and set(got[0]) == set(want), q["id"]
        for k in ("adapter", "output_token_ids", "text", "finish_reason"):
            assert got[0][k] == want[k], (q["id"], k)
        assert got[0]["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    batch = llm.generate([q["prompt_token_ids"] for q, _ in reference], adapter=[q["adapter"] for q, _ in reference],
                         max_new_tokens=8)
    for (q, want), got in zip(reference, batch):
        n = len(got["output_token_ids"])
        assert got["output_token_ids"] == want["output_token_ids"][:n] and (n == 8 or got["finish_reason"] == "stop")


def test_n_and_best_of_equal_single_runs_with_the_siblings_seeds(llm):
    """n=3 with seed S: each prompt's choices are the single runs seeded S, S+1, S+2 (6 sequences through a batch
    of 4: siblings queue); best_of=3, n=2: the two of those with the highest cumulative log-probability, best
    first; greedy n: identical choices; bad values: an error naming the field."""
    prompts, kw = [[1, 17, 42], [1, 5, 9, 11]], dict(adapter="alpha", max_new_tokens=6, temperature=1.0)
    singles = [[llm.generate(p, seed=100 + i, **kw)[0] for i in range(3)] for p in prompts]
    assert len({tuple(s["output_token_ids"]) for s in singles[0]}) > 1, "the seeds should draw different tokens"
    got = llm.generate(prompts, seed=100, n=3, **kw)
    best = llm.generate(prompts, seed=100, n=2, best_of=3, **kw)
    for runs, line, top in zip(singles, got, best):
        assert set(line) == {"id", "adapter", "choices"} and [c["index"] for c in line["choices"]] == [0, 1, 2]
        for want, choice in zip(runs, line["choices"]):
            assert choice["output_token_ids"] == want["output_token_ids"]
            assert choice["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
        ranked = sorted(runs, key=lambda r: -sum(r["logprobs"]))[:2]
        assert [c["output_token_ids"] for c in top["choices"]] == [r["output_token_ids"] for r in ranked]
    greedy = llm.generate(prompts[0], adapter="beta", max_new_tokens=5, n=3)[0]["choices"]
    assert len(greedy) == 3 and all(c["output_token_ids"] == greedy[0]["output_token_ids"] for c in greedy)
    assert "'best_of' (1) must be at least 'n' (2)" in llm.generate(prompts[0], n=2, best_of=1)[0]["error"]


def test_text_prompts_stop_strings_and_errors(llm):
    full = llm.generate("hello world", adapter="beta", max_new_tokens=12)[0]
    assert full["text"] == llm.tokenizer.decode(full["output_token_ids"])
    stop = full["text"][4:6]
    cut = llm.generate("hello world", adapter="beta", max_new_tokens=12, stop=stop)[0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][:full["text"].find(stop)]
    out = llm.generate(["hi", [1, 2], [1, 999], [1, "x"]], adapter=["nope", None, None, None])
    assert "unknown adapter 'nope'" in out[0]["error"] and "outside the vocabulary" in out[2]["error"]
    assert out[1]["output_token_ids"] and "string or a list of token ids" in out[3]["error"]
    assert "temperature" in llm.generate([1, 2], temperature=-1)[0]["error"]
    a = llm.generate("hi", temperature=1.0, seed=7, max_new_tokens=6)
    assert a == llm.generate("hi", temperature=1.0, seed=7, max_new_tokens=6)  # its own seed: the same draws
    # logit rules per call: a bias forces its token; a stop token id ends the sequence; bad values are named
    forced = llm.generate([1, 2], max_new_tokens=4, logit_bias={33: 100.0}, presence_penalty=0.5)[0]
    assert forced["output_token_ids"] == [33] * 4
    stopped = llm.generate([1, 2], max_new_tokens=4, logit_bias={33: 100.0}, stop_token_ids=[33])[0]
    assert stopped["output_token_ids"] == [33] and stopped["finish_reason"] == "stop"
    assert "repetition_penalty" in llm.generate([1, 2], repetition_penalty=0)[0]["error"]
    assert "min_tokens" in llm.generate([1, 2], max_new_tokens=2, min_tokens=3)[0]["error"]
    assert "unknown sampling field" in llm.generate([1, 2], top_k=3)[0]["error"]


@pytest.mark.parametrize("overrides, words", [
    ({"lora.max_lorass": 2}, "max_lorass"),
    ({"lora": {"max_loras": "many"}}, "max_loras"),
    ({"scheduler.max_batch_size": 0}, "scheduler.max_batch_size=0"),
])
def test_bad_overrides_are_named(overrides, words):
    from tp_lora import LLM
    with pytest.raises(ConfigError, match=words):
        LLM(**overrides)


def test_generate_under_torchrun(home, reference, tmp_path):
    from tp_lora.testing import listen_port
    reqs = [q for q, _ in reference]
    script = tmp_path / "llm_tp2.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={listen_port()}", str(script), json.dumps(reqs), str(tmp_path)],
                       capture_output=True, text=True, timeout=240, env=env_for(home), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert lines[1] is None
    for (q, want), got in zip(reference, lines[0]):
        n = len(want["output_token_ids"])
        assert got["output_token_ids"][:n] == want["output_token_ids"], q["id"]


def test_score_gives_the_log_probabilities_generation_sampled(llm):
    """A prompt scored with its greedy continuation: the continuation's scores are the log-probabilities the decode
    steps reported (one prefill over the whole text against a KV cache filled token by token), per adapter."""
    prompts, adapters = [[1, 5, 9, 2], [3, 3, 7], [4, 11]], ["alpha", None, "gamma"]
    out = llm.generate(prompts, adapter=adapters, max_new_tokens=6, ignore_eos=True)
    texts = [p + o["output_token_ids"] for p, o in zip(prompts, out)]
    scores = llm.score(texts, adapter=adapters)
    for p, o, got in zip(prompts, out, scores):
        assert len(got) == len(p) + 6 - 1
        assert got[len(p) - 1:] == pytest.approx(o["logprobs"], abs=1e-4)
    assert llm.score([1, 5, 9], adapter="beta")[0] != llm.score([1, 5, 9])[0]  # the adapter counts
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        llm.score([1, 2], adapter="nope")
