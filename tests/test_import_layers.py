"""The extract stage's modules import one another without a circle: every ``import`` (at module
level or inside a function, not under ``if TYPE_CHECKING:``) of a featcache module is an edge, and
the graph has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import featcache

ROOT = Path(featcache.__file__).parent


def _modules(root: Path, package: str, sub: str) -> dict[str, Path]:
    out = {}
    for p in sorted((root / sub).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = p
    return out


def _imports(mod: str, path: Path) -> set[str]:
    """Every module name ``path`` imports (``from a import b`` names ``a`` and ``a.b``)."""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    static = {  # `if TYPE_CHECKING:` imports never run: names for type checkers only
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in static:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                name = ".".join([*prefix, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


def import_graph(root: Path, package: str, sub: str) -> dict[str, set[str]]:
    mods = _modules(root, package, sub)
    return {m: {d for d in _imports(m, p) if d in mods and d != m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_extract_has_no_import_circle():
    graph = import_graph(ROOT, "featcache", "extract")
    assert "featcache.extract.pipeline" in graph  # the scan sees the package
    found = cycles(graph)
    lines = [f"{m} -> {sorted(graph[m] & set(c))}" for c in found for m in c]
    assert not found, "import circle(s) in extract/:\n" + "\n".join(lines)


def test_the_scan_sees_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "stage"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from featcache.stage import b\n")
    (pkg / "b.py").write_text("def f():\n    from featcache.stage.sub.c import g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import x\n")
    (pkg / "d.py").write_text("import featcache.stage.a\n")
    graph = import_graph(tmp_path, "featcache", "stage")
    assert graph["featcache.stage.d"] == {"featcache.stage.a"}
    assert cycles(graph) == [["featcache.stage.a", "featcache.stage.b", "featcache.stage.sub.c"]]


def test_every_package_is_shipped():
    """pyproject lists packages one by one: a new subpackage (extract/readers) must be in it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}
    found = {
        ".".join(["featcache", *p.parent.relative_to(ROOT).parts])
        for p in ROOT.rglob("__init__.py")
        if not skip & set(p.relative_to(ROOT).parts)
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
