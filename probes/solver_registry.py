"""The probe solver registry: :class:`FitRequest` in, :class:`FitOutcome` out, one
:class:`Solver` per name in :data:`SOLVERS`, and :func:`register_solver`.

It imports none of the solvers (timm's registry shape): each fitter's module imports this one
and registers itself, and :mod:`featcache.probes.solvers` (the built-in fitters, and the one
module that imports the others: ``elevater``, ``lars``) is where :func:`get_solver` finds them
all. Public names are re-exported from :mod:`featcache.probes.solvers`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.core.registry import Registry
from featcache.errors import ProtocolError

__all__ = ["SOLVERS", "FitOutcome", "FitRequest", "Solver", "register_solver"]


@dataclass(frozen=True)
class FitOutcome:
    """What a fitter hands back: ``predict(X) -> scores [n, K]`` (probabilities; per-class
    scores for multi-label), the ``classes`` the columns stand for (``None``: multi-label
    columns = the label matrix's), the hyper-parameters recorded in the results row, whether
    the fit converged (or stayed finite) and its seconds."""

    predict: Callable[[np.ndarray], np.ndarray]
    classes: np.ndarray | None
    hparams: dict[str, Any]
    converged: bool
    seconds: float
    #: the final run's head after each epoch, for a rule that reports the best test epoch
    #: (``final_epoch="best-test"``, ELEVATER's toolkit); empty: report ``predict``
    epoch_predicts: tuple[Callable[[np.ndarray], np.ndarray], ...] = ()


@dataclass(frozen=True)
class FitRequest:
    """One seed's fit: ``plan`` has ``tr``/``va``/``fin`` (X, y) pairs, ``Y`` (multi-label
    targets of the three, or ``None``) and ``info``; ``opts`` is ``ProbeConfig.solver_options()``."""

    proto: Any  # featcache.core.protocols.Protocol
    plan: Any  # featcache.probes.runner._Plan
    opts: dict[str, Any]
    head_init: np.ndarray | None
    seed: int


@dataclass(frozen=True)
class Solver:
    """A registered fitter. ``options``: run-option keys it reads (a tuple, or a function
    of the protocol when they follow its grid); ``fit_multilabel``: the fitter for
    multi-label targets (``None``: refused); ``streams``: it can read a train split left in
    the store block by block; ``default_head_init``: the class embeddings it starts from
    when the config names none; ``multilabel_head_init``: ``fit_multilabel`` takes class
    embeddings too (one row per label column); ``recorded``: settings of its own that every
    run records in its run id (``register_solver(recorded={...})``)."""

    name: str
    fit: Callable[[FitRequest], FitOutcome]
    options: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ()
    fit_multilabel: Callable[[FitRequest], FitOutcome] | None = None
    streams: bool = False
    default_head_init: str | None = None  # the class embeddings it needs when none is given
    multilabel_head_init: bool = False  # its multi-label fitter takes class embeddings (one per label)
    #: fixed ``(key, value)`` settings of its own every run records (they enter the run ids), e.g.
    #: the training loop it runs
    recorded: tuple[tuple[str, Any], ...] = ()
    #: its input when not one stored kind: ``load(cache, backbone, dataset, split, kind)`` returns
    #: what ``FeatureCache.load`` does (X, ids, valid, labels, class_names, fingerprint), e.g.
    #: ``dinov2-linear``'s ``[n, S, D]`` stack of class tokens and mean patch token; ``None``:
    #: ``FeatureCache.load(..., kind=kind)``
    load: Callable[..., Any] | None = None
    #: with ``load``: ``input_fingerprint(cache, backbone, dataset, split, kind)``, the fingerprint of
    #: what ``load`` returns from provenance records only (run ids planned without reading features)
    input_fingerprint: Callable[..., str] | None = None

    def run_option_keys(self, proto: Any) -> tuple[str, ...]:  # a featcache.core.protocols.Protocol
        """The keys of ``ProbeConfig.solver_options()`` that enter ``proto``'s run ids."""
        return tuple(self.options(proto) if callable(self.options) else self.options)


#: every registered solver by name (:class:`~featcache.core.registry.Registry`)
SOLVERS: Registry[Solver] = Registry("probe solver", ProtocolError, key=lambda s: s.fit, idempotent=False)


def register_solver(
    name: str,
    *,
    options: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = (),
    fit_multilabel: Callable[[FitRequest], FitOutcome] | None = None,
    streams: bool = False,
    default_head_init: str | None = None,
    multilabel_head_init: bool = False,
    recorded: Mapping[str, Any] | None = None,
    load: Callable[..., Any] | None = None,
    input_fingerprint: Callable[..., str] | None = None,
) -> Callable:
    """Decorator: register ``fit(request) -> FitOutcome`` as the solver ``name`` (the value
    protocols give as ``Protocol(solver=name)``); a duplicate name is refused."""

    def deco(fn: Callable[[FitRequest], FitOutcome]):
        SOLVERS.register(
            name,
            Solver(
                name,
                fn,
                options,
                fit_multilabel,
                streams,
                default_head_init,
                multilabel_head_init,
                tuple((recorded or {}).items()),
                load,
                input_fingerprint,
            ),
        )
        return fn

    return deco
