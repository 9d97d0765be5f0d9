"""The house rules of docs/architecture.md, read from the code itself.

Every import of the package is read from its source (the ones inside functions too, and
those under ``if TYPE_CHECKING``), so a lazy import cannot hide an upward edge or a
cycle. The layers are the page's table; a module the table does not place is a failure
that says to place it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fdl_fabric"

#: The layers, lowest first: a module imports only its own layer and those below
#: (docs/architecture.md, "Packages, by layer"). Keys are top-level modules or packages.
LAYERS: dict[str, int] = {
    # The vocabulary every layer may use, and the two standalone parts shipped to hosts
    # or imported by training scripts (standard library only: tests/test_agent.py).
    "agent": 0, "rank": 0, "events": 0, "errors": 0, "limits": 0, "shell": 0, "inert": 0,
    "reports": 0, "states": 0, "causes": 0, "shutdown": 0, "masking": 0,
    # The join handshake, shared by the launcher's window and `fdl-fabric join`.
    "joinwire": 0, "tlsstream": 0,
    "clusterfile": 1,
    "planning": 2,
    "presentation": 3,
    "transport": 4,
    "supervision": 5,
    "preflight": 6, "sync": 6,
    "runs": 7,
    "commands": 8,
    "api": 9, "results": 9, "handle": 9, "tasks": 9, "__init__": 9, "testing": 9,
    # The programs, over the task collection: `fdl-fabric` and ``python -m fdl_fabric``.
    "commands.cli": 10, "__main__": 10,
}
#: Edges the linear order would allow but the page forbids: supervision emits data and
#: never renders words.
NEVER: set[tuple[str, str]] = {("supervision", "presentation")}
#: The names of the built-in transport kinds, and the modules that implement them.
KIND_NAMES = {"local", "ssh", "slurm", "gateway", "join"}
KIND_MODULES = {"local", "ssh", "slurm", "gateway", "kinds", "sshconfig", "tunnel", "joining"}
MODULE_LINES_MAX = 600


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of import nodes under ``if TYPE_CHECKING:``: never run, so never a cycle
    (they still count for the layers: a type is a dependency too)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return found


def _imports(name: str, modules: dict[str, Path], *, runtime: bool = False
             ) -> Iterator[tuple[str, int]]:
    """The package's modules ``name`` imports, anywhere in its source, with the line
    (``runtime``: only the imports that run)."""
    tree = ast.parse(modules[name].read_text(encoding="utf-8"))
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    skip = _type_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fdl_fabric"):
                    yield _known(alias.name, modules), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fdl_fabric"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    yield sub, node.lineno
                elif not (target == "fdl_fabric" and alias.name == "__version__"):
                    yield _known(target, modules), node.lineno


def _known(name: str, modules: dict[str, Path]) -> str:
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _part(name: str) -> str:
    """The key of a module's layer: itself where the table places it alone (a program
    inside its package), else the top-level module or package it belongs to."""
    parts = name.split(".")
    if ".".join(parts[1:]) in LAYERS and len(parts) > 2:
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else "__init__"


@lru_cache(maxsize=2)
def _graph(runtime: bool = False) -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: {target: line for target, line in _imports(name, modules, runtime=runtime)
                   if target != name}
            for name in modules}


def test_every_module_has_a_layer() -> None:
    unplaced = sorted({_part(m) for m in _modules()} - set(LAYERS))
    assert not unplaced, (f"place these in LAYERS here and in docs/architecture.md's "
                          f"table: {unplaced}")


def test_no_import_points_up_a_layer_even_inside_a_function() -> None:
    upward = []
    for name, targets in _graph().items():
        for target, line in targets.items():
            src, dst = _part(name), _part(target)
            if src not in LAYERS or dst not in LAYERS:
                continue
            if LAYERS[dst] > LAYERS[src] or (src, dst) in NEVER:
                upward.append(f"{name}:{line} imports {target}")
    assert not upward, "\n".join(upward)


def test_the_agent_and_the_rank_client_import_nothing_else_of_ours() -> None:
    outside = [f"{name}:{line} imports {target}"
               for name, targets in _graph().items() if _part(name) in ("agent", "rank")
               for target, line in targets.items() if _part(target) not in ("agent", "rank")]
    assert not outside, "\n".join(outside)


def test_there_is_no_import_cycle_even_through_lazy_imports() -> None:
    graph = _graph(runtime=True)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _kind_uses(path: Path) -> Iterator[str]:
    """Where a module outside transport/ names a kind: imports an implementation module
    or class, or compares a ``transport``/``kind`` with a kind's name, or passes one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if "transport" in parts and parts[-1] in KIND_MODULES:
                yield f"line {node.lineno}: imports transport.{parts[-1]}"
            for alias in node.names:
                if alias.name.endswith("Transport") and alias.name != "Transport":
                    yield f"line {node.lineno}: imports {alias.name}"
                if "transport" in parts and alias.name in KIND_MODULES:
                    yield f"line {node.lineno}: imports transport.{alias.name}"
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr in ("transport", "kind")
                        for s in sides)
            consts = [c.value for s in sides for c in ast.walk(s)
                      if isinstance(c, ast.Constant)]
            if named and KIND_NAMES & {c for c in consts if isinstance(c, str)}:
                yield f"line {node.lineno}: compares a host's kind with a kind's name"
        elif isinstance(node, ast.keyword) and node.arg == "transport" and \
                isinstance(node.value, ast.Constant) and node.value.value in KIND_NAMES:
            yield f"line {node.value.lineno}: transport={node.value.value!r}"


def test_no_module_outside_transport_names_a_transport_kind() -> None:
    found = [f"{name} {use}" for name, path in _modules().items()
             if _part(name) != "transport" for use in _kind_uses(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source", [
    "from ..transport.ssh import SshTransport\n",
    "if w.transport == 'ssh':\n    pass\n",
    "WorkerSpec(host='a', transport='local')\n",
    "from ..transport import gateway\n",
])
def test_the_kind_check_sees_each_way_of_naming_a_kind(tmp_path: Path, source: str) -> None:
    module = tmp_path / "m.py"
    module.write_text(source, encoding="utf-8")
    assert list(_kind_uses(module)), source


def test_no_package_module_is_over_600_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_MAX}
    assert not long, long
