"""Every raise in library code is a FeatcacheError subclass (which also inherits the builtin),
so a caller can catch featcache's errors as one family and the CLI prints them as one line."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import featcache
from featcache.errors import FeatcacheError

ROOT = Path(featcache.__file__).parent
BUILTIN_ERRORS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
SKIP = {"tests", "benchmarks", "docs", ".venv", "site"}


def _library_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


# Python's own protocols need these builtins: a module's or class's __getattr__ raises
# AttributeError, a sequence's (mapping's) __getitem__ IndexError (KeyError), an abstract method NotImplementedError,
# and a CLI entry point may end with SystemExit.
PROTOCOL_RAISES = {"__getattr__": {"AttributeError"}, "__getitem__": {"IndexError", "KeyError"}}
ANYWHERE = {"NotImplementedError", "SystemExit"}


def _plain_raises(path: Path, root: Path = ROOT) -> list[str]:
    out = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = exc.id if isinstance(exc, ast.Name) else None
            if name in BUILTIN_ERRORS and name not in ANYWHERE | PROTOCOL_RAISES.get(func, set()):
                out.append(f"{path.relative_to(root)}:{node.lineno}: raise {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_library_module_raises_a_plain_builtin():
    found = [r for p in _library_files() for r in _plain_raises(p)]
    assert not found, "raise a FeatcacheError subclass (featcache.errors) instead:\n" + "\n".join(found)


def test_the_scan_sees_a_plain_raise(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "from featcache.errors import DataError\n\ndef f(x):\n    if x:\n        raise ValueError('x')\n    raise DataError('y')\n"
    )
    assert _plain_raises(bad, tmp_path) == ["m.py:5: raise ValueError"]


@pytest.mark.parametrize("name", sorted(n for n in dir(featcache.errors) if n.endswith("Error")))
def test_every_featcache_error_inherits_a_builtin(name):
    cls = getattr(featcache.errors, name)
    if cls is FeatcacheError:
        return
    assert issubclass(cls, FeatcacheError)
    assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:])
