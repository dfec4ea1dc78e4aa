"""Run probe protocols from a feature cache into the tidy results table.

:func:`run_probes` loads each backbone's splits, checks them (valid rows only, finite,
class sets, ids aligned across backbones and disjoint between train and eval splits),
draws the protocol's seeded splits from labels and ids only (so every backbone sees the
same images for a seed), selects hyperparameters on validation data only, refits, reads
each eval split once, and writes one row per (run, metric).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featcache.errors import NotInStoreError, ProbeError
from featcache.probes.logistic import (
    DEFAULT_CS,
    LogisticProbe,
    resolve_backend,
    select_index,
    sweep_C,
)
from featcache.probes.metrics import compute_all
from featcache.probes.protocols import Protocol, parse_protocol
from featcache.splits import (
    HOLDOUT_FRACTION,
    VAL_SOURCES,
    VTAB_TOTAL,
    fewshot_split,
    full_holdout,
    stratified_sample,
    subset_indices,
    vtab1k_indices,
)

log = logging.getLogger(__name__)

#: seeds used when none are given: the protocols' published repeat counts
DEFAULT_SEEDS = {"fewshot": (0, 1, 2), "vtab1k": (0, 1, 2), "vtab1k-sgd": (0, 1, 2)}


@dataclass
class SplitData:
    """Valid rows of one split, in canonical (id-sorted) order."""

    name: str
    X: np.ndarray
    y: np.ndarray  # int64 indices into the train split's class_names
    ids: np.ndarray
    n_invalid: int
    fingerprint: str


@dataclass
class _Plan:
    """What one protocol seed fits on."""

    tr: tuple[np.ndarray, np.ndarray]
    va: tuple[np.ndarray, np.ndarray]
    fin: tuple[np.ndarray, np.ndarray]
    train_split: str
    info: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------ loading
def _open_caches(cache_path) -> list:
    from featcache.store import open_cache

    paths = [cache_path] if isinstance(cache_path, (str, bytes)) or hasattr(cache_path, "__fspath__") else list(cache_path)
    return [open_cache(str(p)) for p in paths]


def _cache_for(caches, backbone: str, dataset: str):
    for c in caches:
        if backbone in c.backbones() and dataset in c.datasets():
            return c
    held = sorted({(b, d) for c in caches for b in c.backbones() for d in c.datasets()})
    raise NotInStoreError(
        f"no features for backbone {backbone!r} on dataset {dataset!r} in the given cache(s); "
        f"they hold backbones x datasets {held}; run `featcache extract` for it first")


def _load_split(cache, backbone, dataset, split, kind, train_names=None) -> SplitData:
    f = cache.load(backbone, dataset, split, kind=kind)
    valid = np.asarray(f.valid, bool)
    X = f.X[valid]
    bad = ~np.isfinite(X).all(axis=1)
    if bad.any():
        raise ProbeError(
            f"{backbone}/{dataset}/{split}: {int(bad.sum())} rows marked valid hold NaN or inf "
            f"features (first id {f.ids[valid][bad][0]!r}); re-extract them with `featcache "
            "extract ... --overwrite` or check the backbone's numerics (e.g. fp16 overflow)")
    names = np.asarray(f.class_names, dtype=object)
    labels = np.asarray(f.labels)[valid]
    ids = np.asarray(f.ids)[valid].astype(str)
    order = np.argsort(ids, kind="stable")
    y_names = names[labels[order]]
    if train_names is None:
        train_names = list(f.class_names)
    pos = {n: i for i, n in enumerate(train_names)}
    unknown = sorted({str(n) for n in y_names if n not in pos})
    if unknown:
        raise ProbeError(
            f"{dataset}/{split} has classes {unknown[:10]} that the train split does not define; "
            "the class sets of the splits differ: extract both splits from the same dataset "
            "spec (same class list)")
    y = np.fromiter((pos[n] for n in y_names), np.int64, count=y_names.size)
    return SplitData(split, X[order], y, ids[order], int((~valid).sum()), f.fingerprint)


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
                    "every backbone is evaluated on the same images")


def _check_disjoint(train: SplitData, other: SplitData) -> None:
    both = np.intersect1d(train.ids, other.ids)
    if both.size:
        raise ProbeError(
            f"{both.size} sample ids occur in both {train.name!r} and {other.name!r} (e.g. "
            f"{both[0]!r}); evaluation on training images is invalid: fix the split definitions")


# ------------------------------------------------------------------ planning
def _plan(proto: Protocol, seed: int, train: SplitData, val: SplitData | None,
          val_source: str) -> _Plan:
    X, y = train.X, train.y

    def sel(idx):
        return X[idx], y[idx]

    def union(a, b):
        return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])

    if proto.name in ("full", "salman", "subset"):
        idx = np.arange(y.size)
        label = train.name
        info: dict[str, Any] = {}
        if proto.name == "subset":
            idx = subset_indices(y, proto.fraction, seed)
            label = f"{train.name}[{proto.spec}]"
            info["n_subset"] = int(idx.size)
        if val is not None:
            tr, va = sel(idx), (val.X, val.y)
            fin = union(tr, va)
            info.update(val="official", val_split=val.name)
            return _Plan(tr, va, fin, f"{label}+{val.name}", info)
        t, v = full_holdout(y[idx], seed)
        info.update(val=f"holdout-{HOLDOUT_FRACTION:.0%}-of-{train.name}")
        return _Plan(sel(idx[t]), sel(idx[v]), sel(idx), label, info)
    if proto.name == "fewshot":
        t, v = fewshot_split(y, proto.shots, seed)
        return _Plan(sel(t), sel(v), sel(np.sort(np.concatenate([t, v]))),
                     f"{train.name}[{proto.spec}]",
                     {"val": "per-class-80/20", "shots_counted": "before-split"})
    if proto.name in ("vtab1k", "vtab1k-sgd"):
        if val_source not in VAL_SOURCES:
            raise ProbeError(f"val_source must be one of {VAL_SOURCES}, got {val_source!r}")
        label = f"{train.name}[{VTAB_TOTAL}]"
        if val_source == "official-val":
            idx = stratified_sample(y, VTAB_TOTAL, seed)
            if val is None:
                raise ProbeError("val_source='official-val' needs a 'val' split in the cache; "
                                 "extract it or use val_source='split-800-200'")
            return _Plan(sel(idx), (val.X, val.y), sel(idx), label,
                         {"val": "official", "val_split": val.name, "val_source": val_source})
        t, v = vtab1k_indices(y, seed)
        return _Plan(sel(t), sel(v), sel(np.sort(np.concatenate([t, v]))), label,
                     {"val": "split-800-200", "val_source": val_source})
    raise ProbeError(f"protocol {proto.spec!r} has no split plan")  # pragma: no cover


# ------------------------------------------------------------------ fitting
def _fit_lbfgs(plan: _Plan, opts: dict, head_init) -> tuple[Any, dict, bool, float]:
    Xtr, ytr = plan.tr
    hi = None if head_init is None else head_init[np.unique(ytr)]
    sw = sweep_C(Xtr, ytr, *plan.va, opts["Cs"], backend=opts["backend"], max_iter=opts["max_iter"],
                 tol=opts["tol"], standardize=opts["standardize"], head_init=hi)
    probe = LogisticProbe(C=sw.best_C, backend=opts["backend"], max_iter=opts["max_iter"],
                          tol=opts["tol"], standardize=opts["standardize"])
    same = np.array_equal(np.unique(plan.fin[1]), np.unique(ytr))
    probe.fit(*plan.fin, init=sw.heads[sw.best_index] if same else None)
    hp = {
        "C": sw.best_C, "selection": "val top1 (ties: smaller C)",
        "val_top1": sw.val_top1[sw.best_index], "n_grid": len(sw.Cs),
        "grid": [min(sw.Cs), max(sw.Cs)], "sweep_not_converged": int(sum(not c for c in sw.converged)),
        "sweep_seconds": round(sw.seconds, 4), "sweep_tol": sw.tol, "backend": probe.backend_, "device": probe.device_,
        "solver": "lbfgs", "n_iter": probe.n_iter_, "grad_max": probe.grad_max_,
        "max_iter": opts["max_iter"], "tol": opts["tol"], "standardize": opts["standardize"],
        "warm_start": bool(same),
    }
    predict = probe.predict_proba
    classes = probe.classes_
    return (predict, classes), hp, probe.converged_, sw.seconds + probe.fit_seconds_


def _sgd_configs(proto: Protocol, n: int, opts: dict) -> list[dict]:
    if proto.name == "salman":
        e, bs = opts["sgd_epochs"], 64
        spe = math.ceil(n / bs)
        step_e = max(1, e // 3)
        miles = [k * step_e * spe for k in range(1, 3) if k * step_e < e]
        return [dict(lr=lr, steps=e * spe, batch_size=bs, momentum=0.9, weight_decay=5e-4,
                     milestones=miles, epochs=e, lr_decay_epochs=[k * step_e for k in (1, 2) if k * step_e < e])
                for lr in (0.01, 0.001)]
    cfgs = []
    for steps in opts["vtab_steps"]:
        miles = [steps // 3, 2 * steps // 3, int(round(opts["last_decay"] * steps))]
        for lr in (0.1, 0.01):
            cfgs.append(dict(lr=lr, steps=steps, batch_size=512, momentum=0.9, weight_decay=0.0,
                             milestones=miles))
    return cfgs


def _fit_sgd(proto: Protocol, plan: _Plan, opts: dict, head_init, seed: int):
    from featcache.probes.sgd import SGDProbe

    _, device = resolve_backend("torch")
    Xtr, ytr = plan.tr
    classes = np.unique(ytr)
    pos = np.full(int(max(ytr.max(), plan.va[1].max(), plan.fin[1].max())) + 1, -1)
    pos[classes] = np.arange(classes.size)
    if (pos[plan.va[1]] < 0).any() or (pos[plan.fin[1]] < 0).any():
        raise ProbeError("validation/final training data hold classes absent from the selection "
                         "train data; resample the split so every class is in train")
    hi = None if head_init is None else head_init[classes]

    def fit(X, y, cfg, n_for_cfg) -> SGDProbe:
        kw = {k: v for k, v in cfg.items() if k not in ("epochs", "lr_decay_epochs")}
        if proto.name == "salman":  # same number of epochs on the (larger) refit data
            spe = math.ceil(n_for_cfg / cfg["batch_size"])
            kw["steps"] = cfg["epochs"] * spe
            kw["milestones"] = [e * spe for e in cfg["lr_decay_epochs"]]
        probe = SGDProbe(**kw, standardize=opts["sgd_standardize"], head_init=hi,
                         random_state=seed, device=device)
        return probe.fit(X, y, classes=classes)

    t0 = time.perf_counter()
    cfgs = _sgd_configs(proto, ytr.size, opts)
    scores = []
    for cfg in cfgs:
        p = fit(Xtr, ytr, cfg, ytr.size)
        Xv, yv = plan.va
        scores.append(float(np.mean(p.predict_proba(Xv).argmax(1) == pos[yv])) if p.finite_ else -1.0)
    best = select_index(scores)
    cfg = cfgs[best]
    probe = fit(*plan.fin, cfg, plan.fin[1].size)
    seconds = time.perf_counter() - t0
    hp = {"solver": "sgd", "device": device, "val_top1": scores[best],
          "selection": "val top1 (ties: first config)", "candidates": len(cfgs),
          "standardize": opts["sgd_standardize"], **{k: v for k, v in cfg.items() if k != "milestones"}}
    if proto.name == "salman":
        hp.pop("steps", None)  # steps follow from epochs and the size of each fit's data
    if proto.name == "vtab1k-sgd":
        hp["last_decay"] = opts["last_decay"]
        hp["milestones"] = cfg["milestones"]
    return (probe.predict_proba, classes), hp, probe.finite_, seconds


# ------------------------------------------------------------------ main entry
def run_probes(
    cache_path,
    backbones,
    dataset: str,
    protocol: str = "full",
    seeds=None,
    results_path=None,
    *,
    force: bool = False,
    backend: str = "auto",
    Cs=DEFAULT_CS,
    max_iter: int = 1000,
    tol: float = 1e-4,
    standardize: bool = True,
    eval_splits=("test",),
    train_split: str = "train",
    val_split: str = "val",
    kind: str = "pooled",
    val_source: str = "split-800-200",
    head_init: str | None = None,
    sgd_epochs: int = 150,
    vtab_steps=(2500, 10000),
    last_decay: float = 0.9,
    sgd_standardize: bool = False,
    metrics=None,
    progress: bool = True,
):
    """Probe ``backbones`` on ``dataset`` with ``protocol``; returns the rows of these runs.

    Parameters
    ----------
    cache_path : a cache path/URL, or a list of them (each backbone is read from the first
        cache holding it; rows of different caches must still align by id).
    backbones : a name, a list of names, or ``"all"`` (every backbone holding ``dataset``).
    protocol : ``full``, ``fewshot:N``, ``vtab1k``, ``vtab1k-sgd``, ``salman``, ``subset:F%``.
    seeds : iterable of ints; default (0, 1, 2) for fewshot/vtab1k, else (0,).
    results_path : parquet to append to (None: do not write). Runs already in it are skipped
        (their stored rows are returned) unless ``force``.
    head_init : name of a class-embedding matrix stored beside the dataset (ELEVATER).
    sgd_epochs : epochs of the ``salman`` protocol (150 in the paper; recorded per row).
    vtab_steps, last_decay : ``vtab1k-sgd`` schedules and the position of its last lr drop
        (the paper says only "shortly before the end"; recorded per row).

    Returns a polars DataFrame in the results schema.
    """
    import polars as pl
    from tqdm.auto import tqdm

    from featcache.results import (
        add_median_rows,
        append_results,
        existing_run_ids,
        make_run_id,
        read_results,
        rows_to_frame,
    )

    proto = parse_protocol(protocol)
    caches = _open_caches(cache_path)
    if isinstance(backbones, str):
        backbones = [backbones]
    backbones = list(backbones)
    if backbones == ["all"]:
        backbones = sorted({b for c in caches for b in c.backbones()
                            if dataset in c.datasets() and _has(c, b, dataset, train_split)})
        if not backbones:
            raise NotInStoreError(f"no backbone in the cache has features for dataset {dataset!r}")
    if not backbones:
        raise ProbeError("no backbone given; pass --backbone NAME (repeatable) or --all")
    seeds = tuple(DEFAULT_SEEDS.get(proto.name, (0,)) if seeds is None else (int(s) for s in seeds))
    if not seeds:
        raise ProbeError("seeds is empty; give at least one seed, e.g. --seeds 0,1,2")
    eval_splits = [eval_splits] if isinstance(eval_splits, str) else list(eval_splits)
    Cs = sorted(float(c) for c in Cs)
    opts = dict(Cs=Cs, backend=backend, max_iter=int(max_iter), tol=float(tol),
                standardize=bool(standardize), sgd_epochs=int(sgd_epochs),
                vtab_steps=tuple(int(s) for s in vtab_steps), last_decay=float(last_decay),
                sgd_standardize=bool(sgd_standardize))
    if proto.name == "salman" and sgd_epochs < 3:
        raise ProbeError("salman needs sgd_epochs >= 3 (the lr drops at 1/3 and 2/3 of training)")

    # load and check every split of every backbone before fitting anything
    data: dict[str, dict[str, SplitData]] = {}
    for b in backbones:
        c = _cache_for(caches, b, dataset)
        splits = c.splits(dataset)
        if train_split not in splits:
            raise NotInStoreError(f"dataset {dataset!r} has no split {train_split!r} (has {splits})")
        tr = _load_split(c, b, dataset, train_split, kind)
        names = list(c.split_meta(dataset, train_split).class_names)
        d = {train_split: tr}
        use_val = val_split in splits and proto.name != "fewshot" and not (
            proto.name.startswith("vtab1k") and val_source == "split-800-200")
        if use_val:
            d[val_split] = _load_split(c, b, dataset, val_split, kind, names)
        for s in eval_splits:
            if s not in splits:
                raise NotInStoreError(f"dataset {dataset!r} has no split {s!r} to evaluate on "
                                      f"(has {splits}); pass --eval-split with one of them")
            d[s] = _load_split(c, b, dataset, s, kind, names)
            _check_disjoint(tr, d[s])
            if val_split in d:
                _check_disjoint(d[val_split], d[s])
        if len(np.unique(tr.y)) < 2:
            raise ProbeError(f"{b}/{dataset}/{train_split} holds a single class among its valid "
                             "rows; a probe needs at least two classes")
        d["__names__"] = names  # type: ignore[assignment]
        data[b] = d
    _check_alignment({b: {s: v for s, v in d.items() if s != "__names__"} for b, d in data.items()})

    hi_matrix = None
    if head_init is not None:
        c = _cache_for(caches, backbones[0], dataset)
        hi_matrix = np.asarray(c.load_class_embeddings(dataset, head_init), np.float64)

    done = existing_run_ids(results_path) if results_path is not None and not force else set()
    new_rows: list[dict] = []
    wanted: list[str] = []
    jobs = [(b, s) for b in backbones for s in seeds]
    for b, seed in tqdm(jobs, desc=f"probe {proto.spec}", disable=not progress):
        d = data[b]
        tr, va = d[train_split], d.get(val_split)
        if hi_matrix is not None and hi_matrix.shape != (len(d["__names__"]), tr.X.shape[1]):
            raise ProbeError(
                f"class embeddings {head_init!r} have shape {hi_matrix.shape} but {b} on "
                f"{dataset} needs ({len(d['__names__'])}, {tr.X.shape[1]}): one row per class "
                "of the dataset, in its class order, with the backbone's feature dimension")
        options = {k: v for k, v in opts.items() if k != "backend"}
        options.update(kind=kind, head_init=head_init, train_split=train_split)
        if proto.name.startswith("vtab1k"):
            options["val_source"] = val_source
        if proto.solver == "lbfgs":
            for k in ("sgd_epochs", "vtab_steps", "last_decay", "sgd_standardize"):
                options.pop(k)
        elif proto.name == "salman":
            options = {k: v for k, v in options.items() if k not in ("Cs", "max_iter", "tol", "standardize", "vtab_steps", "last_decay")}
        else:
            options = {k: v for k, v in options.items() if k not in ("Cs", "max_iter", "tol", "standardize", "sgd_epochs")}
        fps = {s: v.fingerprint for s, v in d.items() if s != "__names__"}
        run_ids = {}
        for es in eval_splits:
            fp = _combine(fps[train_split], fps.get(val_split, ""), fps[es])
            run_ids[es] = (make_run_id(kind="probe", backbone=b, dataset=dataset, protocol=proto.spec,
                                       seed=seed, eval_split=es, options=options,
                                       store_fingerprint=fp), fp)
        wanted += [r for r, _ in run_ids.values()]
        if all(r in done for r, _ in run_ids.values()):
            log.info("skip %s/%s %s seed %d: already in %s (force=True reruns)", b, dataset,
                     proto.spec, seed, results_path)
            continue
        plan = _plan(proto, seed, tr, va, val_source)
        if proto.solver == "lbfgs":
            (predict, classes), hp, conv, secs = _fit_lbfgs(plan, opts, hi_matrix)
        else:
            (predict, classes), hp, conv, secs = _fit_sgd(proto, plan, opts, hi_matrix, seed)
        hp.update(plan.info)
        hp.update(n_train=int(plan.tr[1].size), n_val=int(plan.va[1].size),
                  n_train_final=int(plan.fin[1].size), head_init=head_init,
                  n_invalid={s: v.n_invalid for s, v in d.items() if s != "__names__"})
        if proto.name.startswith("vtab1k"):
            hp.setdefault("val_source", val_source)
        for es in eval_splits:
            ev = d[es]
            missing = np.setdiff1d(np.unique(ev.y), classes)
            if missing.size:
                names = [d["__names__"][i] for i in missing[:10]]
                raise ProbeError(
                    f"{es} holds classes {names} that the probe never saw in training "
                    f"({plan.train_split}); the class sets differ between splits: use a protocol "
                    "or seed whose training sample covers every class")
            P = predict(ev.X)  # the eval split is read once per final fit
            y_pos = np.searchsorted(classes, ev.y)
            vals = compute_all(y_pos, P, metrics)
            rid, fp = run_ids[es]
            for m, v in vals.items():
                new_rows.append(dict(
                    run_id=rid, kind="probe", backbone=b, dataset=dataset, protocol=proto.spec,
                    train_split=plan.train_split, eval_split=es, shots=proto.shots, seed=seed,
                    metric=m, value=float(v), n_eval=int(ev.y.size), hparams=hp,
                    converged=bool(conv), fit_seconds=float(secs), store_fingerprint=fp))
            log.info("%s %s %s seed %d %s: top1=%.4f (C/lr=%s, converged=%s)", b, dataset,
                     proto.spec, seed, es, vals.get("top1", float("nan")),
                     hp.get("C", hp.get("lr")), conv)
    frame = rows_to_frame(new_rows) if new_rows else None
    if results_path is not None and frame is not None:
        table = append_results(results_path, frame, replace_runs=True)
    elif results_path is not None and _exists(results_path):
        table = read_results(results_path)
    else:
        table = frame
    if table is None:
        out = rows_to_frame([])
    else:
        out = table.filter(pl.col("run_id").is_in(wanted))
    if proto.name.startswith("vtab1k") and out.height:
        out = add_median_rows(out, "probe", results_path, carry=("val_source",))
    return out


def _has(cache, backbone, dataset, split) -> bool:
    return any(e == (backbone, dataset, split) for e in cache.entries())


def _exists(path) -> bool:
    from pathlib import Path

    return Path(path).exists()


def _combine(*fps: str) -> str:
    return hashlib.sha256("|".join(fps).encode()).hexdigest()[:16]
