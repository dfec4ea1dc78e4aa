"""What ``featcache audit`` checks before and around its search: the ``--out`` table it may
replace, the feature kind and values it reads, and whether the feature space is collapsed
(where its near-duplicate flags are no evidence).

- :func:`check_out`: ``--out`` is refused, before anything is read or written, when it is the
  ``--results`` table, a folder, an existing file that is not an audit pairs table (a results
  table, a predictions table, any other parquet or CSV), or in a folder where no file can be
  created. The pairs are written through the results table's locked, atomic append
  (:func:`write_pairs`), which reads and checks the file it replaces under the lock.
- :func:`check_vector_kind`: the audit compares ``[rows, features]`` vectors; an N-d kind
  (``tokens``, ``blocks:K``, ``tokens@GxG``) is refused in one line naming the vector kinds the
  store holds (pooling the tokens would audit features no probe reads).
- :func:`check_finite`: NaN or infinite features are named with their split and first row ids.
- :func:`collapse` and :func:`is_collapsed`: a collapsed feature space (a random-init ViT) has
  a near-constant nearest-neighbour cosine (median >= :data:`COLLAPSE_NN_COSINE`, so the adaptive
  threshold is >= 0.9998) *and* random (query, training) pairs nearly as alike (median cosine >=
  :data:`COLLAPSE_RANDOM_COSINE`): every image is every other's near-copy, so a flag says
  nothing. The second condition keeps a healthy space full of real duplicates (nearest
  neighbours at 1, random pairs far apart) from being called collapsed.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import DataError, ResultsError
from featcache.similarity.neighbours import unit_rows
from featcache.similarity.streaming import iter_blocks, take_rows

__all__ = [
    "COLLAPSE_NN_COSINE",
    "COLLAPSE_RANDOM_COSINE",
    "PAIR_COLUMNS",
    "check_finite",
    "check_out",
    "check_vector_kind",
    "collapse",
    "is_collapsed",
    "write_pairs",
]

PAIR_COLUMNS = ("query_split", "query_id", "train_id", "cosine", "exact_content")
#: median nearest-neighbour cosine at or above which the space may be collapsed (the adaptive
#: threshold is then >= 0.9998; a random-init ViT on Fashion-MNIST: 27 flags, a sneaker and a
#: coat at 1.0000; on digits, measured: 0.9995)
COLLAPSE_NN_COSINE = 0.998
#: ... when random (query, training) pairs have a median cosine at least this too (measured on
#: digits: random-init ViT 0.982; ImageNet lite0 0.644; random-init lite0 0.941, whose median
#: nearest neighbour, 0.983, is far from constant)
COLLAPSE_RANDOM_COSINE = 0.95
#: random pairs drawn to measure it
COLLAPSE_PAIRS = 2000

_HINT = "give --out a new .csv or .parquet file, or an audit pairs table written by featcache audit"


def _siblings(out: Path) -> list[Path]:
    return [out, out.with_name(out.stem + ".nn.png"), out.with_name(out.stem + ".pairs.png")]


def check_out(out: str | os.PathLike, results_path: str | os.PathLike | None) -> Path:
    """Refuse, before the search, an ``--out`` the audit does not own or cannot write (see the
    module docstring); creates missing parent folders. Returns the path."""
    p = Path(out)
    if results_path is not None and os.path.abspath(p) == os.path.abspath(results_path):
        raise ResultsError(
            f"--out {p} is the --results table: the audit would replace its rows with its pairs; {_HINT}"
        )
    for f in _siblings(p):
        if f.is_dir():
            raise ResultsError(f"--out {p}: {f} is a folder; {_HINT}, e.g. {f / 'pairs.csv'}")
    if p.exists():
        read_pairs(p)  # refuses a file that is not a pairs table, whatever it is
    from featcache.core.results import try_write_beside

    try:
        try_write_beside(p)
    except OSError as exc:
        raise ResultsError(
            f"cannot write --out {p}: {exc.strerror or exc}; choose a writable folder (or fix its permissions)"
        ) from None
    for f in _siblings(p):
        if f.exists() and not os.access(f, os.W_OK):
            raise ResultsError(f"cannot write --out {p}: {f} is read-only; make it writable or choose another --out")
    return p


def read_pairs(p: Path) -> Any:
    """The audit pairs table at ``p`` (CSV or parquet); anything else is refused, never replaced."""
    import polars as pl

    from featcache.core.results import RESULT_COLUMNS, read_parquet_checked

    try:
        if p.suffix.lower() == ".csv":
            df = pl.read_csv(p, schema_overrides={"query_id": pl.Utf8, "train_id": pl.Utf8})
        else:
            df = read_parquet_checked(p)
    except ResultsError as exc:
        raise ResultsError(f"--out {p} exists and is not an audit pairs table ({exc}); {_HINT}") from None
    except Exception as exc:  # polars' own errors for a file that is no table
        raise ResultsError(
            f"--out {p} exists and is not an audit pairs table ({type(exc).__name__}); {_HINT}"
        ) from None
    if tuple(df.columns) != PAIR_COLUMNS:
        what = "a featcache results table" if set(RESULT_COLUMNS) <= set(df.columns) else f"columns {df.columns}"
        raise ResultsError(
            f"--out {p} exists and is not an audit pairs table ({what}); featcache never overwrites it: {_HINT}"
        )
    return df


def _encode(out: Path):
    from featcache.core.results import table_bytes

    if out.suffix.lower() != ".csv":
        return table_bytes

    def csv_bytes(table) -> bytes:
        buf = io.BytesIO()
        table.write_csv(buf)
        return buf.getvalue()

    return csv_bytes


def write_pairs(pairs: Any, out: Path) -> str:
    """Replace the pairs table at ``out`` with ``pairs`` through the locked, atomic append
    (:func:`featcache.core.results.append_table`: the file there is read and checked under the
    lock, and a killed writer's temporary file is removed)."""
    from featcache.core.results import append_table

    append_table(out, pairs, read=read_pairs, keys=None, what="audit pairs", encode=_encode(out))
    return str(out)


def check_vector_kind(cache: Any, backbone: str, dataset: str, split: str, kind: str) -> None:
    """Refuse an N-d feature kind (rows of ``[T, D]`` tokens or ``[K, D]`` blocks) in one line
    naming the vector kinds ``backbone`` holds for ``split``."""
    kinds = cache.kinds(backbone, dataset, split)
    if kind not in kinds:
        return  # the load names what is there
    inner = tuple(cache.provenance(backbone, dataset, split, kind).inner)
    if not inner:
        return
    vector = [k for k in kinds if not tuple(cache.provenance(backbone, dataset, split, k).inner)]
    shown = ", ".join(vector) if vector else "none: extract one, e.g. --features pooled"
    raise DataError(
        f"audit compares one vector per image, but --kind {kind} holds {list(inner)} x D per image; "
        f"pass --kind with a vector kind of {backbone}/{dataset}/{split} ({shown})"
    )


def check_finite(X: Any, ids: Sequence[str] | np.ndarray, where: str, block_rows: int = 8192) -> None:
    """Refuse features holding NaN or inf, naming how many rows and the first ids."""
    bad: list[int] = []
    start = 0
    for block in iter_blocks(X, block_rows):
        b = np.asarray(block)
        bad += (start + np.flatnonzero(~np.isfinite(b).all(axis=tuple(range(1, b.ndim))))).tolist()
        start += len(b)
    if bad:
        first = ", ".join(str(ids[i]) for i in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise DataError(
            f"{where}: {len(bad)} row(s) hold NaN or infinite features ({first}); cosines are undefined "
            "there: re-extract them (featcache verify names damaged chunks) or audit another backbone"
        )


def collapse(Q: Any, G: Any, seed: int = 0) -> float:
    """The median cosine between up to :data:`COLLAPSE_PAIRS` random (query, training) row pairs
    (distinct rows of each, paired at random)."""
    rng = np.random.default_rng(seed)
    n = min(COLLAPSE_PAIRS, Q.shape[0], G.shape[0])
    qi = np.sort(rng.choice(Q.shape[0], n, replace=False))
    gi = np.sort(rng.choice(G.shape[0], n, replace=False))
    q = unit_rows(np.asarray(take_rows(Q, qi)))
    g = unit_rows(np.asarray(take_rows(G, gi)))[rng.permutation(n)]
    return float(np.median(np.einsum("ij,ij->i", q, g)))


def is_collapsed(nn_cosine_median: float, random_pair_cosine: float) -> bool:
    """Whether a space with these medians is collapsed (see the module docstring)."""
    return nn_cosine_median >= COLLAPSE_NN_COSINE and random_pair_cosine >= COLLAPSE_RANDOM_COSINE
