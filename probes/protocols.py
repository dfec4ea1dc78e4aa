"""Evaluation protocols as named presets and their seeded, stratified splits (pure numpy).

=============  ===========================================================================
spec           meaning
=============  ===========================================================================
full           C selected on validation (the dataset's ``val`` split if it has one, else a
               stratified, seeded 10% of train), refit on train+val, test once.
fewshot:N      ELEVATER: N examples per class drawn from train (N counts *before* the
               80/20 split), each class split 80/20 (val = max(1, round(0.2 N)) per class)
               for selecting C, refit on all N per class. N=1 is an error (no train sample).
vtab1k         VTAB-1k: 1000 train examples (stratified draw), 800 train / 200 val, select
               on the 200, retrain on the 1000. ``val_source``: ``split-800-200`` (default)
               or ``official-val`` (fit on the 1000, select on the dataset's val split).
               Reports each seed and the median over seeds.
vtab1k-sgd     VTAB-1k splits with the lightweight SGD schedule (batch 512, momentum 0.9,
               lr {0.1, 0.01} x {2500, 10000} steps, lr /10 at 1/3, 2/3 and ``last_decay``
               of the steps; no weight decay).
salman         Salman et al.: SGD head, 150 epochs, batch 64, momentum 0.9, weight decay
               5e-4, lr {0.01, 0.001} selected on validation (as ``full``), lr /10 every
               50 epochs, refit on train+val.
subset:F%      Battle of the Backbones: stratified F% of train (label distribution kept, at
               least one example per class), then ``full`` on that subset.
=============  ===========================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from featcache.errors import ProbeError

__all__ = [
    "Protocol",
    "parse_protocol",
    "allocate",
    "stratified_holdout",
    "sample_per_class",
    "stratified_sample",
    "fewshot_split",
]

PROTOCOL_NAMES = ("full", "fewshot", "vtab1k", "vtab1k-sgd", "salman", "subset")
VAL_SOURCES = ("split-800-200", "official-val")


@dataclass(frozen=True)
class Protocol:
    spec: str  # canonical text recorded in result rows, e.g. "fewshot:5", "subset:10%"
    name: str
    shots: int = -1  # examples per class, -1 = all
    fraction: float | None = None  # subset fraction

    @property
    def solver(self) -> str:
        return "sgd" if self.name in ("salman", "vtab1k-sgd") else "lbfgs"


def parse_protocol(spec: str) -> Protocol:
    """Parse ``full``, ``fewshot:N``, ``vtab1k``, ``vtab1k-sgd``, ``salman``, ``subset:F%``."""
    s = str(spec).strip().lower()
    if s in ("full", "vtab1k", "vtab1k-sgd", "salman"):
        return Protocol(spec=s, name=s)
    m = re.fullmatch(r"fewshot:(\d+)", s)
    if m:
        n = int(m.group(1))
        if n < 2:
            raise ProbeError(
                f"fewshot:{n} cannot work: the 80/20 per-class split for selecting C needs at "
                "least one training and one validation example per class, so N >= 2 "
                "(ELEVATER uses N = 5, 20, 50)")
        return Protocol(spec=f"fewshot:{n}", name="fewshot", shots=n)
    m = re.fullmatch(r"subset:(\d+(?:\.\d+)?)%", s)
    if m:
        pct = float(m.group(1))
        if not 0 < pct < 100:
            raise ProbeError(f"subset fraction must lie in (0%, 100%), got {spec!r}; use 'full' for all data")
        return Protocol(spec=f"subset:{m.group(1)}%", name="subset", fraction=pct / 100)
    raise ProbeError(
        f"unknown protocol {spec!r}; choose full, fewshot:N (N >= 2), vtab1k, vtab1k-sgd, "
        "salman or subset:F% (e.g. subset:1%, subset:10%)")


def allocate(counts: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder split of ``total`` over classes proportional to ``counts``.

    Sums exactly to ``total``; each class gets floor or ceil of its quota (ties: lower class).
    """
    counts = np.asarray(counts, np.int64)
    if total > counts.sum():
        raise ProbeError(f"cannot draw {total} examples from {int(counts.sum())}")
    quota = counts * total / counts.sum()
    base = np.floor(quota).astype(np.int64)
    rest = total - base.sum()
    order = np.lexsort((np.arange(counts.size), -(quota - base)))
    base[order[:rest]] += 1
    return np.minimum(base, counts)


def _by_class(y: np.ndarray) -> list[np.ndarray]:
    classes = np.unique(y)
    return [np.flatnonzero(y == c) for c in classes]


def _draw(y: np.ndarray, per_class: np.ndarray, rng: np.random.Generator):
    """Per class, a seeded draw of ``per_class[c]`` indices; returns (drawn, rest), sorted."""
    drawn, rest = [], []
    for idx, k in zip(_by_class(y), per_class):
        perm = idx[rng.permutation(idx.size)]
        drawn.append(perm[:k])
        rest.append(perm[k:])
    return np.sort(np.concatenate(drawn)), np.sort(np.concatenate(rest))


def stratified_holdout(y, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, val_idx): a stratified, seeded ``fraction`` of ``y`` held out.

    Exactly ``round(fraction * n)`` validation rows, per class floor/ceil of its share;
    every class keeps at least one training row.
    """
    y = np.asarray(y)
    counts = np.array([i.size for i in _by_class(y)])
    n_val = int(round(fraction * y.size))
    if n_val < 1 or y.size - n_val < counts.size:
        raise ProbeError(
            f"{y.size} examples are too few to hold out {fraction:.0%} for validation and keep "
            f"every one of the {counts.size} classes in train; use more data or a dataset with "
            "its own val split")
    per = allocate(counts, n_val)
    per = np.minimum(per, counts - 1)  # keep >= 1 training example per class
    short = n_val - per.sum()
    if short:  # give the shortfall to classes that still have room, largest first
        room = np.argsort(-(counts - 1 - per), kind="stable")
        for c in room[:short]:
            per[c] += 1
    rng = np.random.default_rng(seed)
    val, train = _draw(y, per, rng)
    return train, val


def sample_per_class(y, n: int, seed: int) -> np.ndarray:
    """Indices of exactly ``n`` examples of every class (seeded)."""
    y = np.asarray(y)
    classes = np.unique(y)
    counts = np.array([i.size for i in _by_class(y)])
    if (counts < n).any():
        few = {str(c): int(k) for c, k in zip(classes, counts) if k < n}
        raise ProbeError(f"{n} examples per class requested but class(es) {few} have fewer "
                         "valid training examples; lower N or drop those classes")
    drawn, _ = _draw(y, np.full(classes.size, n), np.random.default_rng(seed))
    return drawn


def fewshot_split(y, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ELEVATER few-shot: ``n`` per class (N counted before the split), then per class
    ``max(1, round(0.2 n))`` to validation and the rest to train. Returns (train, val)."""
    if n < 2:
        raise ProbeError(f"fewshot:{n} leaves no training example after the 80/20 split; use N >= 2")
    y = np.asarray(y)
    idx = sample_per_class(y, n, seed)
    n_val = max(1, int(round(0.2 * n)))
    rng = np.random.default_rng([seed, 1])
    val, train = _draw(y[idx], np.full(np.unique(y).size, n_val), rng)
    return idx[train], idx[val]


def stratified_sample(y, total: int, seed: int, min_per_class: int = 0) -> np.ndarray:
    """Seeded draw of ``total`` indices keeping the label distribution (largest remainder);
    with ``min_per_class`` every class gets at least that many (total grows if needed)."""
    y = np.asarray(y)
    counts = np.array([i.size for i in _by_class(y)])
    if total > y.size:
        raise ProbeError(f"the protocol needs {total} training examples but only {y.size} valid "
                         "ones exist; use a larger train split or another protocol")
    per = np.maximum(allocate(counts, total), np.minimum(min_per_class, counts))
    drawn, _ = _draw(y, per, np.random.default_rng(seed))
    return drawn
