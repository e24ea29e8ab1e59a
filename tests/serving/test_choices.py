"""n / best_of on the offline job's request lines, through launch/generate.py as users run it: a line with n
sampled sequences (seeded) or best_of gets one output line with its choices, a line of one sequence keeps its
shape; two data-parallel replicas (self-spawned, parallel=dp2) write the same file as one process (each line's
sequences run on one replica); a request line with an unknown field is an error line naming it."""
import json

import pytest

from _serving import read_lines, run_app


def test_n_and_best_of_lines_one_process_and_two_replicas(bundle, tmp_path):
    model, adapters = bundle
    lines = [{"id": "n3", "adapter": "r8", "prompt_token_ids": [5, 9, 11], "max_new_tokens": 6, "n": 3,
              "temperature": 1.0, "seed": 7, "ignore_eos": True},
             {"id": "plain", "adapter": None, "prompt_token_ids": [4, 4, 8], "max_new_tokens": 5, "ignore_eos": True},
             {"id": "best", "adapter": "r4", "prompt_token_ids": [30, 31], "max_new_tokens": 4, "n": 2, "best_of": 4,
              "temperature": 1.0, "seed": 3, "ignore_eos": True},
             {"id": "typo", "prompt_token_ids": [1], "max_new_tokens": 2, "temprature": 0.5}]
    req = tmp_path / "req.jsonl"
    req.write_text("".join(json.dumps(x) + "\n" for x in lines))
    outs = {}
    for layout in ("tp1", "dp2"):
        out = tmp_path / f"{layout}.jsonl"
        r = run_app([f"parallel={layout}", f"model.path={model}", f"lora.adapter_dir={adapters}", f"requests={req}",
                     f"output={out}", "device=cpu", "dtype=float32", "lora.max_loras=2", "scheduler.max_batch_size=4",
                     "progress=false"], timeout=180)
        assert r.returncode == 0, r.stderr[-3000:]
        outs[layout] = read_lines(out)
    got = outs["tp1"]
    assert [x["id"] for x in got] == ["n3", "plain", "best", "typo"]
    n3, plain, best, typo = got
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2] and all(len(c["output_token_ids"]) == 6
                                                                    for c in n3["choices"])
    assert len({tuple(c["output_token_ids"]) for c in n3["choices"]}) > 1  # seeds 7, 8, 9 draw apart
    assert "choices" not in plain and len(plain["output_token_ids"]) == 5
    sums = [sum(c["logprobs"]) for c in best["choices"]]
    assert len(sums) == 2 and sums[0] >= sums[1]
    assert "unknown field(s) ['temprature']" in typo["error"]
    for a, b in zip(outs["dp2"], got):  # the same tokens; log-probabilities to float32 summation order
        assert a.keys() == b.keys() and a.get("error") == b.get("error")
        for x, y in zip(a.get("choices", [a]), b.get("choices", [b])) if "error" not in a else ():
            assert x["output_token_ids"] == y["output_token_ids"], (a["id"], x, y)
            assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-4)


@pytest.mark.parametrize("prompt,budget", [(13, 64), (16, 64), (37, 16)])
def test_siblings_join_as_the_prompt_ends_and_draw_as_separate_requests(bundle, prompt, budget):
    """n=4 in one engine run: the siblings join the batch in the step that computes the prompt's end (a partial
    last block copied, or a whole last block; in one step, or after chunks of a 16-token budget), so the run takes
    the steps of n=1; each draws what a separate request seeded like it draws (each in a run of its own, no cache)."""
    from tp_lora import distributed as comm
    from tp_lora.engine.engine import Engine
    from tp_lora.engine.requests import Request

    from _serving import serving_cfg

    def run(reqs, caching=True):
        cfg = serving_cfg(batch=6, budget=budget, kv_block_size=4, prefix_caching=caching)
        engine = Engine(cfg, comm.single_process(), *bundle)
        out = engine.generate(reqs)
        return out, engine.stats

    ids = [(7 * i) % 250 + 3 for i in range(prompt)]
    ask = dict(prompt_token_ids=ids, max_new_tokens=5, temperature=1.0, ignore_eos=True, adapter="r8")
    (one,), st1 = run([Request(0, id=0, **ask, seed=7)])
    (four,), st4 = run([Request(0, id=0, **ask, seed=7, n=4)])
    assert st4.steps == st1.steps and st4.prompt_tokens == 4 * prompt and st4.prefix_hit_tokens == 3 * prompt
    assert four.choices[0].output_token_ids == one.output_token_ids
    for i, choice in enumerate(four.choices):
        (alone,), _ = run([Request(0, id=0, **ask, seed=7 + i)], caching=False)
        assert choice.output_token_ids == alone.output_token_ids, i
        assert choice.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert len({tuple(c.output_token_ids) for c in four.choices}) > 1
