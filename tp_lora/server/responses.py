"""The answers' shapes: completions and chat log-probability objects, usage, chunks. Pure functions of results and a
token decoder; tp_lora.server.http sends what they build."""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional

from tp_lora.engine.requests import Result
from tp_lora.server.engine_proxy import Delta


def completion_logprobs(tok: Callable[[int], str], ids: list[int], lps: list[float], tops: list,
                        offset: int) -> dict:
    """The completions `logprobs` object for these positions, text offsets counted from `offset`."""
    text_offset, pos = [], offset
    for t in ids:
        text_offset.append(pos)
        pos += len(tok(t))
    return {"tokens": [tok(t) for t in ids], "token_logprobs": lps,
            "top_logprobs": [_by_text(tok, row) for row in tops] if tops else None,
            "text_offset": text_offset}


def _by_text(tok: Callable[[int], str], row) -> dict:
    """One position's top (token, logprob) pairs keyed by text; tokens decoding alike (bytes of one character) keep
    the highest."""
    out: dict[str, float] = {}
    for t, lp in row:
        s = tok(t)
        out[s] = max(lp, out.get(s, lp))
    return out


def chat_logprobs(tok: Callable[[int], str], ids: list[int], lps: list[float], tops: list, k: int) -> dict:
    """The chat `logprobs` object: per position the token, its log-probability and bytes, and the k most likely."""
    def entry(t: int, lp: float) -> dict:
        s = tok(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(a, b) for a, b in tops[i][:k]] if k and i < len(tops) else []
        content.append(e)
    return {"content": content, "refusal": None}


def usage(results: list[Result]) -> dict:
    p = sum(len(r.request.prompt_token_ids) for r in results)
    c = sum(len(r.output_token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


async def caught_up(q: asyncio.Queue) -> list[tuple[int, Delta]]:
    """The queued (choice, Delta)s, waiting for the first, merged per choice: a stream that fell behind the engine
    catches up in one chunk per choice."""
    items = [await q.get()]
    while not q.empty():
        items.append(q.get_nowait())
    merged: dict[int, Delta] = {}
    for choice, d in items:
        m = merged.get(choice)
        if m is None:
            merged[choice] = Delta(list(d.token_ids), list(d.logprobs), list(d.top_logprobs), d.final)
        else:
            m.token_ids += d.token_ids
            m.logprobs += d.logprobs
            m.top_logprobs += d.top_logprobs
            m.final = d.final
    return list(merged.items())


def text_or(res: Result, decode: Optional[Callable[[list[int]], str]]) -> str:
    """The result's text: where a stop string cut it, the engine's; else the decoded tokens."""
    if res.text is not None:
        return res.text
    return decode(res.output_token_ids) if decode is not None else ""
