"""The project's import shape (docs/ARCHITECTURE.md) holds: no import cycle among the modules of its packages
(imports inside functions counted too: a lazy import still ties two modules together), the runtime never imports
the measurement package, the seed-API shim is a leaf nothing else in the runtime imports, and no module of the
measurement package takes another module's underscore name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("epgen", "generator", "runtime", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def from_module(package: str, node: ast.ImportFrom) -> str:
    """The module a `from ... import` statement in `package` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from pkg import mod` names the module)."""
    package = package_of(name, path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_module(package, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import generator.specs` ties to generator.specs; a name in a module, to it
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_packages_and_their_edges():
    g = graph()
    assert {"runtime.op", "runtime.backends.native", "generator.specs", "bench.sweep"} <= set(g)
    assert "runtime.backends" in g["runtime.op"]          # relative import of a subpackage
    assert "runtime.config" in g["runtime.backends.native"]  # `from ..config import`
    assert "runtime" in g["bench.sweep"]                  # `from runtime import ...`


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_project_packages():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("src", ["runtime", "generator"])
def test_the_library_packages_never_import_the_measurement_package(src):
    g = graph()
    bad = sorted(f"{m} -> {t}" for m, ts in g.items() if m.split(".")[0] == src
                 for t in ts if t.split(".")[0] == "bench")
    assert not bad, f"{src} imports the measurement package: {bad}"


def test_the_generator_never_imports_the_runtime():
    g = graph()
    bad = sorted(f"{m} -> {t}" for m, ts in g.items() if m.startswith("generator") for t in ts
                 if t.split(".")[0] == "runtime")
    assert not bad, bad


def test_the_seed_shim_is_a_leaf():
    g = graph()
    shim = "runtime.seed_compat"
    users = sorted(m for m, ts in g.items() if m.split(".")[0] != "bench" and not (m == shim or m.startswith(shim + "."))
                   and any(t == shim or t.startswith(shim + ".") for t in ts))
    assert not users, f"the core imports the seed-API shim: {users}"


def test_the_framework_integrations_are_leaves_and_alone_import_their_frameworks():
    """runtime.integrations.* (torchtitan's token dispatcher) import an optional framework: nothing in the project
    imports them, and no other module of the packages imports the framework."""
    g = graph()
    pkg = "runtime.integrations"
    users = sorted(m for m, ts in g.items() if not m.startswith(pkg) for t in ts if t.startswith(pkg + "."))
    assert not users, f"modules import a framework integration: {users}"
    framework = sorted(name for name, path in modules().items() if not name.startswith(pkg + ".")
                       for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                           n.split(".")[0] == "torchtitan" for n in
                           ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
                           if not getattr(node, "level", 0)))
    assert not framework, f"modules outside runtime.integrations import torchtitan: {framework}"


def test_the_core_reaches_the_backends_only_through_their_factory():
    g = graph()
    core = [m for m in g if m.startswith("runtime") and not m.startswith("runtime.backends")
            and m != "runtime.seed_compat" and not m.startswith("runtime.seed_compat.")]
    bad = sorted(f"{m} -> {t}" for m in core for t in g[m]
                 if t.startswith("runtime.backends."))
    assert not bad, f"core modules import a backend module directly (use runtime.backends.make): {bad}"


def private_uses(name: str, path: Path, known: set[str]) -> list[str]:
    """The underscore names of other project modules that `name` takes: `from m import _x`, or `b._x` where `b`
    is a module of the project imported by name (dunders such as `__doc__` are public)."""
    package = package_of(name, path)
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = from_module(package, node)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif a.name.startswith("_") and base in known and base != name:
                    out.append(f"{name}: from {base} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in known:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    return out


def test_no_bench_module_takes_another_modules_private_name():
    mods = modules()
    known = set(mods)
    bad = sorted(u for name, path in mods.items() if name.split(".")[0] == "bench"
                 for u in private_uses(name, path, known))
    assert not bad, f"bench modules use other modules' underscore names (make the name public where it belongs): {bad}"


def test_the_private_name_finder_sees_both_spellings(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from . import core as B\nfrom .core import _x, y\nB._stats([])\nB.__doc__\n")
    assert private_uses("bench.m", src, {"bench", "bench.m", "bench.core"}) == \
        ["bench.m: from bench.core import _x", "bench.m: bench.core._stats"]
