"""Run probe protocols from a feature cache into the tidy results table.

:func:`run_probes` takes a :class:`~featcache.probes.config.ProbeConfig`, loads each
backbone's splits, checks them (valid rows only, finite, class sets, ids aligned across
backbones and disjoint between train and eval splits), draws the protocol's seeded splits
(:mod:`featcache.core.protocols`) from labels and ids only (so every backbone sees the same images
for a seed), selects hyperparameters on validation data only, refits, reads each eval split
once, and writes one row per (run, metric).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from featcache.core.metrics import MULTILABEL_METRICS, compute_all, metric_names
from featcache.core.protocols import Protocol, SplitPlan
from featcache.core.stagerun import (
    canonical_order,
    check_disjoint,
    check_two_classes,
    collect,
    finished,
    label_positions,
    pending,
)
from featcache.errors import IncompleteStoreError, NotInStoreError, ProbeError, StoreBusyError
from featcache.probes._stream import nonfinite_rows
from featcache.probes.config import ProbeConfig
from featcache.probes.solvers import SOLVERS, FitRequest
from featcache.probes.store_lookup import (  # the store side, shared with store_lookup.run_ids
    TEXT_SOURCE_KEYS,
    cache_for,
    open_caches,
    resolve_backbones,
    resolve_val_source,
    text_fingerprint,
)
from featcache.probes.store_lookup import store_fingerprints as store_fingerprints  # its old home
from featcache.store import StoredRows, combine_fingerprints

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)


@dataclass
class SplitData:
    """Valid rows of one split, in canonical (id-sorted) order."""

    name: str
    X: np.ndarray | StoredRows  # StoredRows: a lazily loaded split, still in the store
    y: np.ndarray  # int64 indices into the train split's class_names
    ids: np.ndarray
    n_invalid: int
    fingerprint: str
    rows: np.ndarray | None = None  # each row's position in the store (the dataset's own order)
    Y: np.ndarray | None = None  # multi-label targets [N, C] bool, same row order
    input_info: dict[str, Any] | None = None  # a solver's own input (Solver.load): its sources


@dataclass
class _Plan:
    """What one protocol seed fits on: (X, y) of its train, val and final fits."""

    tr: tuple[np.ndarray | StoredRows, np.ndarray]
    va: tuple[np.ndarray | StoredRows, np.ndarray]
    fin: tuple[np.ndarray | StoredRows, np.ndarray]
    train_split: str
    info: dict[str, Any] = field(default_factory=dict)
    Y: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # multi-label targets of tr, va, fin
    #: ``--views K``: per plan part ("tr", "fin"), the K views' X in that part's row order (rows
    #: of a val split, which has no views, repeat its deterministic features)
    views: dict[str, list[np.ndarray | StoredRows]] | None = None


@dataclass
class _Data:
    """Every split one backbone is probed on, and the train split's class names."""

    train: SplitData
    val: SplitData | None
    evals: dict[str, SplitData]
    names: list[str]
    views: list[SplitData] = field(default_factory=list)  # --views K: train's views, aligned by id

    def splits(self) -> dict[str, SplitData]:
        return {self.train.name: self.train, **({self.val.name: self.val} if self.val else {}), **self.evals}


# ------------------------------------------------------------------ loading
def _load_split(cache, backbone, dataset, split, kind, train_names=None, lazy: bool = False, load=None) -> SplitData:
    """A split's valid rows in id order; ``lazy``: features stay in the store (a
    :class:`~featcache.store.rows.StoredRows` view in the stored dtype, read block by block);
    ``load``: the solver's own input loader (:attr:`Solver.load <featcache.probes.solvers.Solver.load>`)."""
    f = (
        cache.load(backbone, dataset, split, kind=kind, lazy=lazy)
        if load is None
        else load(cache, backbone, dataset, split, kind)
    )
    valid = np.asarray(f.valid, bool)
    ids = np.asarray(f.ids)[valid].astype(str)
    order = canonical_order(ids)
    rows = np.flatnonzero(valid)[order]
    X = f.X[rows]  # the valid rows in id order: one copy (a view when lazy)
    bad = nonfinite_rows(X)
    if bad.any():
        raise ProbeError(
            f"{backbone}/{dataset}/{split}: {int(bad.sum())} rows marked valid hold NaN or inf "
            f"features (first id {ids[order][bad][0]!r}); re-extract them with `featcache "
            "extract ... --overwrite` or check the backbone's numerics (e.g. fp16 overflow)"
        )
    names = np.asarray(f.class_names, dtype=object)
    y_names = names[np.asarray(f.labels)[rows]]
    y = label_positions(y_names, list(f.class_names) if train_names is None else train_names, f"{dataset}/{split}")
    info = getattr(f, "input_info", None)
    return SplitData(split, X, y, ids[order], int((~valid).sum()), f.fingerprint, rows=rows, input_info=info)


def _load_backbone(caches, b: str, cfg: ProbeConfig, proto: Protocol) -> _Data:
    """Load and check every split ``b`` is probed on (before anything is fitted)."""
    ds = cfg.dataset
    c = cache_for(caches, b, ds)
    splits = c.splits(ds)
    if cfg.train_split not in splits:
        raise NotInStoreError(f"dataset {ds!r} has no split {cfg.train_split!r} (has {splits})")
    lazy = _large(c, b, ds, cfg, proto)
    load = cfg.solver.load
    tr = _load_split(c, b, ds, cfg.train_split, cfg.kind, lazy=lazy, load=load)
    names = list(c.split_meta(ds, cfg.train_split).class_names)
    va = None
    val_name = cfg.val_split_used(proto, splits)
    if val_name:  # lazy with train: the final fit is on train+val
        va = _load_split(c, b, ds, val_name, cfg.kind, names, lazy=lazy, load=load)
        log.info("%s %s: selecting on the dataset's own %r split", b, ds, val_name)
    elif proto.uses_val_split(cfg.val_source):
        log.info("%s %s: no %r split; selecting on a holdout of %r", b, ds, cfg.val_split, cfg.train_split)
    evals = {}
    for s in cfg.eval_splits:
        if s not in splits:
            raise NotInStoreError(
                f"dataset {ds!r} has no split {s!r} to evaluate on (has {splits}); pass --eval-split with one of them"
            )
        evals[s] = _load_split(c, b, ds, s, cfg.kind, names, lazy=lazy, load=load)  # lazy: read after the fits
        for fitted in (tr, va) if va is not None else (tr,):
            check_disjoint(fitted.name, fitted.ids, s, evals[s].ids)
    check_two_classes(tr.y, f"{b}/{ds}/{cfg.train_split}", "a probe")
    data = _Data(tr, va, evals, names)
    if cfg.views:
        from featcache.probes.views import load_views

        def load_view(*args, **kw) -> SplitData:  # through the solver's own input loader, as train
            return _load_split(*args, **kw, load=load)

        data.views = load_views(c, b, ds, cfg, tr, names, load_view, lazy)
        tr.fingerprint = combine_fingerprints(tr.fingerprint, *(v.fingerprint for v in data.views))  # run ids
    _attach_label_matrices(c, ds, data)
    return data


def _attach_label_matrices(cache, ds: str, data: _Data) -> None:
    """Multi-label targets (:mod:`featcache.store.tasks`) of every split, aligned by id;
    their hash joins the split's fingerprint (so run ids follow the targets)."""
    from featcache.store import load_label_matrix

    loaded = {s: load_label_matrix(cache, ds, s) for s in data.splits()}
    found = {s: v for s, v in loaded.items() if v is not None}
    held = list(found)
    if not held:
        return
    if len(held) != len(loaded):
        raise ProbeError(
            f"{ds}: splits {held} have multi-label targets but "
            f"{sorted(set(loaded) - set(held))} do not; write a label matrix for every "
            "split (featcache.store.tasks.write_label_matrix)"
        )
    names = found[data.train.name][1]
    for s, sd in data.splits().items():
        M, cols, sha = found[s]
        if cols != names:
            raise ProbeError(
                f"{ds}/{s}: label-matrix classes {cols[:5]}... differ from the train "
                f"split's {names[:5]}...; write every split with the same class list"
            )
        store_ids = cache.split_rows(ds, s)[0]
        order = np.argsort(store_ids, kind="stable")
        sd.Y = M[order[np.searchsorted(store_ids[order], sd.ids)]]
        sd.fingerprint = combine_fingerprints(sd.fingerprint, sha)


def _large(cache, b: str, ds: str, cfg: ProbeConfig, proto: Protocol) -> bool:
    """Leave the train split in the store, read block by block in its stored dtype, when
    the L-BFGS probe will stream it: its float32 copy alone would exceed ``max_host_bytes``."""
    from featcache.probes._stream import use_streaming

    if not cfg.solver.streams:
        return False
    prov = cache.provenance(b, ds, cfg.train_split, cfg.kind)
    row = int(np.prod(getattr(prov, "row_shape", None) or (prov.dim,)))  # [T, D] rows (tokens) count whole
    return use_streaming(prov.n, row, 0, 0, cfg.max_host_bytes)


def _check_alignment(per_backbone: dict[str, dict[str, SplitData]]) -> None:
    ref_b = next(iter(per_backbone))
    for b, splits in per_backbone.items():
        for s, d in splits.items():
            ref = per_backbone[ref_b][s]
            if d.ids.shape != ref.ids.shape or not np.array_equal(d.ids, ref.ids):
                only = np.setdiff1d(d.ids, ref.ids).size + np.setdiff1d(ref.ids, d.ids).size
                raise ProbeError(
                    f"split {s!r}: the valid rows of backbones {ref_b!r} and {b!r} do not align "
                    f"by id ({only} ids in one but not the other); extract both backbones from "
                    "the same dataset spec into one cache (or re-run the failed images) so "
                    "every backbone is evaluated on the same images"
                )


# ------------------------------------------------------------------ planning
def _take(train: SplitData, val: SplitData | None, pos: np.ndarray) -> tuple[np.ndarray | StoredRows, np.ndarray]:
    """(X, y) of positions into ``train ++ val`` (the protocol plan's index space)."""
    n = train.y.size
    in_val = pos >= n
    if not in_val.any():
        return train.X[pos], train.y[pos]
    assert val is not None  # the plan has positions past the train rows only with a val split
    a, b = pos[~in_val], pos[in_val] - n
    if not a.size:
        return val.X[b], val.y[b]
    xa, xb = train.X[a], val.X[b]  # lazily loaded splits (both or neither) stay lazy
    if isinstance(xa, StoredRows):
        assert isinstance(xb, StoredRows)  # _load_backbone loads every split lazily or none
        X = StoredRows.concatenate([xa, xb])
    else:
        X = np.concatenate([xa, xb])
    return X, np.concatenate([train.y[a], val.y[b]])


def _plan(
    proto: Protocol, seed: int, train: SplitData, val: SplitData | None, val_source: str, views: list | None = None
) -> _Plan:
    """The protocol's seeded plan (:meth:`Protocol.plan`) as the arrays the fits use (with
    ``views``, the train split's views of the train and final rows too)."""
    sp: SplitPlan = proto.plan(
        train.y,
        seed,
        n_val=None if val is None else val.y.size,
        val_source=val_source,
        train_name=train.name,
        val_name="val" if val is None else val.name,  # read only with a val split (n_val set)
        rows=train.rows,
        val_rows=None if val is None else val.rows,
        label_matrix=train.Y,
    )
    Y = None
    if train.Y is not None:
        rows = train.Y
        if val is not None:
            assert val.Y is not None  # _attach_label_matrices gives every split targets or none
            rows = np.concatenate([train.Y, val.Y])
        Y = (rows[sp.train], rows[sp.val], rows[sp.final])
    plan = _Plan(
        _take(train, val, sp.train), _take(train, val, sp.val), _take(train, val, sp.final), sp.train_split, sp.info, Y
    )
    if views:
        from dataclasses import replace

        vs = [replace(train, X=v.X) for v in views]
        plan.views = {part: [_take(v, val, pos)[0] for v in vs] for part, pos in (("tr", sp.train), ("fin", sp.final))}
    return plan


# ------------------------------------------------------------------ fitting
def _class_embeddings(caches, b: str, cfg: ProbeConfig) -> np.ndarray:
    """``b``'s class embeddings for the dataset (its text tower's; else dataset-level), checked
    against the tower that extracted ``b``'s features and the templates asked for."""
    c = cache_for(caches, b, cfg.dataset)
    m = np.asarray(c.load_class_embeddings(cfg.dataset, cfg.head_init, backbone=b), np.float64)
    _check_text_provenance(c, b, cfg)
    return m


def text_source(cache, b: str, cfg: ProbeConfig) -> dict:
    """Where ``b``'s class embeddings came from: their name and key, and the tower (its weights
    hash) and template set (its name and hash) ``featcache embed-classes`` recorded
    (``recorded: False`` for a matrix written with ``write_class_embeddings``)."""
    prov = cache.class_embeddings_provenance(cfg.dataset, cfg.head_init, backbone=b)
    out = {"name": cfg.head_init, **{k: prov[k] for k in TEXT_SOURCE_KEYS if k in prov}}
    return out if prov else {**out, "recorded": False}


def _check_text_provenance(cache, b: str, cfg: ProbeConfig) -> None:
    """Refuse class embeddings from another tower (weights hash) than ``b``'s image features,
    or from another template set than ``cfg.templates``, stating stored vs asked."""
    prov = cache.class_embeddings_provenance(cfg.dataset, cfg.head_init, backbone=b)
    feat = cache.provenance(b, cfg.dataset, cfg.train_split, cfg.kind)
    diff = {}
    if prov.get("weights_sha256") and prov["weights_sha256"] != feat.weights_sha256:
        diff["tower weights sha256"] = (
            f"{prov['weights_sha256'][:16]} ({prov.get('tower')})",
            f"{feat.weights_sha256[:16]} ({feat.model_name}, weights {feat.weights_source})",
        )
    if cfg.templates is not None:
        from featcache.core.prompts import load_templates, template_label, templates_sha256

        sha = templates_sha256(load_templates(cfg.templates, cfg.prompt_dataset or cfg.dataset))
        if prov.get("templates_sha256") != sha:
            stored = f"{prov['templates']} ({prov['templates_sha256'][:16]})" if prov else "not recorded"
            diff["templates"] = (stored, f"{template_label(cfg.templates)} ({sha[:16]})")
    if diff:
        what = "; ".join(f"{k}: stored {v[0]}, asked {v[1]}" for k, v in diff.items())
        raise ProbeError(
            f"class embeddings {cfg.head_init!r} of {b}/{cfg.dataset} do not match: {what}. Regenerate them "
            f"with the tower that extracted {b}: featcache embed-classes --cache {cache.path} --model "
            f"{feat.model_name} --weights {feat.weights_source} --dataset {cfg.dataset} --backbone {b} "
            f"--name {cfg.head_init} --templates {cfg.templates or prov.get('templates', 'SET')} --overwrite"
        )


# ------------------------------------------------------------------ main entry
def _writer_busy(cache, b: str, ds: str) -> str | None:
    """The split of ``b``/``ds`` whose writer lock another job holds now (local stores: a
    remote lease is not probed, that would write one), or None."""
    from featcache.store import StoreLock, local_root

    if local_root(cache.root.store) is None:
        return None
    for split in cache.splits(ds):
        try:
            StoreLock(cache.root, f"features/{b}/{ds}/{split}", timeout=0).acquire().release()
        except StoreBusyError:
            return split
        except Exception:  # a read-only store: nobody can be writing it
            return None
    return None


def _load_all(caches, backbones: list[str], cfg: ProbeConfig, proto: Protocol) -> dict[str, _Data]:
    """Every backbone's splits; one that another job is writing is refused in one line saying
    so, or with ``--all`` (several backbones) reported and skipped: the others are probed."""
    data = {}
    for b in backbones:
        try:
            data[b] = _load_backbone(caches, b, cfg, proto)
        except IncompleteStoreError as exc:
            split = _writer_busy(cache_for(caches, b, cfg.dataset), b, cfg.dataset)
            if split is None:
                raise
            msg = (
                f"{b}/{cfg.dataset}/{split} is being written by another job (its writer lock is held); "
                "wait for that job to finish, then run the probe again"
            )
            if list(cfg.backbones) != ["all"] or len(backbones) == 1:
                raise StoreBusyError(msg) from exc
            log.warning("%s: skipped, the other backbones are probed", msg)
    if not data:
        raise StoreBusyError("every backbone of --all is being written by another job; run the probe when they finish")
    return data


def run_probes(config: ProbeConfig) -> pl.DataFrame:
    """Probe ``config.backbones`` on ``config.dataset`` with ``config.protocol``; returns the
    rows of these runs (a polars DataFrame in the results schema).

    Runs already in ``config.results_path`` are skipped (their stored rows are returned)
    unless ``config.force``. Protocols with ``median_over_seeds`` (vtab1k) add the median
    row over seeds (``seed=-1``).
    """
    from featcache.core.progress import tqdm
    from featcache.core.results import check_results_path

    if config.layers:  # a layer sweep: this function once per stored layer (probes.layer_sweep)
        from featcache.probes.layer_sweep import run_layer_sweep

        return run_layer_sweep(config, run_probes)
    proto, cfg = config.resolve()
    if cfg.views:
        from featcache.probes.views import check_view_solver

        check_view_solver(cfg.solver, proto, cfg.views)
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)  # an unwritable table fails before the fits
    if cfg.predictions is not None:
        from featcache.probes.predictions import check_predictions_path

        check_predictions_path(cfg.predictions, cfg.results_path)
    caches = open_caches(cfg.cache)
    cfg = resolve_val_source(cfg, proto, caches)
    backbones = resolve_backbones(caches, cfg)
    data = _load_all(caches, backbones, cfg, proto)
    backbones = [b for b in backbones if b in data]
    _check_alignment({b: d.splits() for b, d in data.items()})
    cfg = _task_metric(caches, backbones, cfg, data)
    if data[backbones[0]].train.Y is not None:
        _check_multilabel(proto, cfg)
        if cfg.views:
            raise ProbeError(f"--views {cfg.views}: multi-label targets are fitted without views; drop --views")
    hi = {b: _class_embeddings(caches, b, cfg) for b in backbones} if cfg.head_init else {}
    src = {b: text_source(cache_for(caches, b, cfg.dataset), b, cfg) for b in hi}
    text_fp = {b: text_fingerprint(cache_for(caches, b, cfg.dataset), b, cfg) for b in hi}

    assert cfg.seeds is not None  # resolve() fills in the protocol's seeds
    run_ids = {(b, s): _run_ids(cfg, proto, b, s, data[b], text_fp.get(b, "")) for b in backbones for s in cfg.seeds}

    def describe(k: Hashable) -> str:
        b, s = cast("tuple[str, int]", k)  # a key of run_ids: (backbone, seed)
        return f"{b}/{cfg.dataset} {proto.spec} seed {s}"

    todo = cast(  # pending() returns keys of the mapping it is given: run_ids' (backbone, seed)
        "list[tuple[str, int]]",
        pending(
            {k: [r for r, _ in v.values()] for k, v in run_ids.items()},
            _finished(cfg, data[backbones[0]].train.Y is None),
            describe,
            cfg.results_path,
            log,
        ),
    )
    new_rows: list[dict] = []
    preds: list | None = [] if cfg.predictions is not None else None
    for b, seed in tqdm(todo, desc=f"probe {proto.spec}", disable=not cfg.progress):
        new_rows += _probe_one(cfg, proto, b, seed, data[b], hi.get(b), run_ids[(b, seed)], src.get(b), preds)
    if preds and cfg.predictions is not None:
        from featcache.probes.predictions import write_predictions

        log.info(
            "per-row predictions of %d run(s) written to %s", len(preds), write_predictions(cfg.predictions, preds)
        )
    wanted = [r for v in run_ids.values() for r, _ in v.values()]
    return collect("probe", cfg.results_path, new_rows, wanted, protocol=proto)


def _finished(cfg: ProbeConfig, single_label: bool) -> set[str]:
    """Run ids in the results table; with ``--predictions`` (single-label targets, the ones that
    have predictions) only those whose predictions are in that table too, so a run whose
    predictions were lost or never asked for is run again rather than skipped."""
    done = finished(cfg.results_path, cfg.force)
    if cfg.predictions is None or not single_label or not done:
        return done
    from featcache.probes.predictions import predicted_run_ids

    return done & predicted_run_ids(cfg.predictions)


def _check_multilabel(proto: Protocol, cfg: ProbeConfig) -> None:
    """Multi-label targets need a solver with a multi-label fitter (one that takes class
    embeddings when head_init is set)."""
    solver = cfg.solver
    if solver.fit_multilabel is None:
        ok = [n for n in SOLVERS if SOLVERS[n].fit_multilabel is not None]
        raise ProbeError(
            f"multi-label targets run the multi-label fitters of the solvers {ok}; {proto.spec} "
            f"(solver {proto.solver!r}) is not supported for them: use full, fewshot:N or "
            "subset:F% (one-vs-rest L-BFGS), elevater-full or elevater-fewshot:N (a BCE-trained "
            "SGD head, as the ELEVATER toolkit), or zeroshot"
        )
    if cfg.head_init and not solver.multilabel_head_init:
        ok = [n for n in SOLVERS if SOLVERS[n].multilabel_head_init]
        raise ProbeError(
            f"{proto.spec} (solver {proto.solver!r}) fits multi-label targets without class embeddings; "
            f"drop --head-init {cfg.head_init} (head_init=None in Python), or use a protocol of the solvers {ok}"
        )


def _run_ids(
    cfg: ProbeConfig, proto: Protocol, b: str, seed: int, d: _Data, text_fp: str = ""
) -> dict[str, tuple[str, str]]:
    """Per eval split: (run id, store fingerprint) of one backbone and seed (``text_fp``:
    :func:`text_fingerprint`, joined to the store fingerprint when not empty)."""
    val_fp = d.val.fingerprint if d.val is not None else ""
    out = {}
    for es, ev in d.evals.items():
        fp = combine_fingerprints(d.train.fingerprint, val_fp, ev.fingerprint, *([text_fp] if text_fp else []))
        out[es] = (cfg.run_id(proto, b, seed, es, fp), fp)
    return out


def _probe_one(
    cfg: ProbeConfig,
    proto: Protocol,
    b: str,
    seed: int,
    d: _Data,
    hi_matrix,
    run_ids: dict[str, tuple[str, str]],
    text: dict | None = None,
    predictions: list | None = None,
) -> list[dict]:
    """Plan, select, refit and evaluate one backbone and seed; its result rows (``text``: where
    the class embeddings came from, recorded in hparams; its digest is in the run id, :func:`text_fingerprint`;
    ``predictions``: a list the per-row predictions of each eval split are appended to)."""
    n_cls = len(d.names) if d.train.Y is None else d.train.Y.shape[1]  # multi-label: one per label column
    if hi_matrix is not None and hi_matrix.shape != (n_cls, d.train.X.shape[1]):
        raise ProbeError(
            f"class embeddings {cfg.head_init!r} have shape {hi_matrix.shape} but {b} on "
            f"{cfg.dataset} needs ({n_cls}, {d.train.X.shape[1]}): one row per class (per label "
            "column of a label matrix) of the dataset, in its class order, with the backbone's "
            f"feature dimension; store {b}'s own with write_class_embeddings(..., backbone={b!r})"
        )
    plan = _plan(proto, seed, d.train, d.val, cfg.val_source, d.views)
    opts, capped = _cap_batch(cfg.solver_options(), int(plan.fin[1].size), b)
    solver = cfg.solver
    fit = solver.fit if plan.Y is None else solver.fit_multilabel
    assert fit is not None  # multi-label targets: run_probes checked the solver has a fitter (_check_multilabel)
    out = fit(FitRequest(proto, plan, opts, hi_matrix, seed))
    predict, classes, conv, secs = out.predict, out.classes, out.converged, out.seconds
    hp = dict(out.hparams)
    hp.update(plan.info)
    hp.update(
        n_train=int(plan.tr[1].size),
        n_val=int(plan.va[1].size),
        n_train_final=int(plan.fin[1].size),
        head_init=cfg.head_init,
        **({"class_embeddings": text} if text else {}),
        n_invalid={s: v.n_invalid for s, v in d.splits().items()},
    )
    if d.train.input_info:  # the solver built its input from several kinds (dinov2-linear)
        hp.update(d.train.input_info)
    if proto.val_source_choice:
        hp.setdefault("val_source", cfg.val_source)
    hp["task_metric"] = opts["metric"]
    hp.update(capped)
    rows = []
    for es, ev in d.evals.items():
        hp_es = hp
        if out.epoch_predicts:  # final_epoch="best-test": the epoch is chosen on this eval split
            predict, epoch = _best_test_epoch(cfg, d, plan, out, es, ev, opts["metric"])
            hp_es = {**hp, "reported_epoch": epoch, "reported_epoch_split": es}
        scores: list[np.ndarray] = []
        vals = _evaluate(cfg, d, plan, predict, classes, es, ev, keep=scores)
        rid, fp = run_ids[es]
        if predictions is not None and plan.Y is None:
            predictions.append(_prediction_frame(rid, b, proto, seed, es, ev, d.names, classes, scores[0]))
        rows += [
            {
                "run_id": rid,
                "kind": "probe",
                "backbone": b,
                "dataset": cfg.dataset,
                "protocol": proto.spec,
                "train_split": plan.train_split,
                "eval_split": es,
                "shots": proto.shots,
                "seed": seed,
                "metric": m,
                "value": float(v),
                "n_eval": int(ev.y.size),
                "hparams": hp_es,
                "converged": bool(conv),
                "fit_seconds": float(secs),
                "store_fingerprint": fp,
            }
            for m, v in vals.items()
        ]
        log.info(
            "%s %s %s seed %d %s: top1=%.4f (C/lr=%s, converged=%s)",
            b,
            cfg.dataset,
            proto.spec,
            seed,
            es,
            vals.get("top1", float("nan")),
            hp.get("C", hp.get("lr")),
            conv,
        )
    return rows


def _cap_batch(opts: dict[str, Any], n: int, b: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``opts`` with a ``batch_size`` larger than the ``n`` rows fitted capped at ``n`` (a
    batch of 10^9 rows would stack the sampler's passes for minutes), and what the row
    records of it (``batch_size_given``; nothing when no cap)."""
    given = opts.get("batch_size")
    if not isinstance(given, int) or given <= n:
        return opts, {}
    log.warning("%s: --batch-size %d is larger than the %d training rows; capped at %d (recorded)", b, given, n, n)
    return {**opts, "batch_size": n}, {"batch_size_given": given, "batch_size": n}


def _best_test_epoch(cfg: ProbeConfig, d: _Data, plan: _Plan, out, es: str, ev: SplitData, metric: str):
    """ELEVATER's toolkit rule (``train_task``: ``best_acc1 = max(acc1, best_acc1)`` over the
    final run's epochs, validated on the test loader): the epoch whose head scores best on
    ``es`` by the task metric (the first such). Selects on the test split, by request."""
    from dataclasses import replace

    one = replace(cfg, metrics=(metric,))
    scores = [_evaluate(one, d, plan, p, out.classes, es, ev)[metric] for p in out.epoch_predicts]
    best = int(np.argmax(scores))
    return out.epoch_predicts[best], best + 1


def _prediction_frame(rid: str, b: str, proto: Protocol, seed: int, es: str, ev: SplitData, names, classes, P):
    """The per-row predictions of one eval split (``--predictions``), class names as text."""
    from featcache.probes.predictions import prediction_frame

    names = np.asarray(names, dtype=object)
    pred = names[np.asarray(classes)[np.argmax(P, axis=1)]]
    return prediction_frame(rid, b, proto.spec, seed, es, ev.ids, names[ev.y], pred)


def _evaluate(
    cfg: ProbeConfig, d: _Data, plan: _Plan, predict, classes, es: str, ev: SplitData, keep: list | None = None
) -> dict[str, float]:
    """The metrics of one eval split (read once per final fit): multi-label targets get the
    ranking metrics of the per-class scores; single-label ones ``metric_names`` of the task.
    ``keep``: a list the single-label score matrix is appended to."""
    X = ev.X if isinstance(ev.X, np.ndarray) else np.asarray(ev.X, np.float32)  # a lazy split is read now
    assert cfg.metric is not None  # run_probes sets the task metric (_task_metric) before any fit
    if plan.Y is not None:
        assert ev.Y is not None  # _attach_label_matrices gives every split targets or none
        return compute_all(ev.Y, predict(X), cfg.metrics or metric_names(0, cfg.metric, multilabel=True))
    missing = np.setdiff1d(np.unique(ev.y), classes)
    if missing.size:
        raise ProbeError(
            f"{es} holds classes {[d.names[i] for i in missing[:10]]} that the probe never "
            f"saw in training ({plan.train_split}); the class sets differ between splits: "
            "use a protocol or seed whose training sample covers every class"
        )
    P = predict(X)
    if keep is not None:
        keep.append(P)
    return compute_all(np.searchsorted(classes, ev.y), P, cfg.metrics or metric_names(P.shape[1], cfg.metric))


def _task_metric(caches, backbones: list[str], cfg: ProbeConfig, data: dict[str, _Data]) -> ProbeConfig:
    """``cfg`` with ``metric`` set: the given one, else the dataset's recorded task metric
    (:mod:`featcache.store.tasks`), else top1 (multi-label targets: CLIP_benchmark's mAP,
    :data:`~featcache.core.metrics.MULTILABEL_DEFAULT`). Multi-label targets need a ranking metric."""
    from dataclasses import replace

    from featcache.core.metrics import MULTILABEL_DEFAULT
    from featcache.store import task_metric

    multilabel = next(iter(data.values())).train.Y is not None
    metric = (
        cfg.metric
        or task_metric(cache_for(caches, backbones[0], cfg.dataset), cfg.dataset)
        or (MULTILABEL_DEFAULT if multilabel else "top1")
    )
    if multilabel and metric not in MULTILABEL_METRICS:
        raise ProbeError(
            f"{cfg.dataset} has multi-label targets; its task metric must be one of "
            f"{MULTILABEL_METRICS} (got {metric!r}): pass --metric map11 or record it "
            "with featcache.store.tasks.write_task_metric"
        )
    log.info("%s: task metric %s (hyper-parameters are selected on it)", cfg.dataset, metric)
    return replace(cfg, metric=metric)
