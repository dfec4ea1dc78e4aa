"""The tidy results table shared by probes, retrieval, fine-tuning and analysis.

One row per (run, metric). Written as parquet with polars; appends are atomic
(write to a temporary file beside the target, then ``os.replace``), so a killed
run never leaves a half-written table, and serialised by a lock file beside the table
(``.<name>.lock``), so concurrent writers (several commands, Dask workers) never lose
rows. :func:`check_results_path` lets a stage refuse a bad path before computing.

Columns (see README, "Results schema"):

=================  =========  ==========================================================
column             dtype      meaning
=================  =========  ==========================================================
run_id             str        stable hash of the run definition (see :func:`make_run_id`)
kind               str        ``probe`` | ``knn`` | ``retrieval`` | ``finetune`` | ``similarity`` | ``audit`` | ``dense``
backbone           str        backbone key in the store
dataset            str        dataset name (the task)
protocol           str        ``full``, ``fewshot:5``, ``vtab1k``, ``salman``, ``zeroshot``, ``image-text``...
train_split        str        split(s) fitted on (``train+val`` when refit on both)
eval_split         str        split the metric was computed on
shots              int        examples per class (-1 for "all", 0 for zero-shot)
seed               int        seed of the sample/split/initialisation
metric             str        ``top1``, ``top5``, ``mean_per_class``, ``nll``, ``ece``, ``map``...
value              float      metric value (accuracies as fractions in [0, 1])
n_eval             int        number of evaluated samples (or queries)
hparams            str        JSON of selected hyperparameters and protocol options
converged          bool       solver convergence (True where not applicable)
fit_seconds        float      wall time of the final fit / search
store_fingerprint  str        fingerprint of the features the run read
featcache_version  str        featcache version that wrote the row
created_at         str        ISO-8601 UTC timestamp
=================  =========  ==========================================================
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from featcache.errors import BackendUnavailableError, CorruptResultsError, NoSpaceError, ResultsError

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger(__name__)

#: column name -> polars dtype name (resolved lazily so importing this module is cheap)
RESULT_COLUMNS: dict[str, str] = {
    "run_id": "Utf8",
    "kind": "Utf8",
    "backbone": "Utf8",
    "dataset": "Utf8",
    "protocol": "Utf8",
    "train_split": "Utf8",
    "eval_split": "Utf8",
    "shots": "Int64",
    "seed": "Int64",
    "metric": "Utf8",
    "value": "Float64",
    "n_eval": "Int64",
    "hparams": "Utf8",
    "converged": "Boolean",
    "fit_seconds": "Float64",
    "store_fingerprint": "Utf8",
    "featcache_version": "Utf8",
    "created_at": "Utf8",
}

KINDS = ("probe", "knn", "retrieval", "finetune", "similarity", "audit", "dense")
#: kinds whose rows are no backbone's score on a task (pairwise similarity, the near-duplicate
#: audit): analysis keeps them out of rankings and reads them for their own report sections
NON_SCORE_KINDS = ("similarity", "audit")


def make_run_id(**definition: Any) -> str:
    """Stable 16-hex id for a run definition (kind, backbone, dataset, protocol, splits,
    shots, seed, options, store fingerprint...). Same definition -> same id.

    >>> make_run_id(kind="probe", backbone="b", seed=0) == make_run_id(seed=0, backbone="b", kind="probe")
    True
    """
    blob = json.dumps(definition, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _schema() -> dict[Any, Any]:
    import polars as pl

    return {name: getattr(pl, dtype) for name, dtype in RESULT_COLUMNS.items()}


def rows_to_frame(rows: Iterable[Mapping[str, Any]]):
    """Build a polars DataFrame with exactly the results schema; missing optional
    fields get defaults, unknown fields are an error (typos would silently vanish)."""
    import polars as pl

    from featcache._version import __version__

    rows = [dict(r) for r in rows]
    required = ("run_id", "kind", "backbone", "dataset", "metric", "value")
    for r in rows:
        unknown = set(r) - set(RESULT_COLUMNS)
        if unknown:
            raise ResultsError(f"unknown result field(s) {sorted(unknown)}; allowed: {list(RESULT_COLUMNS)}")
        missing = [c for c in required if r.get(c) is None]
        if missing:
            raise ResultsError(f"result row lacks required field(s) {missing}: {r}")
        if r["kind"] not in KINDS:
            raise ResultsError(f"kind must be one of {KINDS}, got {r['kind']!r}")
        if isinstance(r.get("hparams"), Mapping):
            r["hparams"] = json.dumps(r["hparams"], sort_keys=True, default=str)
        r.setdefault("protocol", "")
        r.setdefault("train_split", "")
        r.setdefault("eval_split", "")
        r.setdefault("shots", -1)
        r.setdefault("seed", 0)
        r.setdefault("n_eval", None)
        r.setdefault("hparams", "{}")
        r.setdefault("converged", True)
        r.setdefault("fit_seconds", None)
        r.setdefault("store_fingerprint", "")
        r.setdefault("featcache_version", __version__)
        r.setdefault("created_at", now_iso())
    return pl.DataFrame(rows, schema=_schema(), orient="row" if not rows else None)


#: suffixes a user may give for a table that featcache would write as parquet by mistake
_NOT_PARQUET_SUFFIXES = (".csv", ".tsv", ".txt", ".json", ".jsonl", ".xlsx", ".xls", ".feather", ".arrow")
#: seconds a writer waits for another writer's append before giving up
LOCK_TIMEOUT = 600.0


#: parquet key-value metadata entry holding the table's checksum: ``featcache-sha256:<hex>``,
#: the sha256 of the whole file with the hex digits read as zeros
CHECKSUM_KEY = "featcache_checksum"
_CHECKSUM_PREFIX = b"featcache-sha256:"
_CHECKSUM_RE = re.compile(re.escape(_CHECKSUM_PREFIX) + rb"([0-9a-f]{64})")
_ZEROS = b"0" * 64


def _looks_like_parquet(data: bytes) -> bool:
    """A parquet file, or a featcache table whose first bytes are damaged (its checksum
    entry is still in the footer)."""
    return data[:4] == b"PAR1" or _CHECKSUM_PREFIX in data[-4096:]


def _is_parquet(p: Path) -> bool:
    with open(p, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(0, os.fstat(fh.fileno()).st_size - 4096))
        return _looks_like_parquet(head + fh.read())


def _damaged(p: Path, why: str) -> CorruptResultsError:
    return CorruptResultsError(
        f"results table {p} is damaged ({why}); featcache neither reads nor rewrites it. Restore it "
        "from a copy, or move it aside: the next run starts a new table and recomputes the runs it held"
    )


def table_bytes(table) -> bytes:
    """``table`` as parquet bytes carrying their own checksum (:data:`CHECKSUM_KEY`)."""
    buf = io.BytesIO()
    table.write_parquet(buf, metadata={CHECKSUM_KEY: (_CHECKSUM_PREFIX + _ZEROS).decode()})
    data = bytearray(buf.getvalue())
    at = data.rfind(_CHECKSUM_PREFIX + _ZEROS) + len(_CHECKSUM_PREFIX)
    data[at : at + 64] = hashlib.sha256(data).hexdigest().encode()
    return bytes(data)


def verify_table_bytes(data: bytes, p: Path) -> bool:
    """Check the checksum of a results table's bytes; False for a table written without one
    (before featcache kept checksums, or by hand). Raises CorruptResultsError on damage."""
    if len(data) < 12 or data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise _damaged(p, "not a whole parquet file: its start or end marker is wrong")
    flen = int.from_bytes(data[-8:-4], "little")
    if not 0 < flen <= len(data) - 12:
        raise _damaged(p, "its footer length is wrong")
    start = len(data) - 8 - flen
    footer = data[start:-8]
    found = list(_CHECKSUM_RE.finditer(footer))
    if not found:
        if CHECKSUM_KEY.encode() in footer or _CHECKSUM_PREFIX in footer:
            raise _damaged(p, "its checksum entry is unreadable")
        return False
    m = found[-1]
    at = start + m.start(1)
    zeroed = data[:at] + _ZEROS + data[at + 64 :]
    if hashlib.sha256(zeroed).hexdigest().encode() != m.group(1):
        raise _damaged(p, "its bytes do not match their sha256 checksum")
    return True


#: bytes of the smallest parquet file ("PAR1", footer length, "PAR1")
_MIN_PARQUET = 12


def _truncated(data: bytes) -> bool:
    """Too short for parquet and not a text table (a CSV gets its own message): empty, one
    byte, or a few bytes that are not printable text."""
    if len(data) >= _MIN_PARQUET:
        return False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return len(data) <= 1 or not all(c.isprintable() or c.isspace() for c in text)


def _too_short(p: Path, n: int) -> str:
    return (
        f"{p} is {n} byte{'s' if n != 1 else ''} long: an empty or truncated file (an interrupted copy?), not a "
        "results table; featcache never overwrites it: move it aside (or restore it from a copy), then re-run"
    )


def _read_bytes(p: Path) -> bytes:
    """The bytes of the table at ``p``, read through one open file handle (an append's
    ``os.replace`` between two opens would mix two files), checksum verified."""
    with open(p, "rb") as fh:
        data = fh.read()
    if _truncated(data):
        raise ResultsError(_too_short(p, len(data)))
    if not _looks_like_parquet(data):
        raise ResultsError(
            f"{p} is not a parquet results table (a CSV?); featcache "
            "results are parquet files written by probe/retrieve/finetune/sweep"
        )
    if not verify_table_bytes(data, p):
        log.debug("%s has no checksum (written before featcache kept one, or by hand)", p)
    return data


def read_parquet_checked(path: str | os.PathLike):
    """Any parquet table at ``path`` (all columns, no schema check), read through one file
    handle with its checksum verified; damage is a :class:`CorruptResultsError`."""
    import polars as pl

    p = Path(path)
    data = _read_bytes(p)
    try:
        return pl.read_parquet(io.BytesIO(data))
    except Exception as exc:
        raise _damaged(p, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}") from None


def try_write_beside(p: Path) -> None:
    """Make ``p``'s folder and a temporary file in it, removed at once: raises the ``OSError``
    that writing ``p`` would meet (a read-only folder, a missing permission)."""
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=p.parent)
    os.close(fd)
    os.unlink(probe)


def check_results_path(path: str | os.PathLike | None) -> Path:
    """Check, before any compute, that ``path`` can hold a featcache results table.

    Refuses a folder, a file that is not parquet (a CSV...), a parquet without the results
    columns, a path whose parent is a file, and a folder where a new file cannot be created
    (probed by creating and removing a temporary file). Creates missing parent folders.
    Returns the path. Stages call this first so a bad ``--results`` never costs a fit.
    """
    hint = "pass --results with a new or existing featcache .parquet results file"
    if path is None:
        raise ResultsError(f"no results path given; {hint} (Python: results_path=...)")
    p = Path(path)
    if p.is_dir():
        raise ResultsError(f"results path {p} is a folder; {hint}, e.g. {p / 'results.parquet'}")
    if p.exists():
        if p.is_file() and p.stat().st_size < _MIN_PARQUET and _truncated(p.read_bytes()):
            raise ResultsError(_too_short(p, p.stat().st_size))
        if not _is_parquet(p):
            raise ResultsError(
                f"results path {p} exists but is not a parquet file (a CSV or other text?); featcache "
                f"never overwrites it: {hint}, or convert it first, e.g. "
                f"polars.read_csv('{p}').write_parquet('{p.with_suffix('.parquet')}')"
            )
        missing = [c for c in RESULT_COLUMNS if c not in read_parquet_checked(p).columns]
        if missing:
            raise ResultsError(
                f"{p} is a parquet file but not a featcache results table (missing columns {missing}); {hint}"
            )
    elif p.suffix.lower() in _NOT_PARQUET_SUFFIXES:
        raise ResultsError(
            f"results path {p} ends in {p.suffix!r}, but results tables are parquet; "
            f"use e.g. {p.with_suffix('.parquet')}"
        )
    for anc in [p.parent, *p.parent.parents]:
        if anc.exists():
            if not anc.is_dir():
                raise ResultsError(
                    f"cannot write results to {p}: {anc} is a file, not a folder; choose a results path inside a folder"
                )
            break
    try:
        try_write_beside(p)
    except OSError as exc:
        raise ResultsError(
            f"cannot write results to {p}: {exc.strerror or exc}; choose a writable "
            "folder (or fix its permissions) before running"
        ) from exc
    _check_replaceable(p)
    return p


def _check_replaceable(p: Path) -> None:
    """An append replaces the table and takes the lock file beside it: refuse, before any
    compute, a table that cannot be replaced (immutable, read-only) and a lock path that is
    not a writable file."""
    if p.exists() and not os.access(p, os.W_OK):
        raise ResultsError(
            f"results table {p} is read-only or immutable (see `lsattr {p}`), and every append replaces "
            "it; make it writable (chmod u+w, chattr -i) or choose another results path before running"
        )
    lock = _lock_path(p)
    if os.path.lexists(lock) and not os.path.isfile(lock):
        what = "a folder" if os.path.isdir(lock) else "not a regular file"
        raise ResultsError(
            f"the lock file of results table {p}, {lock}, is {what}; if no featcache run is writing "
            f"that table, remove it (rm -r {lock}) and re-run"
        )
    if os.path.isfile(lock) and not os.access(lock, os.W_OK):
        raise ResultsError(
            f"the lock file of results table {p}, {lock}, is read-only or immutable; if no featcache "
            f"run is writing that table, remove it (chattr -i, rm) and re-run"
        )


def _read_raw(p: Path):
    """The table at ``p`` with every column (extra user columns too); schema checked."""
    import polars as pl

    if not p.exists():
        raise ResultsError(
            f"results table {p} does not exist; create it with `featcache probe` or `featcache retrieve`"
        )
    if p.is_dir():
        raise ResultsError(
            f"{p} is not a parquet results table but a folder; featcache "
            "results are parquet files written by probe/retrieve/finetune/sweep"
        )
    df = read_parquet_checked(p)
    missing = [c for c in RESULT_COLUMNS if c not in df.columns]
    if missing:
        raise ResultsError(f"{p} is not a featcache results table: missing columns {missing}")
    return df.with_columns([pl.col(c).cast(t) for c, t in _schema().items()])


@overload
def read_results(
    path: str | os.PathLike, *, extra_columns: bool = False, backend: Literal["polars"] = "polars"
) -> pl.DataFrame: ...


@overload
def read_results(path: str | os.PathLike, *, extra_columns: bool = False, backend: str) -> Any: ...


def read_results(path: str | os.PathLike, *, extra_columns: bool = False, backend: str = "polars") -> Any:
    """Read a results parquet; validates that every schema column is present.

    Returns the schema columns in schema order, plus any extra user columns after them
    when ``extra_columns``, as a polars DataFrame, or a pandas one with ``backend="pandas"``
    (needs the ``pandas`` extra). Safe to call while other processes append (appends replace
    the file atomically and the file is read through one handle, so a reader sees the table
    before or after an append, never between). The table's checksum is verified: a damaged
    table raises :class:`~featcache.errors.CorruptResultsError`.
    """
    if backend not in ("polars", "pandas"):
        raise ResultsError(f"backend must be 'polars' or 'pandas', got {backend!r}")
    if backend == "pandas":
        _need_pandas()
    df = _read_raw(Path(path))
    cols = list(RESULT_COLUMNS)
    if extra_columns:
        cols += [c for c in df.columns if c not in RESULT_COLUMNS]
    df = df.select(cols)
    return df.to_pandas() if backend == "pandas" else df


def _need_pandas() -> None:
    """pandas, or an error naming the extra that installs it (polars' to_pandas needs it too)."""
    import importlib.util

    if importlib.util.find_spec("pandas") is None:
        raise BackendUnavailableError(
            "backend='pandas' needs pandas, which featcache does not install by default: "
            "pip install 'featcache[pandas]' (the same makes polars' DataFrame.to_pandas() work)"
        )


def existing_run_ids(path: str | os.PathLike) -> set[str]:
    p = Path(path)
    if not p.exists():
        return set()
    return set(read_results(p)["run_id"].unique().to_list())


def _lock_path(p: Path) -> Path:
    return p.parent / f".{p.name}.lock"


def _lock(p: Path):
    from filelock import FileLock

    return FileLock(str(_lock_path(p)), timeout=LOCK_TIMEOUT)


def _remove_orphans(p: Path) -> None:
    """Delete temporary files of appends killed mid-write (called with the lock held, so no
    live writer owns one)."""
    for tmp in p.parent.glob(f".{p.name}.*.tmp"):
        log.info("removing %s, left by an append that was killed", tmp)
        tmp.unlink(missing_ok=True)


def append_results(path: str | os.PathLike, rows, *, replace_runs: bool = True):
    """Append rows (dicts or a DataFrame) to the parquet at ``path`` atomically.

    Safe for concurrent writers (processes, Dask workers, several ``featcache`` commands):
    the read-modify-replace runs under an exclusive lock file ``.<name>.lock`` beside the
    table (:func:`append_table`), so no append loses another's rows. The new table is written
    to a temporary file and renamed over the old one, so readers never see a partial table;
    temporary files of killed appends are removed by the next append. Rows of a run_id
    already in the table are replaced when ``replace_runs`` (``--force``), so a table never
    holds a run twice. Extra user columns of the table are kept (null in the new rows). A
    table that fails its checksum is refused (:class:`~featcache.errors.CorruptResultsError`),
    never rewritten. Returns the full table (schema columns).
    """
    import polars as pl

    new = rows if isinstance(rows, pl.DataFrame) else rows_to_frame(rows)
    new = new.select(list(RESULT_COLUMNS)).cast(_schema())
    p = check_results_path(path)
    table = append_table(p, new, read=_read_raw, keys=("run_id",) if replace_runs else (), what="result rows")
    return table.select(list(RESULT_COLUMNS))


def append_table(
    path: str | os.PathLike,
    new,
    *,
    read: Callable[[Path], Any],
    keys: Sequence[str] | None = (),
    what: str = "rows",
    encode: Callable[[Any], bytes] = table_bytes,
):
    """The one locked, atomic append of every table featcache appends to (results,
    ``probe --predictions``, the audit's pairs): under the lock file ``.<name>.lock`` beside the
    table, remove the temporary files of killed writers, read the table there with ``read``
    (which refuses a file that is not the table the caller owns: nothing is replaced then),
    drop its rows whose ``keys`` columns match a new row (``keys=None``: every row, the new
    rows replace the table), append ``new``, write ``encode(table)`` to a temporary file and
    rename it over the table. Returns the table written."""
    import polars as pl
    from filelock import Timeout

    p = Path(path)
    try:
        with _lock(p):
            _remove_orphans(p)
            table = new
            if p.exists():
                old = read(p)
                if keys is None:
                    old = old.clear()
                elif keys:
                    old = old.join(new.select(list(keys)).unique(), on=list(keys), how="anti", nulls_equal=True)
                table = pl.concat([old, new], how="diagonal_relaxed").select(old.columns)
            _replace(p, encode(table))
    except Timeout as exc:
        raise ResultsError(
            f"another process has held the lock on {p} for over {LOCK_TIMEOUT:.0f} s; "
            f"if no featcache run is writing there, delete {exc.lock_file}"
        ) from exc
    except Exception as exc:  # a full disk: the temporary file is gone, the table unchanged
        if isinstance(exc, (PermissionError, IsADirectoryError)):  # changed since the up-front check
            raise ResultsError(
                f"cannot append {len(new)} {what} to {p}: {type(exc).__name__}: {exc.strerror or exc} "
                f"({exc.filename}); the table is unchanged. Fix that path's permissions (or choose another "
                "path) and re-run: runs already in the results table are skipped"
            ) from None
        if not NoSpaceError.caused_by(exc):
            raise
        need = (p.stat().st_size if p.exists() else 0) + int(new.estimated_size())
        raise NoSpaceError.about(
            p, f"{len(new)} new {what}", need, "The table is unchanged; free space, then re-run."
        ) from None
    return table


def _replace(p: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``p`` and rename it over ``p`` (its mode kept)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, p.stat().st_mode & 0o777 if p.exists() else 0o644)  # not mkstemp's 0600
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def median_rows(frame, kind: str, carry: Sequence[str] = (), *, run_id: Callable[..., str] = make_run_id) -> list[dict]:
    """VTAB reporting: rows with ``seed=-1`` holding, per backbone, dataset, protocol, train
    split, eval split and store fingerprint with at least two seeds, the median over the
    seeds of every metric.

    Shared by probes and fine-tuning so both aggregate the same way. ``carry`` names the
    hparams keys copied from the first seed's row beside ``aggregate``, ``seeds`` and
    ``run_ids``; ``run_id`` makes the aggregate's id from ``kind``, ``aggregate="median"``
    and the sorted seed run ids.
    """
    import numpy as np

    rows = []
    seeded = frame.filter(frame["seed"] >= 0)
    keys = (
        seeded.select(["backbone", "dataset", "protocol", "eval_split", "train_split", "store_fingerprint"])
        .unique()
        .rows()
    )
    for b, ds, p, es, trs, fp in sorted(keys):
        sub = seeded.filter(
            (seeded["backbone"] == b)
            & (seeded["dataset"] == ds)
            & (seeded["protocol"] == p)
            & (seeded["eval_split"] == es)
            & (seeded["train_split"] == trs)
            & (seeded["store_fingerprint"] == fp)
        )
        run_ids = sorted(set(sub["run_id"].to_list()))
        seeds = sorted(set(sub["seed"].to_list()))
        if len(seeds) < 2:
            continue
        hp0 = json.loads(sub["hparams"][0])
        rid = run_id(kind=kind, aggregate="median", runs=run_ids)
        for m in sorted(set(sub["metric"].to_list())):
            ms = sub.filter(sub["metric"] == m)
            rows.append(
                {
                    "run_id": rid,
                    "kind": kind,
                    "backbone": b,
                    "dataset": ds,
                    "protocol": p,
                    "train_split": trs,
                    "eval_split": es,
                    "shots": int(ms["shots"][0]),
                    "seed": -1,
                    "metric": m,
                    "value": float(np.median(ms["value"].to_numpy())),
                    "n_eval": int(ms["n_eval"][0]),
                    "hparams": {
                        "aggregate": "median",
                        "seeds": seeds,
                        "run_ids": run_ids,
                        **{k: hp0.get(k) for k in carry},
                    },
                    "converged": bool(ms["converged"].all()),
                    "fit_seconds": float(ms["fit_seconds"].sum()),
                    "store_fingerprint": fp,
                }
            )
    return rows


def add_median_rows(frame, kind: str, results_path: str | os.PathLike | None = None, carry: Sequence[str] = ()):
    """``frame`` plus its :func:`median_rows` (also appended to ``results_path`` when given,
    replacing earlier medians of the same runs)."""
    import polars as pl

    med = median_rows(frame, kind, carry)
    if not med:
        return frame
    mframe = rows_to_frame(med)
    if results_path is not None:
        append_results(results_path, mframe, replace_runs=True)
    return pl.concat([frame, mframe.select(list(RESULT_COLUMNS))], how="vertical")
