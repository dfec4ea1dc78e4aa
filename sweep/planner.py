"""Plan a sweep: expand backbones x datasets x protocols x seeds (+ retrieval setups and
fine-tunes) from the store catalog into small, frozen, idempotent work items.

An item carries the stage's own frozen config (:class:`~featcache.probes.ProbeConfig` for one
backbone, dataset, protocol and seed; :class:`~featcache.retrieval.RetrievalConfig`;
:class:`~featcache.finetune.FinetuneConfig`) and the store path or URL, never arrays. Its
``run_ids`` are the ids the stage itself gives its rows, computed from the config and the
store's provenance records without reading features (``featcache.probes.store_lookup.run_ids``,
``RetrievalConfig.run_ids``), so an item whose runs are all in the results, whoever wrote
them (a plain ``featcache probe`` too), is skipped. A fine-tune's run ids depend on the built
backbone (weights hash, resolved preprocessing): its item is always sent, and the stage skips
the seeds already in the results before training.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from featcache.core.configs import flag, float_list, int_list, renamed_kwargs, seed_tuple
from featcache.errors import NotInStoreError, SweepError

log = logging.getLogger(__name__)

KINDS = ("probe", "retrieval", "finetune")
#: FinetuneConfig fields the sweep's fine-tune options may set (its scaled-down runs)
FINETUNE_OPTIONS = (
    "steps",
    "lrs",
    "batch_size",
    "micro_batch",
    "input_size",
    "limit",
    "device",
    "checkpoint_every",
    "memory_limit_gb",
)


def _frozen_map(value) -> tuple[tuple[str, Any], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))


def _data_map(value) -> tuple[tuple[str, str], ...]:
    """``data`` as sorted ``(name, spec)`` pairs, from a mapping, pairs or ``NAME=SPEC``
    strings (``--data``; a later NAME wins)."""
    if isinstance(value, Mapping) or not any(isinstance(v, str) for v in value):
        return _frozen_map(value)
    out = {}
    for text in value:
        if not isinstance(text, str):
            name, spec = text
            out[str(name)] = spec
            continue
        name, sep, spec = text.partition("=")
        if not sep or not name.strip() or not spec.strip():
            raise SweepError(f"--data takes NAME=SPEC, e.g. digits=digits (got {text!r})")
        out[name.strip()] = spec.strip()
    return _frozen_map(out)


def _protocols_help() -> str:
    from featcache.core.protocols import protocol_usages

    return (
        f"probe protocol: {' | '.join(protocol_usages('probe'))} "
        "(repeatable; default: full, or none with --retrieval or --finetune)"
    )


def _dense_help() -> str:
    from featcache.core.protocols import protocol_usages

    return (
        f"dense protocol: {' | '.join(protocol_usages('dense'))} (repeatable; one item per backbone, dense "
        "dataset and seed: the datasets whose store groups hold targets, featcache extract on a dense dataset)"
    )


def _finetune_help() -> str:
    from featcache.core.protocols import protocol_usages

    return f"fine-tune protocol: {' | '.join(protocol_usages('finetune'))} (repeatable)"


@dataclass(frozen=True)
class FinetuneFlags:
    """The sweep's ``--ft-*`` flags: the :data:`FINETUNE_OPTIONS` the command line sets
    (:attr:`SweepConfig.finetune_options` takes any of them in Python)."""

    steps: tuple[int, ...] | None = flag(
        None,
        "comma-separated schedule lengths (scaled-down run; default: the protocol's)",
        name="--ft-steps",
        type=int_list,
    )
    lrs: tuple[float, ...] | None = flag(
        None, "comma-separated learning rates (default: the protocol's)", name="--ft-lrs", type=float_list
    )
    batch_size: int | None = flag(None, "SGD batch (default: the protocol's)", name="--ft-batch-size", type=int)
    input_size: int | None = flag(
        None, "input resolution (default: the extraction's)", name="--ft-input-size", type=int
    )
    limit: int | None = flag(None, "first N images of every split", name="--ft-limit", type=int)

    def options(self) -> dict[str, Any]:
        """The flags given, as ``finetune_options``."""
        return {k: v for k, v in vars(self).items() if v is not None}


@renamed_kwargs(results="results_path")
@dataclass(frozen=True)
class SweepConfig:
    """What to sweep and where. Empty ``backbones``/``datasets`` mean "all in the store".
    ``protocols`` are probe protocol specs (``full``, ``fewshot:5``, ...); ``seeds=None`` uses
    each protocol's default seeds. ``retrieval`` adds one retrieval (+ k-NN) run per
    (backbone, dataset). ``finetune``: fine-tune protocols (``vtab1k-light``, ``full``), one
    item per backbone, dataset and seed, with the model and weights the store's provenance
    records for the backbone, the images of ``data[dataset]`` (a data spec: the store does
    not record where the images are) and ``finetune_options`` (FinetuneConfig fields, e.g.
    steps, lrs, batch_size, input_size, limit); their paired probe protocol is added to
    ``protocols``. ``scheduler``: address of a running Dask scheduler (default:
    ``DASK_SCHEDULER_ADDRESS``, else an in-process LocalCluster of ``workers`` processes;
    ``workers=0`` runs the items one by one in this process, without Dask);
    ``connect_timeout``: seconds to wait for that scheduler. ``seeds`` may be ``"0,1,2"`` and
    ``data`` ``NAME=SPEC`` strings, as on the command line; the fields' ``configs.flag``
    metadata are ``featcache sweep``'s flags."""

    cache: str = flag(help="feature store path or URL (workers read it themselves)", required=True)
    results_path: str = flag(help="results parquet to append to", name="--results", required=True)
    backbones: tuple[str, ...] = flag((), "backbone key (repeatable; default: all)", name="--backbone", action="append")
    datasets: tuple[str, ...] = flag((), "dataset (repeatable; default: all)", name="--dataset", action="append")
    protocols: tuple[str, ...] = flag(("full",), _protocols_help, name="--protocol", action="append")
    seeds: tuple[int, ...] | None = flag(None, "comma-separated seeds (default: each protocol's defaults)")
    retrieval: bool = flag(False, "add a retrieval + k-NN run per backbone and dataset", action="store_true")
    finetune: tuple[str, ...] = flag((), _finetune_help, action="append", metavar="PROTOCOL")
    dense: tuple[str, ...] = flag((), _dense_help, action="append", metavar="PROTOCOL")
    data: tuple[tuple[str, str], ...] = flag(
        (),
        "images of dataset NAME for the fine-tunes (required for each swept dataset: "
        "the store does not record where its images are), e.g. digits=digits, "
        "fmnist=fashion-mnist, pets=imagefolder:DIR",
        action="append",
        metavar="NAME=SPEC",
    )
    finetune_options: tuple[tuple[str, Any], ...] = flag((), cli=False)  # the CLI: FinetuneFlags
    scheduler: str | None = flag(
        None, "address of a running Dask scheduler (default: $DASK_SCHEDULER_ADDRESS, else an in-process LocalCluster)"
    )
    workers: int = flag(
        2, "LocalCluster worker processes (default 2; 0: run here, one item at a time)", type=int, show_default=False
    )
    force: bool = flag(False, "rerun items already done", action="store_true")
    views: int = flag(
        0,
        "probe protocols that train on augmented views (bob-linear, dinov2-linear, the L-BFGS ones) use the "
        "store's first K views (featcache extract --views K); the others run without (default 0: none)",
        type=int,
        metavar="K",
    )
    train_split: str = flag("train", cli=False)
    eval_split: str = flag("test", cli=False)
    gallery_split: str = flag("train", cli=False)
    feature_kind: str = flag("pooled", cli=False)
    connect_timeout: float = flag(30.0, cli=False)

    @property
    def results(self) -> str:
        """Deprecated: the results table is :attr:`results_path`."""
        import warnings

        warnings.warn("SweepConfig.results is deprecated; use .results_path", DeprecationWarning, stacklevel=2)
        return self.results_path

    def __post_init__(self):
        for name in ("backbones", "datasets", "protocols", "finetune", "dense"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "cache", str(self.cache))
        object.__setattr__(self, "results_path", str(self.results_path))
        object.__setattr__(self, "data", _data_map(self.data))
        object.__setattr__(self, "finetune_options", _frozen_map(self.finetune_options))
        if self.seeds is not None:
            object.__setattr__(self, "seeds", seed_tuple(self.seeds, SweepError))
            if not self.seeds:
                raise SweepError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
        if isinstance(self.views, bool) or not isinstance(self.views, int) or self.views < 0:
            raise SweepError(f"views must be an integer >= 0 (0: no augmented views), got {self.views!r}")
        if self.workers < 0:
            raise SweepError(f"workers must be >= 0 (0: run in this process), got {self.workers}")
        unknown = sorted(set(dict(self.finetune_options)) - set(FINETUNE_OPTIONS))
        if unknown:
            raise SweepError(f"finetune_options {unknown} are not sweep fine-tune options; use {FINETUNE_OPTIONS}")
        if not self.protocols and not self.retrieval and not self.finetune and not self.dense:
            raise SweepError("nothing to sweep: give --protocol P, --retrieval, --finetune P and/or --dense P")


@dataclass(frozen=True)
class WorkItem:
    """One stage run: ``config`` is the stage's own config, ``run_ids`` the ids of the rows
    it writes (empty: known only once the stage runs), ``run_id`` the item's key (its one
    run id, else a hash of them)."""

    kind: str
    run_id: str
    config: Any
    run_ids: tuple[str, ...]
    backbone: str
    dataset: str
    protocol: str
    seed: int = 0

    @property
    def label(self) -> str:
        if self.kind == "retrieval":
            c = self.config
            return f"retrieval {self.backbone}/{self.dataset} {self.protocol} {c.query_split}->{c.gallery_split}"
        return f"{self.kind} {self.backbone}/{self.dataset} {self.protocol} seed {self.seed}"

    @property
    def results(self) -> str:
        return self.config.results_path  # every stage config names its results table so


@dataclass(frozen=True)
class Plan:
    """Items to run, items skipped as already done, and requested cells the store lacks."""

    items: tuple[WorkItem, ...]
    done: tuple[WorkItem, ...] = ()
    not_in_store: tuple[str, ...] = field(default=())


def default_seeds(protocol: str, stage: str = "probe") -> tuple[int, ...]:
    """Seeds a protocol runs by default (from the protocol registry)."""
    from featcache.core.protocols import get_protocol

    return tuple(get_protocol(protocol, stage).seeds)


def _select(requested: Sequence[str], present: Sequence[str], what: str) -> list[str]:
    if not requested:
        return sorted(present)
    unknown = [r for r in requested if r not in present]
    if unknown:
        raise SweepError(
            f"{what} {unknown} not in the store; it holds {sorted(present)} (run `featcache ls` to see the catalog)"
        )
    return list(dict.fromkeys(requested))


def _item(kind: str, config, run_ids, backbone: str, dataset: str, protocol: str, seed: int = 0) -> WorkItem:
    from featcache.core.results import make_run_id

    ids = tuple(run_ids)
    key = ids[0] if len(ids) == 1 else make_run_id(kind=f"sweep-{kind}", runs=sorted(ids))
    return WorkItem(kind, key, config, ids, backbone, dataset, protocol, seed)


def _probe_items(config: SweepConfig, b: str, d: str, protocols: Sequence[str]) -> list[WorkItem]:
    from featcache.core.protocols import get_protocol
    from featcache.probes import ProbeConfig
    from featcache.probes.solvers import get_solver
    from featcache.probes.store_lookup import run_ids as probe_run_ids

    out = []
    for p in protocols:
        views = config.views if config.views and get_solver(get_protocol(p, "probe").solver).views else 0
        for s in config.seeds or default_seeds(p):
            pc = ProbeConfig(
                config.cache,
                (b,),
                d,
                p,
                seeds=(s,),
                results_path=config.results_path,
                force=config.force,
                eval_splits=(config.eval_split,),
                train_split=config.train_split,
                kind=config.feature_kind,
                views=views,
                progress=False,
            )
            out.append(_item("probe", pc, probe_run_ids(pc).values(), b, d, p, s))
    return out


def _retrieval_item(config: SweepConfig, cache, b: str, d: str) -> WorkItem:
    from featcache.retrieval import RetrievalConfig

    rc = RetrievalConfig(
        cache=config.cache,
        dataset=d,
        backbones=(b,),
        query_split=config.eval_split,
        gallery_split=config.gallery_split,
        results_path=config.results_path,
        kind=config.feature_kind,
        force=config.force,
        progress=False,
    )

    q = cache.stored_fingerprint(b, d, config.eval_split, config.feature_kind)
    g = q if rc.same_split else cache.stored_fingerprint(b, d, config.gallery_split, config.feature_kind)
    return _item("retrieval", rc, rc.run_ids(b, rc.pair_fingerprint(q, g)), b, d, "semantic")


def _finetune_items(config: SweepConfig, cache, b: str, d: str) -> list[WorkItem]:
    from featcache.core.results import make_run_id
    from featcache.finetune import FinetuneConfig
    from featcache.models.backbones import reproducible_weights

    prov = cache.provenance(b, d, config.train_split, config.feature_kind)
    if not reproducible_weights(prov.weights_source):  # a scheme registered as reproducible, or a file
        log.warning("no fine-tune of %s: its weights %r cannot be loaded again", b, prov.weights_source)
        return []
    opts = dict(config.finetune_options)
    size = prov.data_config.get("input_size")
    opts.setdefault("input_size", int(size[-1]) if size else None)
    opts.setdefault("pre_resize", prov.data_config.get("pre_resize"))
    out = []
    for p in config.finetune:
        for s in config.seeds or default_seeds(p, "finetune"):
            fc = FinetuneConfig(
                model=prov.model_name,
                weights=prov.weights_source,
                data=dict(config.data)[d],
                protocol=p,
                seeds=(s,),
                results_path=config.results_path,
                eval_splits=(config.eval_split,),
                train_split=config.train_split,
                dataset_name=d,
                backbone_name=b,
                workers=0,
                force=config.force,
                progress=False,
                **opts,
            )
            key = make_run_id(
                kind="sweep-finetune", config={k: v for k, v in vars(fc).items() if k not in ("force", "progress")}
            )
            out.append(WorkItem("finetune", key, fc, (), b, d, p, s))
    return out


def _dense_items(config: SweepConfig, cache, b: str, d: str) -> list[WorkItem]:
    """One dense item per protocol and seed where ``b`` stores ``d`` as a dense dataset (its
    groups hold targets); the stage itself skips runs already in the table."""
    from featcache.core.results import make_run_id
    from featcache.dense import DenseConfig
    from featcache.store import dense_groups

    if not config.dense or not dense_groups(cache, b, d):
        return []
    out = []
    for p in config.dense:
        for s in config.seeds or (0,):
            dc = DenseConfig(
                config.cache,
                d,
                (b,),
                p,
                seeds=(s,),
                results_path=config.results_path,
                force=config.force,
                progress=False,
            )
            key = make_run_id(
                kind="sweep-dense", config={k: v for k, v in vars(dc).items() if k not in ("force", "progress")}
            )
            out.append(WorkItem("dense", key, dc, (), b, d, p, s))
    return out


def _probe_protocols(config: SweepConfig) -> list[str]:
    """The probe protocols, plus the one each fine-tune protocol pairs with (registry)."""
    from featcache.core.protocols import get_protocol, parse_protocol

    for p in config.protocols:
        parse_protocol(p)  # an unknown protocol fails here, before anything runs
    paired = [get_protocol(p, "finetune").pairs_with for p in config.finetune]
    return list(dict.fromkeys([*config.protocols, *(p for p in paired if p)]))


def _check_data(config: SweepConfig, datasets: Sequence[str]) -> None:
    if not config.finetune:
        return
    missing = [d for d in datasets if d not in dict(config.data)]
    if missing:
        raise SweepError(
            f"fine-tunes read images, and the store does not record where they are: "
            f"pass --data NAME=SPEC for {missing} (e.g. --data digits=digits, "
            "--data fmnist=fashion-mnist) or restrict --dataset"
        )


def plan(config: SweepConfig) -> Plan:
    """Expand ``config`` against the store catalog into work items (see the module doc)."""
    from featcache.core.results import existing_run_ids
    from featcache.store import open_cache

    protocols = _probe_protocols(config)
    cache = open_cache(config.cache)
    entries = set(cache.entries())
    datasets = _select(config.datasets, sorted({d for _, d, _ in entries}), "dataset(s)")
    backbones = _select(config.backbones, sorted({b for b, _, _ in entries}), "backbone(s)")
    _check_data(config, datasets)
    items: list[WorkItem] = []
    lacking: list[str] = []
    for d in datasets:
        for b in backbones:
            gallery = [] if config.gallery_split == "same" else [config.gallery_split]
            needs = [(bool(protocols or config.finetune), [config.train_split]), (config.retrieval, gallery)]
            splits = [config.eval_split] + [s for want, ss in needs if want for s in ss]
            if not all((b, d, s) in entries for s in splits):
                lacking.append(f"{b}/{d} ({'+'.join(dict.fromkeys(splits))})")
                continue
            try:
                items += _probe_items(config, b, d, protocols)
                if config.retrieval:
                    items.append(_retrieval_item(config, cache, b, d))
                if config.finetune:
                    items += _finetune_items(config, cache, b, d)
                items += _dense_items(config, cache, b, d)
            except NotInStoreError as exc:  # e.g. a val split the protocol reads is not extracted
                lacking.append(f"{b}/{d} ({exc})")
    result_ids = set() if config.force else existing_run_ids(config.results_path)
    done = tuple(i for i in items if i.run_ids and set(i.run_ids) <= result_ids)
    todo = tuple(i for i in items if not (i.run_ids and set(i.run_ids) <= result_ids))
    lacking = list(dict.fromkeys(lacking))
    if config.backbones and config.datasets and lacking:
        log.warning("the store lacks %d requested cell(s): %s", len(lacking), ", ".join(lacking[:10]))
    log.info("sweep plan: %d item(s) to run, %d already done", len(todo), len(done))
    return Plan(todo, done, tuple(lacking))
