"""Package boundaries: who may import whom (docs/architecture.md), and no import cycles.

Layers, lowest first: ``learning`` (models, data, training loops) -> ``common`` (method
table, wire constants, options, parameter roles) -> ``strategies`` (server rules and their
pure math) -> ``client`` / ``server`` (the two apps) -> ``ops`` (operator tools). A package
imports only from layers below it; ``client`` may use the pure ``strategies.*_math``
modules (no Flower, no server state); ``client`` and ``server`` never import each other.
Imports under ``if TYPE_CHECKING:`` are type hints only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("learning", "common", "strategies", "client", "server", "ops")
ALLOWED: dict[str, set[str]] = {
    "learning": {"learning", "common"},
    "common": {"common", "learning"},
    "strategies": {"strategies", "common", "learning"},
    "client": {"client", "common", "learning", "strategies_math"},
    "server": {"server", "strategies", "common", "learning"},
    "ops": set(PACKAGES) | {"strategies_math"},
}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Project modules imported by ``path`` (module name, line), TYPE_CHECKING blocks skipped."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


def _layer(module: str) -> str:
    top = module.split(".")[0]
    if top == "strategies" and module.endswith("_math"):
        return "strategies_math"
    return top


def test_packages_import_only_from_allowed_layers() -> None:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).glob("*.py")):
            for module, line in _imports(path):
                layer = _layer(module)
                ok = ALLOWED[pkg] | ({"strategies"} if pkg in ("strategies", "server", "ops") else set())
                if layer not in ok and not (layer == "strategies_math" and "strategies" in ok):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, "imports across the package boundaries:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).glob("*.py"):
            name = f"{pkg}.{path.stem}" if path.stem != "__init__" else pkg
            graph[name] = {m for m, _ in _imports(path) if m in graph or (REPO / (m.replace(".", "/") + ".py")).exists()}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append(" -> ".join([*stack[stack.index(node):], node]))
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        visit(node, [], done)
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(sorted(set(cycles)))
