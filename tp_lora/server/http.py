"""The OpenAI-compatible HTTP front end (in the front-end process, tp_lora.server.frontend_process): FastAPI routes
over an EngineProxy.

Requests are checked (tp_lora.server.openai_models: one pydantic model per endpoint) and tokenized here first (model,
parameters, context), so the engine sees only runnable ones; `n` / `best_of` become that many engine requests per
prompt (seeds seed, seed + 1, ...). The engine's token ids come back per step and are detokenized and formatted (JSON,
SSE; tp_lora.server.responses) here. Errors are OpenAI-style JSON (tp_lora.server.errors). Choices carry the
generated `token_ids` beside `text` (an extension, as vLLM's return_token_ids).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
import uuid
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from tp_lora.engine.choices import best, siblings
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.tokenizer import Detokenizer
from tp_lora.server.channel import SHUTTING_DOWN

STARTING = "the server is starting"
from tp_lora.server.engine_proxy import UNLOAD_PENDING, EngineProxy
from tp_lora.server.errors import APIError, status_of
from tp_lora.server.guard import BodyGuard
from tp_lora.server.openai_models import (MAX_LOGPROB_ENTRIES, ChatCompletionRequest, CompletionRequest,
                                          LoadAdapter, Sampling, UnloadAdapter, load_json, parse)
from tp_lora.server.responses import (caught_up, chat_logprobs, completion_logprobs, sse, text_or,
                                      usage)


class OpenAIFrontend:
    """The API's side of the server: checks requests, hands them to the engine, shapes the answers."""

    def __init__(self, engine: EngineProxy, tokenizer, model_name: str, model_dir: str, cfg,
                 lora_roots: list[str]):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.model_name, self.model_dir = model_name, model_dir
        self.lora_roots = lora_roots  # real paths: run-time loads must lie inside one
        self.metrics = engine.metrics
        self.created = int(time.time())
        self._index = itertools.count()
        self.max_in_flight = cfg.scheduler.max_batch_size + cfg.server.max_queue
        self.token_bytes = tokenizer.max_token_bytes() if tokenizer is not None else 0

    # ---- request building -------------------------------------------------------------------------------------
    def adapter(self, model: str) -> Optional[str]:
        if model == self.model_name:
            return None
        if model not in self.engine.adapters:
            known = [self.model_name] + sorted(self.engine.adapters)
            raise APIError(404, f"the model {model!r} does not exist; served: {known[:20]}", "model")
        return model

    def prompts(self, prompt: Any, max_tokens: int, key: str) -> list[list[int]]:
        """A completions `prompt` (text, token ids, or a list of either; types checked already) -> token id lists.
        Tokenizes: call off the event loop."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either",
                           "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "text prompts need a tokenizer (tokenizer.json in the model dir); send "
                                        "token ids", "prompt")
                self.check_text_fits(utf8_size(p), max_tokens, key, "prompt")
                out.append(self.tokenizer.encode(p))
            elif p:
                out.append(list(p))
            else:
                raise APIError(400, "each prompt must be a string or a non-empty list of token ids, got []", "prompt")
        return out

    def check_text_fits(self, size: int, max_tokens: int, key: str, field: str) -> None:
        """A 400 for text of `size` bytes that cannot fit the context whatever it holds (each token covers at most
        self.token_bytes bytes), decided before tokenizing it."""
        least = -(-size // max(1, self.token_bytes))
        if least + max_tokens > self.engine.context:
            raise APIError(400, f"the prompt ({size} bytes of text: at least {least} tokens) + {key} ({max_tokens}) "
                                f"exceeds the context of {self.engine.context} tokens", field)

    def chat_prompt(self, body: ChatCompletionRequest, max_tokens: int, key: str) -> list[int]:
        """The chat messages as prompt token ids (the model's template). Tokenizes: call off the event loop."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template in the model "
                                "dir): use /v1/completions", "messages")
        texts = [m.text() for m in body.messages]
        self.check_text_fits(sum(map(utf8_size, texts)), max_tokens, key, "messages")
        messages = [{"role": m.role, "content": t, **({"name": m.name} if m.name else {})}
                    for m, t in zip(body.messages, texts)]
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))

    def requests(self, body: Sampling, prompts: list[list[int]], adapter: Optional[str], max_tokens: int,
                 key: str, logprobs: int = 0) -> list[Request]:
        """body.best_of_n() engine Requests per prompt (consecutive), sibling i seeded seed + i and sharing the first
        one's prompt (tp_lora.engine.choices). Token ids and the logit rules' ids are checked against the vocabulary
        by the engine: a 400 naming them."""
        fields = body.engine_fields()
        if fields["stop"] and self.tokenizer is None:
            raise APIError(400, "'stop' strings need a tokenizer (tokenizer.json in the model dir)", "stop")
        if fields["min_tokens"] > max_tokens:
            raise APIError(400, f"'min_tokens' ({fields['min_tokens']}) exceeds {key} ({max_tokens})", "min_tokens")
        seed, per_prompt = fields.pop("seed"), body.best_of_n()
        if per_prompt * len(prompts) > self.max_in_flight:
            raise APIError(400, f"{len(prompts)} prompts x {per_prompt} sequences = {per_prompt * len(prompts)} "
                                f"exceed what the server can ever hold at once ({self.max_in_flight}: "
                                f"scheduler.max_batch_size + server.max_queue)", "prompt")
        entries = len(prompts) * (body.n or 1) * max_tokens * (1 + logprobs)
        if body.wants_logprobs() and entries > MAX_LOGPROB_ENTRIES:
            raise APIError(400, f"the response would carry {len(prompts)} prompts x {body.n or 1} choices x {key} "
                                f"{max_tokens} x (1 + {logprobs} top logprobs) = {entries} log-probabilities, past "
                                f"the limit of {MAX_LOGPROB_ENTRIES}", key)
        reqs = []
        for ids in prompts:
            if len(ids) + max_tokens > self.engine.context:
                raise APIError(400, f"the prompt ({len(ids)} tokens) + {key} ({max_tokens}) = "
                                    f"{len(ids) + max_tokens} exceeds the context of {self.engine.context} tokens",
                               key)
            first = Request(next(self._index), id=f"cmpl-{uuid.uuid4().hex[:16]}", adapter=adapter,
                            prompt_token_ids=ids, max_new_tokens=max_tokens, logprobs=logprobs, seed=seed, **fields)
            reqs += [first] + siblings(first, [next(self._index) for _ in range(per_prompt - 1)])
        return reqs

    def check_capacity(self, n: int) -> None:
        if self.engine.draining:
            raise APIError(503, SHUTTING_DOWN, headers={"Retry-After": "5"})
        if self.engine.in_flight + n > self.max_in_flight:
            self.metrics.requests.labels("rejected").inc(n)
            raise APIError(429, f"the queue is full ({self.engine.in_flight} requests in flight, server.max_queue="
                                f"{self.cfg.server.max_queue} beyond scheduler.max_batch_size="
                                f"{self.cfg.scheduler.max_batch_size}); {n} more asked; retry later",
                           headers={"Retry-After": "1"})

    # ---- running ------------------------------------------------------------------------------------------------
    def _submit(self, reqs: list[Request], stream: bool) -> asyncio.Queue:
        """Hand the requests to the engine loop; their deltas arrive on the returned queue as (choice, Delta)."""
        self.check_capacity(len(reqs))
        q: asyncio.Queue = asyncio.Queue()
        for choice, req in enumerate(reqs):
            self.engine.submit(req, lambda d, c=choice: q.put_nowait((c, d)), stream)
        return q

    def cancel_unfinished(self, reqs: list[Request], finished: dict) -> None:
        """The client went away: free the slots and KV of its requests still running."""
        for choice, req in enumerate(reqs):
            if choice not in finished:
                self.engine.cancel(req.index)

    async def run_all(self, reqs: list[Request], gone: asyncio.Future) -> list[Result]:
        """The requests' results; cancelled when `gone` (the client's disconnect) comes first."""
        q = self._submit(reqs, stream=False)
        results: dict[int, Result] = {}
        try:
            while len(results) < len(reqs):
                got = asyncio.ensure_future(q.get())
                await asyncio.wait((got, gone), return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    raise APIError(499, "the client closed the connection")
                choice, d = got.result()
                if d.final is not None:
                    results[choice] = d.final
        finally:
            self.cancel_unfinished(reqs, results)
        for res in results.values():
            if res.error is not None:
                raise APIError(status_of(res.error), res.error)
        return [results[i] for i in range(len(reqs))]

    def token_text(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"token_id:{t}"

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def logprobs_of(self, kind: str, top_k: Optional[int], ids, lps, tops) -> Optional[dict]:
        """The choice's logprobs object for these positions (None: not asked)."""
        if top_k is None:
            return None
        if kind == "text_completion":
            return completion_logprobs(self.token_text, ids, lps, tops, 0)
        return chat_logprobs(self.token_text, ids, lps, tops, top_k)

    async def stream(self, q: asyncio.Queue, finals: dict[int, Result], reqs: list[Request], kind: str, model: str,
                     include_usage: bool, top_k: Optional[int], echo: list[str]):
        """SSE chunks of the submitted `reqs` (their deltas on q; finals filled as they end); kind:
        'text_completion' or 'chat.completion.chunk'; echo: text sent first, per choice."""
        rid = reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id
        created = int(time.time())
        detoks = [Detokenizer(self.tokenizer) if self.tokenizer is not None else None for _ in reqs]
        emitted = [""] * len(reqs)
        hold = [max((len(s) for s in r.stop), default=1) - 1 for r in reqs]  # a stop string may still complete
        started = [False] * len(reqs)
        per_prompt = len(reqs) // max(1, len(echo)) if echo else 1

        def chunk(choice: int, text: str, d, finish: Optional[str], use: Optional[dict] = None) -> str:
            lp = self.logprobs_of(kind, top_k, d.token_ids, d.logprobs, d.top_logprobs)
            if not started[choice]:
                text = (echo[choice // per_prompt] if echo else "") + text
            if kind == "text_completion":
                c = {"index": choice, "text": text, "logprobs": lp, "finish_reason": finish,
                     "token_ids": d.token_ids}
            else:
                delta = {"content": text} if text or finish is None else {}
                if not started[choice]:
                    delta["role"] = "assistant"
                c = {"index": choice, "delta": delta, "logprobs": lp, "finish_reason": finish,
                     "token_ids": d.token_ids}
            started[choice] = True
            return sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [c],
                        "usage": use})

        while len(finals) < len(reqs):
            for choice, d in await caught_up(q):
                res, dt = d.final, detoks[choice]
                if res is not None:
                    finals[choice] = res
                    if res.error is not None:
                        err = {"message": res.error, "type": "server_error", "param": None,
                               "code": status_of(res.error)}
                        yield sse({"error": err})
                        continue
                    if dt is not None and res.text is None:  # the stream's own decoder: one decode, a true tail
                        dt.add(d.token_ids)
                        dt.flush()
                        text = dt.text
                    else:
                        text = text_or(res, self.decode if self.tokenizer is not None else None)
                    rest = text[len(emitted[choice]):] if text.startswith(emitted[choice]) else ""
                    emitted[choice] += rest
                    yield chunk(choice, rest, d, res.finish_reason, usage([res]))
                    continue
                text = ""
                if dt is not None:
                    dt.add(d.token_ids)
                    ready = dt.text[:max(len(emitted[choice]), len(dt.text) - hold[choice])]
                    text = ready[len(emitted[choice]):]
                    emitted[choice] = ready
                yield chunk(choice, text, d, None)
        if include_usage:
            yield sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                       "usage": usage(list(finals.values()))})
        yield "data: [DONE]\n\n"

    async def respond(self, body: Sampling, reqs: list[Request], kind: str, top_k: Optional[int],
                      echo: list[str], request: HTTPRequest):
        """The answer to `reqs` (body.best_of_n() per prompt): a stream, or the n best per prompt as JSON, built off
        the event loop. A client that disconnects has its requests cancelled either way."""
        if body.stream:  # submitted before the 200 goes out: the stream's capacity is reserved once, here
            q, finals = self._submit(reqs, stream=True), {}
            chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
            include = bool(body.stream_options and body.stream_options.include_usage)
            return EventStream(self.stream(q, finals, reqs, chunk_kind, body.model, include, top_k, echo),
                               lambda: self.cancel_unfinished(reqs, finals))
        gone = asyncio.ensure_future(until_gone(request))
        try:
            results = await self.run_all(reqs, gone)
        finally:
            gone.cancel()
        return Response(await asyncio.to_thread(self.answer, body, reqs, results, kind, top_k, echo),
                        media_type="application/json")

    def answer(self, body: Sampling, reqs: list[Request], results: list[Result], kind: str, top_k: Optional[int],
               echo: list[str]) -> bytes:
        """The JSON body of a non-streamed answer: the n best results per prompt."""
        per_prompt, n = body.best_of_n(), body.n or 1
        chosen = [r for p in range(0, len(results), per_prompt) for r in best(results[p:p + per_prompt], n)]
        choices = []
        for i, res in enumerate(chosen):
            text = text_or(res, self.decode if self.tokenizer is not None else None)
            lp = self.logprobs_of(kind, top_k, res.output_token_ids, res.logprobs, res.top_logprobs)
            if kind == "text_completion":
                choices.append({"index": i, "text": (echo[i // n] if echo else "") + text, "logprobs": lp,
                                "finish_reason": res.finish_reason, "token_ids": res.output_token_ids})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": res.finish_reason, "token_ids": res.output_token_ids})
        out = {"id": reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id, "object": kind,
               "created": int(time.time()), "model": body.model, "choices": choices, "usage": usage(results)}
        return json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

    # ---- run-time adapters --------------------------------------------------------------------------------------
    def check_runtime_lora(self) -> None:
        if not self.cfg.server.allow_runtime_lora:
            raise APIError(403, "run-time adapter loading is off: start the server with "
                                "server.allow_runtime_lora=true (and server.lora_roots)")

    def confined(self, path: str) -> str:
        """`path` resolved (links, `..`), if it lies inside one of the lora roots; else one refusal for every path,
        existing or not (the detail goes to the log only)."""
        real = os.path.realpath(path)
        if any(os.path.commonpath([real, root]) == root for root in self.lora_roots):
            return real
        print(f"[tp_lora] server: refused lora_path {path!r} (resolved {real!r}): outside server.lora_roots "
              f"{self.lora_roots}", file=sys.stderr, flush=True)
        raise APIError(403, "lora_path is not an adapter directory inside server.lora_roots", "lora_path")


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class EventStream(StreamingResponse):
    """An SSE response that calls on_end however it ends: done, the client gone, or never started."""

    def __init__(self, chunks, on_end: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream")
        self.on_end = on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


async def until_gone(request: HTTPRequest) -> None:
    """Returns when the client closes the connection (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


def make_app(fe: OpenAIFrontend):
    """The ASGI app: the routes behind the body bounds (tp_lora.server.guard), behind the API key when set."""
    app = FastAPI(title="tp_lora", docs_url=None, redoc_url=None)
    srv = fe.cfg.server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    async def read(request: HTTPRequest, model: type):
        raw = (await request.receive())["body"]  # BodyGuard's one message: the whole body, not copied again
        return await asyncio.to_thread(lambda: parse(model, load_json(raw)))

    @app.get("/health")
    async def health():
        if fe.engine.draining:
            return PlainTextResponse(SHUTTING_DOWN, status_code=503)
        if not fe.engine.linked:
            return PlainTextResponse(STARTING, status_code=503)
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
        body = await read(request, CompletionRequest)
        adapter = fe.adapter(body.model)
        max_tokens = body.max_tokens or fe.cfg.generation.max_new_tokens

        def prepare() -> tuple[list[Request], list[str]]:
            prompts = fe.prompts(body.prompt, max_tokens, "max_tokens")
            reqs = fe.requests(body, prompts, adapter, max_tokens, "max_tokens", body.logprobs or 0)
            sent = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
            echo = [p if isinstance(p, str) else fe.decode(ids) for p, ids in zip(sent, prompts)] if body.echo else []
            return reqs, echo
        reqs, echo = await asyncio.to_thread(prepare)
        return await fe.respond(body, reqs, "text_completion", body.logprobs, echo, request)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await read(request, ChatCompletionRequest)
        adapter = fe.adapter(body.model)
        top_k = (body.top_logprobs or 0) if body.logprobs else None
        key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens or body.max_tokens or fe.cfg.generation.max_new_tokens

        def prepare() -> list[Request]:
            return fe.requests(body, [fe.chat_prompt(body, max_tokens, key)], adapter, max_tokens, key, top_k or 0)
        reqs = await asyncio.to_thread(prepare)
        return await fe.respond(body, reqs, "chat.completion", top_k, [], request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: HTTPRequest):
        fe.check_runtime_lora()
        body = await read(request, LoadAdapter)
        name = body.lora_name
        if name == fe.model_name:
            raise APIError(400, f"{name!r} is the base model's name", "lora_name")
        err = await fe.engine.call("load", name, fe.confined(body.lora_path))
        if err:
            raise APIError(503 if err == SHUTTING_DOWN else 400, err, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: HTTPRequest):
        fe.check_runtime_lora()
        name = (await read(request, UnloadAdapter)).lora_name
        err = await fe.engine.call("unload", name)
        if err and err.endswith(UNLOAD_PENDING):  # still serving its last requests: it goes when they end
            return PlainTextResponse(err, status_code=202)
        if err:
            status = 503 if err == SHUTTING_DOWN else 404 if err.endswith("is not loaded") else 400
            raise APIError(status, err, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    guarded = BodyGuard(app, int(srv.max_body_mb * 2 ** 20), int(srv.max_reading_mb * 2 ** 20), srv.body_timeout_s)
    return guarded if srv.api_key is None else BearerAuth(guarded, srv.api_key)
