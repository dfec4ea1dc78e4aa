"""The one stage-run skeleton: run ids -> skip what is finished -> run -> append rows ->
median-over-seeds rows; the split checks every stage makes; the registry of stages.

Probes (:func:`featcache.probes.run_probes`), fine-tuning (:func:`featcache.finetune.finetune`)
and retrieval (:func:`featcache.retrieval.run_retrieval`) each compute their run ids and rows;
what happens around that is here, once:

- :func:`finished` the run ids already in the results table (none when ``force``);
- :func:`pending` which groups of runs (a backbone and seed, a seed...) still need to run,
  logging a skip line for the others;
- :func:`write_rows` appends rows (replacing earlier rows of the same runs);
- :func:`collect` the rows of every wanted run, plus the stage's median rows;
- :func:`add_medians` / :func:`medians_from_table` the median-over-seeds rows (``seed=-1``)
  with the hparams :attr:`Stage.median_carry` declares, the same whether a stage runs its
  seeds together or the sweep runs them as separate items;
- :func:`check_disjoint`, :func:`check_two_classes`, :func:`label_positions` and
  :func:`canonical_order` the split checks.

:data:`STAGES` maps a stage name (a sweep work item's ``kind``) to its :class:`Stage`; the
sweep's executor is a lookup in it. Each stage registers its own :class:`Stage` in its package's
``__init__`` (its entry point a ``"module:function"`` string of its own package, imported when
called, so registering imports no runner); this module imports no stage, so every stage may
import it.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np

from featcache.core.registry import Registry
from featcache.core.splits import canonical_order
from featcache.errors import ConfigError, SplitError

if TYPE_CHECKING:
    import polars as pl

K = TypeVar("K", bound=Hashable)  # a group key of pending()

log = logging.getLogger(__name__)

__all__ = [
    "STAGES",
    "Stage",
    "add_medians",
    "canonical_order",
    "check_disjoint",
    "check_two_classes",
    "collect",
    "finished",
    "get_stage",
    "label_positions",
    "medians_from_table",
    "pending",
    "register_stage",
    "write_rows",
]

PathLike = str | os.PathLike


@dataclass(frozen=True)
class Stage:
    """A stage that writes results rows.

    ``name``: its work-item kind (and the ``kind`` of its seed rows' median rows);
    ``entry``: ``"module:function"`` of its public entry point, called with the stage's config;
    ``medians``: when it adds median-over-seeds rows: ``"protocol"`` where the protocol says
    so (``Protocol.median_over_seeds``), ``"always"`` for any two or more seeds, ``"never"``;
    ``median_carry``: the hparams keys a median row copies from its first seed's row.
    """

    name: str
    entry: str
    medians: Literal["protocol", "always", "never"] = "never"
    median_carry: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.medians not in ("protocol", "always", "never"):
            raise ConfigError(f"Stage.medians is 'protocol', 'always' or 'never', got {self.medians!r}")

    def run(self, config: Any) -> Any:
        """Call the entry point with ``config``; the rows of the run (polars DataFrame)."""
        module, fn = self.entry.split(":")
        return getattr(importlib.import_module(module), fn)(config)

    def wants_medians(self, protocol: Any) -> bool:
        """Whether runs of ``protocol`` (a :class:`~featcache.core.protocols.Protocol` or a
        registered name) get median-over-seeds rows."""
        if self.medians != "protocol":
            return self.medians == "always"
        if isinstance(protocol, str):
            from featcache.core.protocols import STAGES as PROTOCOL_STAGES
            from featcache.core.protocols import get_protocol

            # a stage with protocols of its own (dense) looks them up there; the others in probe's
            protocol = get_protocol(protocol, self.name if self.name in PROTOCOL_STAGES else "probe")
        return bool(protocol.median_over_seeds)


#: every stage that writes results rows, by name (:class:`~featcache.core.registry.Registry`)
STAGES: Registry[Stage] = Registry(
    "stage", ConfigError, duplicate="a stage named {name!r} is already registered ({prev.entry})", idempotent=False
)


def register_stage(stage: Stage) -> Stage:
    """Add ``stage`` to :data:`STAGES`; a second stage of the same name is refused."""
    STAGES.register(stage.name, stage, note=stage.entry)
    return stage


def get_stage(name: str) -> Stage:
    """The registered stage ``name`` (a sweep work item's ``kind``)."""
    if name not in STAGES:
        raise ConfigError(STAGES.unknown(name, known="registered stages:", listing=str(sorted(STAGES))))
    return STAGES[name]


# ------------------------------------------------------------------ the skeleton
def finished(results_path: PathLike | None, force: bool) -> set[str]:
    """Run ids already in ``results_path`` (none without a table, or with ``force``)."""
    from featcache.core.results import existing_run_ids

    return set() if results_path is None or force else existing_run_ids(results_path)


def pending(
    groups: Mapping[K, Iterable[str]],
    done: set[str],
    describe: Callable[[K], str],
    results_path: PathLike | None = None,
    logger: logging.Logger | None = None,
) -> list[K]:
    """The keys of ``groups`` (each a group of run ids that runs together) with a run not in
    ``done``, in order; a skip line (``describe(key)``) goes to ``logger`` (the stage's own)
    for each of the others."""
    out = []
    for key, ids in groups.items():
        if all(r in done for r in ids):
            (logger or log).info(
                "skip %s: already in %s (--force, or force=True in Python, reruns it)", describe(key), results_path
            )
        else:
            out.append(key)
    return out


def write_rows(results_path: PathLike | None, rows: Sequence[Mapping[str, Any]] | pl.DataFrame) -> pl.DataFrame | None:
    """Append ``rows`` (dicts, or a frame from :func:`~featcache.core.results.rows_to_frame`) to
    ``results_path``, replacing earlier rows of their runs; the table after the append, or
    None without a path or rows."""
    import polars as pl

    from featcache.core.results import append_results, rows_to_frame

    if results_path is None or not len(rows):
        return None
    frame = rows if isinstance(rows, pl.DataFrame) else rows_to_frame(rows)
    return append_results(results_path, frame, replace_runs=True)


def collect(
    stage: Stage | str,
    results_path: PathLike | None,
    new_rows: Sequence[Mapping[str, Any]],
    wanted: Iterable[str],
    *,
    protocol: Any = None,
    append: bool = True,
) -> pl.DataFrame:
    """The rows of every ``wanted`` run (read from the table, which holds the runs skipped as
    finished too) plus the stage's median rows; ``new_rows`` are appended first when
    ``append`` (a stage that wrote them as they came passes ``append=False``)."""
    import polars as pl

    from featcache.core.results import read_results, rows_to_frame

    stage = get_stage(stage) if isinstance(stage, str) else stage
    table = write_rows(results_path, new_rows) if append else None
    if table is None and results_path is not None and Path(results_path).exists():
        table = read_results(results_path)
    elif table is None and new_rows:
        table = rows_to_frame(new_rows)
    out = rows_to_frame([]) if table is None else table.filter(pl.col("run_id").is_in(list(wanted)))
    if out.height and stage.wants_medians(protocol):
        out = add_medians(out, stage, results_path)
    return out


def add_medians(frame: pl.DataFrame, stage: Stage | str, results_path: PathLike | None = None) -> pl.DataFrame:
    """``frame`` plus the median-over-seeds rows of its seed rows (appended to
    ``results_path`` when given), carrying :attr:`Stage.median_carry`."""
    from featcache.core.results import add_median_rows

    stage = get_stage(stage) if isinstance(stage, str) else stage
    return add_median_rows(frame, stage.name, results_path, carry=stage.median_carry)


def medians_from_table(results_path: PathLike, stage: Stage | str, run_ids: Iterable[str]) -> pl.DataFrame:
    """The median rows of the seed runs ``run_ids`` as stored in ``results_path``, appended
    there (the sweep, after every seed's item is in)."""
    import polars as pl

    from featcache.core.results import read_results

    frame = read_results(results_path).filter(pl.col("run_id").is_in(sorted(run_ids)) & (pl.col("seed") >= 0))
    return add_medians(frame, stage, results_path)


# ------------------------------------------------------------------ split checks
def check_disjoint(name: str, ids: np.ndarray, other_name: str, other_ids: np.ndarray) -> None:
    """Refuse sample ids that occur in both a training split and an evaluated one."""
    both = np.intersect1d(ids, other_ids)
    if both.size:
        raise SplitError(
            f"{both.size} sample ids occur in both {name!r} and {other_name!r} (e.g. "
            f"{both[0]!r}); evaluation on training images is invalid: fix the split definitions"
        )


def check_two_classes(y: np.ndarray, where: str, who: str) -> None:
    """Refuse a training split with a single class (``who``: "a probe", "fine-tuning")."""
    if np.unique(y).size < 2:
        raise SplitError(f"{where} holds a single class among its valid rows; {who} needs at least two classes")


def label_positions(names: np.ndarray, train_names: Sequence[str], where: str) -> np.ndarray:
    """Each row's class name as its index into the train split's ``train_names`` (int64);
    a class the train split does not define is refused."""
    pos = {n: i for i, n in enumerate(train_names)}
    unknown = sorted({str(n) for n in names if n not in pos})
    if unknown:
        raise SplitError(
            f"{where} has classes {unknown[:10]} that the train split does not define; "
            "the class sets of the splits differ: give every split the same class list "
            "(extract or read them from one dataset spec)"
        )
    return np.fromiter((pos[n] for n in names), np.int64, count=len(names))
