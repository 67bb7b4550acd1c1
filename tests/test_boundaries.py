"""Package boundaries: who may import whom (docs/architecture.md), and no import cycles.

The layers are read from the "Layers" table of docs/architecture.md itself (its "may import"
column), so the document and the check cannot disagree; there is no list of exceptions.
Imports under ``if TYPE_CHECKING:`` and inside functions count like any other. And Flower's
internals: no module but Flower's public ones is imported outside ``common/flower_compat.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("learning", "common", "strategies", "client", "server", "ops")


def _layers_of_the_architecture_doc() -> dict[str, set[str]]:
    """The "Layers" table of docs/architecture.md: package -> the layers it may import (its
    own always; ``strategies`` includes its pure ``*_math`` modules)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        package = cells[0].strip("`/")
        may = cells[2]
        if may == "everything":
            layers = {*PACKAGES, "strategies_math"}
        elif may == "nothing of ours":
            layers = set()
        else:
            names = re.findall(r"`([^`]+)`", may)
            layers = {"strategies_math" if n.endswith("_math.py") else n.strip("/") for n in names}
        layers.add(package)
        if "strategies" in layers:
            layers.add("strategies_math")
        allowed[package] = layers
    return allowed


ALLOWED = _layers_of_the_architecture_doc()


def _imports(path: Path) -> list[tuple[str, int]]:
    """Project modules imported by ``path`` (module name, line), wherever the import is: in a
    function, or under ``if TYPE_CHECKING:`` (a type hint that names a higher layer is a
    dependency on it all the same)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
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


def test_the_doc_table_is_read() -> None:
    assert set(ALLOWED) == set(PACKAGES)
    assert ALLOWED["learning"] == {"learning"}
    assert ALLOWED["client"] == {"client", "common", "learning", "strategies_math"}


def test_packages_import_only_from_allowed_layers() -> None:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for module, line in _imports(path):
                layer = _layer(module)
                if layer not in ALLOWED[pkg]:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, "imports across the package boundaries:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
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


# Flower's public API: what its docs present to app authors (1.39 and 1.42 alike). A submodule of
# one of these (``flwr.app.error``) is Flower's own layout, not its API.
PUBLIC_FLOWER = {"flwr", "flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp",
                 "flwr.simulation", "flwr.common.logger",
                 # the SecAgg+ primitives (Shamir sharing, shared keys and encryption, the mask
                 # generator), unchanged from 1.39 to 1.42 (common/secure_aggregation.py)
                 "flwr.common.secure_aggregation.crypto.shamir",
                 "flwr.common.secure_aggregation.crypto.symmetric_encryption",
                 "flwr.common.secure_aggregation.secaggplus_utils"}
SOURCE_DIRS = ("client", "common", "learning", "strategies", "server", "ops", "bench")


def flower_imports(path: Path) -> list[tuple[str, int]]:
    """Every ``flwr`` module a file imports (TYPE_CHECKING blocks and function bodies included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names if name.split(".")[0] == "flwr"]
    return found


def test_no_flower_module_but_the_public_ones_outside_the_compat_module() -> None:
    offenders = [f"{path.relative_to(REPO)}:{line} imports {module}"
                 for folder in SOURCE_DIRS for path in sorted((REPO / folder).rglob("*.py"))
                 if path != REPO / "common" / "flower_compat.py"
                 for module, line in flower_imports(path) if module not in PUBLIC_FLOWER]
    assert offenders == [], ("Flower internals outside common/flower_compat.py (give each a compat "
                             "item naming Flower's file): " + "; ".join(offenders))


def test_the_boundary_check_sees_an_internal_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from flwr.supercore.task_identity import TaskIdentity\n"
                     "def f():\n    import flwr.common.serde\n    from flwr.app import Message\n")
    assert [m for m, _ in flower_imports(probe) if m not in PUBLIC_FLOWER] == [
        "flwr.supercore.task_identity", "flwr.common.serde"]


def test_a_type_checking_import_counts(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from client.trainer import X\n"
                     "def f():\n    from server.app import app\n")
    assert [m for m, _ in _imports(probe)] == ["client.trainer", "server.app"]


# The method registry names its classes as "module:attribute" strings (conf/strategy/<name>.yaml,
# loaded with importlib), which no import above sees: each kind of string is held to a layer here.
# The server and client classes are loaded by the two app edges only; the options, role rule and
# wrapper by composition (common/methods.py: resolve_method, roles_of, build_method_model), which
# both sides run, so they live in the parts both sides read.
ROW_STRING_LAYERS = {"server": {"strategies"}, "client": {"client"},
                     "options": {"common", "strategies_math"}, "roles": {"common", "strategies_math"},
                     "wrapper": {"learning", "strategies_math"}}


def _row_strings() -> list[tuple[str, str, str]]:
    """(method, key, module) of every "module:attribute" string of every row and variant."""
    from common.methods import method, method_names

    found = []
    for name in method_names():
        row = method(name)
        for label, r in [(name, row), *((f"{name} ({flag})", v) for flag, v in row.variants)]:
            for key in ROW_STRING_LAYERS:
                value = getattr(r, key)
                if ":" in value:
                    found.append((label, key, value.partition(":")[0]))
    return found


def test_the_registrys_class_names_stay_in_their_layers() -> None:
    strings = _row_strings()
    assert {key for _, key, _ in strings} == set(ROW_STRING_LAYERS)   # every kind is named somewhere
    bad = [f"conf/strategy: {label} names {key} {module} (layer {_layer(module)}; allowed: "
           f"{sorted(ROW_STRING_LAYERS[key])})"
           for label, key, module in strings if _layer(module) not in ROW_STRING_LAYERS[key]]
    assert not bad, "\n".join(bad)


def _loads_a_side_class(path: Path) -> bool:
    """Whether ``path`` calls ``load_named(<anything>.server)`` or ``load_named(<anything>.client)``."""
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "load_named"
               and node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr in ("server", "client")
               for node in ast.walk(ast.parse(path.read_text())))


def test_only_the_two_edges_load_the_server_and_client_classes(tmp_path: Path) -> None:
    loaders = sorted(str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")
                     if _loads_a_side_class(p))
    assert loaders == ["client/handlers.py", "server/app.py"], loaders
    probe = tmp_path / "probe.py"    # the form the edges replaced is seen too
    probe.write_text("def f(name, options):\n    return load_named(method(name, options).server)\n")
    assert _loads_a_side_class(probe)
