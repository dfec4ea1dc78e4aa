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
SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}


def _library_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


# The one exception to the rule: inside a class's ``__getitem__`` or ``__iter__`` method, the
# builtins Python's data model names for those protocols (``__getitem__``: TypeError for a key
# of the wrong type, IndexError past the end of a sequence, which also ends old-style
# iteration, KeyError for a missing mapping key; ``__delitem__``: KeyError for a missing mapping
# key; ``__iter__``: TypeError for an object that cannot be iterated). Nowhere else, not even NotImplementedError (use abc.abstractmethod),
# SystemExit (a CLI raises a FeatcacheError; cli.main prints it as one line and exits 1) or a
# module __getattr__'s AttributeError (featcache.errors.NoSuchNameError is one).
PROTOCOL_RAISES = {
    "__getitem__": {"TypeError", "IndexError", "KeyError"},
    "__delitem__": {"KeyError"},
    "__iter__": {"TypeError"},
}


def _plain_raises(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: raise NAME`` for every raise of a builtin exception outside the exempt
    protocol methods (the innermost enclosing function counts, and only a method, a function
    defined directly in a class body, is exempt)."""
    out = []

    def visit(node: ast.AST, method: str | None, in_class: bool) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            method = node.name if in_class else None
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name):
                name = exc.id
            elif isinstance(exc, ast.Attribute) and getattr(exc.value, "id", None) == "builtins":
                name = exc.attr
            else:
                name = None
            if name in BUILTIN_ERRORS and name not in PROTOCOL_RAISES.get(method or "", set()):
                out.append(f"{path.relative_to(root)}:{node.lineno}: raise {name}")
        for child in ast.iter_child_nodes(node):
            visit(child, method, isinstance(node, ast.ClassDef))

    visit(ast.parse(path.read_text(), str(path)), None, False)
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


def test_the_scan_exempts_exactly_the_protocol_methods(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import builtins\n"
        "class S:\n"
        "    def __getitem__(self, i):\n"  # 3
        "        if i is None:\n"
        "            raise TypeError(i)\n"  # 5: exempt
        "        def inner():\n"
        "            raise IndexError(i)\n"  # 7: a nested function is not the method
        "        raise IndexError(i)\n"  # 8: exempt
        "    def __iter__(self):\n"
        "        raise TypeError('no')\n"  # 10: exempt
        "    def __getattr__(self, name):\n"
        "        raise AttributeError(name)\n"  # 12: not exempt
        "    def __next__(self):\n"
        "        raise ValueError('x')\n"  # 14
        "    def f(self):\n"
        "        raise NotImplementedError\n"  # 16: not exempt anywhere
        "def __getitem__(i):\n"
        "    raise KeyError(i)\n"  # 18: a module function, not a method
        "def main():\n"
        "    raise SystemExit('bye')\n"  # 20
        "def g():\n"
        "    raise builtins.ValueError('x')\n"  # 22
        "class T:\n"
        "    def __getitem__(self, k):\n"
        "        raise ValueError(k)\n"  # 25: not a builtin of the protocol
    )
    assert _plain_raises(src, tmp_path) == [
        f"m.py:{n}: raise {e}"
        for n, e in [
            (7, "IndexError"),
            (12, "AttributeError"),
            (14, "ValueError"),
            (16, "NotImplementedError"),
            (18, "KeyError"),
            (20, "SystemExit"),
            (22, "ValueError"),
            (25, "ValueError"),
        ]
    ]


@pytest.mark.parametrize("name", sorted(n for n in dir(featcache.errors) if n.endswith("Error")))
def test_every_featcache_error_inherits_a_builtin(name):
    cls = getattr(featcache.errors, name)
    if cls is FeatcacheError:
        return
    assert issubclass(cls, FeatcacheError)
    assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:])


def test_a_missing_package_name_is_a_featcache_attribute_error():
    """A package's lazy ``__getattr__`` (PEP 562) raises a FeatcacheError that is an
    AttributeError: ``hasattr`` and ``from ... import`` behave as Python's protocol asks."""
    from featcache import analysis
    from featcache.errors import NoSuchNameError

    with pytest.raises(NoSuchNameError, match=r"featcache\.analysis.*no_such_name"):
        analysis.no_such_name  # noqa: B018
    assert not hasattr(analysis, "no_such_name")
    with pytest.raises(ImportError):
        exec("from featcache.analysis import no_such_name")
