"""CLIP_benchmark's per-run JSON, as ``clip_benchmark eval`` dumps it (clip_benchmark 1.6.2,
``clip_benchmark/cli.py`` ``main_eval``: ``{dataset, model, pretrained, task, metrics,
language}``, ``json.dump`` without indent) and ``clip_benchmark build`` merges it (one CSV row
per file: the metrics beside the other keys). A linear probe is task ``linear_probe`` with
``lp_acc1``, ``lp_acc5``, ``lp_mean_per_class_recall`` (and ``seed``, ``fewshot_k``), zero-shot
classification is ``zeroshot_classification`` with ``acc1``, ``acc5``,
``mean_per_class_recall``; values are fractions in [0, 1]. featcache's other metrics (nll,
ece...) go in ``metrics`` under their own names, and its provenance in a top-level
``featcache`` object (build merges it into the row as one column)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from featcache.interop.formats import ExportContext, ResultFormat, read_json
from featcache.interop.runs import BLOCK, Imported, Run, external_rows, file_sha256, finite, safe_name

NAME = "clip_benchmark"
#: featcache metric -> CLIP_benchmark's name, per task
METRIC_NAMES = {
    "linear_probe": {"top1": "lp_acc1", "top5": "lp_acc5", "mean_per_class": "lp_mean_per_class_recall"},
    "zeroshot_classification": {"top1": "acc1", "top5": "acc5", "mean_per_class": "mean_per_class_recall"},
}
LANGUAGE = "en"  # clip_benchmark's --language default
#: the keys clip_benchmark's own dump always has
KEYS = ("dataset", "model", "pretrained", "task", "metrics", "language")


def task_of(run: Run) -> str | None:
    if run.kind != "probe":
        return None
    return "zeroshot_classification" if run.protocol == "zeroshot" else "linear_probe"


def dump_of(run: Run, task: str) -> dict[str, Any]:
    """The JSON object of one run, keys in clip_benchmark's order."""
    names = METRIC_NAMES[task]
    metrics: dict[str, Any] = {names.get(m, m): v for m, v in run.metrics.items()}
    if task == "linear_probe":
        metrics.update(seed=run.seed, fewshot_k=run.shots)
    pretrained = (run.weights_sha256 or "")[:12] or run.store_fingerprint or "unknown"
    return {
        "dataset": run.dataset,
        "model": run.backbone,
        "pretrained": pretrained,
        "task": task,
        "metrics": metrics,
        "language": LANGUAGE,
        BLOCK: run.provenance(),
    }


def write(runs: Sequence[Run], ctx: ExportContext) -> tuple[list[Path], list[str]]:
    """One ``{dataset}_{pretrained}_{model}_{language}_{task}.json`` per run (clip_benchmark's
    default output template; the run id added where two runs would share a name)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    files, skipped, seen = [], [], set()
    for run in runs:
        task = task_of(run)
        if task is None:
            skipped.append(f"run {run.run_id} ({run.kind}): CLIP_benchmark has no task for image-only {run.kind} rows")
            continue
        d = dump_of(run, task)
        stem = "_".join(safe_name(str(d[k])) for k in ("dataset", "pretrained", "model", "language", "task"))
        if stem in seen:
            stem = f"{stem}_{run.run_id}"
        seen.add(stem)
        path = ctx.out / f"{stem}.json"
        with open(path, "w") as f:
            json.dump(d, f)
        files.append(path)
    return files, skipped


def read_one(path: Path) -> Imported:
    """The rows of one CLIP_benchmark JSON file."""
    data, got = read_json(path), Imported()
    missing = [k for k in KEYS[:5] if k not in (data if isinstance(data, dict) else {})]
    if missing:
        got.problems.append(f"{path}: field {missing[0]!r} missing: not a CLIP_benchmark result")
        return got
    task, raw = data["task"], data["metrics"]
    if task not in METRIC_NAMES:
        got.problems.append(f"{path}: field 'task' is {task!r}; featcache reads {sorted(METRIC_NAMES)}")
        return got
    block = data.get(BLOCK)
    names = METRIC_NAMES[task]
    wanted = block["metrics"] if isinstance(block, dict) else list(names)
    metrics = {}
    for m in wanted:
        key = names.get(m, m)
        if key not in raw:
            continue
        v = raw[key]
        if not finite(v) or (m in names and not 0 <= v <= 1):
            got.problems.append(f"{path}: field 'metrics.{key}' is {v!r}, not a fraction in [0, 1]")
            return got
        metrics[m] = v
    if not metrics:
        got.problems.append(f"{path}: field 'metrics' holds none of {sorted(names.values())}")
        return got
    base = block if isinstance(block, dict) else foreign_base(data, task)
    got.rows += external_rows(base, metrics, fmt=NAME, path=path, sha=file_sha256(path))
    return got


def foreign_base(data: dict[str, Any], task: str) -> dict[str, Any]:
    """The run-level columns of a file clip_benchmark wrote: the backbone named as ``build``
    names it (``model_fullname``: model and pretrained tag)."""
    m = data["metrics"]
    lp = task == "linear_probe"
    keep = ("weight_decay", "epochs", "normalized") if lp else ()
    return {
        "kind": "probe",
        "backbone": f"{data['model']} {data['pretrained']}",
        "dataset": str(data["dataset"]).replace("wds/", "", 1),
        "protocol": "clip_benchmark-linear_probe" if lp else "zeroshot",
        "train_split": "train" if lp else "",
        "eval_split": "test",
        "shots": int(m.get("fewshot_k") or -1) if lp else 0,
        "seed": int(m.get("seed") or 0),
        "hparams": {"language": data.get("language"), **{k: m[k] for k in keep if k in m}},
    }


def read(path: Path) -> Imported:
    """A JSON file, or every ``*.json`` of a folder (as ``clip_benchmark build`` takes them)."""
    got = Imported()
    for p in sorted(Path(path).glob("*.json")) if Path(path).is_dir() else [Path(path)]:
        got.extend(read_one(p))
    return got


def detect(path: Path) -> bool:
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    if not files or files[0].suffix != ".json":
        return False
    data = read_json(files[0])
    return isinstance(data, dict) and all(k in data for k in KEYS[:5])


FORMAT = ResultFormat(write=write, read=read, detect=detect)
