"""One public-API style for every package ``__init__``: ``__all__`` lists the public names, each
resolves, lazily exported names go through :func:`featcache.core._lazy.lazy_exports` only (declared
for static tools in an ``if TYPE_CHECKING:`` block), and no ``__init__`` wraps a function of its
own submodule."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INITS = sorted(
    p
    for p in ROOT.rglob("__init__.py")
    if not ({"tests", ".venv", "site", "docs", "benchmarks"} & set(p.relative_to(ROOT).parts))
)


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(("featcache", *parts))


@pytest.mark.parametrize("path", INITS, ids=lambda p: _module(p))
def test_init_declares_all_and_every_name_resolves(path):
    mod = importlib.import_module(_module(path))
    assert isinstance(getattr(mod, "__all__", None), list), f"{path} has no __all__"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name
        assert name in dir(mod), name


def _lazy_mapping(tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            if getattr(call.func, "id", None) == "lazy_exports":
                return {k.value: v.value for k, v in zip(call.args[1].keys, call.args[1].values)}
    return {}


def _type_checking_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                names |= {a.asname or a.name for a in imp.names}
    return names


@pytest.mark.parametrize("path", INITS, ids=lambda p: _module(p))
def test_lazy_names_one_mechanism(path):
    tree = ast.parse(path.read_text())
    funcs = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert "__getattr__" not in funcs, f"{path}: a hand-written __getattr__; use featcache.core._lazy.lazy_exports"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            imports = [
                n
                for n in ast.walk(node)
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(_module(path))
            ]
            assert not imports, f"{path}: {node.name} wraps its own submodule; export it with lazy_exports"
    lazy = _lazy_mapping(tree)
    all_names = set(importlib.import_module(_module(path)).__all__)
    assert set(lazy) <= all_names, f"{path}: lazily exported but not in __all__: {set(lazy) - all_names}"
    missing = set(lazy) - _type_checking_names(tree)
    assert not missing, f"{path}: add {sorted(missing)} to its `if TYPE_CHECKING:` imports"
    for name, module in lazy.items():
        assert hasattr(importlib.import_module(module), name), f"{path}: {module} has no {name}"


def test_lazy_packages_import_no_heavy_library():
    code = (
        "import sys, featcache, featcache.extract, featcache.probes, featcache.analysis, featcache.finetune\n"
        "heavy = [m for m in ('torch', 'sklearn', 'matplotlib', 'zarr', 'timm') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the packages pulled in {out}"


def test_unknown_attribute_is_attribute_error():
    import featcache.analysis

    with pytest.raises(AttributeError, match=r"featcache\.analysis"):
        featcache.analysis.no_such_name  # noqa: B018
