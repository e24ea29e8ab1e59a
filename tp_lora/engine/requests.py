"""What the engine takes in and gives back: Request and Result. The front ends build Requests (tp_lora.request_files
from JSONL lines, the API and the server from their calls); Result.to_json is a result as an output line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tp_lora.engine.response_format import parse_response_format


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
    stop: list[str] = field(default_factory=list)  # generation ends before the first of these in the text
    top_p: Optional[float] = None  # None: generation.top_p
    seed: Optional[int] = None  # sampling draws from its own generator seeded so (None: the run's)
    logprobs: int = 0  # the most likely tokens (with their log-probabilities) to report at each position
    # logit rules (OpenAI / vLLM definitions), applied to the logits before the choice; logprobs stay the model's
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token generated so far
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and generated tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens were generated
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after any of these (kept in output)
    n: int = 1  # sequences to return for the prompt (tp_lora.engine.choices)
    best_of: Optional[int] = None  # sequences to run, the n with the highest cumulative log-probability returned
    # n / best_of: the index of the first of this prompt's sequences; joins in the step that ends that one's prompt
    # (sharing its KV blocks, drawing from its last logits row), or later through the prefix cache when no room
    sibling_of: Optional[int] = None
    # structured output (tp_lora.engine.grammar): (response_format's type, the JSON schema's text)
    grammar: Optional[tuple[str, str]] = None


@dataclass
class Result:
    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    error: Optional[str] = None
    text: Optional[str] = None  # the decoded output (with a tokenizer), ending before a matched stop string
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per position, with request.logprobs
    interrupted: bool = False  # a stop left it unfinished: no output line, so resume=true runs it again
    # perf_counter() times: arrival, admitted, first_token, finished (serving metrics; not written)
    metrics: dict = field(default_factory=dict)
    # a request of n > 1 sequences (tp_lora.engine.choices): their Results, in place of this one's outputs
    choices: Optional[list["Result"]] = None

    def to_json(self) -> dict:
        out = {"id": self.request.id, "adapter": self.request.adapter}
        if self.error is not None:
            out["error"] = self.error
        elif self.choices is not None:
            out["choices"] = [dict(index=i, **c.outputs()) for i, c in enumerate(self.choices)]
        else:
            out.update(self.outputs())
        return out

    def outputs(self) -> dict:
        """The output line's fields of one sequence."""
        out = dict(output_token_ids=self.output_token_ids, logprobs=[round(p, 6) for p in self.logprobs],
                   finish_reason=self.finish_reason)
        if self.text is not None:
            out["text"] = self.text
        return out


def parse_stop(stop) -> list[str]:
    """A request's `stop`: a string, a list of strings, or null -> the list (non-empty strings only)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
        raise ValueError(f"'stop' must be a non-empty string or a list of them, got {stop!r}")
    return stops


MAX_N = 16  # n and best_of: sequences per prompt


def choices_error(n, best_of) -> Optional[tuple[str, str]]:
    """(field, why) when n / best_of (None: the default) cannot be served, else None."""
    for name, v in (("n", n), ("best_of", best_of)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_N):
            return name, f"'{name}' must be an integer from 1 to {MAX_N}, got {v!r}"
    if best_of is not None and best_of < (n or 1):
        return "best_of", f"'best_of' ({best_of}) must be at least 'n' ({n or 1})"
    return None


def set_choices(req: Request, n, best_of) -> None:
    """req.n / req.best_of from request values (None: the default), checked: ValueError naming the field."""
    err = choices_error(n, best_of)
    if err:
        raise ValueError(err[1])
    req.n, req.best_of = n or 1, best_of


RULES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids",
         "response_format")


def _number(name: str, v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"'{name}' must be a number, got {v!r}")
    return float(v)


def _int_id(name: str, v) -> int:
    """A token id: an integer, or an integer as a string (JSON object keys)."""
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"'{name}' holds {v!r}: expected token ids (integers)")
    return v


def set_rules(req: Request, values: dict) -> None:
    """Set req's logit rules and response_format from `values` (names in RULES, None for the default), type-checked:
    ValueError naming the field (ranges are request_error's, grammars the sampler's)."""
    unknown = sorted(set(values) - set(RULES))
    if unknown:
        raise ValueError(f"unknown sampling field(s) {unknown}; expected some of {list(RULES)}")
    for name, v in values.items():
        if v is None:
            continue
        if name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(req, name, _number(name, v))
        elif name == "min_tokens":
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"'min_tokens' must be an integer, got {v!r}")
            req.min_tokens = v
        elif name == "response_format":
            req.grammar = parse_response_format(v)
        elif name == "logit_bias":
            if not isinstance(v, dict):
                raise ValueError(f"'logit_bias' must be an object of token id -> bias, got {v!r:.80}")
            req.logit_bias = {_int_id(name, k): _number(f"logit_bias[{k}]", b) for k, b in v.items()}
        else:
            if not isinstance(v, list):
                raise ValueError(f"'stop_token_ids' must be a list of token ids, got {v!r:.80}")
            req.stop_token_ids = [_int_id(name, t) for t in v]


def request_error(req: Request, max_len: int, vocab: int, has_tokenizer: bool) -> Optional[str]:
    """Why `req` cannot run on a model of `vocab` tokens with a context of `max_len` positions, or None (its adapter
    is the registry's to judge)."""
    if req.error:
        return req.error
    if not req.prompt_token_ids:
        return "empty prompt"
    if req.stop and not has_tokenizer:
        return "'stop' strings need a tokenizer (tokenizer.json in the model dir)"
    if req.top_p is not None and not 0 < req.top_p <= 1:
        return f"top_p={req.top_p}: expected in (0, 1]"
    if not 0 <= req.logprobs <= vocab:
        return f"logprobs={req.logprobs}: expected in [0, {vocab}]"
    why = rules_error(req, vocab)
    if why:
        return why
    bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
    if bad:
        return f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
    total = len(req.prompt_token_ids) + req.max_new_tokens
    if total > max_len:
        return (f"prompt ({len(req.prompt_token_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"exceeds the context of {max_len} tokens")
    return None


def rules_error(req: Request, vocab: int) -> Optional[str]:
    """Why the request's logit rules (penalties, logit_bias, min_tokens, stop_token_ids) cannot apply on a model of
    `vocab` tokens, or None."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if not -2.0 <= v <= 2.0:
            return f"{name}={v}: expected in [-2, 2]"
    if not 0 < req.repetition_penalty <= 2.0:
        return f"repetition_penalty={req.repetition_penalty}: expected in (0, 2]"
    for tok, bias in req.logit_bias.items():
        if not 0 <= tok < vocab:
            return f"logit_bias token id {tok} is outside the vocabulary [0, {vocab})"
        if not -100.0 <= bias <= 100.0:
            return f"logit_bias[{tok}]={bias}: expected in [-100, 100]"
    bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
    if bad:
        return f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab})"
    if not 0 <= req.min_tokens <= req.max_new_tokens:
        return f"min_tokens={req.min_tokens}: expected in [0, max_new_tokens={req.max_new_tokens}]"
    return None
