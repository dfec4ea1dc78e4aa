"""The built-in split plans, each registered once under its name with what follows from it
(:class:`~featcache.core.protocols.base.SplitRules`). A plan works on labels only, in the
canonical order of :mod:`featcache.core.splits`, and returns positions into ``train ++ val``.
A new split plan is one module: a planner under :func:`register_split_plan`, named by a
protocol's ``split``."""

from __future__ import annotations

from typing import Any

import numpy as np

from featcache.core.protocols.base import Protocol, SplitPlan, register_split_plan
from featcache.core.splits import (
    HOLDOUT_FRACTION,
    VAL_SOURCES,
    VTAB_TOTAL,
    VTAB_VAL,
    elevater_holdout,
    elevater_holdout_multilabel,
    fewshot_split,
    full_holdout,
    sample_per_class,
    stratified_sample,
    subset_indices,
    vtab1k_fixed,
    vtab1k_indices,
)
from featcache.errors import SplitError

__all__ = ["ELEVATER_MULTILABEL_VAL"]


def _concat_val(idx: np.ndarray, n_train: int, n_val: int) -> np.ndarray:
    return np.concatenate([idx, n_train + np.arange(n_val)])


def _full_of(idx: np.ndarray, label: str, info: dict[str, Any], y, seed, n_val, train_name, val_name) -> SplitPlan:
    """``full``'s rule on train rows ``idx``: select on the val split when there is one (refit
    on ``idx`` + val), else on a stratified seeded holdout of ``idx`` (refit on ``idx``)."""
    if n_val is not None:
        va = y.size + np.arange(n_val)
        info.update(val="official", val_split=val_name)
        return SplitPlan(idx, va, _concat_val(idx, y.size, n_val), f"{label}+{val_name}", info)
    t, v = full_holdout(y[idx], seed)
    info.update(val=f"holdout-{HOLDOUT_FRACTION:.0%}-of-{train_name}")
    return SplitPlan(idx[t], idx[v], idx, label, info)


@register_split_plan("full")
def _plan_full(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """All of train; selection on the val split, else a stratified seeded 10% holdout."""
    return _full_of(np.arange(y.size), train_name, {}, y, seed, n_val, train_name, val_name)


@register_split_plan("fewshot", val_split=False)
def _plan_fewshot(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    t, v = fewshot_split(y, p.shots, seed)
    return SplitPlan(
        t,
        v,
        np.sort(np.concatenate([t, v])),
        f"{train_name}[{p.spec}]",
        {"val": "per-class-80/20", "shots_counted": "before-split"},
    )


@register_split_plan("subset")
def _plan_subset(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """A stratified ``p.fraction`` of train (Battle of the Backbones), then ``full``'s rule on it."""
    if p.fraction is None:
        raise SplitError(f"protocol {p.spec!r}: the 'subset' split plan needs the protocol's fraction")
    idx = subset_indices(y, p.fraction, seed)
    info: dict[str, Any] = {"n_subset": int(idx.size)}
    return _full_of(idx, f"{train_name}[{p.spec}]", info, y, seed, n_val, train_name, val_name)


#: the validation rule of the ``elevater-*`` plans on a label matrix (the toolkit's greedy fill)
ELEVATER_MULTILABEL_VAL = "greedy-ceil-20%-per-label"


def _elevater_val(pos: np.ndarray, y, rows, Y) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) of canonical positions ``pos`` by ELEVATER's rule, "first" taken in the
    dataset's own order (``rows``: each position's row there) as the toolkit walks its
    manifest: per class on ``y``, or the multi-label greedy fill on ``Y`` when given."""
    pos = pos[np.argsort(np.asarray(rows)[pos], kind="stable")]
    t, v = elevater_holdout(y[pos]) if Y is None else elevater_holdout_multilabel(Y[pos])
    return np.sort(pos[t]), np.sort(pos[v])


@register_split_plan("elevater-full", val_split=False)
def _plan_elevater_full(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **kw) -> SplitPlan:
    """ELEVATER's full-data split: select on the first ceil(20%) per class of train in the
    dataset's own order (the toolkit's ``get_dataloader(val_split=0.2)``; a dataset val split
    is not used), refit on all of train. With a label matrix, the toolkit's multi-label rule
    (:func:`~featcache.core.splits.elevater_holdout_multilabel`)."""
    Y = kw.get("label_matrix")
    t, v = _elevater_val(np.arange(y.size), y, rows, Y)
    rule = "first-ceil-20%-per-class" if Y is None else ELEVATER_MULTILABEL_VAL
    return SplitPlan(t, v, np.arange(y.size), train_name, {"val": f"{rule}-of-{train_name}"})


@register_split_plan("elevater-fewshot", val_split=False)
def _plan_elevater_fewshot(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **kw) -> SplitPlan:
    """``fewshot`` as ELEVATER's ``linear_probe.py`` runs it: N = 1 draws 2 per class and
    does not merge train and val for the final run (MERGE_TRAIN_VAL_FINAL_RUN=False). With a
    label matrix, the N (or 2) per class drawn on ``y`` are split as the toolkit splits its
    few-shot subset: :func:`~featcache.core.splits.elevater_holdout_multilabel` over their rows."""
    Y = kw.get("label_matrix")
    if Y is not None:
        drawn = sample_per_class(y, max(p.shots, 2), seed)
        t, v = _elevater_val(drawn, y, rows, Y)
        info: dict[str, Any] = {"val": ELEVATER_MULTILABEL_VAL, "shots_counted": "before-split"}
        if p.shots == 1:
            info.update(shots_drawn=2, final="train only")
            return SplitPlan(t, v, t, f"{train_name}[{p.spec}]", info)
        return SplitPlan(t, v, drawn, f"{train_name}[{p.spec}]", info)
    if p.shots != 1:
        return _plan_fewshot(p, y, seed, n_val, val_source, train_name, val_name)
    t, v = fewshot_split(y, 2, seed)
    info = {"val": "per-class-80/20", "shots_counted": "before-split", "shots_drawn": 2, "final": "train only"}
    return SplitPlan(t, v, t, f"{train_name}[{p.spec}]", info)


def _check_val_source(val_source: str) -> None:
    if val_source not in VAL_SOURCES:
        raise SplitError(f"val_source must be one of {VAL_SOURCES}, got {val_source!r}")


@register_split_plan("vtab1k", val_source=True, auto_official_val=True)
def _plan_vtab1k(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, val_rows, **_) -> SplitPlan:
    """VTAB's fixed subsets (seed-independent): train[:800] + the first 200 of the val
    source (``split-800-200``: train[800:1000]; ``official-val``: val[:200])."""
    _check_val_source(val_source)
    n_tr = VTAB_TOTAL - VTAB_VAL
    if val_source == "official-val":
        if n_val is None:
            raise SplitError(
                "val_source='official-val' needs a 'val' split; extract it or use val_source='split-800-200'"
            )
        t, v = vtab1k_fixed(rows, val_rows)
        label, val = f"{train_name}[:{n_tr}]+{val_name}[:{VTAB_VAL}]", f"{val_name}[:{VTAB_VAL}]"
    else:
        t, v = vtab1k_fixed(rows)
        label, val = f"{train_name}[:{VTAB_TOTAL}]", f"{train_name}[{n_tr}:{VTAB_TOTAL}]"
    return SplitPlan(
        t, v, np.concatenate([t, v]), label, {"val": val, "val_source": val_source, "subset": "fixed, dataset order"}
    )


@register_split_plan("none", val_split=False)
def _plan_none(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    e = np.zeros(0, np.int64)
    return SplitPlan(e, e, e, "none", {"trained": False})


@register_split_plan("vtab1k-stratified", val_source=True)
def _plan_vtab1k_stratified(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    _check_val_source(val_source)
    label = f"{train_name}[{VTAB_TOTAL}]"
    if val_source == "official-val":
        idx = stratified_sample(y, VTAB_TOTAL, seed)
        if n_val is None:
            raise SplitError(
                "val_source='official-val' needs a 'val' split; extract it or use val_source='split-800-200'"
            )
        return SplitPlan(
            idx,
            y.size + np.arange(n_val),
            idx,
            label,
            {"val": "official", "val_split": val_name, "val_source": val_source},
        )
    t, v = vtab1k_indices(y, seed)
    return SplitPlan(t, v, np.sort(np.concatenate([t, v])), label, {"val": "split-800-200", "val_source": val_source})


@register_split_plan("dinov2")
def _plan_dinov2(p: Protocol, y, seed, n_val, val_source, train_name, val_name, *, rows, **_) -> SplitPlan:
    """DINOv2's ``eval_log_regression``: the dataset's val split when it has one (its
    ``finetune_dataset``), else a plain random 10 %: ``torch.manual_seed(seed)``,
    ``randperm(n)`` over the dataset's own row order, the first ``n // 10`` for selection."""
    if n_val is not None:
        return _plan_full(p, y, seed, n_val, val_source, train_name, val_name)
    import torch

    perm = torch.randperm(y.size, generator=torch.Generator().manual_seed(int(seed))).numpy()
    pos_of_row = np.empty(y.size, np.int64)
    pos_of_row[np.asarray(rows)] = np.arange(y.size)  # dataset row -> canonical position
    k = y.size // 10
    v, t = pos_of_row[perm[:k]], pos_of_row[perm[k:]]
    info = {"val": f"dinov2-random-{k}-of-{train_name}"}
    return SplitPlan(t, v, np.arange(y.size), train_name, info)


@register_split_plan("train", val_split=False)
def _plan_train(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """All of train, nothing held out (a protocol that selects nothing: ``bob-linear``)."""
    e = np.zeros(0, np.int64)
    return SplitPlan(e, e, np.arange(y.size), train_name, {"val": "none (nothing is selected)"})


@register_split_plan("no-refit")
def _plan_no_refit(p: Protocol, y, seed, n_val, val_source, train_name, val_name, **_) -> SplitPlan:
    """Train once and select on held-out rows, no refit (a grid of heads trained together:
    ``dinov2-linear``, as ``run_eval_linear`` evaluates the heads it trained, and the attentive
    probes): ``full``'s train and validation rows (the dataset's val split, else a stratified
    seeded 10% of train), the final fit being the train fit, so ``train_split`` names the rows
    actually trained on (``train``, or ``train[90%]`` beside a holdout)."""
    sp = _plan_full(p, y, seed, n_val, val_source, train_name, val_name)
    label = train_name if n_val is not None else f"{train_name}[{1 - HOLDOUT_FRACTION:.0%}]"
    return SplitPlan(sp.train, sp.val, sp.train, label, {**sp.info, "refit": "none"})
