"""The offline job's JSONL files: reading request lines into Requests, resume's view of an output file, and writing
results back as output lines.

Request line: {"id": ..., "adapter": NAME or null, "prompt_token_ids": [...] (or "prompt": text with a tokenizer),
               "max_new_tokens": N, optional "temperature", "top_p", "seed", "ignore_eos", "stop": [strings],
               "n" and "best_of" (sequences returned / run, tp_lora.engine.choices),
               "stop_token_ids", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias": {token id: bias}, "response_format": OpenAI's {"type": "json_object"} or
               {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} (tp_lora.engine.grammar)}
Output line:  {"id": ..., "adapter": ..., "output_token_ids": [...], "logprobs": [...], "finish_reason": ...,
               "text": ... (with a tokenizer)}; with n > 1 or best_of, {"id": ..., "adapter": ..., "choices":
               [{"index": i, "output_token_ids": ..., "logprobs": ..., "finish_reason": ..., "text": ...}, ...]}
               (the n best by cumulative log-probability with best_of)
              or, for a request that could not run, {"id": ..., "adapter": ..., "error": "..."} (Result.to_json).
"""
from __future__ import annotations

import json
import os
from typing import Any

from tp_lora.engine.requests import RULES, Request, Result, parse_stop, set_choices, set_rules

FIELDS = ("id", "adapter", "prompt_token_ids", "prompt", "max_new_tokens", "temperature", "top_p", "seed",
          "ignore_eos", "stop", "n", "best_of") + RULES


def parse_request(index: int, line: str, default_max_new_tokens: int, tokenizer=None) -> Request:
    """One JSONL line -> Request; a malformed line gives a Request carrying `error`, never an exception."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Request(index, id=f"line-{index + 1}", error=f"malformed JSON on line {index + 1}: {e.msg}")
    if not isinstance(obj, dict):
        return Request(index, id=f"line-{index + 1}", error=f"line {index + 1}: expected a JSON object")
    req = Request(index, id=obj.get("id", f"line-{index + 1}"), adapter=obj.get("adapter"))
    try:
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; a request line takes {list(FIELDS)}")
        if req.adapter is not None and not isinstance(req.adapter, str):
            raise ValueError(f"'adapter' must be a name or null, got {req.adapter!r}")
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("'prompt_token_ids' must be a list of integers")
            req.prompt_token_ids = ids
        elif "prompt" in obj:
            if tokenizer is None:
                raise ValueError("'prompt' text needs a tokenizer (tokenizer.json in the model dir and the "
                                 "`tokenizers` package); send 'prompt_token_ids' instead")
            req.prompt_token_ids = tokenizer(obj["prompt"])
        else:
            raise ValueError("expected 'prompt_token_ids' (or 'prompt')")
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        n = obj.get("max_new_tokens", default_max_new_tokens)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"'max_new_tokens' must be a positive integer, got {n!r}")
        req.max_new_tokens = n
        if "temperature" in obj:
            t = obj["temperature"]
            if not isinstance(t, (int, float)) or t < 0:
                raise ValueError(f"'temperature' must be a number >= 0, got {t!r}")
            req.temperature = float(t)
        if "ignore_eos" in obj:
            req.ignore_eos = bool(obj["ignore_eos"])
        if "stop" in obj:
            req.stop = parse_stop(obj["stop"])
        if obj.get("top_p") is not None:
            t = obj["top_p"]
            if not isinstance(t, (int, float)) or isinstance(t, bool):
                raise ValueError(f"'top_p' must be a number in (0, 1], got {t!r}")
            req.top_p = float(t)
        if obj.get("seed") is not None:
            if not isinstance(obj["seed"], int) or isinstance(obj["seed"], bool) or obj["seed"] < 0:
                raise ValueError(f"'seed' must be a non-negative integer, got {obj['seed']!r}")
            req.seed = obj["seed"]
        set_choices(req, obj.get("n"), obj.get("best_of"))
        set_rules(req, {k: obj[k] for k in RULES if k in obj})
    except ValueError as e:
        req.error = f"request {req.id!r}: {e}"
    return req


def read_requests(path: str, default_max_new_tokens: int, tokenizer=None) -> list[Request]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"requests file {path!r} does not exist")
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    return [parse_request(i, ln, default_max_new_tokens, tokenizer) for i, ln in enumerate(lines)]


def read_output_lines(path: str) -> list[dict]:
    """The answered lines of an output file (JSON objects with an "id"), in file order. A line cut short by a run
    that died mid-write, or anything else unparsable, is skipped: its request simply runs again."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for ln in f:
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "id" in obj:
                out.append(obj)
    return out


def _id_key(rid: Any) -> str:
    return json.dumps(rid, sort_keys=True)


def split_answered(requests: list[Request], lines: list[dict]) -> tuple[list[Request], list[tuple[float, dict]]]:
    """(requests still to run, kept lines as (request index, line)) for resume: a line answers the first request
    with its id not answered yet (ids may repeat); lines answering no request are kept at the end (index inf)."""
    by_id: dict[str, list[dict]] = {}
    for line in lines:
        by_id.setdefault(_id_key(line["id"]), []).append(line)
    todo, kept = [], []
    for req in requests:
        queue = by_id.get(_id_key(req.id))
        if queue:
            kept.append((req.index, queue.pop(0)))
        else:
            todo.append(req)
    kept += [(float("inf"), line) for queue in by_id.values() for line in queue]
    return todo, kept


class OutputWriter:
    """Appends and flushes a line as each request completes (nothing finished is lost if the run dies); close()
    rewrites the file in request order, lines kept by resume included.

    keep: lines of an earlier run, as (request index, line). ordered=False only appends
    (a data-parallel replica's part file: its lines are merged by the driver, and an earlier part must survive)."""

    def __init__(self, path: str, enabled: bool = True, keep: list | None = None, ordered: bool = True):
        self.path, self.enabled, self.ordered = path, enabled, ordered
        self.done: list[tuple[float, dict]] = []
        self.kept = list(keep or [])
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if ordered:
                self._rewrite(self.kept)  # atomically: the kept lines are never absent from disk
            self.f = open(path, "a", encoding="utf-8")

    def write(self, result: Result) -> None:
        if not self.enabled:
            return
        line = result.to_json()
        self.done.append((result.request.index, line))
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()

    def _rewrite(self, lines: list[tuple[float, dict]]) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for _, line in lines:
                f.write(json.dumps(line) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        if not self.enabled or self.f.closed:
            return
        self.f.close()
        if self.ordered:
            self._rewrite(sorted(self.kept + self.done, key=lambda x: x[0]))
