"""What every result format shares: a results table's rows grouped into runs (one per
``run_id``), the provenance block a format keeps where it has room for it, and the rows an
import builds back from a file, marked external with their source.

An imported row is a row of the results table like any other: its ``hparams`` hold
``{"external": {"format", "source", "file_sha256", "run_id"}}`` (``run_id``: the run's id where
the file names one) and its ``run_id`` is made from that record, so importing a file into the
table its numbers came from never replaces featcache's own rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcache.core.results import RESULT_COLUMNS, make_run_id
from featcache.errors import NoSuchNameError

#: the hparams key marking an imported row
EXTERNAL = "external"
#: the key of the provenance block inside each format's own free-form field
BLOCK = "featcache"
#: the run-level columns (a run's rows differ only in metric and value)
RUN_COLUMNS = tuple(c for c in RESULT_COLUMNS if c not in ("metric", "value"))
#: metrics that are fractions of the evaluated rows (an exact binomial interval applies)
ACCURACIES = frozenset({"top1", "top5", "mean_per_class"})


@dataclass(frozen=True)
class Run:
    """One run of a results table: its run-level columns, its metrics and, where a store was
    given, the sha256 of the backbone's weights."""

    fields: Mapping[str, Any]
    metrics: Mapping[str, float]
    weights_sha256: str | None = None
    weights_source: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name in RUN_COLUMNS:
            return self.fields[name]
        raise NoSuchNameError(f"a run has no column {name!r}; its columns: {', '.join(RUN_COLUMNS)}")

    @property
    def hparams(self) -> dict[str, Any]:
        return json.loads(self.fields.get("hparams") or "{}")

    def interval(self, metric: str, alpha: float = 0.05) -> list[float] | None:
        """The exact (Clopper-Pearson) ``1 - alpha`` interval of an accuracy over ``n_eval`` rows."""
        n, v = self.fields.get("n_eval"), self.metrics.get(metric)
        if metric not in ACCURACIES or not n or v is None or not 0 <= v <= 1:
            return None
        from scipy.stats import beta

        k = round(v * n)
        lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
        hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
        return [lo, hi]

    def provenance(self) -> dict[str, Any]:
        """The block a format keeps: every run-level column (hparams as a mapping), the weights'
        sha256 and the 95% interval of each accuracy."""
        block = {c: self.fields.get(c) for c in RUN_COLUMNS if c != "hparams"}
        block["hparams"] = self.hparams
        block["weights_sha256"] = self.weights_sha256
        block["weights_source"] = self.weights_source
        block["metrics"] = list(self.metrics)
        block["interval95"] = {m: ci for m in sorted(self.metrics) if (ci := self.interval(m)) is not None}
        return block


def group_runs(frame, weights: Mapping[str, tuple[str, str]] | None = None) -> list[Run]:
    """The runs of a results table (polars DataFrame), in the table's order; ``weights`` maps
    a backbone to its weights' (sha256, source)."""
    runs: dict[str, tuple[dict[str, Any], dict[str, float]]] = {}
    for row in frame.iter_rows(named=True):
        _, metrics = runs.setdefault(row["run_id"], ({c: row[c] for c in RUN_COLUMNS}, {}))
        metrics[row["metric"]] = row["value"]
    weights = weights or {}
    return [Run(f, m, *weights.get(f["backbone"], (None, None))) for f, m in runs.values()]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class Imported:
    """What a format's reader found in one file or folder: result rows (dicts of the results
    schema) and one line per row it left out (naming the file and the field)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def extend(self, other: Imported) -> None:
        self.rows += other.rows
        self.problems += other.problems


def external_rows(
    base: Mapping[str, Any], metrics: Mapping[str, float], *, fmt: str, path: Path, sha: str
) -> list[dict[str, Any]]:
    """Result rows for one imported run: ``base`` holds its run-level columns (a provenance
    block or what the file says), ``metrics`` featcache metric -> value. Marked external."""
    cols = {c: base[c] for c in RUN_COLUMNS if base.get(c) is not None and c not in ("run_id", "hparams")}
    hparams = dict(base.get("hparams") or {})
    hparams[EXTERNAL] = {"format": fmt, "source": Path(path).name, "file_sha256": sha, "run_id": base.get("run_id")}
    kind = cols.get("kind", "probe")
    ident = {k: cols.get(k) for k in ("backbone", "dataset", "protocol", "eval_split", "seed", "shots")}
    rid = make_run_id(kind=kind, external=hparams[EXTERNAL], **ident)
    return [
        {**cols, "kind": kind, "run_id": rid, "hparams": hparams, "metric": m, "value": float(v)}
        for m, v in metrics.items()
    ]


def finite(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool, a string, NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def invert(mapping: Mapping[str, str]) -> dict[str, str]:
    return {v: k for k, v in mapping.items()}


def by(runs: Iterable[Run], *keys: str) -> dict[tuple, list[Run]]:
    """``runs`` grouped by the values of run-level columns ``keys``, in first-seen order."""
    out: dict[tuple, list[Run]] = {}
    for r in runs:
        out.setdefault(tuple(r.fields[k] for k in keys), []).append(r)
    return out


def safe_name(text: str) -> str:
    """``text`` as one path component (characters other than letters, digits, ``._-`` become ``-``)."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unnamed"


def lower_is_better(metrics: Sequence[str]) -> set[str]:
    from featcache.core.metrics import lower_is_better as lib

    return set(metrics) & set(lib())
