"""featcache's modules import one another without a circle: every ``import`` (at module level or
inside a function, not under ``if TYPE_CHECKING:``) of a featcache module is an edge, across the
whole package (root modules, every stage, between packages), and the graph has no cycle.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module (Python finds a
submodule in ``sys.modules`` even while ``pkg/__init__`` is still running, and importing any
submodule runs ``pkg/__init__`` anyway, so that is no dependency on the package's own body),
else to ``pkg`` (its ``__init__`` defines or re-exports the name)."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import featcache

ROOT = Path(featcache.__file__).parent


SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed module (each file is parsed once per test session)."""
    return ast.parse(path.read_text(), str(path))


def _python_files(top: Path) -> list[Path]:
    """The ``.py`` files under ``top``, not descending into SKIP or hidden folders."""
    out = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith((".", "__pycache__"))]
        out += [Path(folder) / f for f in files if f.endswith(".py")]
    return out


def _modules(root: Path, package: str, sub: str = "") -> dict[str, Path]:
    """Module name -> file of every module under ``root / sub`` (``sub=""``: the whole package)."""
    out = {}
    for p in sorted(_python_files(root / sub)):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = p
    return out


def _imports(mod: str, path: Path, modules: Collection[str] = ()) -> set[str]:
    """Every module name ``path`` imports: ``from a import b`` names ``a.b`` when that is one of
    ``modules``, else ``a`` (``modules`` empty: both)."""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    tree = _tree(path)
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
            subs = {f"{name}.{a.name}" for a in node.names}
            found.update(subs)
            if not modules or subs - set(modules):
                found.add(name)
    return found


def import_graph(root: Path, package: str, sub: str = "") -> dict[str, set[str]]:
    mods = _modules(root, package, sub)
    return {m: {d for d in _imports(m, p, mods) if d in mods and d != m} for m, p in mods.items()}


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


def test_featcache_has_no_import_circle():
    graph = import_graph(ROOT, "featcache")
    for m in ("featcache", "featcache.errors", "featcache.extract.pipeline", "featcache.store.cache"):
        assert m in graph  # the scan sees the whole package...
    assert "featcache.store.manifest" in graph["featcache.store.cache"]  # ...and its edges
    assert not any(m.startswith(("featcache.tests", "featcache.benchmarks")) for m in graph)
    found = cycles(graph)
    lines = [
        f"circle {i}: " + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for i, c in enumerate(found, 1)
    ]
    assert not found, (
        "import circle(s) among featcache's modules (imports inside functions count; only `if TYPE_CHECKING:` "
        "ones do not). Move the shared piece into the lower module or a new small one; a registry imports "
        "none of its members (they import it and register):\n" + "\n".join(lines)
    )


def _registries(mods: dict[str, Path]) -> dict[str, tuple[str, set[str]]]:
    """Registry module -> (its ``register_*`` function, the other modules that call it)."""
    trees = {m: _tree(p) for m, p in mods.items()}
    called: dict[str, set[str]] = {}
    for m, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                f = n.func
                called.setdefault(getattr(f, "id", None) or getattr(f, "attr", ""), set()).add(m)
    return {
        m: (n.name, called.get(n.name, set()) - {m})
        for m, tree in trees.items()
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("register_")
    }


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_no_registry_imports_its_members():
    """timm's shape: a registry module (one defining ``register_*``) reaches none of the
    modules that register into it, even through others; the members import the registry,
    and the package ``__init__`` or one builtins module imports the members."""
    mods = _modules(ROOT, "featcache")
    graph = import_graph(ROOT, "featcache")
    regs = _registries(mods)
    assert regs["featcache.probes.solver_registry"][1] >= {"featcache.probes.elevater", "featcache.probes.lars"}
    assert "featcache.retrieval.revisited" in regs["featcache.retrieval.metrics"][1]
    bad = {r: sorted(_reachable(graph, r) & members) for r, (_, members) in regs.items()}
    bad = {r: ms for r, ms in bad.items() if ms}
    assert not bad, "registries that import their members (move the import to the package __init__): " + str(bad)


def test_every_registry_is_complete_whatever_is_imported_first():
    """With the registries importing no member, whoever imports the members must do it before
    a lookup: solvers.get_solver and retrieval's written metric names still see every built-in."""
    code = (
        "from featcache.retrieval.metrics import written_metric_names\n"
        "assert {'map_bob', 'mp@k', 'map@k'} <= set(written_metric_names()), written_metric_names()\n"
        "from featcache.probes.solvers import get_solver\n"
        "assert get_solver('elevater').name == 'elevater' and get_solver('lars').name == 'lars'\n"
        "from featcache.probes.solver_registry import SOLVERS\n"
        "assert {'elevater', 'lars', 'zeroshot'} <= set(SOLVERS), sorted(SOLVERS)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


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


def test_the_whole_package_scan_sees_circles_between_packages_and_root_modules(tmp_path):
    (tmp_path / "__init__.py").write_text("from featcache.core import f\n")
    (tmp_path / "core.py").write_text("def f():\n    from featcache.stage.a import g\n")
    for pkg in ("stage", "other", "tests"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "stage" / "__init__.py").write_text("from featcache.stage.a import g\n")
    (tmp_path / "stage" / "a.py").write_text("from featcache import core\n\ndef g():\n    pass\n")
    (tmp_path / "stage" / "b.py").write_text("from featcache.stage import a\n")  # the submodule, not __init__
    (tmp_path / "stage" / "c.py").write_text("from featcache.stage import a, g\n")  # g: __init__'s name
    (tmp_path / "other" / "__init__.py").write_text("")
    (tmp_path / "other" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from featcache.stage.a import g\n"
    )
    (tmp_path / "tests" / "test_x.py").write_text("import featcache.core\n")
    graph = import_graph(tmp_path, "featcache")
    assert sorted(graph) == [
        "featcache",
        "featcache.core",
        "featcache.other",
        "featcache.other.x",
        "featcache.stage",
        "featcache.stage.a",
        "featcache.stage.b",
        "featcache.stage.c",
    ]
    assert graph["featcache.stage.b"] == {"featcache.stage.a"}
    assert graph["featcache.stage.c"] == {"featcache.stage", "featcache.stage.a"}
    assert graph["featcache.other.x"] == set()
    assert cycles(graph) == [["featcache.core", "featcache.stage.a"]]


def test_every_package_is_shipped():
    """pyproject lists packages one by one: a new subpackage (data/readers) must be in it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}
    found = {
        ".".join(["featcache", *p.parent.relative_to(ROOT).parts])
        for p in ROOT.rglob("__init__.py")
        if not skip & set(p.relative_to(ROOT).parts)
    }
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


#: the stages: each runs one step of the work and has its own command
STAGES = {
    "extract",
    "probes",
    "retrieval",
    "similarity",
    "finetune",
    "sweep",
    "suites",
    "analysis",
    "demo",
    "interop",
    "dense",
}
#: the layers below the stages: what more than one stage builds on (models and images)
LAYERS = {"models", "data"}
#: below the layers: the store, the shared core, the public errors and the version
BASE = {"store", "core", "errors", "_version"}
#: above everything: ``featcache.testing``, the contracts a member written outside the repository
#: runs on itself (as ``zarr.testing``): it may import any stage, layer or base module it tests
#: (``check_source`` runs extract -> store -> load), and no module of the library imports it
TESTING = {"testing"}
#: stages that run other stages, as they always have: the demo is the whole pipeline on a small
#: task, the sweep plans and runs the probe, retrieval, fine-tuning and dense grids
ORCHESTRATORS = {
    "demo": {"extract", "probes", "retrieval", "finetune", "analysis"},
    "sweep": {"probes", "retrieval", "finetune", "dense"},
}
#: the single module-level edges between stages that are not orchestration: the suites are the
#: benchmarks' task catalogue that the `--suite` option of extract, probe and finetune expands
#: (the suites stage's own command is `featcache suites`), and a suite's retrieval metrics are
#: checked against the names `featcache retrieve` writes (its metric registry)
CATALOGUE_EDGES = {
    ("featcache.extract.cli", "featcache.suites"),
    ("featcache.probes.cli", "featcache.suites"),
    ("featcache.finetune.cli", "featcache.suites"),
    ("featcache.suites", "featcache.retrieval.metrics"),
}


def _folder(mod: str) -> str:
    """The top folder (or root module) of a featcache module: ``featcache.extract.cli`` -> ``extract``,
    ``featcache.errors`` -> ``errors``, the package itself -> ``featcache``."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "featcache"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layers: stages -> layers -> store/core/errors/version, no stage
    imports another stage (ORCHESTRATORS and CATALOGUE_EDGES excepted), no layer imports a stage,
    the base imports no layer or stage; testing/ imports what it tests and nothing imports it.
    Only the root modules import the package ``featcache`` itself (the CLI, for the version)."""
    out = []
    for mod, deps in sorted(graph.items()):
        src = _folder(mod)
        for dep in sorted(deps):
            dst = _folder(dep)
            if dst == src or (mod, dep) in CATALOGUE_EDGES:
                continue
            if src in TESTING:
                ok = True
            elif dst in TESTING:
                ok = False
            elif src in STAGES:
                ok = dst in LAYERS | BASE or dst in ORCHESTRATORS.get(src, set())
            elif src in LAYERS:
                ok = dst in LAYERS | BASE
            elif src in BASE:
                ok = dst in BASE and not (src == "core" and dst == "store")
            else:  # the root modules: the package, the command line, `python -m featcache`
                ok = dst not in STAGES | LAYERS or src in ("cli", "__main__")
            if not ok:
                out.append(f"{mod} ({src}) imports {dep} ({dst})")
    return out


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top folder -> the top folders its modules import (the package's own ``__init__`` left out:
    only the root modules import it, and it imports only the core, the errors and the version)."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        src = _folder(mod)
        out.setdefault(src, set()).update(_folder(d) for d in deps if _folder(d) not in (src, "featcache"))
    return out


def test_the_stages_sit_on_the_layers_and_the_layers_on_the_store_and_core():
    graph = import_graph(ROOT, "featcache")
    folders = {_folder(m) for m in graph}
    assert folders >= STAGES | LAYERS | BASE | TESTING  # every named folder exists...
    assert folders - {"featcache", "cli", "__main__"} <= STAGES | LAYERS | BASE | TESTING, (
        "a new folder: name its place above"
    )
    assert {"featcache.models.backbones", "featcache.data.readers"} <= graph["featcache.extract.pipeline"] | {
        d for m in graph if m.startswith("featcache.extract.") for d in graph[m]
    }  # ...and the stages' edges into the layers
    assert all((a in graph and b in graph and b in graph[a]) for a, b in CATALOGUE_EDGES), "a stale exception"
    assert graph["featcache"] <= {m for m in graph if _folder(m) in ("core", "errors", "_version")}
    bad = layer_violations(graph)
    assert not bad, (
        "imports across the layers (stages -> models/data -> store/core/errors; a stage imports no other "
        "stage): move the shared piece into models/, data/, the store or the core:\n" + "\n".join(bad)
    )


def test_no_two_folders_import_each_other_even_through_others():
    folders = folder_graph(import_graph(ROOT, "featcache"))
    assert "data" in folders["extract"]
    assert "models" in folders["data"]
    found = cycles(folders)
    assert not found, f"folders that import each other (through the folders between them): {found}"


def test_the_layer_check_sees_a_stage_importing_a_stage_and_a_layer_importing_up(tmp_path):
    for folder, body in {
        "core": {"a.py": "from featcache.errors import E\n"},
        "data": {"read.py": "def f():\n    from featcache.extract.pipeline import run\n"},
        "models": {"m.py": "from featcache.data import read\n"},
        "extract": {"pipeline.py": "from featcache.models import m\n", "cli.py": "import featcache.probes.fit\n"},
        "probes": {"fit.py": "from featcache.core import a\n"},
        "demo": {"run.py": "from featcache.probes import fit\n"},
        "testing": {"contract.py": "from featcache.extract import pipeline\nfrom featcache.probes import fit\n"},
        "analysis": {"plot.py": "from featcache.testing import contract\n"},
    }.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        for name, text in body.items():
            (tmp_path / folder / name).write_text(text)
    (tmp_path / "errors.py").write_text("class E(Exception):\n    pass\n")
    graph = import_graph(tmp_path, "featcache")
    assert layer_violations(graph) == [
        "featcache.analysis.plot (analysis) imports featcache.testing.contract (testing)",
        "featcache.data.read (data) imports featcache.extract.pipeline (extract)",
        "featcache.extract.cli (extract) imports featcache.probes.fit (probes)",
    ]  # the demo orchestrates the probes; testing imports the stages it tests; models -> data -> core
    assert cycles(folder_graph(graph)) == [["data", "extract", "models"]]


def test_the_probe_config_reads_no_store():
    """probes/store_lookup.py reads the store for a ProbeConfig (its run ids, fingerprints and
    val source); the config imports none of it, not even for type checkers: no mutual import."""
    graph = import_graph(ROOT, "featcache")
    assert "featcache.probes.config" not in graph["featcache.probes.store_lookup"]
    assert "featcache.probes.store_lookup" not in graph["featcache.probes.config"]
    assert "store_lookup" not in (ROOT / "probes" / "config.py").read_text()
