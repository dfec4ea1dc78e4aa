"""The dense solvers: a protocol's ``solver`` names one (``seg-linear``, ``depth-linear``,
``hummingbird``); each is ``fn(task, protocol, config, seed) -> DenseFit``, registered with
:func:`register_dense_solver` from its own module and imported on first use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from featcache.core.dense import DenseInfo, DenseRows
from featcache.core.registry import Registry
from featcache.errors import ProtocolError

__all__ = ["DENSE_SOLVERS", "DenseEval", "DenseFit", "DenseTask", "register_dense_solver"]


@dataclass
class DenseEval:
    """An evaluation split: its ``resize`` rows (targets at the input size, the original-size
    targets and image sizes), and its sliding ``windows`` / ``flip`` rows where stored."""

    rows: DenseRows
    windows: DenseRows | None = None
    flip: DenseRows | None = None


@dataclass
class DenseTask:
    """What a dense solver fits and scores: ``train`` (the groups it trains on: the augmented
    views, else the ``resize`` rows), ``val`` (selection), ``test`` (reported)."""

    info: DenseInfo
    train: list[DenseRows]
    val: DenseEval
    test: DenseEval


@dataclass
class DenseFit:
    """A dense solver's result: ``scores[role][metric]`` for role ``val`` and ``test``, the
    hyper-parameters it chose and recorded, and its fit time."""

    scores: dict[str, dict[str, float]]
    hparams: dict[str, Any] = field(default_factory=dict)
    fit_seconds: float = 0.0
    #: ``per_image[role]``: the per-image parts of the headline metric, image order of the eval
    #: split (segmentation ``[N, 3, C]`` areas, Hummingbird ``[N, C, P]`` confusions, depth
    #: ``[N]`` values), for intervals over images (:mod:`featcache.core.dense_intervals`)
    per_image: dict[str, Any] = field(default_factory=dict)


#: solver name -> ``fn(task: DenseTask, protocol, config, seed: int) -> DenseFit``
DENSE_SOLVERS: Registry[Callable[..., DenseFit]] = Registry("dense solver", ProtocolError, idempotent=False)


def register_dense_solver(name: str, target: Callable[..., DenseFit] | str | None = None, *, note: str = "") -> Any:
    """Register a dense solver (a decorator without ``target``; a ``str`` target is
    ``module:attr``, imported on first use)."""
    return DENSE_SOLVERS.register(name, target, note=note)
