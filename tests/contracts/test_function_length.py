"""A function fits on a screen: no function or method of library code (the package, not its
tests, benchmarks or docs) is over 100 lines, decorators aside (``end_lineno - lineno + 1``)."""

from __future__ import annotations

import ast
from pathlib import Path

import featcache

ROOT = Path(featcache.__file__).parent
SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}
MAX_LINES = 100


def _library_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIP & set(p.relative_to(root).parts))


def long_functions(path: Path, root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """``file:line: name is N lines`` for every (nested) function of ``path`` over ``limit``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(root)}:{n.lineno}: {n.name} is {n.end_lineno - n.lineno + 1} lines"
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and n.end_lineno is not None
        and n.end_lineno - n.lineno + 1 > limit
    ]


def test_no_library_function_is_over_100_lines():
    files = _library_files()
    assert ROOT / "analysis" / "api.py" in files  # the scan sees the package...
    assert ROOT / "store" / "cache.py" in files
    found = [line for p in files for line in long_functions(p)]
    assert not found, f"split these functions (at most {MAX_LINES} lines each):\n" + "\n".join(found)


def test_the_scan_sees_a_long_function(tmp_path):
    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    (tmp_path / "m.py").write_text(
        "def fits():\n"
        + lines(99, "    ")  # 100 lines: allowed
        + "class C:\n    async def long(self):\n"
        + lines(100, "        ")  # 101 lines
        + "    def outer(self):\n        def inner():\n"
        + lines(100, "            ")  # nested: both count
    )
    assert sorted(long_functions(tmp_path / "m.py", tmp_path)) == [
        "m.py:102: long is 101 lines",
        "m.py:203: outer is 102 lines",
        "m.py:204: inner is 101 lines",
    ]
