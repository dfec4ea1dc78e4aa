"""Import paths of modules that moved into :mod:`featcache.core` keep working, with a warning.

``import featcache.protocols`` (and ``from featcache import protocols``, ``from
featcache.protocols import X``) gives the very module object :mod:`featcache.core.protocols`,
so state and monkeypatches are shared, and emits one :class:`FutureWarning` naming the new
path. Only the names in :data:`MOVED` are handled; every other import is left to Python's own
finders. The finder is installed by ``featcache/__init__.py`` (once, however often it is
imported); it adds an entry to ``sys.meta_path`` that answers for these names only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module path -> where it lives now (moved in 0.1.0; the old paths go in a later release)
MOVED: dict[str, str] = {
    f"featcache.{name}": f"featcache.core.{name}"
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
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one (imported first if need be)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there (the old path goes in a later release)",
            FutureWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module at the new path is executed); the import machinery has set
        ``__spec__`` to the old path's, so the module gets its own back."""
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (it answers for :data:`MOVED` only) unless it is there."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
