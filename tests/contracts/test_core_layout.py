"""The root reads as the architecture: entry points and folders only; the shared core imports no
stage; the paths of modules that moved into ``featcache.core`` still import, with a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_import_layers import _imports, _modules

import featcache
from featcache.core.moved import MOVED

ROOT = Path(featcache.__file__).parent
#: what sits at the root besides the folders: the package, ``python -m featcache``, the CLI, the errors
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py", "errors.py"}
#: what the core may import: itself, the errors (a module at the root, like sklearn.exceptions) and
#: the package's version (``featcache/__init__`` imports only the core and the errors)
CORE_MAY_IMPORT = ("featcache.core", "featcache.errors", "featcache.__version__")


def test_the_root_holds_only_the_entry_points_and_the_errors():
    assert {p.name for p in ROOT.glob("*.py")} == ROOT_MODULES


def test_the_core_imports_no_stage_store_or_analysis():
    """Every import in core/, at module level or inside a function, stays inside the core."""
    bad = {
        f"{mod} imports {dep}"
        for mod, path in _modules(ROOT, "featcache", "core").items()
        for dep in _imports(mod, path)
        if dep.startswith("featcache") and dep != "featcache" and not dep.startswith(CORE_MAY_IMPORT)
    }
    assert not bad, "the core must not import a stage, the store or the analysis:\n" + "\n".join(sorted(bad))


def test_no_library_module_imports_a_moved_path():
    """featcache's own code uses the new paths (an old one would warn at every import)."""
    found = {
        f"{p.relative_to(ROOT)}: {dep}"
        for p in ROOT.rglob("*.py")
        if not {"tests", "benchmarks", "docs", ".venv"} & set(p.relative_to(ROOT).parts)
        for dep in _imports("featcache.x", p)
        if dep in MOVED
    }
    assert not found, "import these from featcache.core:\n" + "\n".join(sorted(found))


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_path_is_the_same_module_and_warns(old):
    """Checked in a fresh interpreter: the alias warns on the first import of the old path only."""
    new = MOVED[old]
    code = (
        "import warnings, importlib, sys\n"
        "warnings.simplefilter('error')\n"
        f"new = importlib.import_module({new!r})\n"
        "try:\n"
        f"    importlib.import_module({old!r})\n"
        "except FutureWarning as w:\n"
        "    print(w)\n"
        "warnings.simplefilter('ignore')\n"
        f"old = importlib.import_module({old!r})\n"
        "assert old is new, (old, new)\n"
        f"assert old.__spec__.name == {new!r}, old.__spec__\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{old} moved to {new}" in out


def test_from_featcache_import_a_moved_module_and_its_names():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from featcache import protocols  # noqa: F401  (the old spelling under test)
        from featcache.splits import canonical_order
    core_splits = importlib.import_module("featcache.core.splits")
    assert canonical_order is core_splits.canonical_order
    assert sys.modules["featcache.protocols"] is importlib.import_module("featcache.core.protocols")
    assert all(issubclass(w.category, FutureWarning) for w in caught if "moved to" in str(w.message))


def test_an_unknown_submodule_still_fails_as_python_says():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("featcache.no_such_module")
