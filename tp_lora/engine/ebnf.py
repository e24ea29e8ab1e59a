"""Bounded repetitions of a grammar's EBNF (xgrammar's text form) written out as chains of rules.

xgrammar turns a JSON schema's bounds (maxLength, maxItems, ...) into `rule{lo, hi}`; its matcher fills the next
token's mask for a position inside such a repetition far more slowly than for a position of an ordinary rule. The
same language as `lo` copies of the rule and a chain of optional ones, `rule__upto_k ::= "" | rule rule__upto_(k-1)`,
gives every position a rule of its own. Only repetitions of a named rule with a bound up to `most` change; string
literals and character classes are copied as they are."""
from __future__ import annotations

import re
from typing import Iterator

REPEAT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (\d+)\}")  # rule{lo, hi}; hi -1 (no bound)
MOST = 64  # the largest upper bound written out (each bound up to it adds that many rules)


def expand_repetitions(ebnf: str, most: int = MOST) -> str:
    """ebnf with each `rule{lo, hi}` (0 <= lo <= hi <= most) written out as a sequence and a chain of rules."""
    made: dict[str, str] = {}  # new rule name -> its definition

    def chain(m: re.Match) -> str:
        name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if lo > hi or hi > most:
            return m.group(0)
        for k in range(1, hi - lo + 1):
            rest = f" {name}__upto_{k - 1}" if k > 1 else ""
            made.setdefault(f"{name}__upto_{k}", f'("" | ({name}{rest}))')
        parts = [name] * lo + ([f"{name}__upto_{hi - lo}"] if hi > lo else [])
        return f"({' '.join(parts)})" if parts else '""'

    text = "".join(REPEAT.sub(chain, piece) if code else piece for code, piece in _pieces(ebnf))
    return text.rstrip("\n") + "".join(f"\n{name} ::= {body}" for name, body in made.items()) + "\n"


def _pieces(ebnf: str) -> Iterator[tuple[bool, str]]:
    """ebnf in order as (is grammar code, text): string literals ("...") and character classes ([...]) apart, with
    their backslash escapes, so that nothing inside them is taken for a repetition."""
    start = i = 0
    while i < len(ebnf):
        if ebnf[i] not in '"[':
            i += 1
            continue
        close, j = '"' if ebnf[i] == '"' else "]", i + 1
        while j < len(ebnf) and ebnf[j] != close:
            j += 2 if ebnf[j] == "\\" else 1
        if i > start:
            yield True, ebnf[start:i]
        yield False, ebnf[i:j + 1]
        start = i = j + 1
    if start < len(ebnf):
        yield True, ebnf[start:]
