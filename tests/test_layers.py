"""Imports point down the layers, and no module imports itself back through others.

Every import counts, also one inside a function: a function-level import may delay loading
(transformers, triton), never hide an upward import or a cycle. The layer of a module is that of the
longest prefix listed in LAYERS; every module of the package must have one.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ffl_backend"

# Lowest first. A module may import its own layer or a lower one.
LAYERS = (
    ("numerics", ("ffl_backend._lazy", "ffl_backend.paths", "ffl_backend.progress", "ffl_backend.numerics")),
    ("ops", ("ffl_backend.kernels", "ffl_backend.attention")),
    ("quantization", ("ffl_backend.quant",)),
    ("patterns", ("ffl_backend.patterns",)),
    ("integration", ("ffl_backend.config", "ffl_backend.report", "ffl_backend.cache_key", "ffl_backend.replay",
                     "ffl_backend.backend", "ffl_backend.generation", "ffl_backend.hf_attention",
                     "ffl_backend.window_cache", "ffl_backend.kv_cache", "ffl_backend.prompt_linears",
                     "ffl_backend.decode_loop", "ffl_backend.api", "ffl_backend.models", "ffl_backend.engine",
                     "ffl_backend.onnx")),
    ("tools", ("ffl_backend.bench", "ffl_backend.demo", "ffl_backend.quant.cli", "ffl_backend.serve",
               "ffl_backend.onnx.cli")),
    ("package", ("ffl_backend",)),  # the package's own __init__: lazy names for users only
)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, name: str, known: set) -> set:
    """The package modules `path` imports anywhere in its body (`from . import x` names module x)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph(root: pathlib.Path) -> dict:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, name, set(modules)) for name, path in modules.items()}


def layer_of(name: str, layers=LAYERS) -> int | None:
    best = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    return None if best is None else best[0]


def upward_imports(graph: dict, layers=LAYERS) -> list:
    return sorted(f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} ({layers[layer_of(b, layers)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b, layers) > layer_of(a, layers))


def cycles(graph: dict) -> list:
    """One path per strongly connected group of modules that import each other."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_every_module_has_a_layer():
    assert [name for name in import_graph(PACKAGE) if layer_of(name) is None] == []


def test_imports_only_point_down():
    assert upward_imports(import_graph(PACKAGE)) == []


def test_no_import_cycles():
    assert cycles(import_graph(PACKAGE)) == []


@pytest.fixture
def planted(tmp_path):
    """A two-layer package in which the low layer imports the high one, inside a function."""
    root = tmp_path / "ffl_backend"
    (root / "kernels").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "kernels" / "__init__.py").write_text("")
    (root / "kernels" / "op.py").write_text("def f():\n    from ..api import optimize\n")
    (root / "api.py").write_text("from .kernels import op\n")
    return root


def test_the_checks_catch_a_planted_upward_import_and_cycle(planted):
    graph = import_graph(planted)
    assert graph["ffl_backend.kernels.op"] == {"ffl_backend.api"}
    assert upward_imports(graph) == ["ffl_backend.kernels.op (ops) imports ffl_backend.api (integration)"]
    assert cycles(graph) == ["ffl_backend.api -> ffl_backend.kernels.op -> ffl_backend.api"]
