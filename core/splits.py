"""Seeded, stratified protocol splits as pure numpy functions on labels (stage-neutral).

Shared by the probes (frozen features) and fine-tuning (images) so that a probe row and a
fine-tune row of the same dataset, protocol and seed were trained and selected on exactly
the same examples. Every function works on a label vector ``y`` given in the dataset's
*canonical order* (:func:`canonical_order`: valid rows sorted by sample id) and returns
sorted integer positions into it. Seeds make every draw reproducible bit for bit.

=====================  =================================================================
function               protocol
=====================  =================================================================
``full_holdout``       ``full``: a stratified, seeded 10% of train for selection
``vtab1k_fixed``       ``vtab1k`` (VTAB's rule): the first 800 of train and the first 200
                       of the val source in the dataset's own order, the same for every seed
``vtab1k_indices``     ``vtab1k-stratified``: 1,000 stratified, seeded examples, 800 / 200
``fewshot_split``      ``fewshot:N`` (ELEVATER): N per class (counted before the split),
                       per class ``max(1, round(0.2 N))`` to validation
``subset_indices``     ``subset:F%`` (Battle of the Backbones): stratified F% of train
``elevater_holdout``   ``elevater-full``: the first ceil(20%) per class (ELEVATER's toolkit);
                       ``elevater_holdout_multilabel`` its greedy rule for a label matrix
=====================  =================================================================

Building blocks: :func:`allocate` (largest remainder), :func:`stratified_holdout`,
:func:`sample_per_class`, :func:`stratified_sample`. The protocol registry
(:mod:`featcache.core.protocols`) builds every plan of the probes and of fine-tuning from
them; the selection is the probes' original one bit for bit (tests/finetune/test_finetune.py pins
it on digits).

Two orders. The seeded draws work in canonical order (ids sorted as strings), so they do
not depend on how a reader or a store lists rows. VTAB-1k's fixed subsets instead take
"the first N" in *the dataset's own order*: the order its data source lists the rows (the
TFDS/file-list order VTAB reads), which is the store's row order (extraction writes row
``i`` of the reader to row ``i`` of the store) and the fine-tune reader's order.
:func:`vtab1k_fixed` therefore takes, for each canonical position, its row in that order
(``rows``). For digits ids ``digits-0, digits-1, ...`` the two orders differ ("digits-10"
sorts before "digits-2"); for zero-padded ids (Fashion-MNIST ``train-00000``) they agree.

:func:`batch_positions` is the one SGD data order of featcache: full batches cut from a
stream of seeded epoch permutations (VTAB's ``repeat`` then ``batch(drop_remainder=True)``),
shared by fine-tuning and the probes' ``vtab1k-sgd`` head.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import SplitError

__all__ = [
    "HOLDOUT_FRACTION",
    "VAL_SOURCES",
    "VTAB_TOTAL",
    "VTAB_VAL",
    "allocate",
    "batch_positions",
    "canonical_order",
    "elevater_holdout",
    "elevater_holdout_multilabel",
    "fewshot_split",
    "full_holdout",
    "sample_per_class",
    "stratified_holdout",
    "stratified_sample",
    "subset_indices",
    "vtab1k_fixed",
    "vtab1k_indices",
]

HOLDOUT_FRACTION = 0.1
VTAB_TOTAL, VTAB_VAL = 1000, 200
#: where VTAB-1k selects: its own 800/200 split of the 1,000, or the dataset's val split
VAL_SOURCES = ("split-800-200", "official-val")


def canonical_order(ids: ArrayLike) -> np.ndarray:
    """Positions that sort ``ids`` (as strings, stable): the order every split function
    expects its labels in, independent of how a reader or a store lists the rows."""
    return np.argsort(np.asarray(ids).astype(str), kind="stable")


def allocate(counts: ArrayLike, total: int) -> np.ndarray:
    """Largest-remainder split of ``total`` over classes proportional to ``counts``.

    Sums exactly to ``total``; each class gets floor or ceil of its quota (ties: lower class).
    """
    counts = np.asarray(counts, np.int64)
    if total > counts.sum():
        raise SplitError(f"cannot draw {total} examples from {int(counts.sum())}")
    quota = counts * total / counts.sum()
    base = np.floor(quota).astype(np.int64)
    rest = total - base.sum()
    order = np.lexsort((np.arange(counts.size), -(quota - base)))
    base[order[:rest]] += 1
    return np.minimum(base, counts)


def _by_class(y: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(y == c) for c in np.unique(y)]


def _draw(y: np.ndarray, per_class, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per class (ascending label), a seeded draw of ``per_class[c]`` positions; (drawn, rest)."""
    drawn, rest = [], []
    for idx, k in zip(_by_class(y), per_class):
        perm = idx[rng.permutation(idx.size)]
        drawn.append(perm[:k])
        rest.append(perm[k:])
    return np.sort(np.concatenate(drawn)), np.sort(np.concatenate(rest))


def stratified_holdout(y: ArrayLike, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): a stratified, seeded ``fraction`` of ``y`` held out.

    Exactly ``round(fraction * n)`` validation rows, per class floor/ceil of its share;
    every class keeps at least one training row.
    """
    y = np.asarray(y)
    counts = np.array([i.size for i in _by_class(y)])
    n_val = round(fraction * y.size)
    if n_val < 1 or y.size - n_val < counts.size:
        raise SplitError(
            f"{y.size} examples are too few to hold out {fraction:.0%} for validation and keep "
            f"every one of the {counts.size} classes in train; use more data or a dataset with "
            "its own val split"
        )
    per = allocate(counts, n_val)
    per = np.minimum(per, counts - 1)  # keep >= 1 training example per class
    short = n_val - per.sum()
    if short:  # give the shortfall to classes that still have room, largest first
        room = np.argsort(-(counts - 1 - per), kind="stable")
        for c in room[:short]:
            per[c] += 1
    val, train = _draw(y, per, np.random.default_rng(seed))
    return train, val


def sample_per_class(y: ArrayLike, n: int, seed: int) -> np.ndarray:
    """Positions of exactly ``n`` examples of every class (seeded)."""
    y = np.asarray(y)
    classes = np.unique(y)
    counts = np.array([i.size for i in _by_class(y)])
    if (counts < n).any():
        few = {str(c): int(k) for c, k in zip(classes, counts) if k < n}
        raise SplitError(
            f"{n} examples per class requested but class(es) {few} have fewer "
            "valid training examples; lower N or drop those classes"
        )
    drawn, _ = _draw(y, np.full(classes.size, n), np.random.default_rng(seed))
    return drawn


def fewshot_split(y: ArrayLike, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ELEVATER few-shot: ``n`` per class (N counted before the split), then per class
    ``max(1, round(0.2 n))`` to validation and the rest to train. Returns (train, val)."""
    if n < 2:
        raise SplitError(f"fewshot:{n} leaves no training example after the 80/20 split; use N >= 2")
    y = np.asarray(y)
    idx = sample_per_class(y, n, seed)
    n_val = max(1, round(0.2 * n))
    val, train = _draw(y[idx], np.full(np.unique(y).size, n_val), np.random.default_rng([seed, 1]))
    return idx[train], idx[val]


def stratified_sample(y: ArrayLike, total: int, seed: int, min_per_class: int = 0) -> np.ndarray:
    """Seeded draw of ``total`` positions keeping the label distribution (largest remainder);
    with ``min_per_class`` every class gets at least that many (total grows if needed)."""
    y = np.asarray(y)
    counts = np.array([i.size for i in _by_class(y)])
    if total > y.size:
        raise SplitError(
            f"the protocol needs {total} training examples but only {y.size} valid "
            "ones exist; use a larger train split or another protocol"
        )
    per = np.maximum(allocate(counts, total), np.minimum(min_per_class, counts))
    drawn, _ = _draw(y, per, np.random.default_rng(seed))
    return drawn


def vtab1k_indices(
    y: ArrayLike, seed: int, total: int = VTAB_TOTAL, n_val: int = VTAB_VAL
) -> tuple[np.ndarray, np.ndarray]:
    """``vtab1k-stratified``: a stratified, seeded draw of ``total`` (1,000) examples, split stratified
    into ``total - n_val`` train (800) and ``n_val`` validation (200) with the same seed.

    Returns (train, val) positions into ``y``; their union (sorted) is the 1,000 the final
    model is retrained on.
    """
    idx = stratified_sample(y, total, seed)
    t, v = stratified_holdout(np.asarray(y)[idx], n_val / total, seed)
    return idx[t], idx[v]


def _first(rows, n: int, what: str) -> np.ndarray:
    """Positions of the ``n`` smallest ``rows`` (the first ``n`` in the dataset's order)."""
    rows = np.asarray(rows)
    if rows.size < n:
        raise SplitError(
            f"the protocol needs {n} {what} examples but only {rows.size} valid ones "
            "exist; use a larger split or the protocol 'vtab1k-stratified'/'full'"
        )
    return np.sort(np.argsort(rows, kind="stable")[:n])


def vtab1k_fixed(
    rows: ArrayLike, val_rows: ArrayLike | None = None, n_train: int = VTAB_TOTAL - VTAB_VAL, n_val: int = VTAB_VAL
) -> tuple[np.ndarray, np.ndarray]:
    """VTAB-1k as published: ``train[:800]`` and the first 200 of the val source, in the
    dataset's own order, identical for every seed (seeds vary only training randomness).

    ``rows``: for each canonical position of train, its row in the dataset's own order.
    ``val_rows``: the same for the dataset's val split; ``None``: the val source is the rest
    of train, so val is ``train[800:1000]``. Returns (train, val) positions in the plan's
    index space (val split rows follow the ``len(rows)`` train rows).
    """
    rows = np.asarray(rows)
    if val_rows is None:
        both = _first(rows, n_train + n_val, "training")
        order = both[np.argsort(rows[both], kind="stable")]
        return np.sort(order[:n_train]), np.sort(order[n_train:])
    return _first(rows, n_train, "training"), rows.size + _first(val_rows, n_val, "validation")


def batch_positions(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Positions (into ``n`` training rows) of the batch of ``step``: items
    ``[step * batch_size, (step + 1) * batch_size)`` of the concatenated seeded epoch
    permutations ``default_rng([seed, epoch]).permutation(n)``. Every batch is full (VTAB's
    ``drop_remainder``) and depends only on (seed, step), so a resumed run repeats it."""
    start = step * batch_size
    out = []
    need = batch_size
    epoch, off = divmod(start, n)
    while need:
        perm = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
        take = perm[off : off + need]
        out.append(take)
        need -= take.size
        epoch, off = epoch + 1, 0
    return np.concatenate(out)


def full_holdout(y: ArrayLike, seed: int, fraction: float = HOLDOUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """``full`` protocol without a dataset val split: (train, val) with a stratified, seeded
    ``fraction`` (10%) of train held out for selection; the final fit uses all of train."""
    return stratified_holdout(y, fraction, seed)


def elevater_holdout(y: ArrayLike, fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """ELEVATER's validation split of a train set (Elevater_Toolkit_IC ``get_dataloader``,
    ``val_split=0.2``): per class the first ``ceil(fraction * count)`` positions (no
    randomness), the rest train. Returns (train, val), sorted."""
    val = [idx[: math.ceil(idx.size * fraction)] for idx in _by_class(np.asarray(y))]
    val = np.sort(np.concatenate(val)) if val else np.zeros(0, np.int64)
    return np.setdiff1d(np.arange(np.asarray(y).size), val), val


def elevater_holdout_multilabel(Y: ArrayLike, fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """ELEVATER's validation split of a multi-label train set (Elevater_Toolkit_IC
    ``get_dataloader``, ``val_split=0.2``, its ``len(labels.shape) == 2`` branch): each label
    column needs ``ceil(fraction * positives)`` validation rows; while one still does, the
    lowest such column takes its first positive row not yet taken, and that row counts for
    every label it carries. Deterministic. ``Y``: [n, C] 0/1. Returns (train, val), sorted."""
    labels = np.array(Y, dtype=np.int64)  # a copy: taken rows are zeroed, as the toolkit does
    if labels.ndim != 2:
        raise SplitError(f"a label matrix is [n, C]; got shape {labels.shape}")
    need = np.ceil(labels.sum(0) * fraction)
    val: list[int] = []
    todo = np.flatnonzero(need > 0)
    while todo.size:
        row = int(np.flatnonzero(labels[:, todo[0]] > 0)[0])
        val.append(row)
        need -= labels[row]
        labels[row] = 0
        todo = np.flatnonzero(need > 0)
    va = np.sort(np.asarray(val, np.int64))
    return np.setdiff1d(np.arange(labels.shape[0]), va), va


def subset_indices(y: ArrayLike, fraction: float, seed: int) -> np.ndarray:
    """Battle of the Backbones ``subset:F%``: ``max(1, round(F n))`` stratified positions,
    at least one per class."""
    y = np.asarray(y)
    if not 0 < fraction < 1:
        raise SplitError(f"subset fraction must lie in (0, 1), got {fraction!r}")
    return stratified_sample(y, max(1, round(fraction * y.size)), seed, min_per_class=1)
