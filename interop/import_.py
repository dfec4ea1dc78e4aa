"""``featcache import``: published results (a result format's files) appended to a results table
as external rows (``hparams.external``: format, source file, its sha256), so rank, the report
and the analyses put them beside featcache's own."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.errors import ResultsError
from featcache.interop.formats import RESULT_FORMATS, detect_format

log = logging.getLogger(__name__)

__all__ = ["ImportConfig", "ImportReport", "import_results", "read_external"]


@dataclass(frozen=True)
class ImportConfig:
    """``source``: a file or folder of results; ``results``: the featcache results parquet to
    append to; ``format``: a registered result format or ``auto`` (detected from the files)."""

    source: str
    results: str
    format: str = "auto"


@dataclass(frozen=True)
class ImportReport:
    format: str
    rows: int
    runs: int
    problems: tuple[str, ...]


def read_external(source: str | Path, fmt: str = "auto") -> tuple[str, Any, tuple[str, ...]]:
    """``(format, rows, problems)``: the rows of ``source`` as results-table rows (a polars
    DataFrame with the results schema) and one line per row left out (file and field)."""
    from featcache.core.results import rows_to_frame

    path = Path(source)
    if not path.exists():
        raise ResultsError(f"{path} does not exist; give a results file or folder to import")
    name = detect_format(path) if fmt == "auto" else fmt
    got = RESULT_FORMATS.resolve(name).read(path)
    return name, rows_to_frame(got.rows), tuple(got.problems)


def import_results(config: ImportConfig) -> ImportReport:
    """Append the rows of ``config.source`` to ``config.results`` (checked before anything is
    read; importing the same file again replaces its rows). A row the reader cannot take is one
    warning line naming the file and the field; nothing readable at all is an error, and the
    table is left as it was."""
    from featcache.core.results import append_results, check_results_path

    check_results_path(config.results)
    name, frame, problems = read_external(config.source, config.format)
    for line in problems:
        log.warning("skipped: %s", line)
    if frame.height == 0:
        first = f"; first: {problems[0]}" if problems else ""
        raise ResultsError(f"{config.source}: no result rows to import as {name}{first}")
    append_results(config.results, frame, replace_runs=True)
    return ImportReport(name, frame.height, frame["run_id"].n_unique(), problems)
