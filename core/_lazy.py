"""The one way a featcache package exports a name it imports on first use (PEP 562).

Every package ``__init__`` lists its public names in ``__all__``. Names whose module is light
are imported eagerly; names whose module pulls torch, scikit-learn, zarr or matplotlib are
declared in a mapping ``name -> module`` and resolved here, so ``featcache --help`` and
``featcache extract --help`` import none of those::

    __getattr__, __dir__ = lazy_exports(__name__, {"rank": "featcache.analysis.api"})

Static tools (pyright, mkdocstrings) see the same names through an ``if TYPE_CHECKING:`` block
beside the mapping.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from featcache.errors import NoSuchNameError  # an AttributeError, as PEP 562 asks


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module ``__getattr__`` and ``__dir__`` that import ``names[name]`` on first access."""
    table = dict(names)

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise NoSuchNameError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        import sys

        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
