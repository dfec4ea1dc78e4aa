"""Benchmark task suites shipped as data: one TOML file per suite in this package.

>>> from featcache.suites import load_suite
>>> s = load_suite("vtab-1k")
>>> len(s.tasks), s.groups
(19, ('natural', 'specialized', 'structured'))
>>> s.task("dsprites_location").metric
'top1'

A :class:`Task` says where its data comes from (``source``: the paper's dataset and version),
how the paper splits it (``splits``: e.g. VTAB's TFDS split strings), how labels are derived
where the paper derives them (``label``), which metric it reports and the paper it comes from
(its suite's ``paper``). ``featcache suites`` lists them; ``featcache extract --suite NAME
--data-root DIR`` extracts every task whose data lies under ``DIR/<task name or alias>``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Any

from featcache.core import metrics as _metrics
from featcache.core.metrics import TASK_METRICS as METRICS
from featcache.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # pyright: ignore[reportMissingImports]  # installed on Python 3.10 only

__all__ = [
    "KINDS",
    "METRICS",
    "Suite",
    "Task",
    "list_suites",
    "load_suite",
    "present_tasks",
    "suite_names",
    "warn_missing",
]

# METRICS: the metrics a classification task may declare, as registered when this module was
# imported (featcache.core.metrics.TASK_METRICS; a suite is checked against the registry as it is)
#: metrics a retrieval task may declare (names as ``featcache retrieve`` writes them; ``@k`` any k)
#: what a task is evaluated by: probes/fine-tuning (classification) or ``featcache retrieve``
KINDS = ("classification", "retrieval")
_TASK_KEYS = {
    "name",
    "group",
    "source",
    "aliases",
    "metric",
    "num_classes",
    "class_names",
    "label",
    "multilabel",
    "splits",
    "kind",
    "protocols",
    "metrics",
    "relevance",
    "data",
}


class SuiteError(ConfigError):
    """A suite name that does not exist, or a suite file that breaks the schema."""


@dataclass(frozen=True)
class Task:
    """One task of a suite."""

    name: str
    group: str
    source: str
    metric: str
    num_classes: int
    splits: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    aliases: tuple[str, ...] = ()
    class_names: tuple[str, ...] | None = None
    label: str | None = None
    multilabel: bool = False
    #: ``classification`` or ``retrieval`` (no training: ``featcache retrieve``)
    kind: str = "classification"
    #: featcache probe protocol specs that run the paper's setting (e.g. ``subset:10%``)
    protocols: tuple[str, ...] = ()
    #: further metrics the paper reports beside ``metric`` (retrieval: ``mp@5``, ``mrr_bob``...)
    metrics: tuple[str, ...] = ()
    #: retrieval: how a match is defined (semantic label, explicit positives, revisitop setup)
    relevance: str | None = None
    #: where the data comes from and how to lay it out (no suite's data is bundled)
    data: str | None = None

    @property
    def dir_names(self) -> tuple[str, ...]:
        """Folder names under a data root that hold this task (name first, then aliases)."""
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Suite:
    """A named benchmark suite: its tasks, groups, preprocessing and the paper it follows."""

    name: str
    title: str
    paper: str
    groups: tuple[str, ...]
    tasks: tuple[Task, ...]
    resize: str = "timm"
    input_size: int | None = None
    subsets: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: how to bring the data (none is bundled: featcache never downloads)
    data: str | None = None

    def task(self, name: str) -> Task:
        for t in self.tasks:
            if name in t.dir_names:
                return t
        raise SuiteError(f"suite {self.name} has no task {name!r}; tasks: {', '.join(t.name for t in self.tasks)}")


def list_suites() -> list[str]:
    """Names of the suites shipped in this package."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".toml"))


def suite_names() -> str:
    """The shipped suites' names, comma-separated (for help texts)."""
    return ", ".join(list_suites())


@cache
def load_suite(name: str) -> Suite:
    """The suite ``name`` (see :func:`list_suites`), validated."""
    if name not in list_suites():
        raise SuiteError(f"unknown suite {name!r}; available: {', '.join(list_suites())} (see `featcache suites`)")
    raw = tomllib.loads(resources.files(__name__).joinpath(f"{name}.toml").read_text(encoding="utf-8"))
    return _suite(raw, f"{name}.toml")


def _suite(raw: dict[str, Any], where: str) -> Suite:
    try:
        groups = tuple(raw["groups"])
        tasks = tuple(_task(t, groups, where) for t in raw["tasks"])
        suite = Suite(
            raw["name"],
            raw["title"],
            raw["paper"],
            groups,
            tasks,
            raw.get("resize", "timm"),
            raw.get("input_size"),
            MappingProxyType(dict(raw.get("subsets", {}))),
            raw.get("data"),
        )
    except KeyError as exc:
        raise SuiteError(f"{where}: missing key {exc}") from exc
    names = [n for t in tasks for n in t.dir_names]
    if len(set(names)) != len(names):
        raise SuiteError(f"{where}: task names/aliases repeat: {sorted({n for n in names if names.count(n) > 1})}")
    from featcache.models.model import RESIZE_MODES

    if suite.resize not in RESIZE_MODES:
        raise SuiteError(f"{where}: resize {suite.resize!r} must be one of {', '.join(RESIZE_MODES)}")
    return suite


def _task(t: dict[str, Any], groups: tuple[str, ...], where: str) -> Task:
    unknown = set(t) - _TASK_KEYS
    if unknown:
        raise SuiteError(f"{where}: task {t.get('name')!r} has unknown keys {sorted(unknown)}")
    task = Task(
        t["name"],
        t["group"],
        t["source"],
        t["metric"],
        int(t["num_classes"]),
        MappingProxyType(dict(t.get("splits", {}))),
        tuple(t.get("aliases", ())),
        tuple(t["class_names"]) if "class_names" in t else None,
        t.get("label"),
        bool(t.get("multilabel")),
        t.get("kind", "classification"),
        tuple(t.get("protocols", ())),
        tuple(t.get("metrics", ())),
        t.get("relevance"),
        t.get("data"),
    )
    _check_kind_metrics_protocols(task, where)
    if task.group not in groups:
        raise SuiteError(f"{where}: task {task.name} group {task.group!r} is not one of {groups}")
    if task.kind == "classification" and task.num_classes < 2:
        raise SuiteError(f"{where}: task {task.name} needs num_classes >= 2 (got {task.num_classes})")
    if task.class_names is not None and len(task.class_names) != task.num_classes:
        raise SuiteError(
            f"{where}: task {task.name} has {len(task.class_names)} class names for {task.num_classes} classes"
        )
    return task


def _retrieval_metrics() -> tuple[str, ...]:
    """The names ``featcache retrieve`` writes (its metric registry), ``NAME@k`` for any k."""
    from featcache.retrieval.metrics import written_metric_names

    return written_metric_names()


def _retrieval_metric_ok(name: str) -> bool:
    base, at, k = name.partition("@")
    names = _retrieval_metrics()
    return (f"{base}@k" in names and k.isdigit() and int(k) > 0) if at else name in names


def _check_kind_metrics_protocols(task: Task, where: str) -> None:
    """The task's kind is known, its metrics are ones its stage writes, its protocols are registered."""
    if task.kind not in KINDS:
        raise SuiteError(f"{where}: task {task.name} kind {task.kind!r} is not one of {', '.join(KINDS)}")
    for m in (task.metric, *task.metrics):
        if task.kind == "retrieval" and not _retrieval_metric_ok(m):
            raise SuiteError(
                f"{where}: retrieval task {task.name} metric {m!r} is not one featcache retrieve writes "
                f"({', '.join(_retrieval_metrics())})"
            )
        if task.kind == "classification" and m not in _metrics.TASK_METRICS:
            raise SuiteError(f"{where}: task {task.name} metric {m!r} is not one of {', '.join(_metrics.TASK_METRICS)}")
    if task.protocols:
        from featcache.core.protocols import get_protocol, list_protocols
        from featcache.errors import ProtocolError

        for spec in task.protocols:
            try:
                get_protocol(spec)
            except ProtocolError as exc:
                raise SuiteError(
                    f"{where}: task {task.name} protocol {spec!r} is not a probe protocol ({exc}); "
                    f"registered: {', '.join(list_protocols())}"
                ) from exc


def present_tasks(suite: Suite, data_root: str) -> list[tuple[Task, str]]:
    """``(task, data spec)`` of each task of ``suite`` with data under ``data_root``
    (``DIR/<task name or alias>`` in any supported layout); the missing ones named in one warning, none is an error."""
    from pathlib import Path

    from featcache.data import detect_spec
    from featcache.errors import DataError

    if not data_root or not Path(data_root).is_dir():
        raise DataError(f"--suite {suite.name} needs --data-root DIR, an existing folder with one entry per task")
    found = []
    for task in suite.tasks:
        spec = next((s for n in task.dir_names for s in [detect_spec(Path(data_root) / n)] if s), None)
        if spec:
            found.append((task, spec))
    if not found:
        raise DataError(
            f"no task of suite {suite.name} has data under {data_root}; expected e.g. "
            f"{data_root}/{suite.tasks[0].name}/ (names and aliases: `featcache suites {suite.name}`)"
        )
    have = {t.name for t, _ in found}
    warn_missing(suite, [t.name for t in suite.tasks if t.name not in have], f"have no data under {data_root}")
    return found


def warn_missing(suite: Suite, missing: list[str], why: str) -> None:
    """One warning line naming the tasks of ``suite`` that are skipped and why."""
    if missing:
        import logging

        logging.getLogger(__name__).warning(
            "suite %s: %d of %d tasks %s, skipped: %s",
            suite.name,
            len(missing),
            len(suite.tasks),
            why,
            ", ".join(missing),
        )
