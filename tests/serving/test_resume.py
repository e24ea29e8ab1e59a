"""Resume bookkeeping without a model: which lines answer which requests (ids may repeat, lines may be torn), and
the writer keeping them on disk at every moment and ending in request order."""
import json

from tp_lora.engine.requests import Request, Result
from tp_lora.request_files import OutputWriter, read_output_lines, split_answered


def _reqs(ids):
    return [Request(i, id=rid, prompt_token_ids=[1]) for i, rid in enumerate(ids)]


def test_split_answered_matches_ids_in_order_with_repeats():
    reqs = _reqs(["a", 1, "a", {"k": [1]}, "b"])
    lines = [{"id": "a", "x": 1}, {"id": {"k": [1]}, "x": 2}, {"id": "zz", "x": 3}, {"id": "a", "x": 4}]
    todo, kept = split_answered(reqs, lines)
    assert [r.index for r in todo] == [1, 4]
    assert [(i, ln["x"]) for i, ln in kept] == [(0, 1), (2, 4), (3, 2), (float("inf"), 3)]


def test_torn_and_foreign_lines_are_not_answers(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a", "output_token_ids": [1]}\n[1, 2]\n{"no_id": 1}\n\n{"id": "b", "outp')
    assert read_output_lines(str(path)) == [{"id": "a", "output_token_ids": [1]}]
    assert read_output_lines(str(tmp_path / "missing.jsonl")) == []


def test_writer_keeps_old_lines_on_disk_and_ends_in_request_order(tmp_path):
    path = tmp_path / "out.jsonl"
    reqs = _reqs(["r0", "r1", "r2", "r3"])
    path.write_text('{"id": "r2", "old": true}\n{"id": "r0", "old": true}\n{"id": "r1", "torn')
    todo, kept = split_answered(reqs, read_output_lines(str(path)))
    assert [r.id for r in todo] == ["r1", "r3"]
    w = OutputWriter(str(path), keep=kept)
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["r0", "r2"]  # torn line gone, old kept
    w.write(Result(reqs[3], output_token_ids=[3]))
    w.write(Result(reqs[1], output_token_ids=[1]))
    assert len(path.read_text().splitlines()) == 4  # appended and flushed before close
    w.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [ln["id"] for ln in lines] == ["r0", "r1", "r2", "r3"]
    assert lines[0] == {"id": "r0", "old": True} and lines[2] == {"id": "r2", "old": True}


def test_part_writer_only_appends(tmp_path):
    path = tmp_path / "out.jsonl.dp1.part"
    path.write_text('{"id": "earlier"}\n')
    w = OutputWriter(str(path), ordered=False)
    w.write(Result(_reqs(["x"])[0], output_token_ids=[1]))
    w.close()
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["earlier", "x"]
