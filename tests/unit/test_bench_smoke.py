"""The benchmark scripts every GPU number comes from, each once in its CPU mode with a tiny workload: it exits 0 and
writes its report with a measurement in it (so a refactor of what they call cannot break them unseen)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, script: str, *args: str, ranks: int = 0) -> None:
    """ranks: launched by torchrun as that many gloo ranks (0: one plain process)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TP_LORA_HOME=str(tmp_path / "home"))
    env.pop("TRITON_INTERPRET", None)  # the scripts' CPU modes pick their own backends
    launch = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}"] if ranks else []
    proc = subprocess.run([sys.executable, *launch, os.path.join(ROOT, "scripts", script), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _report(path):
    with open(path) as f:
        return json.load(f)


def test_bench_generate_smoke(tmp_path):
    _run(tmp_path, "bench_generate.py", "--smoke", "--no-hf", "--cache", str(tmp_path / "cache"),
         "--out", str(tmp_path / "out"))
    ours = _report(tmp_path / "out" / "bench_generate.json")["ours"]
    assert ours["adapters"]["tokens_per_s"] > 0 and ours["no_adapters"]["tokens_per_s"] > 0


def test_bench_prefix_smoke(tmp_path):
    _run(tmp_path, "bench_prefix.py", "--shapes", "smoke", "--conversations", "2", "--turns", "2",
         "--system-tokens", "16", "--user-tokens", "4", "--reply-tokens", "2", "--think-s", "0", "--rate", "1000",
         "--batch", "4", "--tokens-per-step", "64", "--max-loras", "2", "--cache", str(tmp_path / "cache"),
         "--out", str(tmp_path / "out"))
    rows = _report(tmp_path / "out" / "bench_prefix.json")["rows"]
    assert {(r["trace"], r["caching"]) for r in rows} >= {("chat", False), ("chat", True), ("random", True)}
    assert all(r["generated_tokens"] > 0 for r in rows)
    assert any(r["prefix_hit_rate"] > 0 for r in rows if r["trace"] == "chat" and r["caching"])


def test_bench_dora_quick(tmp_path):
    _run(tmp_path, "bench_dora.py", "--quick", "--reps", "1", "--out", str(tmp_path / "out"))
    res = _report(tmp_path / "out" / "dora.json")
    assert res["plain_ms"] > 0 and res["dora_ms"] > 0 and res["shrink_expand_r256_qkv_us"] > 0


def test_bench_routing_small(tmp_path):
    rows = tmp_path / "rows.jsonl"
    _run(tmp_path, "bench_routing.py", "--dp", "2", "--policies", "affinity", "--adapters", "8", "--requests", "16",
         "--concurrency", "4", "--max-tokens", "2", "--slots", "2", "--host", "4", "--batch", "4",
         "--out", str(rows))
    (row,) = [json.loads(line) for line in rows.read_text().splitlines()]
    assert row["completed"] == row["finished"] == 16 and row["slot_loads"] > 0, row


def test_bench_sampling_smoke(tmp_path):
    pytest.importorskip("xgrammar")
    _run(tmp_path, "bench_sampling.py", "--smoke", "--timeline", "--cache", str(tmp_path / "cache"),
         "--out", str(tmp_path / "out"))
    rows = _report(tmp_path / "out" / "bench_sampling.json")["rows"]
    assert set(rows) == {"n", "separate", "no_grammar", "grammar_nested", "grammar_free_text"} and all(r["tokens"] > 0 for r in rows.values())


def test_bench_serving_smoke(tmp_path):
    pytest.importorskip("peft")  # its "peft" system
    _run(tmp_path, "bench_serving.py", "--smoke", "--adapters", "8", "--out", str(tmp_path / "out"))
    res = _report(tmp_path / "out" / "bench_serving.json")["results"]["8"]
    assert set(res) >= {"ours", "merged", "peft"}, list(res)
    assert res["ours"]["failed"] == 0 and res["ours"]["generated_tokens"] > 0 and res["merged"]["tokens_per_s"] > 0


@pytest.mark.parametrize("ranks,layouts,weights,modes", [(2, "tp1,tp2,ep2,tp2_ep2", "none", "default"),
                                                         (4, "tp1,tp4,ep4,ep2_tp2,tp4_ep4", "none", "default"),
                                                         (2, "tp2_ep2", "none,fp8,fp8_experts", "default,fully_sharded")])
def test_bench_moe_decode_smoke(tmp_path, ranks, layouts, weights, modes):
    """The 2- and 4-GPU tables' layouts (4: the default), with a mixed step, on gloo ranks; fp8 experts and layers
    beside bf16 (--quantization: the fp8 rows read fewer bytes; fp8_experts, attention in bf16, in between) and both
    LoRA modes (--lora-modes)."""
    args = ["--smoke", "--prefill", "8", "--out", str(tmp_path / "out"), "--quantization", weights,
            "--lora-modes", modes]
    _run(tmp_path, "bench_moe_decode.py", *args, *(["--layouts", layouts] if ranks == 2 else []), ranks=ranks)
    report = _report(tmp_path / "out" / "bench_moe_decode.json")
    rows = report["rows"]
    assert report["meta"]["ranks"] == ranks
    adapter_rows = [(0, False)] + [(2, m == "fully_sharded") for m in modes.split(",")]
    assert [(r["layout"], r["weights"], r["adapters"], r["fully_sharded"]) for r in rows] == [
        (name, w, n, fully) for name in layouts.split(",") for w in weights.split(",") for n, fully in adapter_rows]
    assert all(r["ms"] > 0 and r["floor_mb"] > 0 and r["mixed_eager_ms"] > 0 for r in rows), rows
    floor = {(r["weights"], r["adapters"]): r["floor_mb"] for r in rows}
    assert all(floor[("fp8", n)] < floor[("fp8_experts", n)] < floor[("none", n)] for n in (0, 2)
               if ("fp8", n) in floor), floor
    # the adapters' own bytes: none without them; fully sharded, each rank reads its share of every A
    assert all((r["adapter_mb"] > 0) == (r["adapters"] > 0) and r["adapter_floor_ratio"] >= 1 for r in rows), rows
    lora = {(r["layout"], r["weights"], r["fully_sharded"]): r["adapter_mb"] for r in rows if r["adapters"]}
    assert all(mb < lora[(layout, w, False)] for (layout, w, fully), mb in lora.items() if fully), lora
    # the experts' groups: tp2's ranks read every routed (expert, adapter) group (a share of each), tp2_ep2's about
    # half of them (each whole: less than twice tp2's share); both read the same attention LoRA
    if ("tp2", "none", False) in lora and ("tp2_ep2", "none", False) in lora:
        assert lora[("tp2", "none", False)] > lora[("tp2_ep2", "none", False)], lora


def test_bench_moe_engine_smoke(tmp_path):
    """The MoE decode step through the engine, every 2-rank layout, steps run ahead and read one by one."""
    _run(tmp_path, "bench_moe_engine.py", "--smoke", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
         ranks=2)
    rows = _report(tmp_path / "out" / "bench_moe_engine.json")["rows"]
    assert [(r["layout"], r["run_ahead"]) for r in rows] == [
        (name, ahead) for name in ("tp2", "ep2", "tp2_ep2") for ahead in (True, False)]
    assert all(r["decode_step_ms"] > 0 and r["decode_steps"] > 0 and r["tokens_per_s"] > 0 for r in rows), rows


def test_tune_fp8_gemm_smoke(tmp_path):
    _run(tmp_path, "tune_fp8_gemm.py", "--smoke", "--out", str(tmp_path / "out"))
    report = _report(tmp_path / "out" / "tune_fp8_gemm.json")
    errs = report["smoke"]
    assert len(errs) == 9 and max(errs.values()) < 2e-2
    # the experts' sweep: 2 configurations x (per channel, per block), each run
    assert [(r["experts"], tuple(r["cfg"])) for r in report["experts"]] == [
        (s, c) for s in ("block128", "channel") for c in [(64, 4, 3), (64, 4, 4)]], report["experts"]


def test_bench_step_decodes_the_whole_batch_for_about_new_steps(tmp_path):
    """4 prompts of 2048 tokens take two steps of 4096 to fill, and sequences start decoding as theirs fill: the long
    run still gives about --new steps in which the whole batch decodes (it gave 1 of 4 when it made --new tokens)."""
    _run(tmp_path, "bench_step.py", "--shapes", "smoke", "--batches", "4", "--contexts", "2048", "--new", "4",
         "--reps", "1", "--no-adapters-only", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"))
    (row,) = _report(tmp_path / "out" / "bench_step.json")["rows"]
    assert row["decode_steps"] >= 3 and row["decode_step_ms"] > 0, row


def test_bench_moe_plan_smoke(tmp_path):
    _run(tmp_path, "bench_moe_plan.py", "--tokens", "4,16", "--slots", "0,2", "--reps", "3",
         "--out", str(tmp_path / "out"))
    rows = _report(tmp_path / "out" / "bench_moe_plan.json")["rows"]
    assert [(r["tokens"], r["slots"]) for r in rows] == [(4, 0), (4, 2), (16, 0), (16, 2)]
    assert all(r["torch_us"] > 0 and r["pairs"] == 8 * r["tokens"] for r in rows)


def test_bench_race_smoke(tmp_path):
    _run(tmp_path, "bench_race.py", "--rows", "2", "--vocab", "512", "--temperatures", "0", "--reps", "2",
         "--out", str(tmp_path / "out"))
    (row,) = _report(tmp_path / "out" / "bench_race.json")["rows"]
    assert row["race"] > 0 and row["race, grammar rows"] > 0 and row["shard 1/2 + combine"] > 0, row
