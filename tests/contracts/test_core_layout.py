"""The root reads as the architecture: entry points and folders only; the shared core imports no
stage; no module below the root imports the package ``featcache`` itself (the version is
``featcache._version``); the paths of modules that moved into ``featcache.core``,
``featcache.models`` and ``featcache.data`` are gone (no alias answers for them)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_layers import _imports, _modules, import_graph

import featcache

ROOT = Path(featcache.__file__).parent
#: what sits at the root besides the folders: the package, ``python -m featcache``, the CLI, the
#: errors and the version
ROOT_MODULES = {"__init__.py", "__main__.py", "_version.py", "cli.py", "errors.py"}
#: what the core may import: itself, the errors (a module at the root, like sklearn.exceptions) and
#: the package's version (``featcache._version``, which imports nothing)
CORE_MAY_IMPORT = ("featcache.core", "featcache.errors", "featcache._version")


def test_the_root_holds_only_the_entry_points_and_the_errors():
    assert {p.name for p in ROOT.glob("*.py")} == ROOT_MODULES


def test_no_module_below_the_root_imports_the_package_itself():
    """``featcache/__init__`` imports the core (its lazy exports) and the errors: a module below
    the root that imports the package (``from featcache import __version__``) hangs on it; the
    version is read from ``featcache._version`` (``from featcache import errors``, a submodule,
    is no import of the package's own body)."""
    graph = import_graph(ROOT, "featcache")
    assert "featcache" in graph["featcache.cli"]  # the scan sees an import of the package...
    assert "featcache._version" in graph["featcache.store.root"]  # ...and of the version module
    root = {"featcache", *(f"featcache.{Path(n).stem}" for n in ROOT_MODULES - {"__init__.py"})}
    bad = sorted(m for m in set(graph) - root if "featcache" in graph[m])
    assert not bad, "import the version as `from featcache._version import __version__`:\n" + "\n".join(bad)


def test_the_version_module_agrees_with_the_package_and_pyproject():
    """``_version.py`` holds the version the package reports; pyproject's (the wheel's) agrees."""
    import tomllib

    from featcache._version import __version__

    assert featcache.__version__ == __version__
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_the_core_imports_no_stage_store_or_analysis():
    """Every import in core/, at module level or inside a function, stays inside the core."""
    bad = {
        f"{mod} imports {dep}"
        for mod, path in _modules(ROOT, "featcache", "core").items()
        for dep in _imports(mod, path)
        if dep.startswith("featcache") and dep != "featcache" and not dep.startswith(CORE_MAY_IMPORT)
    }
    assert not bad, "the core must not import a stage, the store or the analysis:\n" + "\n".join(sorted(bad))


#: module paths that are gone (no alias is left): the loose root modules that moved into
#: ``featcache.core`` (0.1.0) and the model and image modules that left ``featcache.extract`` for
#: the ``featcache.models`` and ``featcache.data`` layers
GONE = (
    *(
        f"featcache.{name}"
        for name in (
            "_lazy",
            "allocator",
            "configs",
            "cpu",
            "devices",
            "formatting",
            "metrics",
            "optional",
            "progress",
            "prompts",
            "protocols",
            "results",
            "splits",
            "stagerun",
        )
    ),
    "featcache.core.moved",
    *(f"featcache.extract.{name}" for name in ("backbones", "catalog", "model", "sources", "weights")),
    *(f"featcache.extract.{name}" for name in ("decode", "preprocess", "readers", "source")),
)


def test_the_old_module_paths_are_gone():
    """Checked in a fresh interpreter (no earlier import can have left an entry in sys.modules),
    after importing every stage: nothing answers for an old path."""
    code = (
        "import importlib, sys\n"
        "import featcache, featcache.extract, featcache.core, featcache.models, featcache.data\n"
        "assert not any(type(f).__module__.startswith('featcache') for f in sys.meta_path), sys.meta_path\n"
        "for old in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(old)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        assert exc.name == old, (old, exc.name)\n"
        "    else:\n"
        "        raise AssertionError(old + ' still imports')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *GONE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_an_unknown_submodule_still_fails_as_python_says():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("featcache.no_such_module")
