"""The package's shape, read with `ast` (imports inside functions count too): no import cycle between modules or
between folders, imports go down the layers (front ends -> engine -> models -> lora -> layers -> ops ->
distributed and the leaf utilities), no private name imported across modules, no module over MAX_LINES. Each rule
is also run on a small made-up package that breaks it, so a checker that finds nothing fails here."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "tp_lora")
MAX_LINES = 450
# What each part may import: a part imports parts of a lower level, and its own. Root modules not named are front
# ends (app, api, lifecycle, request_files, assets, testing).
LEVELS = {"distributed": 0, "config": 0, "sharding": 0, "hostcopy": 0, "streamwait": 0, "threadlocal": 0,
          "ops": 1, "layers": 2, "lora": 3, "models": 4, "engine": 5, "server": 6}
FRONT = 6
# Front ends that one another must not import (each stands on the shared lifecycle, not on the offline job).
FORBIDDEN = {("server", "app")}


def read_package(root: str) -> dict[str, str]:
    """Dotted module name (without the package) -> source, for every .py under root."""
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                name = rel[:-len(".__init__")] if rel.endswith("__init__") else rel
                with open(path) as fh:
                    out["" if name == "__init__" else name] = fh.read()
    return out


def imports(sources: dict[str, str], pkg: str = "tp_lora") -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """module -> [(imported module, names taken from it)] within the package."""
    out = {}
    for mod, src in sources.items():
        found = []
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                found += [(a.name[len(pkg) + 1:], ()) for a in node.names if a.name.startswith(pkg + ".")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and \
                    (node.module == pkg or node.module.startswith(pkg + ".")):
                base = node.module[len(pkg) + 1:]
                for a in node.names:
                    sub = f"{base}.{a.name}" if base else a.name
                    if sub in sources:  # `from pkg.x import module`
                        found.append((sub, ()))
                    else:
                        found.append((base, (a.name,)))
        out[mod] = found
    return out


def part(mod: str) -> str:
    return mod.split(".")[0]


def level(mod: str) -> int:
    return LEVELS.get(part(mod), FRONT)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def violations(sources: dict[str, str], max_lines: int = MAX_LINES) -> list[str]:
    graph = imports(sources)
    found = []
    modules = {m: {t for t, _ in deps if t != m and t in sources} for m, deps in graph.items()}
    found += [f"import cycle between modules: {' <-> '.join(c)}" for c in cycles(modules)]
    folders: dict[str, set[str]] = {}
    for m, deps in modules.items():
        folders.setdefault(part(m), set()).update(part(t) for t in deps if part(t) != part(m))
    found += [f"import cycle between folders: {' <-> '.join(c)}" for c in cycles(folders)]
    for m, deps in graph.items():
        for t, names in deps:
            if part(t) != part(m) and level(t) > level(m):
                found.append(f"{m} imports {t}: {part(m)} (level {level(m)}) may not import {part(t)} "
                             f"(level {level(t)})")
            if part(m) in LEVELS and part(t) in LEVELS and level(t) == level(m) and part(t) != part(m):
                found.append(f"{m} imports {t}: {part(m)} and {part(t)} are side by side")
            if (part(m), part(t)) in FORBIDDEN:
                found.append(f"{m} imports {t}: {part(m)} may not import {part(t)}")
            found += [f"{m} imports the private name {n} from {t}" for n in names
                      if n.startswith("_") and not n.startswith("__") and t != m]
    found += [f"{m} has {src.count(chr(10))} lines (at most {max_lines})" for m, src in sources.items()
              if src.count("\n") > max_lines]
    return found


def test_the_package_keeps_its_shape():
    assert violations(read_package(ROOT)) == []


@pytest.mark.parametrize("sources, words", [
    ({"engine.a": "from tp_lora.engine import b", "engine.b": "def f():\n    import tp_lora.engine.a"},
     "import cycle between modules: engine.a <-> engine.b"),
    ({"lora.a": "from tp_lora.layers.b import f", "layers.b": "from tp_lora.lora.c import g\nf = 1",
      "lora.c": "g = 1"}, "import cycle between folders: layers <-> lora"),
    ({"ops.k": "from tp_lora.lora.batch import LoRABatch", "lora.batch": "LoRABatch = 1"},
     "ops (level 1) may not import lora (level 3)"),
    ({"ops.k": "from tp_lora.layers.x import y", "layers.x": "y = 1"}, "ops (level 1) may not import layers"),
    ({"models.m": "def f():\n    from tp_lora.engine.core import EngineCore",
      "engine.core": "EngineCore = 1"}, "models (level 4) may not import engine"),
    ({"server.serve": "from tp_lora.app import log", "app": "log = 1"}, "server may not import app"),
    ({"lora.a": "from tp_lora.lora.b import _pad", "lora.b": "_pad = 1"}, "private name _pad from lora.b"),
    ({"engine.big": "x = 1\n" * 12}, "engine.big has 12 lines (at most 10)"),
])
def test_each_rule_finds_a_package_that_breaks_it(sources, words):
    found = violations(sources, max_lines=10)
    assert any(words in v for v in found), found
