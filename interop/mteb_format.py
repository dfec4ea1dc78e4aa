"""MTEB/MIEB results, as mteb 2 writes them (``mteb/cache/result_cache.py`` ``save_to_cache``,
``mteb/results/task_result.py`` ``TaskResult.to_disk``): ``results/{org__name}/{revision}/
{Task}.json`` (a protocol other than the default linear probe under ``experiments/{name}/``,
mteb's folder for an experiment) beside ``model_meta.json`` (``ModelMeta.to_dict()``, indent 4).

A TaskResult holds ``dataset_revision, task_name, mteb_version, scores, evaluation_time,
kg_co2_emissions, date, evaluation_phases``; ``scores`` maps a split to one entry per
``hf_subset`` with ``main_score`` (floats rounded to 6 places, as ``to_disk`` does). Where MIEB
registers the dataset (:data:`MIEB_TASKS`) its task name is used, elsewhere featcache's dataset
name; ``dataset_revision`` is ``featcache:<store fingerprint>`` (never mteb's dataset revision,
as the entry's ``featcache_note`` says). Several seeds are MTEB's ``scores_per_experiment``
(the entry holds their mean), each with featcache's provenance as a JSON string."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from featcache.interop.formats import ExportContext, ResultFormat, read_json
from featcache.interop.runs import BLOCK, Imported, Run, by, external_rows, file_sha256, finite, safe_name

NAME = "mteb"
#: featcache's dataset name (lower case, letters and digits only) -> MIEB's ImageClassification task
MIEB_TASKS = {
    "birdsnap": "Birdsnap",
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
    "caltech101": "Caltech101",
    "country211": "Country211",
    "dtd": "DTD",
    "eurosat": "EuroSAT",
    "fer2013": "FER2013",
    "fgvcaircraft": "FGVCAircraft",
    "food101": "Food101Classification",
    "gtsrb": "GTSRB",
    "imagenet": "Imagenet1k",
    "imagenet1k": "Imagenet1k",
    "mnist": "MNIST",
    "oxfordflowers": "OxfordFlowersClassification",
    "oxfordpets": "OxfordPets",
    "pcam": "PatchCamelyon",
    "patchcamelyon": "PatchCamelyon",
    "resisc45": "RESISC45",
    "stl10": "STL10",
    "sun397": "SUN397",
    "stanfordcars": "StanfordCars",
    "ucf101": "UCF101",
}
#: MIEB's zero-shot task of each dataset: its classification task's name + ``ZeroShot`` (none for
#: Oxford Flowers)
ZERO_SHOT = {k: v.removesuffix("Classification") + "ZeroShot" for k, v in MIEB_TASKS.items() if k != "oxfordflowers"}
NOTE = "featcache's own features, splits and protocol; dataset_revision is featcache's store fingerprint, not mteb's"
DEFAULT = ("probe", "full")  # the (kind, protocol) written outside experiments/


#: the kinds that classify (a retrieval run keeps featcache's dataset name: MIEB's task classifies)
CLASSIFY = ("probe", "knn", "finetune")


def task_name(dataset: str, protocol: str, kind: str = "probe") -> str:
    """MIEB's task name for a classification run on a dataset MIEB registers, else ``dataset``."""
    key = re.sub(r"[^a-z0-9]", "", dataset.lower())
    if kind not in CLASSIFY:
        return dataset
    return (ZERO_SHOT if protocol == "zeroshot" else MIEB_TASKS).get(key, dataset)


def model_name(run: Run, org: str) -> str:
    return f"{org}/{safe_name(run.backbone)}"


def model_meta(name: str, revision: str) -> dict[str, Any]:
    """``ModelMeta.to_dict()`` of an image encoder known by name and revision only."""
    none = dict.fromkeys(
        [
            "release_date",
            "languages",
            "n_parameters",
            "n_active_parameters_override",
            "n_embedding_parameters",
            "memory_usage_mb",
            "max_tokens",
            "embed_dim",
            "license",
            "open_weights",
            "public_training_code",
            "public_training_data",
        ]
    )
    tail = dict.fromkeys(
        ["reference", "similarity_fn_name", "use_instructions", "training_datasets", "adapted_from", "superseded_by"]
    )
    return {
        "loader_kwargs": {},
        "name": name,
        "revision": revision,
        **none,
        "framework": ["PyTorch"],
        **tail,
        "modalities": ["image"],
        "model_type": ["dense"],
        **dict.fromkeys(["citation", "contacts", "experiment_kwargs", "output_dtypes", "extra_requirements_groups"]),
        "loader": None,
        "is_cross_encoder": False,
    }


def main_metric(run: Run) -> str:
    declared = run.hparams.get("task_metric")
    if isinstance(declared, str) and declared in run.metrics:
        return declared
    return "top1" if "top1" in run.metrics else next(iter(run.metrics))


def experiment(run: Run) -> dict[str, Any]:
    """One run's scores as an entry of MTEB's ``scores_per_experiment``."""
    main = main_metric(run)
    scores: dict[str, Any] = {"accuracy": run.metrics["top1"]} if "top1" in run.metrics else {}
    scores.update({m: v for m, v in run.metrics.items() if m != "top1"})
    return {**scores, "main_score": run.metrics[main], BLOCK: json.dumps(run.provenance(), sort_keys=True)}


def split_entry(runs: Sequence[Run]) -> dict[str, Any]:
    """The ``default`` subset of one split: the mean over the runs (seeds) of each score."""
    exps = [experiment(r) for r in runs]
    keys = [k for k in exps[0] if k != BLOCK and all(finite(e.get(k)) for e in exps)]
    mean = {k: sum(e[k] for e in exps) / len(exps) for k in keys}
    return {
        **mean,
        "hf_subset": "default",
        "languages": ["eng-Latn"],  # as every MIEB image task declares (get_score counts no entry without one)
        "scores_per_experiment": exps,
        "featcache_note": NOTE,
    }


def round_scores(scores: Any, n: int = 6) -> Any:
    """``TaskResult._round_scores`` (mteb 2.26.24, mteb/results/task_result.py:360): floats in
    dicts and lists, recursively, rounded to ``n`` places."""
    if isinstance(scores, dict):
        return {k: round_scores(v, n) for k, v in scores.items()}
    if isinstance(scores, list):
        return [round_scores(v, n) for v in scores]
    return round(scores, n) if isinstance(scores, float) else scores


def task_result(runs: Sequence[Run]) -> dict[str, Any]:
    """The TaskResult (``to_disk``'s JSON object) of one backbone's runs on one dataset."""
    first = runs[0]
    name = task_name(first.dataset, first.protocol, first.kind)
    splits = by(runs, "eval_split")
    created = max(datetime.fromisoformat(r.created_at) for r in runs if r.created_at)
    return {
        "dataset_revision": f"featcache:{first.store_fingerprint}",
        "task_name": name,
        "mteb_version": None,
        "scores": round_scores({s[0] or "test": [split_entry(rs)] for s, rs in splits.items()}),
        "evaluation_time": sum(r.fit_seconds or 0.0 for r in runs),
        "kg_co2_emissions": None,
        "date": created.timestamp(),
        "evaluation_phases": None,
    }


def write(runs: Sequence[Run], ctx: ExportContext) -> tuple[list[Path], list[str]]:
    """``results/{org__name}/{revision}/[experiments/{kind-protocol}/]{Task}.json`` per backbone,
    kind, protocol and dataset; ``model_meta.json`` in each revision folder."""
    files, skipped = [], []
    keep = [r for r in runs if r.kind not in ("similarity", "audit")]
    skipped += [
        f"run {r.run_id} ({r.kind}): no MTEB task scores one backbone's {r.kind}" for r in runs if r not in keep
    ]
    for (_, kind, protocol, _), group in by(keep, "backbone", "kind", "protocol", "dataset").items():
        name, revision = model_name(group[0], ctx.org), group[0].weights_sha256 or "no_revision_available"
        folder = ctx.out / "results" / name.replace("/", "__").replace(" ", "_") / revision
        folder.mkdir(parents=True, exist_ok=True)
        meta = folder / "model_meta.json"
        if not meta.exists():
            meta.write_text(json.dumps(model_meta(name, revision), default=str, indent=4), encoding="utf-8")
            files.append(meta)
        if (kind, protocol) != DEFAULT:
            folder = folder / "experiments" / safe_name(f"{kind}-{protocol}")
            folder.mkdir(parents=True, exist_ok=True)
        res = task_result(group)
        path = folder / f"{res['task_name']}.json"
        path.write_text(json.dumps(res, indent=2), encoding="utf-8")
        files.append(path)
    return files, skipped


def read_task(path: Path, backbone: str, revision: str) -> Imported:
    """The rows of one ``{Task}.json``: each featcache experiment as it was, or (a file mteb
    wrote) one row per split from its ``accuracy``, kind probe, protocol ``mteb``."""
    data, got = read_json(path), Imported()
    if not isinstance(data, dict) or not isinstance(data.get("scores"), dict) or "task_name" not in data:
        got.problems.append(f"{path}: field 'scores' or 'task_name' missing: not an MTEB TaskResult")
        return got
    sha = file_sha256(path)
    for split, entries in data["scores"].items():
        for i, entry in enumerate(entries if isinstance(entries, list) else []):
            where = f"{path}: field 'scores.{split}[{i}]"
            exps = [e for e in entry.get("scores_per_experiment") or [] if isinstance(e, dict) and BLOCK in e]
            if exps:
                for e in exps:
                    got.extend(_ours(e, where, path, sha))
            elif finite(entry.get("accuracy")):
                base = _foreign_base(data, split, entry, backbone, revision)
                got.rows += external_rows(base, {"top1": entry["accuracy"]}, fmt=NAME, path=path, sha=sha)
            else:
                got.problems.append(f"{where}.accuracy' missing: featcache reads classification accuracy")
    return got


def _ours(exp: dict[str, Any], where: str, path: Path, sha: str) -> Imported:
    got = Imported()
    block = json.loads(exp[BLOCK])
    metrics = {
        m: exp["accuracy" if m == "top1" else m] for m in block["metrics"] if ("accuracy" if m == "top1" else m) in exp
    }
    bad = [m for m, v in metrics.items() if not finite(v)]
    if bad or not metrics:
        got.problems.append(f"{where}.{bad[0] if bad else 'main_score'}' is not a number")
        return got
    got.rows += external_rows(block, metrics, fmt=NAME, path=path, sha=sha)
    return got


def _foreign_base(data: dict[str, Any], split: str, entry: dict[str, Any], backbone: str, revision: str) -> dict:
    name = data["task_name"]
    datasets = {v: k for k, v in MIEB_TASKS.items()} | {v: k for k, v in ZERO_SHOT.items()}
    return {
        "kind": "probe",
        "backbone": backbone,
        "dataset": datasets.get(name, name),
        "protocol": "zeroshot" if name in ZERO_SHOT.values() else "mteb",
        "eval_split": split,
        "fit_seconds": data.get("evaluation_time"),
        "hparams": {
            "mteb_task": name,
            "model_revision": revision,
            "dataset_revision": data.get("dataset_revision"),
            "mteb_version": data.get("mteb_version"),
            "hf_subset": entry.get("hf_subset"),
        },
    }


def read(path: Path) -> Imported:
    """Every ``{Task}.json`` under ``path`` (a results folder, a model's or a revision's folder,
    or one file); the backbone is ``model_meta.json``'s name, else the model folder's."""
    path, got = Path(path), Imported()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.json") if p.name != "model_meta.json")
    for f in files:
        rev_dir = f.parent.parent.parent if f.parent.parent.name == "experiments" else f.parent
        meta = rev_dir / "model_meta.json"
        name = read_json(meta).get("name") if meta.exists() else None
        got.extend(read_task(f, name or rev_dir.parent.name.replace("__", "/"), rev_dir.name))
    return got


def detect(path: Path) -> bool:
    if path.is_dir():
        return any(path.rglob("model_meta.json")) or any(
            "task_name" in read_json(p) for p in list(path.rglob("*/*.json"))[:1]
        )
    return path.suffix == ".json" and isinstance(d := read_json(path), dict) and {"task_name", "scores"} <= set(d)


FORMAT = ResultFormat(write=write, read=read, detect=detect)
