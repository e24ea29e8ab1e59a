"""A request's response_format (OpenAI's shape) as Request.grammar, and the check of its schema by the grammar
library (xgrammar, the optional `structured` extra) without a tokenizer. Light: the HTTP front end imports it; the
library is imported at the first grammar."""
from __future__ import annotations

import json
import re
from typing import Optional

FORMATS = ("text", "json_object", "json_schema")
ANY_OBJECT = '{"type": "object"}'  # json_object's grammar: any JSON object (whitespace as json_schema's)


def parse_response_format(v) -> Optional[tuple[str, str]]:
    """OpenAI's response_format -> Request.grammar: {"type": "text"} -> None, {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"schema": {...}, "name", "description", "strict" optional}}."""
    if not isinstance(v, dict) or v.get("type") not in FORMATS:
        raise ValueError(f"'response_format' must be an object with 'type' one of {list(FORMATS)}, got {v!r:.80}")
    extra = sorted(set(v) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"'response_format' has unknown field(s) {extra}; expected 'type' and 'json_schema'")
    kind, spec = v["type"], v.get("json_schema")
    if kind != "json_schema":
        if spec is not None:
            raise ValueError(f"'response_format.json_schema' goes with 'type': 'json_schema', not {kind!r}")
        return None if kind == "text" else ("json_object", ANY_OBJECT)
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError(f"'response_format.json_schema' must be an object with a 'schema' object, got {spec!r:.80}")
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        raise ValueError(f"'response_format.json_schema' has unknown field(s) {extra}; expected some of "
                         f"['name', 'description', 'schema', 'strict']")
    return "json_schema", json.dumps(spec["schema"])


INSTALL = "pip install 'tp_lora[structured]' (the xgrammar grammar library)"
SEPARATORS = (",", ":")  # compact JSON


def library():
    """The xgrammar module, or None where the `structured` extra is not installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


def message(e: Exception) -> str:
    """The library's error without its log prefix ('[12:00:00] /path/file.cc:123: ')."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())


def field_of(kind: str) -> str:
    return "response_format.json_schema.schema" if kind == "json_schema" else "response_format"


def schema_error(grammar: tuple[str, str]) -> Optional[str]:
    """Why `grammar` (a Request.grammar) cannot be built, found without a tokenizer (the HTTP front end's check),
    or None."""
    kind, text = grammar
    xgr = library()
    if xgr is None:
        return f"'response_format' {kind!r} needs the grammar library: {INSTALL}"
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=SEPARATORS)
    except (RuntimeError, ValueError) as e:
        return f"'{field_of(kind)}' is not a JSON schema this server can follow: {message(e)}"
    return None
