"""Evaluation protocols as named presets; their seeded, stratified splits come from
:mod:`featcache.splits` (shared with fine-tuning, so both stages select the same examples).

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

The split functions (:func:`allocate`, :func:`stratified_holdout`, :func:`sample_per_class`,
:func:`stratified_sample`, :func:`fewshot_split`) are re-exported from :mod:`featcache.splits`;
they raise :class:`~featcache.errors.SplitError`, a :class:`ProbeError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from featcache.errors import ProbeError
from featcache.splits import (
    VAL_SOURCES,
    allocate,
    fewshot_split,
    sample_per_class,
    stratified_holdout,
    stratified_sample,
)

__all__ = [
    "VAL_SOURCES",
    "Protocol",
    "parse_protocol",
    "allocate",
    "stratified_holdout",
    "sample_per_class",
    "stratified_sample",
    "fewshot_split",
]

PROTOCOL_NAMES = ("full", "fewshot", "vtab1k", "vtab1k-sgd", "salman", "subset")


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
