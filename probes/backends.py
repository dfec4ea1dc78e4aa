"""The L-BFGS probe's backends: one :class:`~featcache.core.registry.Registry` of name ->
``resolve(cuda) -> (backend, device)``, the only list of them (``--backend`` takes its names;
:func:`featcache.probes.logistic.resolve_backend` looks a name up here). Cheap to import: the
CUDA and cuML probes import torch and cuML when called."""

from __future__ import annotations

import logging
from collections.abc import Callable

from featcache.core.registry import Registry
from featcache.errors import BackendUnavailableError, ProbeError

__all__ = ["BACKENDS", "cuda_available", "cuml_available"]

log = logging.getLogger(__name__)

#: backend name -> ``resolve(cuda) -> (backend, device)`` (``cuda``: a CUDA GPU is visible)
BACKENDS: Registry[Callable[[bool], tuple[str, str]]] = Registry("probe backend", ProbeError)


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def cuml_available() -> bool:
    """Whether RAPIDS cuML imports (a broken install is logged, not raised)."""
    try:
        import cuml  # noqa: F401  # pyright: ignore[reportMissingImports]  # optional gpu extra
    except ImportError:
        return False
    except Exception as exc:  # a broken CUDA install raises other errors at import: say so
        log.warning("cuML is installed but failed to import (%s: %s); not using it", type(exc).__name__, exc)
        return False
    return True


@BACKENDS.register("auto", note="cuML on a GPU when installed, else torch on the GPU, else torch on the CPU")
def _auto(cuda: bool) -> tuple[str, str]:
    if cuda and cuml_available():
        return ("cuml", "cuda")
    return ("torch", "cuda" if cuda else "cpu")


@BACKENDS.register("sklearn", note="scikit-learn's L-BFGS on the CPU")
def _sklearn(cuda: bool) -> tuple[str, str]:
    return ("sklearn", "cpu")


@BACKENDS.register("cuml", note="RAPIDS cuML on a CUDA GPU")
def _cuml(cuda: bool) -> tuple[str, str]:
    if not cuda:
        raise BackendUnavailableError(
            "backend='cuml' needs a CUDA GPU and none is visible; use backend='torch' or "
            "'sklearn' (or 'auto', which falls back to the CPU)"
        )
    if not cuml_available():
        raise BackendUnavailableError(
            "backend='cuml' needs RAPIDS cuML: pip install 'featcache[gpu]' (cuml-cu12), "
            "or use backend='torch', which also runs on the GPU"
        )
    return ("cuml", "cuda")


@BACKENDS.register("torch", note="torch L-BFGS on the GPU when visible, else the CPU")
def _torch(cuda: bool) -> tuple[str, str]:
    return ("torch", "cuda" if cuda else "cpu")
