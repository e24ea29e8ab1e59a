"""A graphed step's kernels on its critical path. Under programmatic dependent launch a kernel starts while the one
before it finishes (and waits there), so kernels' device times overlap and sum past the step. A kernel's marginal
time is how far it moves the end of everything that started before it: its end minus the latest end so far (the
launch gap before it included, up to GAP_US; a longer idle, between replays, is nobody's). A step's marginals sum
to its span. One GEMM kernel serves every projection, so GEMMs are named by their decoder-layer neighbours (the one
before decode attention is qkv, after it o; before act_mul gate_up, after it down).
"""
from __future__ import annotations

GAP_US = 20.0  # idle longer than this between kernels is not charged to the next one
ROLES = {("next", "attention"): "qkv", ("prev", "attention"): "o", ("next", "act * mul"): "gate_up",
         ("prev", "act * mul"): "down"}


def marginals(spans: list[tuple[float, float]]) -> list[float]:
    """The marginal time of each (start, end) interval, in start order as given (microseconds)."""
    out, last = [], None
    for start, end in spans:
        if last is None or start - last > GAP_US:
            last = start
        out.append(max(0.0, end - last))
        last = max(last, end)
    return out


def roles(kinds: list[str], gemm: str = "GEMM") -> list[str]:
    """Each kernel's kind, GEMMs named by the nearest other kinds after and before them (ROLES; "GEMM" where
    neither names it, as the LM head)."""
    out = []
    for i, kind in enumerate(kinds):
        if kind != gemm:
            out.append(kind)
            continue
        after = next((k for k in kinds[i + 1:] if k != gemm), None)
        before = next((k for k in reversed(kinds[:i]) if k != gemm), None)
        out.append(f"{gemm} " + ROLES.get(("next", after), ROLES.get(("prev", before), "other")))
    return out


def role_table(events: list[tuple[str, float, float]], kind_of, steps: int) -> dict[str, dict]:
    """Per role (roles() of kind_of(name)): calls, device us and marginal us per step, from (name, start, end) device
    events of `steps` replays."""
    events = sorted(events, key=lambda e: e[1])
    names = roles([kind_of(name) for name, _, _ in events])
    table: dict[str, dict] = {}
    for role, (_, start, end), marginal in zip(names, events, marginals([(s, e) for _, s, e in events])):
        row = table.setdefault(role, dict(calls=0.0, us=0.0, marginal_us=0.0))
        row["calls"] += 1 / steps
        row["us"] += (end - start) / steps
        row["marginal_us"] += marginal / steps
    return table
