"""The probe stage's config: one frozen dataclass holding the fields every probe run has and
the protocol's solver's options (that solver's own frozen dataclass, :class:`Solver.options
<featcache.probes.solver_registry.Solver>`), the source of ``featcache probe``'s flags (its
fields' and every registered solver's options'), of the probe run ids' options and of the
hyper-parameters recorded in result rows. The solver is looked up once, when the config is made
(:attr:`ProbeConfig.solver`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

from featcache.core.configs import Interval, check_fields, flag, seed_tuple, str_tuple
from featcache.core.layers import LAYER_PARTS
from featcache.probes.solver_registry import SOLVERS, ProbeConfigError, Solver, option_values

__all__ = ["ProbeConfig", "ProbeConfigError"]

if TYPE_CHECKING:
    from featcache.core.protocols import Protocol


def _protocol_help() -> str:
    from featcache.core.protocols import protocol_help

    return protocol_help("probe")


def _task_metrics() -> tuple[str, ...]:
    from featcache.core import metrics

    return metrics.TASK_METRICS


def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def _accepts_options(cls: type) -> type:
    """``cls.__init__`` also takes the solver's options as keywords (into ``options``)."""
    import functools

    init, names = cls.__init__, _names(cls)

    @functools.wraps(init)
    def __init__(self, *args: Any, options: Any = None, **kw: Any) -> None:
        extra = {k: kw.pop(k) for k in list(kw) if k not in names}
        if extra:
            base = option_values(options) if is_dataclass(options) else dict(options or {})
            options = {**base, **extra}
        init(self, *args, options=options, **kw)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_accepts_options
@dataclass(frozen=True)
class ProbeConfig:
    """What ``featcache probe`` / :func:`featcache.probes.runner.run_probes` runs.

    ``cache``: a store path/URL or several (each backbone is read from the first holding
    it). ``backbones``: names, or ``"all"`` (every backbone with features for ``dataset``).
    Grid and schedule fields left at ``None`` take the protocol's values
    (:mod:`featcache.core.protocols`); ``seeds=None`` takes the protocol's default seeds.
    """

    cache: str | tuple[str, ...] = flag(cli=False)
    backbones: str | tuple[str, ...] = flag(cli=False)
    dataset: str = flag(required=True, help="dataset key in the cache")
    protocol: str = flag("full", _protocol_help)
    seeds: tuple[int, ...] | None = flag(
        None, "comma-separated seeds (default: the protocol's, 0,1,2 for fewshot/vtab1k, else 0)"
    )
    results_path: str | None = flag(None, "results parquet to append to", name="--results", required=True)
    force: bool = flag(False, "re-run runs already in the results table", action="store_true")
    predictions: str | None = flag(
        None,
        "also write each evaluated row's predicted class (id, label, prediction, per run id) to this "
        "parquet, to compare runs on the same rows (McNemar); runs skipped as already done write none",
    )
    max_host_bytes: int | None = flag(
        None,
        "stream training rows in blocks when an in-memory fit would allocate more than this many bytes (default 1 GiB)",
        type=int,
        check=Interval(int, 1),
    )
    eval_splits: tuple[str, ...] = flag(
        ("test",), "split(s) to evaluate on (repeatable; default: test)", name="--eval-split", action="append"
    )
    train_split: str = flag("train")
    val_split: str = flag(
        "val", "the dataset's own validation split, used when present (default: 'val', else 'validation')"
    )
    kind: str = flag("pooled", "feature kind in the cache (attentive:*: tokens unless a tokens@GxG kind is named)")
    val_source: str = flag(
        "auto",
        "vtab1k selection data (the paper's two readings): official-val (VTAB's val200: the first "
        "200 of the store's val200 or val split), split-800-200 (train[800:1000]); auto (default): "
        "official-val where the store holds val200 or the val split, else split-800-200",
        choices=["auto", "split-800-200", "official-val"],
    )
    head_init: str | None = flag(
        None,
        "class-embedding matrix the head starts from (ELEVATER: 'text', stored "
        "per backbone x dataset); zeroshot: the classifier itself (default text)",
    )
    templates: str | None = flag(
        None,
        "the template set the class embeddings must come from (as embed-classes --templates); "
        "embeddings made with another set are refused (default: any set; the tower is always checked)",
    )
    prompt_dataset: str | None = flag(None, "with --templates: the dataset's name in that set (as embed-classes)")
    views: int = flag(
        0,
        "train on the train split's first K augmented views (featcache extract --views K): bob-linear and "
        "dinov2-linear draw one view per image per epoch (seeded); full/fewshot/subset fit on all K views "
        "with sample weight 1/K; selection and evaluation read the deterministic features (default 0: none)",
        type=int,
        metavar="K",
        check=Interval(int, 0),
    )
    metrics: tuple[str, ...] | None = flag(None, cli=False)  # None: every metric
    metric: str | None = flag(
        None,
        "the task's metric, used to select hyper-parameters (default: the metric recorded "
        "for the dataset in the store, else top1)",
        choices=_task_metrics,
    )
    progress: bool = flag(True, "no progress bars", negate="--no-progress")
    layers: str | None = flag(
        None,
        "layer sweep: run the protocol on each stored per-layer kind (all, or a comma list such as 1,4,-1), "
        "select the layer on the protocol's validation data, report test for it and record the whole curve",
    )
    layer_part: str = flag(
        "auto",
        "with --layers: the part of each layer read (auto: the first stored of cls, avg, mean, cls_raw, mean_raw)",
        choices=lambda: ["auto", *LAYER_PARTS],
    )
    #: the protocol's solver's options (its own frozen dataclass, :attr:`Solver.options
    #: <featcache.probes.solver_registry.Solver.options>`); given as a mapping or as keywords
    #: (``ProbeConfig(..., Cs=[1.0], max_iter=500)``): each option is a keyword and, on the
    #: command line, a flag; an option of another solver is ignored, or refused where that
    #: solver's options say so (``exclusive``). Its values read as attributes (``cfg.Cs``).
    options: Any = flag(None, cli=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put(
            "cache",
            str(self.cache)
            if isinstance(self.cache, str) or hasattr(self.cache, "__fspath__")
            else tuple(str(c) for c in self.cache),
        )
        check_fields(self)  # --max-host-bytes, --views ... (one line naming the flag)
        put("backbones", str_tuple(self.backbones))
        put("seeds", seed_tuple(self.seeds, ProbeConfigError))
        put("eval_splits", str_tuple(self.eval_splits))
        if self.metrics is not None:
            put("metrics", str_tuple(self.metrics))
        if self.results_path is not None:
            put("results_path", str(self.results_path))
        if self.metric is not None:
            from featcache.core.metrics import TASK_METRICS

            if self.metric not in TASK_METRICS:
                raise ProbeConfigError(f"unknown task metric {self.metric!r}; choose one of {TASK_METRICS}")
        from featcache.core.protocols import get_protocol
        from featcache.probes.solvers import get_solver

        proto = get_protocol(self.protocol, "probe")
        solver = get_solver(proto.solver)  # resolved once: the runner and the store lookup read cfg.solver
        if solver.accepts is not None:
            solver.accepts(proto)
        put("_proto", proto)
        put("_solver", solver)
        put("options", _solver_options(solver, proto, self.options))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the looked-up protocol and solver (found again by name on load)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_proto", "_solver")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def solver(self) -> Solver:
        """The protocol's registered solver (looked up once, when the config is made)."""
        return self.__dict__["_solver"]

    def __getattr__(self, name: str) -> Any:
        """An option of the solver reads as an attribute (``cfg.Cs``, ``cfg.sgd_epochs``)."""
        options = self.__dict__.get("options")
        if not name.startswith("_") and options is not None and name in _names(type(options)):
            return getattr(options, name)
        from featcache.errors import NoSuchNameError

        raise NoSuchNameError(f"{type(self).__name__} has no attribute {name!r}")

    def resolve(self) -> tuple[Protocol, ProbeConfig]:
        """(protocol, config with every ``None`` option and the seeds filled in from it)."""
        proto, solver = self.__dict__["_proto"], self.solver
        resolve = getattr(self.options, "resolve", None)
        out = replace(
            self,
            seeds=proto.seeds if self.seeds is None else self.seeds,
            options=resolve(proto) if resolve is not None else self.options,
        )
        if proto.kind and out.kind == "pooled":  # e.g. the attentive probes read tokens unless told
            out = replace(out, kind=proto.kind)
        if solver.default_head_init and out.head_init is None:  # zeroshot: the text head is the classifier
            out = replace(out, head_init=solver.default_head_init)
        if not out.seeds:
            raise ProbeConfigError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if not out.backbones:
            raise ProbeConfigError("no backbone given; pass --backbone NAME (repeatable) or --all")
        return proto, out

    def solver_options(self) -> dict[str, Any]:
        """What the solver's fitter reads (a resolved config): its options, the task metric
        and ``max_host_bytes``."""
        opts = option_values(self.options)
        if "Cs" in opts:
            opts["Cs"] = list(opts["Cs"] or ())
        return {
            **opts,
            "metric": self.metric or "top1",
            "max_host_bytes": self.max_host_bytes,
            "progress": self.progress,
        }

    def run_options(self, proto: Protocol) -> dict[str, Any]:
        """Options that enter the run id (and are recorded): the task metric and the solver
        settings the protocol's solver declares it reads (:mod:`featcache.probes.solvers`),
        plus the data choices (a resolved config)."""
        # the backend and max_host_bytes change float summation order only, so they stay out
        keep = ("metric", *self.solver.run_option_keys(proto))
        solver = self.solver_options()
        opts = {k: solver[k] for k in solver if k in keep}
        for k, default in (("sweep", "exhaustive"), ("final_epoch", "last"), ("grid_schedule", "full")):
            if opts.get(k) == default:  # the defaults: run ids of earlier results stay
                del opts[k]
        if "halving_eta" in opts and "grid_schedule" not in opts:  # eta is read by halving only
            del opts["halving_eta"]
        if opts["metric"] == "top1":  # top-1 tasks keep the run ids they always had
            del opts["metric"]
        opts.update(kind=self.kind, head_init=self.head_init, train_split=self.train_split)
        if self.views:  # recorded only when used: earlier run ids stay
            opts["views"] = self.views
        if proto.val_source_choice:
            opts["val_source"] = self.val_source
        if proto.holdout_order:  # ELEVATER's full protocol: its first-20% rows, in the dataset's own order
            opts["holdout_order"] = proto.holdout_order
        opts.update(self.solver.recorded)  # elevater: the toolkit's loop (BN modes, seeded init, its batches)
        return opts

    def val_split_used(self, proto: Protocol, splits: Iterable[str]) -> str | None:
        """The dataset's own val split when the protocol selects on it and ``splits`` has it. The
        default name ``val`` also finds a Hugging Face dataset's ``validation`` split."""
        if not proto.uses_val_split(self.val_source):
            return None
        if self.val_split in splits:
            return self.val_split
        if self.val_split == "val" and "validation" in splits:
            return "validation"
        return None

    def run_id(self, proto: Protocol, backbone: str, seed: int, eval_split: str, store_fingerprint: str) -> str:
        """The run id of one backbone, seed and eval split of this (resolved) config;
        ``store_fingerprint`` combines the fingerprints of the splits read (runner)."""
        from featcache.core.results import make_run_id

        return make_run_id(
            kind="probe",
            backbone=backbone,
            dataset=self.dataset,
            protocol=proto.spec,
            seed=seed,
            eval_split=eval_split,
            options=self.run_options(proto),
            store_fingerprint=store_fingerprint,
        )


def _solver_options(solver: Solver, proto: Protocol, given: Any) -> Any:
    """``solver``'s options from ``given`` (``None``, a mapping, or an options dataclass: the
    solver's own, or another solver's after a change of protocol). An option of another
    solver is dropped; one it calls ``exclusive``, set, is refused; a name no solver reads is
    refused."""
    if given is None:
        return solver.options()
    if isinstance(given, solver.options):
        return given
    values = option_values(given) if is_dataclass(given) else dict(given)
    own = _names(solver.options)
    foreign = {k: v for k, v in values.items() if k not in own}
    if foreign:
        _check_foreign(solver, proto, foreign)
    return solver.make_options(values)


def _check_foreign(solver: Solver, proto: Protocol, foreign: dict[str, Any]) -> None:
    """Refuse names no registered solver reads, and set options other solvers keep to themselves."""
    from featcache.probes.solvers import option_fields

    known = option_fields()
    unknown = sorted(set(foreign) - set(known))
    if unknown:
        raise ProbeConfigError(
            f"ProbeConfig has no option {', '.join(map(repr, unknown))}; the solvers' options are {sorted(known)}"
        )
    refused = []
    for name, value in foreign.items():
        f, owners = known[name]
        if value != f.default:  # checked as its solver checks it, even where it is ignored
            SOLVERS[owners[0]].options(**{name: value})
        kept = [o for o in owners if name in getattr(SOLVERS[o].options, "exclusive", ())]
        if kept and value != f.default:
            refused.append(((f.metadata.get("name") or "--" + name.replace("_", "-")), " and ".join(kept)))
    if refused:
        flags = [r[0] for r in refused]
        own = [f.metadata.get("name") or "--" + f.name.replace("_", "-") for f in fields(solver.options)]
        takes = f"the options --protocol {proto.spec} takes: {', '.join(own)}" if own else "it takes no solver option"
        verb = "s read" if " and " in refused[0][1] else " reads"
        raise ProbeConfigError(
            f"--protocol {proto.spec} does not take {' or '.join(flags)}: it fixes its own batches and schedule "
            f"({takes}); drop {' and '.join(flags)}, which only the {refused[0][1]} solver{verb}"
        )
