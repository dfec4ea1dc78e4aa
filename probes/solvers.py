"""The probe fitters as one registry keyed by :attr:`Protocol.solver <featcache.core.protocols.Protocol.solver>`.

The registry itself (:data:`SOLVERS`, :func:`register_solver`, :class:`FitRequest`,
:class:`FitOutcome`, :class:`Solver`) is :mod:`featcache.probes.solver_registry`, which imports
no fitter; this module defines the built-in L-BFGS, SGD and zero-shot fitters, re-exports the
registry's names, and finds every other built-in solver: :func:`get_solver` reads the
``@register_solver("name", ...)`` decorators of the modules of :mod:`featcache.probes` (their
source, nothing imported) and registers each as ``module:function``, imported on first use.
A solver is one module: its fit function decorated with :func:`register_solver`, which
carries its options (a frozen dataclass of its own), whether it trains on views, and the rest
of :class:`Solver` (see docs/development.md).

A fitter takes a :class:`FitRequest` (the protocol, one seed's plan of train / val / final
rows, the solver options of a resolved :class:`~featcache.probes.config.ProbeConfig`, the
optional head-init matrix and the seed) and returns a frozen :class:`FitOutcome`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.errors import ProbeError, ProtocolError
from featcache.probes.backends import BACKENDS
from featcache.probes.solver_registry import (
    SOLVERS,
    EpochsOptions,
    FitOutcome,
    FitRequest,
    NoOptions,
    ProbeConfigError,
    Solver,
    epochs_option,
    register_solver,
)

__all__ = [
    "SOLVERS",
    "EpochsOptions",
    "FitOutcome",
    "FitRequest",
    "LbfgsOptions",
    "NoOptions",
    "SGDOptions",
    "Solver",
    "find_solvers",
    "get_solver",
    "option_fields",
    "register_solver",
]

_found: list[tuple[str, str]] = []  # (name, "module:function") of the built-in solvers, read once


def get_solver(name: str) -> Solver:
    """The registered solver ``name`` (an error lists the registered ones)."""
    find_solvers()
    if name not in SOLVERS:
        raise ProtocolError(SOLVERS.unknown(name, what="no probe solver", known="registered:"))
    return SOLVERS[name]


def find_solvers() -> None:
    """Register every built-in solver lazily: each ``@register_solver("name", ...)`` decorating
    a top-level function of a module of :mod:`featcache.probes` becomes the entry
    ``name -> featcache.probes.<module>:<function>`` (read from the source once; the module is
    imported on the solver's first lookup). A name already registered is left as it is."""
    if not _found:
        for path in sorted(Path(__file__).parent.glob("*.py")):
            text = path.read_text(encoding="utf-8")
            if "@register_solver(" in text:
                _found.extend((name, f"{__package__}.{path.stem}:{fn}") for name, fn in _decorated(ast.parse(text)))
    for name, target in _found:
        if name not in SOLVERS:
            register_solver(name, target)


def _decorated(tree: ast.Module) -> list[tuple[str, str]]:
    """(solver name, function) of each top-level ``@register_solver("name", ...)``."""
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in node.decorator_list:
            first = d.args[0] if isinstance(d, ast.Call) and d.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register_solver":
                out.append((first.value, node.name))
    return out


def option_fields() -> dict[str, tuple[dataclasses.Field, list[str]]]:
    """Every registered solver's option fields by name: (the first solver's field, the
    solvers that read it), in registration order (what ``featcache probe`` adds as flags)."""
    find_solvers()
    out: dict[str, tuple[dataclasses.Field, list[str]]] = {}
    for name in SOLVERS:
        for f in dataclasses.fields(SOLVERS[name].options):
            out.setdefault(f.name, (f, []))[1].append(name)
    return out


# ------------------------------------------------------------------ L-BFGS
@dataclass(frozen=True)
class LbfgsOptions:
    """The L-BFGS probe's options (``full``, ``fewshot:N``, ``subset:F%``, ``dinov2``, ``vtab1k``)."""

    backend: str = flag("auto", choices=lambda: list(BACKENDS))
    Cs: tuple[float, ...] | None = flag(None, cli=False)  # None: the protocol's C grid
    max_iter: int = flag(1000, type=int, check=Interval(int, 1))
    tol: float = flag(1e-4, type=float, check=Interval(float, 0))
    sweep: str = flag(
        "exhaustive",
        "C selection: every C to convergence, or a loose early-stopped scan of the warm-started path, then a climb from its best at full tolerance (torch backend)",
        choices=["exhaustive", "halving"],
    )
    standardize: bool = flag(
        True, "fit on raw features (default: z-score with training statistics)", negate="--no-standardize"
    )

    def __post_init__(self) -> None:
        check_fields(self)
        put = object.__setattr__
        if self.Cs is not None:
            put(self, "Cs", tuple(sorted(float(c) for c in self.Cs)))
        put(self, "max_iter", int(self.max_iter))
        put(self, "tol", float(self.tol))
        put(self, "standardize", bool(self.standardize))
        put(self, "sweep", str(self.sweep))

    def resolve(self, proto: Any) -> LbfgsOptions:
        """The protocol's C grid unless given, then the settings its grid fixes (e.g. DINOv2's)."""
        from featcache.core.protocols import CGrid

        g = proto.grid
        out = self if self.Cs is not None else replace(self, Cs=(g if isinstance(g, CGrid) else CGrid()).Cs)
        if isinstance(g, CGrid) and g.fixed:  # e.g. dinov2 (its log_regression.py): raw features, tol 1e-12
            out = replace(out, **dict(g.fixed))
        return out


def _fit_ovr(req: FitRequest) -> FitOutcome:
    """One-vs-rest L-BFGS probes for multi-label targets: every class sweeps the C grid
    (binary :func:`sweep_C`); one C for all classes is selected on the task's ranking metric
    of the validation scores; then ``OneVsRestClassifier(LogisticProbe(C))`` refits on the
    final data. Predicts per-class probabilities [n, C]."""
    from sklearn.multiclass import OneVsRestClassifier

    from featcache.core.metrics import METRICS
    from featcache.probes.logistic import LogisticProbe, select_index, sweep_C

    plan, opts = req.plan, req.opts
    # one-vs-rest fits are in memory: a lazily loaded split is read here (stored dtype)
    (Xtr, _), (Xva, _), (Xfin, _) = ((np.asarray(X), y) for X, y in (plan.tr, plan.va, plan.fin))
    Ytr, Yva, Yfin = plan.Y
    check_both_labels(Ytr, Yfin, "a one-vs-rest probe")
    t0 = time.perf_counter()
    margins = []  # per class: [n_val, n_C] validation margins of every C
    for c in range(Ytr.shape[1]):
        sw = sweep_C(
            Xtr,
            Ytr[:, c],
            Xva,
            Yva[:, c],
            opts["Cs"],
            backend=opts["backend"],
            max_iter=opts["max_iter"],
            tol=opts["tol"],
            standardize=opts["standardize"],
        )
        margins.append(np.stack([Xva @ (co[1] - co[0]) + (b[1] - b[0]) for co, b in sw.heads], 1))
    Cs, metric = sw.Cs, opts["metric"]
    scores = [float(METRICS[metric](Yva, np.stack([m[:, h] for m in margins], 1))) for h in range(len(Cs))]
    best = select_index(scores)
    ovr = OneVsRestClassifier(
        LogisticProbe(
            C=Cs[best],
            backend=opts["backend"],
            max_iter=opts["max_iter"],
            tol=opts["tol"],
            standardize=opts["standardize"],
        )
    )
    ovr.fit(Xfin, Yfin)
    ests = cast("list[LogisticProbe]", ovr.estimators_)  # sklearn infers no element type
    conv = all(e.converged_ for e in ests)
    hp = {
        "C": Cs[best],
        "selection": f"val {metric} (one C for all classes; ties: smaller C)",
        f"val_{metric}": scores[best],
        "n_grid": len(Cs),
        "grid": [min(Cs), max(Cs)],
        "solver": "lbfgs-ovr",
        "n_labels": int(Yfin.shape[1]),
        "max_iter": opts["max_iter"],
        "tol": opts["tol"],
        "standardize": opts["standardize"],
        "backend": ests[0].backend_,
        "device": ests[0].device_,
    }
    return FitOutcome(ovr.predict_proba, None, hp, conv, time.perf_counter() - t0)


def check_both_labels(Ytr: np.ndarray, Yfin: np.ndarray, what: str) -> None:
    """Every multi-label column has positives and negatives in the selection and final data."""
    for name, Y in (("selection train", Ytr), ("final train", Yfin)):
        one = [c for c in range(Y.shape[1]) if Y[:, c].all() or not Y[:, c].any()]
        if one:
            raise ProbeError(
                f"multi-label classes {one[:10]} are all positive or all negative in "
                f"the {name} data; {what} needs both: drop those "
                "columns or use a larger training sample"
            )


@register_solver(
    "lbfgs",
    options=LbfgsOptions,
    run_options=("Cs", "max_iter", "tol", "standardize", "sweep"),  # backend: float summation order only
    views=True,
    fit_multilabel=_fit_ovr,
    streams=True,
)
def _fit_lbfgs(req: FitRequest) -> FitOutcome:
    """The C sweep on validation (:func:`sweep_C`), then a refit on the final data (warm
    started from the selected head when the class sets agree)."""
    from featcache.probes.logistic import LogisticProbe, sweep_C

    plan, opts = req.plan, req.opts
    Xtr, ytr = plan.tr
    hi = None if req.head_init is None else req.head_init[np.unique(ytr)]
    Xva, yva = plan.va
    fin, Cs, K = plan.fin, opts["Cs"], 1
    if plan.views:  # --views K: every view of every training row, weight 1/K (= C / K on the stack)
        from featcache.probes.views import stack_views

        K = len(plan.views["tr"])
        (Xtr, ytr), fin = stack_views(plan.views["tr"], ytr), stack_views(plan.views["fin"], plan.fin[1])
        Cs = [c / K for c in Cs]
    sw = sweep_C(
        Xtr,
        ytr,
        Xva,
        yva,
        Cs,
        backend=opts["backend"],
        max_iter=opts["max_iter"],
        tol=opts["tol"],
        standardize=opts["standardize"],
        head_init=hi,
        metric=opts["metric"],
        sweep=opts.get("sweep", "exhaustive"),
        max_host_bytes=opts.get("max_host_bytes"),
    )
    probe = LogisticProbe(
        C=sw.best_C,
        backend=opts["backend"],
        max_iter=opts["max_iter"],
        tol=opts["tol"],
        standardize=opts["standardize"],
        max_host_bytes=opts.get("max_host_bytes"),
    )
    same = np.array_equal(np.unique(fin[1]), np.unique(ytr))
    probe.fit(*fin, init=sw.heads[sw.best_index] if same else None)
    hp = {
        "C": sorted(opts["Cs"])[sw.best_index] if K > 1 else sw.best_C,
        "selection": f"val {sw.metric} (ties: smaller C)",
        "val_top1": sw.val_top1[sw.best_index],
        f"val_{sw.metric}": sw.val_scores[sw.best_index],
        "n_grid": len(sw.Cs),
        "grid": [min(sw.Cs), max(sw.Cs)],
        "sweep_not_converged": int(sum(not c for c in sw.converged)),
        "sweep_seconds": round(sw.seconds, 4),
        "sweep_tol": sw.tol,
        "backend": probe.backend_,
        "device": probe.device_,
        "solver": "lbfgs",
        "n_iter": probe.n_iter_,
        "grad_max": probe.grad_max_,
        "max_iter": opts["max_iter"],
        "tol": opts["tol"],
        "standardize": opts["standardize"],
        "warm_start": bool(same),
    }
    if sw.info.get("sweep") == "halving":  # the default exhaustive sweep records as before
        hp.update(
            sweep="halving",
            sweep_head_iters=sw.info["head_iters"],
            **{k: v for k, v in sw.info.items() if k.startswith("halving_")},
        )
    if probe.streamed_ or sw.info.get("streamed"):
        hp["streamed"] = True
    if plan.views:
        hp.update(views=K, view_weight=f"1/{K}: all {K} views of each training row, fitted at C/{K}")
    return FitOutcome(probe.predict_proba, probe.classes_, hp, probe.converged_, sw.seconds + probe.fit_seconds_)


# ------------------------------------------------------------------ SGD
@dataclass(frozen=True)
class SGDOptions:
    """The SGD probe's options (``salman``, ``vtab1k-sgd``); ``None``: the protocol grid's."""

    sgd_epochs: int | None = epochs_option()
    vtab_steps: tuple[int, ...] | None = flag(None, cli=False)  # None: the protocol's schedules
    last_decay: float | None = flag(None, cli=False)  # None: the protocol's (0.9)
    sgd_standardize: bool = flag(False, cli=False)

    def __post_init__(self) -> None:
        check_fields(self)
        put = object.__setattr__
        if self.vtab_steps is not None:
            put(self, "vtab_steps", tuple(int(s) for s in self.vtab_steps))
        if self.last_decay is not None:
            put(self, "last_decay", float(self.last_decay))
        put(self, "sgd_standardize", bool(self.sgd_standardize))

    def resolve(self, proto: Any) -> SGDOptions:
        """The grid's schedule where not given; an epoch grid needs 3 epochs or more."""
        g = proto.grid
        out = replace(
            self,
            vtab_steps=self.vtab_steps if self.vtab_steps is not None else getattr(g, "steps", None),
            last_decay=self.last_decay if self.last_decay is not None else getattr(g, "last_decay", None),
            sgd_epochs=self.sgd_epochs if self.sgd_epochs is not None else getattr(g, "epochs", None),
        )
        if out.sgd_epochs is not None and getattr(g, "epochs", None) is not None and out.sgd_epochs < 3:
            raise ProbeConfigError(f"{proto.spec} needs sgd_epochs >= 3 (the lr drops at 1/3 and 2/3 of training)")
        return out


def _sgd_options(proto) -> tuple[str, ...]:
    return ("sgd_standardize", *proto.grid.run_options)


def sgd_configs(grid, n: int, opts: dict) -> list[dict]:
    """The SGD grid as configs, in tie-break order (epoch grids: the schedule follows ``n``;
    step grids: for each schedule length, for each lr)."""
    g = grid
    if g.epochs is not None:
        e, bs = opts["sgd_epochs"], g.batch_size
        spe = math.ceil(n / bs)
        dec = g.decay_epochs(e)
        return [
            {
                "lr": lr,
                "steps": e * spe,
                "batch_size": bs,
                "momentum": g.momentum,
                "weight_decay": g.weight_decay,
                "milestones": [d * spe for d in dec],
                "epochs": e,
                "lr_decay_epochs": dec,
            }
            for lr in g.lrs
        ]
    return [
        {
            "lr": lr,
            "steps": steps,
            "batch_size": g.batch_size,
            "momentum": g.momentum,
            "weight_decay": g.weight_decay,
            "milestones": list(g.milestones(steps, opts["last_decay"])),
            "drop_remainder": g.drop_remainder,
            "last_decay": opts["last_decay"],
        }
        for steps in opts["vtab_steps"]
        for lr in g.lrs
    ]


#: the config keys an :class:`~featcache.probes.sgd.SGDProbe` takes
_SGD_PROBE_KEYS = ("lr", "steps", "batch_size", "momentum", "weight_decay", "milestones", "drop_remainder")


@register_solver("sgd", options=SGDOptions, run_options=_sgd_options)
def _fit_sgd(req: FitRequest) -> FitOutcome:
    """Each config of the protocol's :class:`~featcache.core.protocols.SGDGrid` trained on the
    plan's train rows and scored on its val rows; the best refit on the final rows (with
    ``grid.refit_epochs``: as many epochs as the selection fits, over the larger data)."""
    from featcache.probes.logistic import resolve_backend, select_index
    from featcache.probes.sgd import SGDProbe

    plan, opts, g = req.plan, req.opts, req.proto.grid
    _, device = resolve_backend("torch")
    Xtr, ytr = plan.tr
    classes = np.unique(ytr)
    pos = np.full(int(max(ytr.max(), plan.va[1].max(), plan.fin[1].max())) + 1, -1)
    pos[classes] = np.arange(classes.size)
    if (pos[plan.va[1]] < 0).any() or (pos[plan.fin[1]] < 0).any():
        raise ProbeError(
            "validation/final training data hold classes absent from the selection "
            "train data; resample the split so every class is in train"
        )
    hi = None if req.head_init is None else req.head_init[classes]

    def fit(X, y, cfg, n_for_cfg) -> SGDProbe:
        kw = {k: cfg[k] for k in _SGD_PROBE_KEYS if k in cfg}
        if g.refit_epochs:  # same number of epochs on the (larger) refit data
            spe = math.ceil(n_for_cfg / cfg["batch_size"])
            kw["steps"] = cfg["epochs"] * spe
            kw["milestones"] = [e * spe for e in cfg["lr_decay_epochs"]]
        probe = SGDProbe(
            **kw,
            standardize=opts["sgd_standardize"],
            head_init=hi,
            init=g.init,
            random_state=req.seed,
            device=device,
        )
        return probe.fit(X, y, classes=classes)

    t0 = time.perf_counter()
    cfgs = sgd_configs(g, ytr.size, opts)
    scores = []
    for cfg in cfgs:
        p = fit(Xtr, ytr, cfg, ytr.size)
        Xv, yv = plan.va
        scores.append(val_score(opts["metric"], pos[yv], p.predict_proba(Xv)) if p.finite_ else -1.0)
    best = select_index(scores)
    cfg = cfgs[best]
    Xfin, yfin = plan.fin
    probe = fit(Xfin, yfin, cfg, yfin.size)
    seconds = time.perf_counter() - t0
    hp = {
        "solver": "sgd",
        "device": device,
        f"val_{opts['metric']}": scores[best],
        "selection": f"val {opts['metric']} (ties: first config)",
        "candidates": len(cfgs),
        "standardize": opts["sgd_standardize"],
        **{k: cfg[k] for k in g.recorded},
    }
    if g.init != "zeros" and hi is None:
        hp["init"] = g.init
    return FitOutcome(probe.predict_proba, classes, hp, probe.finite_, seconds)


def val_score(metric: str, y: np.ndarray, P: np.ndarray) -> float:
    """Validation score of the task metric (top-1 as the SGD selection always computed it)."""
    if metric == "top1":
        return float(np.mean(P.argmax(1) == y))
    from featcache.core.metrics import METRICS

    return float(METRICS[metric](y, P))


# ------------------------------------------------------------------ zero-shot
ZEROSHOT_SCALE = 100.0


def _zeroshot_multilabel(req: FitRequest) -> FitOutcome:
    """Multi-label targets: the same scores, one column per label."""
    return _zeroshot(req)


# the text head is the whole classifier, for single- and multi-label targets alike
@register_solver(
    "zeroshot",
    options=NoOptions,
    default_head_init="text",
    fit_multilabel=_zeroshot_multilabel,
    multilabel_head_init=True,
)
def _zeroshot(req: FitRequest) -> FitOutcome:
    """The text head alone, no training: softmax(scale * normalised features . normalised
    text), scale = CLIP's logit scale 100 (top-1 does not depend on it). Multi-label targets
    get the same scores, one column per label (ranked by the task metric, e.g. mAP)."""
    from scipy.special import softmax

    from featcache.probes.elevater import zeroshot_logits

    text = req.head_init
    if text is None:
        raise ProbeError("the zeroshot solver needs class embeddings; pass head_init='text' (--head-init text)")
    hp = {"solver": "zeroshot", "logit_scale": ZEROSHOT_SCALE, "trained": False}
    return FitOutcome(
        lambda X: softmax(ZEROSHOT_SCALE * zeroshot_logits(X, text), axis=1), np.arange(text.shape[0]), hp, True, 0.0
    )
