"""Per-row predictions of probe runs (``featcache probe --predictions FILE``): one row per
evaluated sample and run id, so two runs can be compared on the same rows (McNemar's test,
:func:`featcache.analysis.stats.mcnemar`) without refitting either.

The table is a parquet file with the columns of :data:`PREDICTION_COLUMNS`. Writing appends;
rows of a run id written again (``--force``) replace the earlier ones. Appends go through the
results table's locked, atomic append (:func:`featcache.core.results.append_table`): two probes
writing one table at once both keep their rows, a crash leaves the previous table whole, and
the temporary file of a killed writer is removed by the next write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import polars as pl

from featcache.errors import ResultsError

__all__ = [
    "PREDICTION_COLUMNS",
    "check_predictions_path",
    "predicted_run_ids",
    "prediction_frame",
    "read_predictions",
    "write_predictions",
]

#: the columns of a predictions table, in order
PREDICTION_COLUMNS = {
    "run_id": pl.Utf8,
    "backbone": pl.Utf8,
    "protocol": pl.Utf8,
    "seed": pl.Int64,
    "eval_split": pl.Utf8,
    "id": pl.Utf8,
    "label": pl.Utf8,
    "prediction": pl.Utf8,
    "correct": pl.Boolean,
}

_HINT = "pass --predictions with a new or existing featcache predictions .parquet file"


def check_predictions_path(path: str | os.PathLike, results_path: str | os.PathLike | None = None) -> Path:
    """Refuse, before any fit, a predictions path that is a folder, not parquet, another table
    (the results table ``results_path`` too, even before it exists), or in a folder where no
    file can be created; creates missing parent folders."""
    p = Path(path)
    if "://" in str(path):
        raise ResultsError(f"--predictions {path}: give a local file path ({_HINT})")
    if results_path is not None and os.path.abspath(p) == os.path.abspath(results_path):
        raise ResultsError(f"--predictions {p} is the results table (--results); {_HINT} beside it")
    if p.is_dir():
        raise ResultsError(f"predictions path {p} is a folder; {_HINT}, e.g. {p / 'predictions.parquet'}")
    if p.suffix != ".parquet":
        raise ResultsError(f"predictions path {p} does not end in .parquet; {_HINT}")
    if p.exists():
        try:
            cols = pl.read_parquet_schema(p)
        except Exception as exc:  # polars raises its own errors for a damaged file
            raise ResultsError(f"predictions path {p} is not a readable parquet file ({exc}); {_HINT}") from None
        if list(cols) != list(PREDICTION_COLUMNS):
            raise ResultsError(f"{p} is a parquet file but not a predictions table (columns {list(cols)}); {_HINT}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p.parent, prefix=f".{p.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise ResultsError(f"cannot write predictions next to {p} ({exc.strerror}); {_HINT}") from None
    return p


def prediction_frame(
    run_id: str,
    backbone: str,
    protocol: str,
    seed: int,
    eval_split: str,
    ids: Sequence[str] | np.ndarray,
    labels: Sequence[str] | np.ndarray,
    predictions: Sequence[str] | np.ndarray,
) -> pl.DataFrame:
    """One run's predictions on one eval split: a row per sample id (class names as text)."""
    ids, labels, predictions = (np.asarray(a).astype(str) for a in (ids, labels, predictions))
    if not ids.shape == labels.shape == predictions.shape:
        raise ResultsError(
            f"predictions of {run_id}: {ids.size} ids, {labels.size} labels, {predictions.size} predictions"
        )
    n = ids.size
    return pl.DataFrame(
        {
            "run_id": [run_id] * n,
            "backbone": [backbone] * n,
            "protocol": [protocol] * n,
            "seed": [int(seed)] * n,
            "eval_split": [eval_split] * n,
            "id": ids.tolist(),
            "label": labels.tolist(),
            "prediction": predictions.tolist(),
            "correct": (labels == predictions).tolist(),
        },
        schema=PREDICTION_COLUMNS,
    )


def read_predictions(path: str | os.PathLike) -> pl.DataFrame:
    """The predictions table at ``path`` (checksum verified where it has one); a file that is
    not a predictions table is refused, never replaced."""
    from featcache.core.results import read_parquet_checked

    p = Path(path)
    df = read_parquet_checked(p)
    if list(df.columns) != list(PREDICTION_COLUMNS):
        raise ResultsError(f"{p} is a parquet file but not a predictions table (columns {list(df.columns)}); {_HINT}")
    return df.select(pl.col(c).cast(t) for c, t in PREDICTION_COLUMNS.items())


def predicted_run_ids(path: str | os.PathLike | None) -> set[str]:
    """Run ids with rows in the predictions table at ``path`` (none without one)."""
    if path is None or not Path(path).exists():
        return set()
    return set(read_predictions(path)["run_id"].unique().to_list())


def write_predictions(path: str | os.PathLike, frames: Sequence[pl.DataFrame]) -> Path:
    """Append ``frames`` to the predictions table at ``path`` (rows of the same run ids and
    eval splits replaced) through the locked, atomic append of the results table."""
    from featcache.core.results import append_table

    p = check_predictions_path(path)
    if not frames:
        return p
    new = pl.concat(list(frames), how="vertical")
    append_table(p, new, read=read_predictions, keys=("run_id", "eval_split"), what="prediction rows")
    return p
