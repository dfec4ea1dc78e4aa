"""Every test file the documentation names exists: each ``tests/...py`` path in docs/*.md,
README.md and the package's own modules (docstrings and comments), and each bare
``test_*.py`` name there is a file somewhere under tests/. The tests moved into
``tests/<package>/`` once and seven paths were left pointing at the old flat layout; this
keeps the next move honest. docs/changelog.md is history (each entry names the paths of its
day) and is not read."""

from __future__ import annotations

import re
from pathlib import Path

import featcache

ROOT = Path(featcache.__file__).parent
SKIP = {"tests", "benchmarks", "docs", ".venv", "site", ".ci"}
#: paths the docs use as made-up examples (two test files of one base name clash)
EXAMPLES = {"tests/store/test_x.py", "tests/data/test_x.py"}

PATH = re.compile(r"\btests/[\w./-]+?\.py\b")
BARE = re.compile(r"(?<![\w/.-])test_\w+\.py\b")


def _documents() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "changelog.md"]
    code = sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))
    return [*docs, ROOT / "README.md", *code]


def missing_test_paths(text: str, root: Path) -> list[str]:
    """The ``tests/...py`` paths and bare ``test_*.py`` names in ``text`` that name no file under
    ``root`` (a bare name may sit in any folder of tests/)."""
    names = {p.name for p in (root / "tests").rglob("test_*.py")}
    paths = [p for p in PATH.findall(text) if p not in EXAMPLES and not (root / p).is_file()]
    return sorted({*paths, *(n for n in BARE.findall(text) if n not in names)})


def test_every_test_path_in_the_docs_exists():
    files = _documents()
    assert ROOT / "docs" / "store.md" in files  # the scan reads the docs...
    assert ROOT / "store" / "__init__.py" in files  # ...and the package's modules
    found = {str(p.relative_to(ROOT)): bad for p in files if (bad := missing_test_paths(p.read_text(), ROOT))}
    assert not found, "test files named in the docs that do not exist (tests live in tests/<package>/): " + repr(found)


def test_the_scan_sees_an_old_flat_path_and_a_lost_name(tmp_path):
    (tmp_path / "tests" / "store").mkdir(parents=True)
    (tmp_path / "tests" / "store" / "test_store_api.py").write_text("")
    text = (
        "see `tests/test_store_api.py` and tests/store/test_store_api.py, "
        "``test_store_api.py``, test_gone.py and tests/store/test_x.py"
    )
    assert missing_test_paths(text, tmp_path) == ["test_gone.py", "tests/test_store_api.py"]
