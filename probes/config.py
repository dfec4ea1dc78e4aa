"""The probe stage's config: one frozen dataclass, the single source of ``featcache probe``'s
flags, of the probe run ids' options and of the hyper-parameters recorded in result rows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from featcache.core.configs import Interval, check_fields, flag, seed_tuple, str_tuple
from featcache.errors import ConfigError, ProbeError

__all__ = ["ProbeConfig"]

if TYPE_CHECKING:
    from featcache.core.protocols import Protocol


class ProbeConfigError(ConfigError, ProbeError):
    """An invalid ProbeConfig value (a ConfigError; still a ProbeError, as it was)."""


def _protocol_help() -> str:
    from featcache.core.protocols import protocol_help

    return protocol_help("probe")


def _task_metrics() -> tuple[str, ...]:
    from featcache.core import metrics

    return metrics.TASK_METRICS


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
    backend: str = flag("auto", choices=["auto", "sklearn", "cuml", "torch"])
    Cs: tuple[float, ...] | None = flag(None, cli=False)  # None: the protocol's C grid
    max_iter: int = flag(1000, type=int, check=Interval(int, 1))
    tol: float = flag(1e-4, type=float, check=Interval(float, 0))
    sweep: str = flag(
        "exhaustive",
        "C selection: every C to convergence, or a loose early-stopped scan of the warm-started path, then a climb from its best at full tolerance (torch backend)",
        choices=["exhaustive", "halving"],
    )
    max_host_bytes: int | None = flag(
        None,
        "stream training rows in blocks when an in-memory fit would allocate more than this many bytes (default 1 GiB)",
        type=int,
        check=Interval(int, 1),
    )
    standardize: bool = flag(
        True, "fit on raw features (default: z-score with training statistics)", negate="--no-standardize"
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
    sgd_epochs: int | None = flag(
        None,
        "salman, bob-linear, dinov2-linear: training epochs (papers: 150, 90; dinov2-linear: 10 epochs of "
        "--epoch-length iterations)",
        name="--epochs",
        type=int,
        check=Interval(int, 1),
    )
    batch_size: int | None = flag(
        None, "dinov2-linear: rows per training batch (reference: 128)", type=int, check=Interval(int, 1)
    )
    epoch_length: int | None = flag(
        None,
        "dinov2-linear: iterations per epoch (reference: 1250; an epoch is not a pass over the data)",
        type=int,
        check=Interval(int, 1),
    )
    views: int = flag(
        0,
        "train on the train split's first K augmented views (featcache extract --views K): bob-linear and "
        "dinov2-linear draw one view per image per epoch (seeded); full/fewshot/subset fit on all K views "
        "with sample weight 1/K; selection and evaluation read the deterministic features (default 0: none)",
        type=int,
        metavar="K",
        check=Interval(int, 0),
    )
    search_epochs: int | None = flag(
        None, "elevater-*: epochs per search trial (paper: 10)", type=int, check=Interval(int, 1)
    )
    final_epochs: int | None = flag(
        None, "elevater-*: epochs of the final run on train+val (paper: 50)", type=int, check=Interval(int, 1)
    )
    final_epoch: str = flag(
        "last",
        "elevater-*: the epoch of the final run that is reported: 'last' (default, an honest "
        "held-out number) or 'best-test', the ELEVATER toolkit's rule, which SELECTS THE EPOCH "
        "ON THE TEST SPLIT (each eval split picks its own best epoch; optimistic)",
        choices=["last", "best-test"],
    )
    vtab_steps: tuple[int, ...] | None = flag(None, cli=False)  # None: the protocol's schedules
    last_decay: float | None = flag(None, cli=False)  # None: the protocol's (0.9)
    sgd_standardize: bool = flag(False, cli=False)
    metrics: tuple[str, ...] | None = flag(None, cli=False)  # None: every metric
    metric: str | None = flag(
        None,
        "the task's metric, used to select hyper-parameters (default: the metric recorded "
        "for the dataset in the store, else top1)",
        choices=_task_metrics,
    )
    progress: bool = flag(True, "no progress bars", negate="--no-progress")

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put(
            "cache",
            str(self.cache)
            if isinstance(self.cache, str) or hasattr(self.cache, "__fspath__")
            else tuple(str(c) for c in self.cache),
        )
        check_fields(self)  # --max-iter, --tol, --max-host-bytes, --epochs ... (one line naming the flag)
        put("backbones", str_tuple(self.backbones))
        put("seeds", seed_tuple(self.seeds, ProbeConfigError))
        put("eval_splits", str_tuple(self.eval_splits))
        if self.Cs is not None:
            put("Cs", tuple(sorted(float(c) for c in self.Cs)))
        if self.vtab_steps is not None:
            put("vtab_steps", tuple(int(s) for s in self.vtab_steps))
        if self.metrics is not None:
            put("metrics", str_tuple(self.metrics))
        if self.results_path is not None:
            put("results_path", str(self.results_path))
        if self.metric is not None:
            from featcache.core.metrics import TASK_METRICS

            if self.metric not in TASK_METRICS:
                raise ProbeConfigError(f"unknown task metric {self.metric!r}; choose one of {TASK_METRICS}")

    def resolve(self) -> tuple[Protocol, ProbeConfig]:
        """(protocol, config with every ``None`` grid/schedule/seed field filled in from it)."""
        from featcache.core.protocols import CGrid, SGDGrid, get_protocol

        proto = get_protocol(self.protocol, "probe")
        g = proto.grid
        cgrid = g if isinstance(g, CGrid) else CGrid()
        out = replace(
            self,
            seeds=proto.seeds if self.seeds is None else self.seeds,
            Cs=cgrid.Cs if self.Cs is None else self.Cs,
            vtab_steps=self.vtab_steps if self.vtab_steps is not None else getattr(g, "steps", None),
            last_decay=self.last_decay if self.last_decay is not None else getattr(g, "last_decay", None),
            sgd_epochs=self.sgd_epochs if self.sgd_epochs is not None else getattr(g, "epochs", None),
            search_epochs=self.search_epochs if self.search_epochs is not None else getattr(g, "search_epochs", None),
            final_epochs=self.final_epochs if self.final_epochs is not None else getattr(g, "final_epochs", None),
        )
        out = _dinov2_linear_schedule(proto, out)
        if out.final_epoch not in ("last", "best-test"):
            raise ProbeConfigError(f"final_epoch must be 'last' or 'best-test' (got {out.final_epoch!r})")
        for f in ("search_epochs", "final_epochs"):
            if getattr(out, f) is not None and getattr(out, f) < 1:
                raise ProbeConfigError(f"{f} must be >= 1 (got {getattr(out, f)})")
        if proto.kind and out.kind == "pooled":  # e.g. the attentive probes read tokens unless told
            out = replace(out, kind=proto.kind)
        if isinstance(g, CGrid) and g.fixed:  # e.g. dinov2 (its log_regression.py): raw features, tol 1e-12
            out = replace(out, **dict(g.fixed))
        from featcache.probes.solvers import get_solver

        solver = get_solver(proto.solver)
        if solver.default_head_init and out.head_init is None:  # zeroshot: the text head is the classifier
            out = replace(out, head_init=solver.default_head_init)
        if not out.seeds:
            raise ProbeConfigError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if not out.backbones:
            raise ProbeConfigError("no backbone given; pass --backbone NAME (repeatable) or --all")
        if out.sgd_epochs is not None and isinstance(g, SGDGrid) and g.epochs is not None and out.sgd_epochs < 3:
            raise ProbeConfigError(f"{proto.spec} needs sgd_epochs >= 3 (the lr drops at 1/3 and 2/3 of training)")
        return proto, out

    def solver_options(self) -> dict[str, Any]:
        """The solver settings the fitters of :mod:`featcache.probes.solvers` read (a resolved config)."""

        def opt(cast, v):  # grid fields a protocol does not use stay None
            return None if v is None else cast(v)

        return {
            "Cs": list(self.Cs or ()),
            "backend": self.backend,
            "max_iter": int(self.max_iter),
            "tol": float(self.tol),
            "standardize": bool(self.standardize),
            "sgd_epochs": opt(int, self.sgd_epochs),
            "vtab_steps": opt(tuple, self.vtab_steps),
            "last_decay": opt(float, self.last_decay),
            "sgd_standardize": bool(self.sgd_standardize),
            "metric": self.metric or "top1",
            "search_epochs": opt(int, self.search_epochs),
            "final_epochs": opt(int, self.final_epochs),
            "final_epoch": str(self.final_epoch),
            "sweep": str(self.sweep),
            "max_host_bytes": opt(int, self.max_host_bytes),
            "batch_size": opt(int, self.batch_size),
            "epoch_length": opt(int, self.epoch_length),
        }

    def run_options(self, proto: Protocol) -> dict[str, Any]:
        """Options that enter the run id (and are recorded): the task metric and the solver
        settings the protocol's solver declares it reads (:mod:`featcache.probes.solvers`),
        plus the data choices (a resolved config)."""
        from featcache.probes.solvers import get_solver

        # the backend and max_host_bytes change float summation order only, so they stay out
        solver_ = get_solver(proto.solver)
        keep = ("metric", *solver_.run_option_keys(proto))
        solver = self.solver_options()
        opts = {k: solver[k] for k in solver if k in keep}
        for k, default in (("sweep", "exhaustive"), ("final_epoch", "last")):
            if opts.get(k) == default:  # the defaults: run ids of earlier results stay
                del opts[k]
        if opts["metric"] == "top1":  # top-1 tasks keep the run ids they always had
            del opts["metric"]
        opts.update(kind=self.kind, head_init=self.head_init, train_split=self.train_split)
        if self.views:  # recorded only when used: earlier run ids stay
            opts["views"] = self.views
        if proto.val_source_choice:
            opts["val_source"] = self.val_source
        if proto.holdout_order:  # ELEVATER's full protocol: its first-20% rows, in the dataset's own order
            opts["holdout_order"] = proto.holdout_order
        opts.update(solver_.recorded)  # elevater: the toolkit's loop (BN modes, seeded init, its batches)
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


def _dinov2_linear_schedule(proto: Protocol, cfg: ProbeConfig) -> ProbeConfig:
    """``cfg`` with ``batch_size`` / ``epoch_length`` from a ``dinov2-linear`` grid; refused
    for the other protocols (which fix their own batches)."""
    from featcache.core.protocols import Dinov2LinearGrid

    g = proto.grid
    if isinstance(g, Dinov2LinearGrid):
        return replace(
            cfg,
            batch_size=g.batch_size if cfg.batch_size is None else cfg.batch_size,
            epoch_length=g.epoch_length if cfg.epoch_length is None else cfg.epoch_length,
        )
    given = [f for f, v in (("--batch-size", cfg.batch_size), ("--epoch-length", cfg.epoch_length)) if v is not None]
    if given:
        raise ProbeConfigError(
            f"{', '.join(given)} set the dinov2-linear schedule; {proto.spec} fixes its own batches: "
            f"drop {' and '.join(given)} or use --protocol dinov2-linear"
        )
    return cfg
