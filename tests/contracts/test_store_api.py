"""The store's boundary: every module outside ``store/`` imports ``featcache.store`` (its
``__init__``) and nothing deeper, so the store's modules (zarr internals, the reading and
writing halves of the cache) can move without a stage noticing; and what the stages use is
exported there."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import featcache
import featcache.store

ROOT = Path(featcache.__file__).parent
SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci", "store"}


def _package_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith((".", "__pycache__"))]
        out += [Path(folder) / f for f in files if f.endswith(".py")]
    return out


def _store_submodules() -> set[str]:
    return {f"featcache.store.{p.stem}" for p in (ROOT / "store").glob("*.py") if p.stem != "__init__"}


def _deep_imports(path: Path, subs: set[str]) -> list[str]:
    """``line: module`` per import of a store submodule in ``path`` (``import featcache.store.x``,
    ``from featcache.store.x import y``, ``from featcache.store import x``), typing-only ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] if node.module in subs else [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if any(n == s or n.startswith(s + ".") for s in subs)]
    return [f"{line}: {n}" for line, n in sorted(found)]


def test_stages_import_the_store_package_only():
    subs = _store_submodules()
    assert {"featcache.store.cache", "featcache.store.writer", "featcache.store._zarr_internal"} <= subs
    files = _package_files()
    assert any(p.parts[-2:] == ("probes", "runner.py") for p in files)  # the scan sees the stages
    deep = {str(p.relative_to(ROOT)): hits for p in files if (hits := _deep_imports(p, subs))}
    assert not deep, (
        "modules outside store/ import store submodules; import the name from `featcache.store` "
        f"(export it in store/__init__.py if a stage needs it): {deep}"
    )


def test_the_scan_finds_a_deep_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from featcache.store import open_cache\n"
        "def g():\n    from featcache.store.cache import FeatureCache\n"
        "import featcache.store.manifest\nfrom featcache.store import summary\n"
    )
    assert _deep_imports(f, _store_submodules()) == [
        "3: featcache.store.cache",
        "4: featcache.store.manifest",
        "5: featcache.store.summary",
    ]


def test_what_the_store_exports_exists():
    for name in featcache.store.__all__:
        assert getattr(featcache.store, name) is not None, name
    assert callable(featcache.store.FeatureCache.stored_fingerprint)
