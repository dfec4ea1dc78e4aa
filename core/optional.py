"""Lazy imports of optional heavy dependencies, with the checks pip cannot express.

faiss ships as several distributions that all install the same ``faiss`` module
(``faiss-cpu``, ``faiss-gpu``, ``faiss-gpu-cu12``, ...). pip cannot declare that two extras
conflict, so installing both silently leaves whichever unpacked last; :func:`import_faiss`
refuses that state with a message saying how to fix it.
"""

from __future__ import annotations

import importlib.metadata as md
from types import ModuleType

from featcache.errors import BackendUnavailableError, DependencyConflictError

#: PyPI distributions that install the ``faiss`` module: the CPU build, then the GPU builds
FAISS_CPU_DISTS = ("faiss-cpu",)
FAISS_GPU_DISTS = ("faiss-gpu", "faiss-gpu-cu11", "faiss-gpu-cu12", "faiss-gpu-cu13")


def installed(dists: tuple[str, ...]) -> list[str]:
    """The names in ``dists`` that are installed in this environment."""
    found = []
    for name in dists:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found.append(name)
    return found


def faiss_conflict() -> list[str]:
    """Installed faiss distributions if more than one is installed (a conflict), else []."""
    found = installed(FAISS_CPU_DISTS + FAISS_GPU_DISTS)
    return found if len(found) > 1 else []


def import_faiss() -> ModuleType:
    """Import faiss, or raise a :class:`~featcache.errors.FeatcacheError` saying what to install.

    Raises :class:`BackendUnavailableError` when faiss is missing and
    :class:`DependencyConflictError` when several faiss distributions are installed at once.
    """
    clash = faiss_conflict()
    if clash:
        keep = next((d for d in clash if d != "faiss-cpu"), clash[0])
        drop = " ".join(d for d in clash if d != keep)
        raise DependencyConflictError(
            f"several faiss distributions are installed ({', '.join(clash)}); they all provide the "
            f"module 'faiss' and overwrite each other. Keep one: `pip uninstall -y {drop}` then "
            f"`pip install --force-reinstall --no-deps {keep}` (a faiss GPU build replaces faiss-cpu "
            f"from featcache[cpu], it cannot sit beside it)"
        )
    try:
        import faiss
    except ImportError as exc:
        raise BackendUnavailableError(
            "faiss is not installed; `pip install 'featcache[cpu]'` (faiss-cpu). Without it retrieval "
            "uses the numpy or torch backend (--backend numpy|torch-cpu|torch-cuda)"
        ) from exc
    return faiss
