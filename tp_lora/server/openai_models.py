"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models: every documented OpenAI field
(and vLLM's sampling extensions) type-checked, unknown fields refused; fields documented but not served are refused
by name with the reason (refusal()); fields accepted on purpose without effect are listed in ACCEPTED_WITHOUT_EFFECT
(and the README). load_json() reads a body (bounded nesting, no lone surrogates) and parse() turns it into its model,
each an APIError (400) naming the field otherwise; list sizes are bounded here too (limits in the README's
"Security")."""
from __future__ import annotations

import json
import re
import reprlib
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tp_lora.engine.requests import MAX_N, choices_error
from tp_lora.engine.response_format import parse_response_format, schema_error
from tp_lora.server.errors import APIError

MAX_LOGPROBS = 5  # completions' logprobs, as OpenAI
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI
MAX_JSON_DEPTH = 64  # nesting of a body's arrays and objects
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_MESSAGES = 2048  # chat messages per request
MAX_ADAPTER_NAME = 128  # characters
# A response's logprob entries (choices x max_tokens x (1 + top logprobs)): about 60 bytes of JSON each
MAX_LOGPROB_ENTRIES = 2 ** 17
TokenId = Annotated[int, Field(ge=0, lt=2 ** 31)]
SHORT = reprlib.Repr()  # a refused value, quoted in the error: a few items / characters of it
SHORT.maxlevel, SHORT.maxlist, SHORT.maxdict, SHORT.maxstring, SHORT.maxother = 2, 4, 4, 60, 60

# Fields taken and given no effect: they tag, route or store requests on OpenAI's side, which this server does not do
ACCEPTED_WITHOUT_EFFECT = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                           "parallel_tool_calls")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def refusal(self) -> Optional[tuple[str, str]]:
        """(field, why) for a valid body asking what is not served, or None."""
        return None


class StreamOptions(Strict):
    include_usage: Optional[bool] = None


class JsonSchema(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` is a BaseModel method's name
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchema] = None

    def grammar(self) -> Optional[tuple[str, str]]:
        """The Request.grammar this format asks for (tp_lora.engine.requests.parse_response_format)."""
        return parse_response_format(self.model_dump(by_alias=True, exclude_none=True))


class Sampling(Strict):
    """The fields both endpoints share."""
    model: str
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    user: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extensions
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = Field(None, ge=0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=2.0)
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for key, bias in v.items():
            if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= 2 ** 31:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for {key}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if not all(stops) or len(stops) > 4:
            raise ValueError("expected a non-empty string or a list of up to 4 of them")
        return v

    def engine_fields(self) -> dict:
        """The Request fields these values set (None where the generation config's default holds)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stops,
                    ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty or 0.0,
                    frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                    min_tokens=self.min_tokens or 0, stop_token_ids=list(self.stop_token_ids or []),
                    grammar=None if self.response_format is None else self.response_format.grammar())

    def refusal(self) -> Optional[tuple[str, str]]:
        """(field, why) for a documented field set to what the server does not serve, or None."""
        rf = self.response_format
        if rf is not None:
            try:
                grammar = rf.grammar()
            except ValueError as e:
                return "response_format", str(e)
            why = grammar and schema_error(grammar)
            if why:
                return "response_format", why
            if grammar and self.min_tokens:
                return "min_tokens", "'min_tokens' with 'response_format': the grammar decides where the output ends"
        bad = choices_error(self.n, self.best_of_n())
        if bad:
            return bad
        if self.stream and self.best_of_n() > (self.n or 1):
            return "best_of", "'best_of' above 'n' cannot stream (the best are known only at the end)"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "'stream_options' needs 'stream': true"
        return None

    def best_of_n(self) -> int:
        return self.n or 1

    def wants_logprobs(self) -> bool:
        return False


class CompletionRequest(Sampling):
    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]]
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None

    def best_of_n(self) -> int:
        return self.best_of or self.n or 1

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def refusal(self) -> Optional[tuple[str, str]]:
        if self.suffix:
            return "suffix", "'suffix' (insertion) is not served: the models served here are not trained for it"
        if self.echo and self.logprobs is not None:
            return "echo", "'echo' with 'logprobs' is not served: the prompt's log-probabilities are not computed " \
                           "by the serving steps (LLM.score computes them offline); drop one of the two"
        return super().refusal()


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# chat fields documented by OpenAI that this server does not serve: refused when set (not null), with the reason
NOT_SERVED = {
    "tools": "tool calling is not served", "tool_choice": "tool calling is not served",
    "functions": "function calling is not served", "function_call": "function calling is not served",
    "audio": "audio output is not served", "prediction": "predicted outputs are not served",
    "reasoning_effort": "the models served here take no reasoning effort",
    "web_search_options": "web search is not served", "verbosity": "the models served here take no verbosity",
}


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    modalities: Optional[list[Literal["text"]]] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None
    audio: Optional[dict] = None
    prediction: Optional[dict] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict] = None
    verbosity: Optional[str] = None

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def refusal(self) -> Optional[tuple[str, str]]:
        for name, why in NOT_SERVED.items():
            v = getattr(self, name)
            if v is not None and not (name == "tool_choice" and v == "none") and v != []:
                return name, f"'{name}': {why}"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "'top_logprobs' needs 'logprobs': true"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_tokens", "give one of 'max_tokens' and 'max_completion_tokens' (the newer name)"
        return super().refusal()


def parse(cls: type[Strict], body: Any) -> Strict:
    """The body as `cls`, or an APIError (400) naming the first bad field and what it expects."""
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # a union's most specific complaint
        field = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x))
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field '{where}' (not an OpenAI {cls.__name__} field nor an extension this "
                                f"server serves)", field) from None
        if err["type"] == "missing":
            raise APIError(400, f"'{where}' is required", field) from None
        got = "" if err["type"] == "value_error" else f", got {SHORT.repr(err.get('input'))}"
        raise APIError(400, f"'{where}': {err['msg']}{got}", field) from None
    refused = req.refusal()
    if refused:
        raise APIError(400, refused[1], refused[0])
    return req


def _is_type_tag(x) -> bool:
    """pydantic's loc names a union member by its type ('str', 'list[int]', 'function-after[...]'): not a key."""
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict", "list"))


class LoadAdapter(Strict):
    """The body of POST /v1/load_lora_adapter."""
    lora_name: str
    lora_path: str = Field(min_length=1, max_length=4096)

    @field_validator("lora_name")
    @classmethod
    def _name(cls, v):
        return adapter_name(v)


class UnloadAdapter(Strict):
    """The body of POST /v1/unload_lora_adapter."""
    lora_name: str

    @field_validator("lora_name")
    @classmethod
    def _name(cls, v):
        return adapter_name(v)


def adapter_name(name: str) -> str:
    """An adapter's API name: 1..MAX_ADAPTER_NAME printable characters (no lone surrogates, no control characters),
    no space at either end: it appears in /v1/models and as a metrics label."""
    if not 1 <= len(name) <= MAX_ADAPTER_NAME:
        raise ValueError(f"expected 1 to {MAX_ADAPTER_NAME} characters, got {len(name)}")
    if not name.isprintable() or name != name.strip():
        raise ValueError(f"expected printable characters with no space at either end, got {name[:40]!r}")
    return name


def load_json(raw: bytes) -> Any:
    """The body as JSON: a 400 naming why for invalid JSON or UTF-8, integers past Python's digit limit, nesting
    deeper than MAX_JSON_DEPTH or strings holding lone surrogates (escaped \\ud800: not text)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the body nests arrays / objects deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, the int digit limit
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    flaw = first_flaw(body)
    if flaw:
        raise APIError(400, flaw, flaw.split("'")[1] if flaw.startswith("'") else None)
    return body


def first_flaw(body: Any) -> Optional[str]:
    """Why a parsed body is refused (too deep, a lone surrogate in a key or string: where), or None. Iterative, and
    lists of numbers are passed over by their element types alone."""
    if not isinstance(body, (list, dict)):
        return None if not isinstance(body, str) or _is_text(body) else "a lone surrogate is not text"
    stack = [(body, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"the body nests arrays / objects deeper than {MAX_JSON_DEPTH} levels (at '{where}')"
        if isinstance(node, list):
            if set(map(type, node)) <= {int, float, bool, type(None)}:
                continue
            items = ((f"{where}[{i}]", v) for i, v in enumerate(node))
        else:
            items = ((f"{where}.{k}" if where else k, v) for k, v in node.items())
            if not all(map(_is_text, node)):
                return f"'{where or 'body'}': a key holds a lone surrogate (\\ud800-\\udfff), which is not text"
        for path, v in items:
            if isinstance(v, str):
                if not _is_text(v):
                    return f"'{path}': a lone surrogate (\\ud800-\\udfff) is not text"
            elif isinstance(v, (list, dict)):
                stack.append((v, depth + 1, path))
    return None


def _is_text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
