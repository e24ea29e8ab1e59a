"""Request and output JSONL formats.

Request line: {"id": ..., "adapter": NAME or null, "prompt_token_ids": [...] (or "prompt": text with a tokenizer),
               "max_new_tokens": N, optional "temperature", "ignore_eos"}
Output line:  {"id": ..., "adapter": ..., "output_token_ids": [...], "logprobs": [...], "finish_reason": ...}
              or, for a request that could not run, {"id": ..., "adapter": ..., "error": "..."}.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Request:
    index: int  # line order: outputs are written back in this order
    id: Any
    adapter: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 16
    temperature: Optional[float] = None
    ignore_eos: Optional[bool] = None
    error: Optional[str] = None  # set when the request is rejected; it then produces an error line only


@dataclass
class Result:
    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    error: Optional[str] = None

    def to_json(self) -> dict:
        out = {"id": self.request.id, "adapter": self.request.adapter}
        if self.error is not None:
            out["error"] = self.error
        else:
            out.update(output_token_ids=self.output_token_ids, logprobs=[round(p, 6) for p in self.logprobs],
                       finish_reason=self.finish_reason)
        return out


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
    except ValueError as e:
        req.error = f"request {req.id!r}: {e}"
    return req


def read_requests(path: str, default_max_new_tokens: int, tokenizer=None) -> list[Request]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"requests file {path!r} does not exist")
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    return [parse_request(i, ln, default_max_new_tokens, tokenizer) for i, ln in enumerate(lines)]


class OutputWriter:
    """Appends and flushes a line as each request completes (nothing finished is lost if the run dies); close()
    rewrites the file in request order."""

    def __init__(self, path: str, enabled: bool = True, keep: list[dict] | None = None):
        self.path, self.enabled = path, enabled
        self.done: list[tuple[int, dict]] = []
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "w")
            for line in keep or []:  # lines of an earlier run kept by resume
                self.f.write(json.dumps(line) + "\n")
            self.f.flush()
        self.kept = list(keep or [])

    def write(self, result: Result) -> None:
        if not self.enabled:
            return
        line = result.to_json()
        self.done.append((result.request.index, line))
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self.f.close()
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for line in self.kept:
                f.write(json.dumps(line) + "\n")
            for _, line in sorted(self.done, key=lambda x: x[0]):
                f.write(json.dumps(line) + "\n")
        os.replace(tmp, self.path)
