"""timm's published results tables (``results/results-imagenet.csv`` and its variants:
``results-imagenet-real.csv``, ``results-imagenetv2-matched-frequency.csv``,
``results-sketch.csv``, ``results-imagenet-a.csv``, ``results-imagenet-r.csv``...), written by
timm's ``validate.py``: ``model, top1, top1_err, top5, top5_err, param_count, img_size, crop_pct,
interpolation`` (the variants add ``top1_diff, top5_diff, rank_diff``), accuracies in percent.
Import only: each row is one supervised model's ImageNet accuracy, kind ``finetune`` (the whole
network trained on the task) with protocol ``full``, the linear-probe protocol a featcache
fine-tune row carries too, so the linear-vs-fine-tune analysis pairs a backbone's featcache probe
on ``imagenet`` with timm's number (``hparams.published``: where it came from);
``results-imagenet.csv`` is split ``val``, a variant its own split (``results-sketch.csv``:
``sketch``). A backbone pairs when its featcache name is timm's model name (with its tag)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from featcache.interop.formats import ResultFormat
from featcache.interop.runs import Imported, external_rows, file_sha256

NAME = "timm"
COLUMNS = ("model", "top1", "top1_err", "top5", "top5_err")
KEEP = ("param_count", "img_size", "crop_pct", "interpolation")
#: top1 + top1_err is 100 within this (timm rounds each to 3 places)
TOLERANCE = 0.0011


def split_of(path: Path) -> str:
    variant = Path(path).stem.removeprefix("results-")
    return "val" if variant == "imagenet" else variant


def _number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def check_row(row: dict[str, Any]) -> tuple[dict[str, float], str | None]:
    """``(metrics, problem)``: top-1/top-5 as fractions, or the first field that is wrong."""
    if not (row.get("model") or "").strip():
        return {}, "model: empty"
    metrics = {}
    for m in ("top1", "top5"):
        v, err = _number(row.get(m)), _number(row.get(f"{m}_err"))
        if v is None or not 0 <= v <= 100:
            return {}, f"{m}: {row.get(m)!r} is not a percentage"
        if err is not None and abs(v + err - 100) > TOLERANCE:
            return {}, f"{m}_err: {m} {v} + {m}_err {err} is not 100"
        metrics[m] = v / 100
    return metrics, None


def read(path: Path) -> Imported:
    """The rows of one timm results CSV (every ``results-*.csv`` of a folder)."""
    got = Imported()
    files = sorted(Path(path).glob("results-*.csv")) if Path(path).is_dir() else [Path(path)]
    for f in files:
        with open(f, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                got.problems.append(f"{f}: field {missing[0]!r} missing from the header: not a timm results CSV")
                continue
            sha = file_sha256(f)
            for line, row in enumerate(reader, start=2):
                metrics, problem = check_row(row)
                if problem:
                    got.problems.append(f"{f}: line {line}, field {problem}")
                    continue
                base = {
                    "kind": "finetune",
                    "backbone": row["model"].strip(),
                    "dataset": "imagenet",
                    "protocol": "full",
                    "train_split": "train",
                    "eval_split": split_of(f),
                    "hparams": {
                        "published": "timm validate.py (results CSV)",
                        **{k: row.get(k) for k in KEEP if row.get(k) not in (None, "")},
                    },
                }
                got.rows += external_rows(base, metrics, fmt=NAME, path=f, sha=sha)
    return got


def detect(path: Path) -> bool:
    files = sorted(path.glob("results-*.csv")) if path.is_dir() else [path]
    if not files or files[0].suffix != ".csv":
        return False
    with open(files[0], newline="", encoding="utf-8") as fh:
        return set(COLUMNS) <= set(next(csv.reader(fh), []))


FORMAT = ResultFormat(write=None, read=read, detect=detect)
