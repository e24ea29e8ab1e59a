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
import time
import uuid
from typing import Any, Optional

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from tp_lora.engine.choices import best, siblings
from tp_lora.engine.requests import Request, Result
from tp_lora.engine.tokenizer import Detokenizer
from tp_lora.server.channel import SHUTTING_DOWN
from tp_lora.server.engine_proxy import EngineProxy
from tp_lora.server.errors import APIError, status_of
from tp_lora.server.openai_models import ChatCompletionRequest, CompletionRequest, Sampling, parse
from tp_lora.server.responses import (caught_up, chat_logprobs, completion_logprobs, sse, text_or,
                                      usage)


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
    def adapter(self, model: str) -> Optional[str]:
        if model == self.model_name:
            return None
        if model not in self.engine.adapters:
            known = [self.model_name] + sorted(self.engine.adapters)
            raise APIError(404, f"the model {model!r} does not exist; served: {known[:20]}", "model")
        return model

    def prompts(self, prompt: Any) -> list[list[int]]:
        """A completions `prompt` (text, token ids, or a list of either; types checked already) -> token id lists."""
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
                out.append(self.tokenizer.encode(p))
            elif p:
                out.append(list(p))
            else:
                raise APIError(400, "each prompt must be a string or a non-empty list of token ids, got []", "prompt")
        return out

    def requests(self, body: Sampling, prompts: list[list[int]], adapter: Optional[str], max_tokens: Optional[int],
                 key: str, logprobs: int = 0) -> list[Request]:
        """body.best_of_n() engine Requests per prompt (consecutive), sibling i seeded seed + i and admitted once the
        first one's prompt is computed (its KV blocks then shared through the prefix cache). Token ids and the logit
        rules' ids are checked against the vocabulary by the engine: a 400 naming them."""
        max_tokens = max_tokens or self.cfg.generation.max_new_tokens
        fields = body.engine_fields()
        if fields["stop"] and self.tokenizer is None:
            raise APIError(400, "'stop' strings need a tokenizer (tokenizer.json in the model dir)", "stop")
        if fields["min_tokens"] > max_tokens:
            raise APIError(400, f"'min_tokens' ({fields['min_tokens']}) exceeds {key} ({max_tokens})", "min_tokens")
        seed, per_prompt = fields.pop("seed"), body.best_of_n()
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

    async def stream(self, reqs: list[Request], kind: str, model: str, include_usage: bool, top_k: Optional[int],
                     echo: list[str]):
        """SSE chunks; kind: 'text_completion' or 'chat.completion.chunk'; echo: text sent first, per choice."""
        q = self._submit(reqs, stream=True)
        rid = reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id
        created = int(time.time())
        detoks = [Detokenizer(self.tokenizer) if self.tokenizer is not None else None for _ in reqs]
        emitted = [""] * len(reqs)
        hold = [max((len(s) for s in r.stop), default=1) - 1 for r in reqs]  # a stop string may still complete
        finals: dict[int, Result] = {}
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

        try:
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
        finally:
            for choice, req in enumerate(reqs):
                if choice not in finals:  # the client went away mid-stream: free its slot and KV
                    self.engine.cancel(req.index)

    async def respond(self, body: Sampling, reqs: list[Request], kind: str, top_k: Optional[int],
                      echo: list[str]):
        """The answer to `reqs` (body.best_of_n() per prompt): a stream, or the n best per prompt as JSON."""
        if body.stream:
            self.check_capacity(len(reqs))  # before the 200 goes out
            chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream(reqs, chunk_kind, body.model, include, top_k, echo),
                                     media_type="text/event-stream")
        results = await self.run_all(reqs)
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
        return {"id": reqs[0].id if kind == "text_completion" else "chat" + reqs[0].id, "object": kind,
                "created": int(time.time()), "model": body.model, "choices": choices, "usage": usage(results)}


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

    async def body_of(request: HTTPRequest) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None

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
        body = parse(CompletionRequest, await body_of(request))
        adapter = fe.adapter(body.model)
        prompts = fe.prompts(body.prompt)
        reqs = fe.requests(body, prompts, adapter, body.max_tokens, "max_tokens", body.logprobs or 0)
        sent = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        echo = [p if isinstance(p, str) else fe.decode(ids) for p, ids in zip(sent, prompts)] if body.echo else []
        return await fe.respond(body, reqs, "text_completion", body.logprobs, echo)

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = parse(ChatCompletionRequest, await body_of(request))
        adapter = fe.adapter(body.model)
        if fe.tokenizer is None or fe.tokenizer.chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json's chat_template in the model "
                                "dir): use /v1/completions", "messages")
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        prompt = fe.tokenizer.encode(fe.tokenizer.apply_chat_template(messages))
        top_k = (body.top_logprobs or 0) if body.logprobs else None
        key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        reqs = fe.requests(body, [prompt], adapter, body.max_completion_tokens or body.max_tokens, key, top_k or 0)
        return await fe.respond(body, reqs, "chat.completion", top_k, [])

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
