"""The layers hold: the library imports no UI or web framework, lower modules never import upper
ones, there is no import circle, front ends use only public names of the library, and no module of
the library, the server or the TUI is over 600 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Modules at the bottom: they may import each other (and the standard library / third parties), nothing else.
BOTTOM = {"edgeinfer.errors", "edgeinfer.cancel", "edgeinfer.quant_types", "edgeinfer.paths",
          "edgeinfer.fsutil", "edgeinfer.kv_types", "edgeinfer.llama_backend", "edgeinfer.cpu"}
# (importer prefix, imported prefix) pairs that must never appear: each is an upward import.
FORBIDDEN = [
    ("edgeinfer.hub", "edgeinfer.convert"),
    ("edgeinfer.hub", "edgeinfer.quantize"),
    ("edgeinfer.hub", "edgeinfer.pull"),
    ("edgeinfer.hub", "edgeinfer.engine"),
    # speculation is policy and drafters over runtimes it is given: the engine (faces/speculation_setup.py) makes
    # self-drafts with the quantizer and keeps costs in the store, speculation never does
    ("edgeinfer.engine.speculation", "edgeinfer.quantize"),
    ("edgeinfer.engine.speculation", "edgeinfer.store"),
    ("edgeinfer.engine", "edgeinfer.pull"),
    ("edgeinfer.engine", "edgeinfer.hub"),
    ("edgeinfer.engine", "edgeinfer.convert"),
    ("edgeinfer.quantize", "edgeinfer.engine"),
    ("edgeinfer.convert", "edgeinfer.engine"),
    ("edgeinfer.store", "edgeinfer.engine"),
    ("edgeinfer.store", "edgeinfer.service"),
    # validation sits under the store (which registers through it), the engine and the service
    ("edgeinfer.validate", "edgeinfer.store"),
    ("edgeinfer.validate", "edgeinfer.engine"),
    ("edgeinfer.validate", "edgeinfer.service"),
    # where layers run is asked of the build, below every load
    ("edgeinfer.devices", "edgeinfer.store"),
    ("edgeinfer.devices", "edgeinfer.engine"),
    ("edgeinfer.devices", "edgeinfer.service"),
    # the service is over the engine, never under it
    ("edgeinfer.engine", "edgeinfer.service"),
]
UI_AND_WEB = ("textual", "rich", "starlette", "uvicorn", "fastapi", "sse_starlette", "edgeinfer_tui",
              "edgeinfer_server")


def _modules(package_dir: Path, package: str) -> dict[str, Path]:
    mods = {}
    for p in package_dir.rglob("*.py"):
        rel = p.relative_to(package_dir).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _imports(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of `known` that `mod` imports, anywhere in the file (function-level too)."""
    is_pkg = path.name == "__init__.py"
    base = mod if is_pkg else mod.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                b = ".".join(parts + ([node.module] if node.module else []))
            else:
                b = node.module or ""
            names = [f"{b}.{a.name}" if f"{b}.{a.name}" in known else b for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod and not mod.startswith(n + "."):
                found.add(n)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _modules(ROOT / "edgeinfer", "edgeinfer")
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_library_imports_no_ui_or_web_framework():
    code = (
        "import sys, edgeinfer, edgeinfer.cli, pkgutil, importlib;"
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(edgeinfer.__path__, 'edgeinfer.')"
        " if m.name != 'edgeinfer.__main__'];"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {UI_AND_WEB!r});"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"edgeinfer imported UI/web modules: {out}"


def test_bottom_modules_import_only_the_bottom(graph):
    missing = BOTTOM - graph.keys()
    assert not missing, f"bottom modules that no longer exist (renamed?): {sorted(missing)}"
    for mod in BOTTOM:
        upward = {m for m in graph[mod] if m not in BOTTOM}
        assert not upward, f"{mod} is a bottom module but imports {sorted(upward)}"


def test_no_upward_imports(graph):
    bad = [
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        for dep in deps
        for low, high in FORBIDDEN
        if (mod == low or mod.startswith(low + ".")) and (dep == high or dep.startswith(high + "."))
    ]
    bad += [f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
            if dep.startswith("edgeinfer.cli") and not mod.startswith("edgeinfer.cli") and mod != "edgeinfer.__main__"]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_circle(graph):
    # Tarjan's strongly connected components; any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # Packages importing their own submodules (edgeinfer -> edgeinfer.engine -> ...) are not edges here,
    # so every reported component is a real circle.
    assert not circles, f"import circles: {circles}"


def _private_uses(front_end_dir: Path) -> list[str]:
    bad = []
    for p in front_end_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "edgeinfer":
                if any(part.startswith("_") for part in node.module.split(".")):
                    bad.append(f"{p.name}: from {node.module}")
                bad += [f"{p.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                bad += [f"{p.name}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "edgeinfer" and any(s.startswith("_") for s in a.name.split("."))]
    return bad


def test_front_ends_use_only_public_names():
    for front_end in ("tui", "server"):
        if (ROOT / front_end).is_dir():
            assert not _private_uses(ROOT / front_end), _private_uses(ROOT / front_end)


def test_public_api_is_declared_and_defined():
    import importlib
    import pkgutil

    import edgeinfer

    assert len(set(edgeinfer.__all__)) == len(edgeinfer.__all__), "duplicate names in edgeinfer.__all__"
    for name in edgeinfer.__all__:
        assert getattr(edgeinfer, name, None) is not None, f"edgeinfer.__all__ names {name}, which is not defined"
    # every public module declares what it exports, and defines all of it
    for info in pkgutil.walk_packages(edgeinfer.__path__, "edgeinfer."):
        if any(part.startswith("_") for part in info.name.split(".")) or ".cli" in info.name:
            continue
        mod = importlib.import_module(info.name)
        exported = getattr(mod, "__all__", None)
        assert exported is not None, f"{info.name} has no __all__"
        missing = [n for n in exported if not hasattr(mod, n)]
        assert not missing, f"{info.name}.__all__ names undefined {missing}"


MODULE_MAX_LINES = 600  # issues 23 and 43: a module one can read whole (split by concern, never by cutting comments)
LINE_RULE_COVERS = ("edgeinfer", "server", "tui")  # the library (engine/ included), the server, the TUI


def test_no_module_is_over_600_lines():
    """Every .py file under edgeinfer/, server/ and tui/, __init__.py files included."""
    modules = sorted(p for top in LINE_RULE_COVERS for p in (ROOT / top).rglob("*.py"))
    for top in LINE_RULE_COVERS:  # each is where it was (a moved tree must not pass by being empty)
        assert sum(1 for p in modules if p.relative_to(ROOT).parts[0] == top) > 10, top
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines()) for p in modules}
    over = {name: n for name, n in sizes.items() if n > MODULE_MAX_LINES}
    assert not over, f"modules over {MODULE_MAX_LINES} lines: {over}"
