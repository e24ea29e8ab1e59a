"""The OpenAI-compatible HTTP front end (in the front-end process, tp_lora.server.frontend_process): FastAPI routes
over an EngineProxy.

Requests are checked and tokenized here first (model, parameters, context), so the engine sees only runnable ones;
the engine's token ids come back per step and are detokenized and formatted (JSON, SSE) here. Errors are
OpenAI-style JSON ({"error": {"message", "type", "param", "code"}}). Completions carry the generated `token_ids`
beside `text` (an extension, as vLLM's return_token_ids).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from typing import Any, Optional

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tp_lora.engine.requests import Request, Result, parse_stop
from tp_lora.engine.tokenizer import Detokenizer
from tp_lora.server.channel import SHUTTING_DOWN
from tp_lora.server.engine_proxy import Delta, EngineProxy

MAX_LOGPROBS = 5  # as OpenAI's completions


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status, headers=self.headers)


def _status(error: str) -> int:
    """HTTP status of an error the engine reported for a request."""
    if error.startswith("unknown adapter"):
        return 404
    if error.startswith(SHUTTING_DOWN):
        return 503
    if "failed to load" in error:
        return 500
    return 400


def _int(body: dict, key: str, default, lo: int, hi: Optional[int] = None):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise APIError(400, f"'{key}' must be an integer {bound}, got {v!r}", key)
    return v


def _float(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise APIError(400, f"'{key}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", key)
    return float(v)


class OpenAIFrontend:
    """The API's side of the server: checks requests, hands them to the engine, shapes the answers."""

    def __init__(self, engine: EngineProxy, tokenizer, model_name: str, model_dir: str, cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.model_name, self.model_dir = model_name, model_dir
        self.metrics = engine.metrics
        self.created = int(time.time())
        self._index = itertools.count()
        self.max_in_flight = cfg.scheduler.max_batch_size + cfg.server.max_queue

    # ---- request building -------------------------------------------------------------------------------------
    def _adapter(self, model: Any) -> Optional[str]:
        if not isinstance(model, str):
            raise APIError(400, f"'model' must be a string (the base model {self.model_name!r} or an adapter's "
                                f"name), got {model!r}", "model")
        if model == self.model_name:
            return None
        if model not in self.engine.adapters:
            known = [self.model_name] + sorted(self.engine.adapters)
            raise APIError(404, f"the model {model!r} does not exist; served: {known[:20]}", "model")
        return model

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """A completions `prompt` (text, token ids, or a list of either) -> token id lists."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                           "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "text prompts need a tokenizer (tokenizer.json in the model dir); send "
                                        "token ids", "prompt")
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append(list(p))
            else:
                raise APIError(400, f"each prompt must be a string or a non-empty list of token ids, got {p!r:.80}",
                               "prompt")
        return out

    def _requests(self, body: dict, prompts: list[list[int]], adapter: Optional[str], logprobs: int = 0
                  ) -> list[Request]:
        """One engine Request per prompt from the body's sampling parameters (defaults: the generation config)."""
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"  # chat's newer name
        max_tokens = _int(body, key, self.cfg.generation.max_new_tokens, 1)
        temperature = _float(body, "temperature", 0.0, 2.0)
        top_p = _float(body, "top_p", 0.0, 1.0, lo_open=True)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63):
            raise APIError(400, f"'seed' must be a non-negative integer, got {seed!r}", "seed")
        if _int(body, "n", 1, 1, 1) != 1:
            raise APIError(400, "'n' must be 1", "n")
        try:
            stop = parse_stop(body.get("stop"))
        except ValueError as e:
            raise APIError(400, str(e), "stop") from None
        if stop and self.tokenizer is None:
            raise APIError(400, "'stop' strings need a tokenizer (tokenizer.json in the model dir)", "stop")
        ignore_eos = body.get("ignore_eos")
        if ignore_eos is not None and not isinstance(ignore_eos, bool):
            raise APIError(400, f"'ignore_eos' must be a boolean, got {ignore_eos!r}", "ignore_eos")
        reqs = []
        for ids in prompts:
            if len(ids) + max_tokens > self.engine.context:
                raise APIError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = "
                                    f"{len(ids) + max_tokens} exceeds the context of {self.engine.context} tokens",
                               key)
            reqs.append(Request(next(self._index), id=f"cmpl-{uuid.uuid4().hex[:16]}", adapter=adapter,
                                prompt_token_ids=ids, max_new_tokens=max_tokens, temperature=temperature,
                                ignore_eos=ignore_eos, stop=stop, top_p=top_p, seed=seed,
                                logprobs=logprobs))
        return reqs

    def _check_capacity(self, n: int) -> None:
        if self.engine.draining:
            raise APIError(503, SHUTTING_DOWN, headers={"Retry-After": "5"})
        if self.engine.in_flight + n > self.max_in_flight:
            self.metrics.requests.labels("rejected").inc(n)
            raise APIError(429, f"the queue is full ({self.engine.in_flight} requests in flight, server.max_queue="
                                f"{self.cfg.server.max_queue} beyond scheduler.max_batch_size="
                                f"{self.cfg.scheduler.max_batch_size}); retry later", headers={"Retry-After": "1"})

    # ---- running ------------------------------------------------------------------------------------------------
    def _submit(self, reqs: list[Request], stream: bool) -> asyncio.Queue:
        """Hand the requests to the engine loop; their deltas arrive on the returned queue as (choice, Delta)."""
        self._check_capacity(len(reqs))
        q: asyncio.Queue = asyncio.Queue()
        for choice, req in enumerate(reqs):
            self.engine.submit(req, lambda d, c=choice: q.put_nowait((c, d)), stream)
        return q

    async def run_all(self, reqs: list[Request]) -> list[Result]:
        q = self._submit(reqs, stream=False)
        results: dict[int, Result] = {}
        try:
            while len(results) < len(reqs):
                choice, d = await q.get()
                if d.final is not None:
                    results[choice] = d.final
        finally:
            for choice, req in enumerate(reqs):
                if choice not in results:  # the client went away
                    self.engine.cancel(req.index)
        for res in results.values():
            if res.error is not None:
                raise APIError(_status(res.error), res.error)
        return [results[i] for i in range(len(reqs))]

    def _logprobs(self, ids: list[int], lps: list[float], tops: list, offset: int) -> dict:
        """The completions `logprobs` object for these positions."""
        tok = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: f"token_id:{t}")
        text_offset, pos = [], offset
        for t in ids:
            text_offset.append(pos)
            pos += len(tok(t))
        return {"tokens": [tok(t) for t in ids], "token_logprobs": lps,
                "top_logprobs": [{tok(t): lp for t, lp in row} for row in tops] if tops else None,
                "text_offset": text_offset}

    def _text(self, res: Result) -> str:
        """The result's text: where a stop string cut it, the engine's; else the decoded tokens."""
        if res.text is not None:
            return res.text
        return self.tokenizer.decode(res.output_token_ids) if self.tokenizer is not None else ""

    @staticmethod
    def _usage(results: list[Result]) -> dict:
        p = sum(len(r.request.prompt_token_ids) for r in results)
        c = sum(len(r.output_token_ids) for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def stream(self, reqs: list[Request], kind: str, model: str, include_usage: bool, want_lp: bool):
        """SSE chunks; kind: 'text_completion' or 'chat.completion.chunk'."""
        q = self._submit(reqs, stream=True)
        rid = reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id
        created = int(time.time())
        detoks = [Detokenizer(self.tokenizer) if self.tokenizer is not None else None for _ in reqs]
        emitted = [""] * len(reqs)
        hold = [max((len(s) for s in r.stop), default=1) - 1 for r in reqs]  # a stop string may still complete
        finals: dict[int, Result] = {}
        started = [False] * len(reqs)

        def chunk(choice: int, text: str, ids: list[int], finish: Optional[str], lp: Optional[dict],
                  usage: Optional[dict] = None) -> str:
            if kind == "text_completion":
                c = {"index": choice, "text": text, "logprobs": lp, "finish_reason": finish, "token_ids": ids}
            else:
                delta = {"content": text} if text or finish is None else {}
                if not started[choice]:
                    delta["role"] = "assistant"
                c = {"index": choice, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}
            started[choice] = True
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                          "choices": [c], "usage": usage}) + "\n\n"

        try:
            while len(finals) < len(reqs):
                for choice, d in await _caught_up(q):
                    res = d.final
                    if res is not None:
                        finals[choice] = res
                        if res.error is not None:
                            err = {"message": res.error, "type": "server_error", "param": None,
                                   "code": _status(res.error)}
                            yield "data: " + json.dumps({"error": err}) + "\n\n"
                            continue
                        dt = detoks[choice]
                        if dt is not None and res.text is None:  # the stream's own decoder: one decode, a true tail
                            dt.add(d.token_ids)
                            dt.flush()
                            text = dt.text
                        else:
                            text = self._text(res)
                        rest = text[len(emitted[choice]):] if text.startswith(emitted[choice]) else ""
                        emitted[choice] += rest
                        lp = self._logprobs(d.token_ids, d.logprobs, d.top_logprobs, 0) if want_lp else None
                        yield chunk(choice, rest, d.token_ids, res.finish_reason, lp, self._usage([res]))
                        continue
                    text = ""
                    dt = detoks[choice]
                    if dt is not None:
                        dt.add(d.token_ids)
                        ready = dt.text[:max(len(emitted[choice]), len(dt.text) - hold[choice])]
                        text = ready[len(emitted[choice]):]
                        emitted[choice] = ready
                    lp = self._logprobs(d.token_ids, d.logprobs, d.top_logprobs, 0) if want_lp else None
                    yield chunk(choice, text, d.token_ids, None, lp)
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                             "choices": [], "usage": self._usage(list(finals.values()))}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for choice, req in enumerate(reqs):
                if choice not in finals:  # the client went away mid-stream: free its slot and KV
                    self.engine.cancel(req.index)


async def _caught_up(q: asyncio.Queue) -> list[tuple[int, Delta]]:
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


class BearerAuth:
    """ASGI middleware: /v1/* need "Authorization: Bearer <key>" (a plain ASGI wrapper: responses, streams
    included, pass through untouched)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = APIError(401, "missing or wrong API key (Authorization: Bearer <server.api_key>)").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def make_app(fe: OpenAIFrontend) -> FastAPI:
    app = FastAPI(title="tp_lora", docs_url=None, redoc_url=None)
    key = fe.cfg.server.api_key

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    if key is not None:
        app.add_middleware(BearerAuth, key=key)

    async def body_of(request: HTTPRequest) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        if fe.engine.draining:
            return PlainTextResponse(SHUTTING_DOWN, status_code=503)
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics():
        return Response(fe.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        def card(name: str, root: str, parent: Optional[str]) -> dict:
            return {"id": name, "object": "model", "created": fe.created, "owned_by": "tp_lora", "root": root,
                    "parent": parent}
        adapters = fe.engine.adapters
        data = [card(fe.model_name, fe.model_dir, None)]
        data += [card(n, adapters[n], fe.model_name) for n in sorted(adapters)]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await body_of(request)
        adapter = fe._adapter(body.get("model"))
        if body.get("echo"):
            raise APIError(400, "'echo' is not supported", "echo")
        if "suffix" in body and body["suffix"] is not None:
            raise APIError(400, "'suffix' is not supported", "suffix")
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise APIError(400, f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}", "logprobs")
        reqs = fe._requests(body, fe._prompts(body.get("prompt")), adapter, logprobs or 0)
        return await respond(body, reqs, "text_completion", logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await body_of(request)
        adapter = fe._adapter(body.get("model"))
        if fe.tokenizer is None or fe.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template in the model "
                                "dir): use /v1/completions", "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with string content",
                           "messages")
        if body.get("logprobs"):
            raise APIError(400, "'logprobs' is not supported on chat completions (use /v1/completions)", "logprobs")
        prompt = fe.tokenizer.encode(fe.tokenizer.apply_chat_template(messages))
        return await respond(body, fe._requests(body, [prompt], adapter), "chat.completion", False)

    async def respond(body: dict, reqs: list[Request], kind: str, want_lp: bool):
        model = body["model"]
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be a boolean, got {stream!r}", "stream")
        if stream:
            opts = body.get("stream_options") or {}
            fe._check_capacity(len(reqs))  # before the 200 goes out
            chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
            return StreamingResponse(fe.stream(reqs, chunk_kind, model, bool(opts.get("include_usage")), want_lp),
                                     media_type="text/event-stream")
        results = await fe.run_all(reqs)
        choices = []
        for i, res in enumerate(results):
            text = fe._text(res)
            if kind == "text_completion":
                lp = fe._logprobs(res.output_token_ids, res.logprobs, res.top_logprobs, 0) if want_lp else None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": res.finish_reason,
                                "token_ids": res.output_token_ids})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": res.finish_reason, "token_ids": res.output_token_ids})
        return {"id": reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id, "object": kind,
                "created": int(time.time()), "model": model, "choices": choices, "usage": fe._usage(results)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: HTTPRequest):
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "expected {\"lora_name\": NAME, \"lora_path\": DIR} (non-empty strings)")
        if name == fe.model_name:
            raise APIError(400, f"{name!r} is the base model's name", "lora_name")
        err = await fe.engine.call("load", name, path)
        if err:
            raise APIError(503 if err == SHUTTING_DOWN else 400, err, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: HTTPRequest):
        body = await body_of(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "expected {\"lora_name\": NAME}", "lora_name")
        err = await fe.engine.call("unload", name)
        if err:
            status = 503 if err == SHUTTING_DOWN else 404 if err.endswith("is not loaded") else 400
            raise APIError(status, err, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app
