"""Experiment tracking: ``--track mlflow[:URI]`` logs what a stage wrote to a tracker.

Every stage that writes results (extract, probe, retrieve, similarity, finetune, sweep) takes
``--track TRACKER[:URI]``. After the stage has written its rows (the parquet first, always),
each featcache run becomes one tracked run: its config and recorded hparams as params, its
metrics, and its rows, config and a short report (extract: the store's summary) as artifacts.
A tracked run is found again by its tag ``featcache.run_id``, so running a run id again updates
its tracked run instead of adding one; a sweep's runs are nested under one parent run.

A tracker that cannot be reached costs one warning line, never a result: :class:`Tracking`
catches the failure, logs it once and tracks nothing more in that command.

:data:`TRACKERS` is the registry of trackers (``mlflow`` built in, in
:mod:`featcache.core.mlflow_tracker`, imported only when ``--track mlflow`` is given): another
tracker is one module whose class takes a URI and has :meth:`Tracker.log_run`, registered with
:func:`register_tracker`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from featcache.core.registry import Registry
from featcache.errors import BackendUnavailableError, ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "RUN_ID_TAG",
    "TRACKERS",
    "TrackedRun",
    "Tracker",
    "TrackerInfo",
    "Tracking",
    "add_track_argument",
    "config_params",
    "open_tracking",
    "parse_track",
    "register_tracker",
    "runs_of_rows",
]

#: the tag that names a tracked run's featcache run id (how a rerun finds it)
RUN_ID_TAG = "featcache.run_id"
#: the tag naming the stage that wrote the run
STAGE_TAG = "featcache.stage"
#: the longest param value logged (MLflow's limit is 6000 characters); longer ones are cut
MAX_PARAM_CHARS = 6000
#: the results columns that define a run, logged as its params (beside its hparams and config)
RUN_COLUMNS = ("kind", "backbone", "dataset", "protocol", "train_split", "shots", "seed", "store_fingerprint")


@dataclass(frozen=True)
class TrackedRun:
    """One featcache run as a tracker logs it: ``run_id`` (featcache's, the lookup tag),
    ``name`` (shown in the tracker), ``params`` (text), ``metrics``, ``artifacts`` (file name ->
    text) and extra ``tags``."""

    run_id: str
    stage: str
    name: str
    params: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)
    artifacts: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)


class Tracker(Protocol):
    """What a registered tracker's class builds from a URI (``cls(uri)``)."""

    def log_run(self, run: TrackedRun, parent: str | None = None) -> str:
        """Create or update the tracked run of ``run.run_id`` (nested under the tracker's run
        ``parent`` when given); the tracker's own id of that run."""
        ...


@dataclass(frozen=True)
class TrackerInfo:
    """What featcache checks before any compute: the URI used when none is given, and the
    module the tracker needs (with the pip line that installs it)."""

    default_uri: str
    module: str
    pip: str


#: tracker name -> the class that tracks to a URI (``--track NAME[:URI]``)
TRACKERS: Registry[Any] = Registry("tracker", ConfigError)


def register_tracker(name: str, target: Any, *, note: str, info: TrackerInfo) -> None:
    """Register a tracker (``target``: its class, or ``"module:Class"`` imported on first use)."""
    TRACKERS.register(name, target, usage=f"{name}[:URI]", note=note, info=info)


register_tracker(
    "mlflow",
    "featcache.core.mlflow_tracker:MlflowTracker",
    note="MLflow; default URI sqlite:///mlflow.db, or http://HOST:PORT of an `mlflow server`",
    info=TrackerInfo("sqlite:///mlflow.db", "mlflow", "pip install mlflow"),
)


def parse_track(text: str) -> tuple[str, str]:
    """``NAME[:URI]`` as (tracker name, URI): the URI defaults to the tracker's; an unknown
    tracker, or one whose library is not installed, is one :class:`ConfigError` line."""
    name, _, uri = text.partition(":")
    entry = TRACKERS.get_entry(name)
    if entry is None:
        raise ConfigError(TRACKERS.unknown(name, spec=text, what="--track: unknown tracker"))
    info: TrackerInfo = entry.info
    if importlib.util.find_spec(info.module) is None:
        raise BackendUnavailableError(f"--track {text}: {info.module} is not installed; `{info.pip}`, or drop --track")
    return name, uri or info.default_uri


def add_track_argument(p: argparse.ArgumentParser) -> None:
    """The ``--track TRACKER[:URI]`` flag every stage that writes results takes."""
    p.add_argument(
        "--track",
        default=None,
        metavar="TRACKER[:URI]",
        help=f"also log each run to an experiment tracker ({TRACKERS.help()}): params, metrics and "
        "artifacts, one tracked run per run id (a rerun updates it); the results are written first, "
        "and a tracker that fails costs one warning",
    )


def open_tracking(text: str | None, results: str | None = None) -> Tracking | None:
    """The :class:`Tracking` of a ``--track`` value (None without one), checked before compute."""
    if not text:
        return None
    name, uri = parse_track(text)
    return Tracking(name, uri, results)


class Tracking:
    """One command's tracking: the tracker (built on first use) and whether it failed (then
    nothing more is tracked: one warning line, never an exception)."""

    def __init__(self, name: str, uri: str, results: str | None = None) -> None:
        self.name, self.uri, self.results = name, uri, results
        self.failed = False
        self._tracker: Tracker | None = None

    def __repr__(self) -> str:
        return f"Tracking({self.name}:{self.uri})"

    def log(
        self, runs: Iterable[TrackedRun] | Callable[[], Iterable[TrackedRun]], parent: str | None = None
    ) -> list[str]:
        """Log ``runs`` (or the runs a function of none builds) nested under ``parent``; the
        tracker's ids of the runs logged (fewer when building or logging failed: that failure is
        logged once as a warning, and nothing more is tracked)."""
        done: list[str] = []
        if self.failed:
            return done
        try:
            runs = list(runs() if callable(runs) else runs)
        except Exception as exc:
            self._fail(exc)
            return done
        for run in runs:
            if self.failed:
                break
            try:
                tracker = self._tracker = self._tracker or TRACKERS.resolve(self.name)(self.uri)
                done.append(tracker.log_run(run, parent))
            except Exception as exc:  # a tracker's failure never costs a result
                self._fail(exc)
        return done

    def log_rows(
        self,
        stage: str,
        rows: Any,
        config: Any = None,
        *,
        parent: str | None = None,
        artifacts: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Log each run of the results ``rows`` a ``stage`` wrote with ``config``
        (:func:`runs_of_rows`); the tracker's ids of the runs logged."""
        return self.log(lambda: runs_of_rows(stage, rows, config, artifacts=artifacts), parent)

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        where = f" (they are in {self.results})" if self.results else ""
        log.warning(
            "--track %s:%s failed, %s: %s; the results are written%s, nothing more is tracked in this "
            "command: rerun it with --track once the tracker answers (the rerun updates the tracked runs)",
            self.name,
            self.uri,
            type(exc).__name__,
            first,
            where,
        )


def _text(value: Any) -> str:
    """A param value as text (scalars as they print, the rest as JSON), cut to MLflow's limit."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        out = str(value)
    else:
        out = json.dumps(value, sort_keys=True, default=str)
    return out if len(out) <= MAX_PARAM_CHARS else out[: MAX_PARAM_CHARS - 3] + "..."


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def config_params(config: Any) -> dict[str, Any]:
    """A stage config (a dataclass, or a mapping) as JSON-ready values by field name."""
    if config is None:
        return {}
    out = _jsonable(config)
    return out if isinstance(out, dict) else {"config": out}


def _run_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``metric -> value``; where a metric occurs on several eval splits, ``SPLIT/metric``."""
    names = [r["metric"] for r in rows]
    out = {}
    for r in rows:
        key = r["metric"] if names.count(r["metric"]) == 1 else f"{r['eval_split']}/{r['metric']}"
        out[key] = float("nan") if r["value"] is None else float(r["value"])
    return out


def _run_params(rows: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, str]:
    first = rows[0]
    params = {c: _text(first[c]) for c in RUN_COLUMNS if c in first}
    splits = sorted({str(r["eval_split"]) for r in rows})
    params["eval_split"] = ",".join(splits)
    hp = json.loads(first["hparams"] or "{}") if isinstance(first["hparams"], str) else first["hparams"] or {}
    params.update({f"hparams.{k}": _text(v) for k, v in hp.items()})
    params.update({f"config.{k}": _text(v) for k, v in config.items()})
    return params


def _report(rows: list[dict[str, Any]]) -> str:
    """The run's rows as a Markdown table (split, metric, value, n_eval, converged)."""
    lines = ["| eval_split | metric | value | n_eval | converged |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['eval_split']} | {r['metric']} | {r['value']!r} | {r['n_eval']} | {r['converged']} |")
    first = rows[0]
    head = f"# {first['kind']} run {first['run_id']}\n\n{first['backbone']} on {first['dataset']}"
    return f"{head} ({first['protocol']}, seed {first['seed']})\n\n" + "\n".join(lines) + "\n"


def runs_of_rows(
    stage: str, rows: Any, config: Any = None, *, artifacts: Mapping[str, str] | None = None
) -> list[TrackedRun]:
    """One :class:`TrackedRun` per run id of ``rows`` (a results frame, or row dicts), in order:
    params = the run's defining columns, its recorded hparams (``hparams.*``) and ``config``'s
    fields (``config.*``); metrics = its rows' values; artifacts = ``rows.json`` (the rows as
    written), ``config.json``, ``report.md`` and ``artifacts``."""
    dicts = rows.to_dicts() if hasattr(rows, "to_dicts") else [dict(r) for r in rows]
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in dicts:
        by_run.setdefault(r["run_id"], []).append(r)
    cfg = config_params(config)
    out = []
    for run_id, group in by_run.items():
        first = group[0]
        seed = "median" if first.get("seed") == -1 else f"seed {first.get('seed')}"
        name = f"{stage} {first['backbone']} {first['dataset']} {first.get('protocol') or ''} {seed}"
        files = {
            "rows.json": json.dumps(_jsonable(group), indent=1, sort_keys=True),
            "config.json": json.dumps(cfg, indent=1, sort_keys=True),
            "report.md": _report(group),
            **(artifacts or {}),
        }
        tags = {"featcache.kind": str(first["kind"])}
        out.append(
            TrackedRun(run_id, stage, " ".join(name.split()), _run_params(group, cfg), _run_metrics(group), files, tags)
        )
    return out
