"""The probe solver registry: :class:`FitRequest` in, :class:`FitOutcome` out, one
:class:`Solver` per name in :data:`SOLVERS`, and :func:`register_solver`.

It imports none of the solvers (timm's registry shape): a solver is one module that decorates
its fit function with :func:`register_solver` (what it reads: its own frozen options
dataclass; whether it trains on views; ...). :func:`featcache.probes.solvers.get_solver` finds
the built-in ones by reading the ``@register_solver`` decorators of the package's modules
(nothing imported) and registers each lazily as ``module:function``: its module is imported on
first use. A solver outside the package registers the same way:
``register_solver("mine", "mypkg.mine:fit")``. Public names are re-exported from
:mod:`featcache.probes.solvers`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.core.registry import Registry
from featcache.errors import ConfigError, ProbeError, ProtocolError

__all__ = [
    "SOLVERS",
    "EpochsOptions",
    "FitOutcome",
    "FitRequest",
    "NoOptions",
    "ProbeConfigError",
    "Solver",
    "epochs_option",
    "option_values",
    "register_solver",
]


class ProbeConfigError(ConfigError, ProbeError):
    """An invalid ProbeConfig value or solver option (a ConfigError; still a ProbeError, as it was)."""


@dataclass(frozen=True)
class NoOptions:
    """The options of a solver that reads none (e.g. ``zeroshot``)."""


def epochs_option() -> Any:
    """The ``--epochs`` field (``sgd_epochs``) every epoch-based solver's options share: ``None``
    takes the protocol grid's ``epochs``."""
    return flag(
        None,
        "salman, bob-linear, dinov2-linear: training epochs (papers: 150, 90; dinov2-linear: 10 epochs of "
        "--epoch-length iterations)",
        name="--epochs",
        type=int,
        check=Interval(int, 1),
    )


def option_values(options: Any) -> dict[str, Any]:
    """A solver's options as ``{field: value}`` (shallow: tuples stay tuples)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


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
    targets of the three, or ``None``) and ``info``; ``opts`` is ``ProbeConfig.solver_options()``:
    the solver's own options and the task ``metric`` and ``max_host_bytes``."""

    proto: Any  # featcache.core.protocols.Protocol
    plan: Any  # featcache.probes.runner._Plan
    opts: dict[str, Any]
    head_init: np.ndarray | None
    seed: int


@dataclass(frozen=True)
class Solver:
    """A registered fitter. ``options``: its frozen options dataclass (fields made with
    :func:`~featcache.core.configs.flag`: they become ``featcache probe`` flags and
    ``ProbeConfig`` keywords; its ``__post_init__`` checks them; an optional
    ``resolve(proto) -> options`` fills in what the protocol's grid gives; a ``ClassVar``
    ``exclusive`` names fields a protocol of another solver refuses instead of ignoring);
    ``run_options``: the option fields that enter run ids (a tuple, or a function of the
    protocol when they follow its grid; ``None``: every field); ``views``: it trains on the
    train split's augmented views (``--views K``); ``fit_multilabel``: the fitter for
    multi-label targets (``None``: refused); ``streams``: it can read a train split left in
    the store block by block; ``default_head_init``: the class embeddings it starts from
    when the config names none; ``multilabel_head_init``: ``fit_multilabel`` takes class
    embeddings too (one row per label column); ``recorded``: settings of its own that every
    run records in its run id (``register_solver(recorded={...})``); ``accepts(proto)``:
    refuses, with one line, a protocol naming it that it cannot run (e.g. an attentive head
    variant it does not build), checked when the probe config is made."""

    name: str
    fit: Callable[[FitRequest], FitOutcome]
    options: type = NoOptions
    run_options: tuple[str, ...] | Callable[[Any], tuple[str, ...]] | None = None
    views: bool = False
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
    accepts: Callable[[Any], None] | None = None

    def __call__(self, request: FitRequest) -> FitOutcome:
        """``fit(request)`` (the decorated fit function's name is the solver)."""
        return self.fit(request)

    def run_option_keys(self, proto: Any) -> tuple[str, ...]:  # a featcache.core.protocols.Protocol
        """The keys of ``ProbeConfig.solver_options()`` that enter ``proto``'s run ids."""
        if self.run_options is None:
            return tuple(f.name for f in dataclasses.fields(self.options))
        return tuple(self.run_options(proto) if callable(self.run_options) else self.run_options)

    def make_options(self, given: Mapping[str, Any]) -> Any:
        """This solver's options from ``given`` (its own fields; the rest is the caller's)."""
        own = {f.name for f in dataclasses.fields(self.options)}
        return self.options(**{k: v for k, v in given.items() if k in own})


#: every registered solver by name (:class:`~featcache.core.registry.Registry`)
SOLVERS: Registry[Solver] = Registry("probe solver", ProtocolError, key=lambda s: s.fit, idempotent=False)


def register_solver(
    name: str,
    target: str | None = None,
    *,
    options: type = NoOptions,
    run_options: tuple[str, ...] | Callable[[Any], tuple[str, ...]] | None = None,
    views: bool = False,
    fit_multilabel: Callable[[FitRequest], FitOutcome] | None = None,
    streams: bool = False,
    default_head_init: str | None = None,
    multilabel_head_init: bool = False,
    recorded: Mapping[str, Any] | None = None,
    load: Callable[..., Any] | None = None,
    input_fingerprint: Callable[..., str] | None = None,
    accepts: Callable[[Any], None] | None = None,
) -> Any:
    """Decorator: register ``fit(request) -> FitOutcome`` as the solver ``name`` (the value
    protocols give as ``Protocol(solver=name)``) with what it reads and does (see
    :class:`Solver`); the decorated name becomes the :class:`Solver` (calling it fits); a
    duplicate name is refused. ``target="module:function"`` registers ``name`` lazily
    instead: ``module`` is imported on first use, and ``function`` there is the decorated one."""
    if target is not None:
        return SOLVERS.register(name, target)

    def deco(fn: Callable[[FitRequest], FitOutcome]):
        solver = Solver(
            name,
            fn,
            options,
            run_options,
            views,
            fit_multilabel,
            streams,
            default_head_init,
            multilabel_head_init,
            tuple((recorded or {}).items()),
            load,
            input_fingerprint,
            accepts,
        )
        prev = SOLVERS.get_entry(name)
        if prev is None or prev.loaded or prev.spec != f"{fn.__module__}:{fn.__qualname__}":
            SOLVERS.register(name, solver)  # else its lazy entry is being loaded: it reads this
        return solver

    return deco


@dataclass(frozen=True)
class EpochsOptions:
    """The options of a solver that reads only its training epochs (``lars``, ``attentive``)."""

    sgd_epochs: int | None = epochs_option()

    def __post_init__(self) -> None:
        check_fields(self)

    def resolve(self, proto: Any) -> EpochsOptions:
        """The protocol grid's epochs unless given."""
        if self.sgd_epochs is not None:
            return self
        return dataclasses.replace(self, sgd_epochs=getattr(proto.grid, "epochs", None))
