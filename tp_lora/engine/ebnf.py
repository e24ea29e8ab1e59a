"""Bounded repetitions of a grammar's EBNF (xgrammar's text form) written out as chains of rules.

xgrammar turns a JSON schema's bounds (maxLength, maxItems, ...) into `rule{lo, hi}`; its matcher fills the next
token's mask for a position inside such a repetition far more slowly than for a position of an ordinary rule. The
same language as `lo` copies of the rule and a chain of optional ones, `rule__upto_k ::= "" | rule rule__upto_(k-1)`,
gives every position a rule of its own. Where a string literal follows the repetition in its sequence (a JSON
string's closing quote, an array's `]`), the literal is folded into the chain instead, `rule__then_k ::= "L" | rule
rule__then_(k-1)`: no rule of the chain may end empty, so the matcher decides a token's fate inside the chain rather
than trying each token against what follows (the first characters of a bounded string: ms a row). Only repetitions of
a named rule with a bound up to `most` change; string literals and character classes are copied as they are."""
from __future__ import annotations

import re
from typing import Iterator, Optional

REPEAT = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (\d+)\}")  # rule{lo, hi}; hi -1 (no bound)
MOST = 64  # the largest upper bound written out (each bound up to it adds that many rules)


def expand_repetitions(ebnf: str, most: int = MOST) -> str:
    """ebnf with each `rule{lo, hi}` (0 <= lo <= hi <= most) written out as a sequence and a chain of rules, a string
    literal right after it in its sequence folded into the chain."""
    made: dict[str, str] = {}  # new rule name -> its definition
    tags: dict[tuple[str, str], str] = {}  # (rule, folded literal) -> the name its chain's rules start with

    def chain(m: re.Match, then: Optional[str] = None) -> str:
        """The text for repetition m, and for `then` (a string literal after it) if given."""
        name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if then is None:
            for k in range(1, hi - lo + 1):
                rest = f" {name}__upto_{k - 1}" if k > 1 else ""
                made.setdefault(f"{name}__upto_{k}", f'("" | ({name}{rest}))')
            parts = [name] * lo + ([f"{name}__upto_{hi - lo}"] if hi > lo else [])
            return f"({' '.join(parts)})" if parts else '""'
        tag = tags.setdefault((name, then), f"{name}__then{sum(n == name for n, _ in tags)}")
        made.setdefault(f"{tag}_0", f"({then})")
        for k in range(1, hi - lo + 1):
            made.setdefault(f"{tag}_{k}", f"(({then}) | ({name} {tag}_{k - 1}))")
        return f"({' '.join([name] * lo + [f'{tag}_{hi - lo}'])})"

    def bounded(m: re.Match) -> bool:
        return int(m.group(2)) <= int(m.group(3)) <= most

    out, pieces, i = [], list(_pieces(ebnf)), 0
    while i < len(pieces):
        code, piece = pieces[i]
        i += 1
        if not code:
            out.append(piece)
            continue
        found = [m for m in REPEAT.finditer(piece) if bounded(m)]
        then = pieces[i][1] if i < len(pieces) and pieces[i][1].startswith('"') else None
        if then is not None and i + 1 < len(pieces) and pieces[i + 1][1][:1] in ("*", "+", "?", "{"):
            then = None  # the literal has an operator of its own
        fold = found and then is not None and not piece[found[-1].end():].strip()
        at = 0
        for m in found:
            out.append(piece[at:m.start()] + chain(m, then if fold and m is found[-1] else None))
            at = m.end()
        if fold:
            i += 1  # the literal is in the chain now (what is left of the piece is blank)
        else:
            out.append(piece[at:])
    text = "".join(out)
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
