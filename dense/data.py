"""What a dense run reads: a :class:`DenseSource` (the store, or arrays held in memory) and the
:class:`~featcache.dense.solvers.DenseTask` built from it for one backbone and seed.

The selection rule (:func:`build_task`): with the val and test splits stored, select on val and
report test; else hold out a seeded 10% of the training images by id (the ``full`` protocols'
rule, :func:`featcache.core.splits.full_holdout`), leave their augmented views out of training,
select on their ``resize`` rows and report test (a dataset without val, as NYU Depth v2), else
val. Never the best of the reported split.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from featcache.core.dense import DenseInfo, DenseRows, dense_split, parse_dense_split
from featcache.dense.solvers import DenseEval, DenseTask
from featcache.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["ArraySource", "DenseSource", "RowView", "StoreSource", "TaskPlan", "build_task", "take_rows"]


class DenseSource(Protocol):
    """Where a dense run's groups come from (the store, or :class:`ArraySource`)."""

    def splits(self, backbone: str, dataset: str) -> list[str]:
        """The stored split group names (``train``, ``train@view0``, ``val@win``...)."""
        ...

    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        """The feature kinds stored for the group."""
        ...

    def read(self, backbone: str, dataset: str, split: str, kinds: tuple[str, ...]) -> DenseRows:
        """The group's rows (features lazy, paired with their targets)."""
        ...

    def fingerprint(self, backbone: str, dataset: str, split: str, kind: str) -> str:
        """The stored features' fingerprint (what run ids are keyed by)."""
        ...


class StoreSource:
    """The dense groups of a feature cache (``featcache.store.dense.read_dense``)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def splits(self, backbone: str, dataset: str) -> list[str]:
        return [s for b, d, s in self.cache.entries() if b == backbone and d == dataset]

    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        return list(self.cache.kinds(backbone, dataset, split))

    def read(self, backbone: str, dataset: str, split: str, kinds: tuple[str, ...]) -> DenseRows:
        from featcache.store import read_dense  # store/dense.py (its pairing checks)

        return read_dense(self.cache, backbone, dataset, split, kinds)

    def fingerprint(self, backbone: str, dataset: str, split: str, kind: str) -> str:
        return self.cache.stored_fingerprint(backbone, dataset, split, kind)


@dataclass
class ArraySource:
    """Dense groups held in memory: ``groups[(backbone, dataset, split)] = DenseRows`` (rows
    made by a library user or a test; the fingerprint hashes ids, geometry and shapes)."""

    groups: dict[tuple[str, str, str], DenseRows] = field(default_factory=dict)

    def splits(self, backbone: str, dataset: str) -> list[str]:
        return [s for b, d, s in self.groups if b == backbone and d == dataset]

    def kinds(self, backbone: str, dataset: str, split: str) -> list[str]:
        return list(self.groups[(backbone, dataset, split)].kinds)

    def read(self, backbone: str, dataset: str, split: str, kinds: tuple[str, ...]) -> DenseRows:
        rows = self.groups[(backbone, dataset, split)]
        missing = [k for k in kinds if k not in rows.kinds]
        if missing:
            raise DataError(f"{backbone}/{dataset}/{split} holds no kind {missing} (it holds {sorted(rows.kinds)})")
        return replace(rows, kinds={k: rows.kinds[k] for k in kinds})

    def fingerprint(self, backbone: str, dataset: str, split: str, kind: str) -> str:
        import hashlib
        import json

        r = self.groups[(backbone, dataset, split)]
        blob = {"ids": [str(i) for i in r.ids], "geometry": r.geometry.record(), "shape": list(r.kinds[kind].shape)}
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


class RowView:
    """Rows ``idx`` (sorted) of an array-like, sliced by row blocks as a stored array is."""

    def __init__(self, base: Any, idx: np.ndarray) -> None:
        self.base, self.idx = base, np.asarray(idx, np.int64)
        self.shape = (len(self.idx), *tuple(base.shape[1:]))
        self.dtype = base.dtype

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, key: Any) -> np.ndarray:
        sel = self.idx[key]
        if np.ndim(sel) == 0:
            return np.asarray(self.base[int(sel) : int(sel) + 1])[0]
        if not len(sel):
            return np.zeros((0, *self.shape[1:]), self.dtype)
        lo, hi = int(sel.min()), int(sel.max()) + 1
        return np.asarray(self.base[lo:hi])[sel - lo]


def take_rows(rows: DenseRows, idx: np.ndarray) -> DenseRows:
    """The rows ``idx`` of a group (features and targets stay lazy views)."""
    idx = np.sort(np.asarray(idx, np.int64))

    def view(a: Any) -> Any:
        return None if a is None else RowView(a, idx)

    return replace(
        rows,
        ids=np.asarray(rows.ids)[idx],
        valid=np.asarray(rows.valid)[idx],
        kinds={k: view(a) for k, a in rows.kinds.items()},
        target=view(rows.target),
        target_valid=view(rows.target_valid),
        tables={k: np.asarray(a)[idx] for k, a in rows.tables.items() if k != "window"},
        full={k: view(a) for k, a in rows.full.items()},
    )


def _without_ids(rows: DenseRows, drop: set[str]) -> DenseRows:
    keep = np.flatnonzero([str(i) not in drop for i in rows.ids])
    return take_rows(rows, keep)


@dataclass
class TaskPlan:
    """Which stored groups a run reads and what it records about them."""

    train_groups: list[str]
    selected_on: str  # "val" (the dataset's val split) or "holdout-10%-of-train"
    eval_split: str  # the reported split: test, else val
    eval_name: str = ""  # the store split reported
    select_name: str = ""  # the store split selected on ("" for the holdout)
    views: int = 0  # K augmented views trained on (0: the resize rows)
    record: dict[str, Any] = field(default_factory=dict)


def plan_groups(stored: list[str], train: str, val: str, test: str, where: str) -> TaskPlan:
    """The groups of ``stored`` a run trains, selects and reports on (no feature read)."""
    parsed = [parse_dense_split(s) for s in stored]
    bases = {b for b, g in parsed if g == "resize"}
    views = sorted((int(g[4:]), s) for s, (b, g) in zip(stored, parsed) if b == train and g.startswith("view"))
    if train not in bases and not views:
        raise DataError(
            f"{where} holds no {train!r} split (groups: {sorted(stored)}); extract it with featcache extract"
        )
    train_groups = [s for _, s in views] or [train]
    if test in bases and val in bases:
        return TaskPlan(train_groups, "val", "test", test, val, len(views))
    report = test if test in bases else val  # no val split (NYU Depth v2: train and test only)
    if report not in bases:
        raise DataError(f"{where} holds no {val!r} or {test!r} split to report (groups: {sorted(stored)})")
    if train not in bases:
        raise DataError(f"{where}: the holdout of train needs the {train!r} resize rows beside its views")
    return TaskPlan(train_groups, "holdout-10%-of-train", "test" if report == test else "val", report, "", len(views))


def _eval(source: DenseSource, b: str, d: str, split: str, kinds: tuple[str, ...], stored: list[str]) -> DenseEval:
    win, flip = dense_split(split, "win"), dense_split(split, "flip")
    return DenseEval(
        source.read(b, d, split, kinds),
        source.read(b, d, win, kinds) if win in stored else None,
        source.read(b, d, flip, kinds) if flip in stored else None,
    )


def holdout_ids(ids: np.ndarray, seed: int) -> set[str]:
    """The seeded 10% of training image ids held out for selection (canonical id order, the
    ``full`` protocols' rule)."""
    from featcache.core.splits import full_holdout

    order = np.sort(np.asarray(ids).astype(str))
    _, v = full_holdout(np.zeros(order.size, np.int64), seed)
    return set(order[v].tolist())


def build_task(
    source: DenseSource, backbone: str, dataset: str, kinds: tuple[str, ...], plan: TaskPlan, seed: int, cfg: Any
) -> DenseTask:
    """The :class:`DenseTask` of ``plan`` for one backbone and seed."""
    stored = source.splits(backbone, dataset)
    train = [source.read(backbone, dataset, s, kinds) for s in plan.train_groups]
    report = _eval(source, backbone, dataset, plan.eval_name, kinds, stored)
    if plan.select_name:
        select = _eval(source, backbone, dataset, plan.select_name, kinds, stored)
    else:
        base = source.read(backbone, dataset, cfg.train_split, kinds)
        held = holdout_ids(base.ids, seed)
        train = [_without_ids(r, held) for r in train]
        select = DenseEval(take_rows(base, np.flatnonzero([str(i) in held for i in base.ids])))
    info: DenseInfo = report.rows.info
    return DenseTask(info, train, select, report)
