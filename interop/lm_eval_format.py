"""lm-evaluation-harness's aggregated results, as lm-eval 0.4 writes them
(``lm_eval/evaluator.py`` ``simple_evaluate`` and ``lm_eval/loggers/evaluation_tracker.py``
``save_results_aggregated``): ``{output}/{sanitized model}/results_{date_id}.json``, indent 2,
with ``results`` (per task ``alias`` and ``metric,filter`` keys, ``metric_stderr,filter``
beside each), ``group_subtasks``, ``configs``, ``versions``, ``n-shot``, ``higher_is_better``,
``n-samples``, ``config``, ``git_hash``, ``date``, ``task_hashes`` and the tracker's fields.

One file per backbone; one task per run, named ``{dataset}_{kind}_{protocol}_{eval split}_seed
{seed}`` (lm-eval's ``\\W`` -> ``_``). Top-1 is lm-eval's ``acc`` with its ``mean_stderr`` (the
sample standard deviation of the per-row 0/1 outcomes over sqrt(n)); featcache's provenance is
the task config's ``metadata.featcache``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from featcache.interop.formats import ExportContext, ResultFormat, read_json
from featcache.interop.runs import BLOCK, Imported, Run, by, external_rows, file_sha256, finite, lower_is_better

NAME = "lm-eval"
FILTER = "none"  # lm-eval's filter name where a task applies none
#: featcache metric -> lm-eval's metric name
METRIC_NAMES = {"top1": "acc"}


def sanitize_model_name(name: str) -> str:
    """lm-eval 0.4.13 ``lm_eval/utils.py:300`` ``sanitize_model_name``."""
    return re.sub(r"[\"<>:/|\\?*\[\]]+", "__", name)


def sanitize_task_name(name: str) -> str:
    """lm-eval 0.4.13 ``lm_eval/utils.py:307`` ``sanitize_task_name``."""
    return re.sub(r"\W", "_", name)


def stderr(run: Run, metric: str) -> float | str:
    """lm-eval's ``mean_stderr`` of an accuracy over ``n_eval`` 0/1 outcomes: sqrt(p (1 - p) /
    (n - 1)) (``sample_stddev`` divides by n - 1); ``"N/A"`` (lm-eval's word) elsewhere."""
    n, p = run.n_eval, run.metrics[metric]
    if metric not in ("top1", "top5") or not n or n < 2:
        return "N/A"
    k = round(p * n)
    return math.sqrt(k * (n - k) / n / (n - 1)) / math.sqrt(n)


def task_of(run: Run) -> str:
    return sanitize_task_name(f"{run.dataset}_{run.kind}_{run.protocol}_{run.eval_split}_seed{run.seed}")


def task_config(run: Run, task: str) -> dict[str, Any]:
    lower = lower_is_better(list(run.metrics))
    return {
        "task": task,
        "tag": ["featcache"],
        "dataset_path": run.dataset,
        "training_split": run.train_split or None,
        "test_split": run.eval_split,
        "num_fewshot": max(run.shots, 0),
        "output_type": f"featcache-{run.kind}",
        "metric_list": [
            {"metric": METRIC_NAMES.get(m, m), "aggregation": "mean", "higher_is_better": m not in lower}
            for m in run.metrics
        ],
        "repeats": 1,
        "should_decontaminate": False,
        "metadata": {"version": run.featcache_version, BLOCK: run.provenance()},
    }


def task_results(run: Run, task: str) -> dict[str, Any]:
    out: dict[str, Any] = {"alias": task}
    for m, v in run.metrics.items():
        name = METRIC_NAMES.get(m, m)
        out[f"{name},{FILTER}"] = v
        out[f"{name}_stderr,{FILTER}"] = stderr(run, m)
    return out


def _date(runs: Sequence[Run]) -> datetime:
    times = [datetime.fromisoformat(r.created_at) for r in runs if r.created_at]
    return max(times).astimezone(timezone.utc).replace(tzinfo=None) if times else datetime(1970, 1, 1)


def results_file(backbone: str, runs: Sequence[Run], version: str) -> dict[str, Any]:
    """The aggregated results object of one backbone's runs, keys in lm-eval's order."""
    tasks: dict[str, Run] = {}
    for r in runs:
        tasks[task_of(r) if task_of(r) not in tasks else f"{task_of(r)}_{r.run_id}"] = r
    lower = {t: lower_is_better(list(r.metrics)) for t, r in tasks.items()}
    date = _date(runs)
    fit = sum(r.fit_seconds or 0.0 for r in runs)
    seeds = {r.seed for r in runs}
    seed = seeds.pop() if len(seeds) == 1 else None  # several: each task's config says its own
    return {
        "results": {t: task_results(r, t) for t, r in tasks.items()},
        "group_subtasks": {t: [] for t in tasks},
        "configs": {t: task_config(r, t) for t, r in tasks.items()},
        "versions": {t: r.featcache_version for t, r in tasks.items()},
        "n-shot": {t: max(r.shots, 0) for t, r in tasks.items()},
        "higher_is_better": {
            t: {METRIC_NAMES.get(m, m): m not in lower[t] for m in r.metrics} for t, r in tasks.items()
        },
        "n-samples": {t: {"original": r.n_eval, "effective": r.n_eval} for t, r in tasks.items()},
        "config": {"model": backbone, "model_args": None, "batch_size": None, "random_seed": seed},
        "git_hash": None,
        "date": date.replace(tzinfo=timezone.utc).timestamp(),
        "featcache_version": version,
        "task_hashes": {},
        # asdict(GeneralConfigTracker), as save_results_aggregated appends it
        "model_source": "featcache",
        "model_name": backbone,
        "model_name_sanitized": sanitize_model_name(backbone),
        "system_instruction": None,
        "system_instruction_sha": None,
        "fewshot_as_multiturn": False,
        "chat_template": None,
        "chat_template_sha": None,
        "total_evaluation_time_seconds": str(fit),
    }


def write(runs: Sequence[Run], ctx: ExportContext) -> tuple[list[Path], list[str]]:
    """``{out}/{sanitized backbone}/results_{date}.json`` per backbone (the date: its latest row's,
    as lm-eval's ``datetime.isoformat()`` with ``:`` -> ``-``)."""
    files = []
    for (backbone,), group in by(runs, "backbone").items():
        folder = ctx.out / sanitize_model_name(backbone)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"results_{_date(group).isoformat(timespec='microseconds').replace(':', '-')}.json"
        path.write_text(json.dumps(results_file(backbone, group, ctx.version), indent=2, ensure_ascii=False), "utf-8")
        files.append(path)
    return files, []


def read_one(path: Path) -> Imported:
    data, got = read_json(path), Imported()
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        got.problems.append(f"{path}: field 'results' missing: not lm-eval's aggregated results")
        return got
    sha = file_sha256(path)
    names = {v: k for k, v in METRIC_NAMES.items()}
    for task, res in data["results"].items():
        block = ((data.get("configs") or {}).get(task) or {}).get("metadata", {}).get(BLOCK)
        if not isinstance(block, dict):
            got.problems.append(
                f"{path}: field 'configs.{task}.metadata.{BLOCK}' missing: no image task of featcache's"
            )
            continue
        metrics = {}
        for key, v in res.items():
            name, _, _ = key.partition(",")
            if key == "alias" or name.endswith("_stderr"):
                continue
            if not finite(v):
                got.problems.append(f"{path}: field 'results.{task}.{key}' is {v!r}, not a number")
                break
            metrics[names.get(name, name)] = v
        else:
            got.rows += external_rows(block, metrics, fmt=NAME, path=path, sha=sha)
    return got


def read(path: Path) -> Imported:
    """A ``results_*.json`` file, or every one under a folder."""
    got = Imported()
    for p in [Path(path)] if Path(path).is_file() else sorted(Path(path).rglob("results_*.json")):
        got.extend(read_one(p))
    return got


def detect(path: Path) -> bool:
    if path.is_dir():
        return any(path.rglob("results_*.json"))
    return path.name.startswith("results_") and path.suffix == ".json"


FORMAT = ResultFormat(write=write, read=read, detect=detect)
