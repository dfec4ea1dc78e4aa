"""The Hugging Face model card's ``model-index``, written and read with huggingface_hub's own
``ModelCardData``/``EvalResult`` (``eval_results_to_model_index``, ``metadata_load``,
``model_index_to_eval_results``): ``{out}/{backbone}/README.md`` whose YAML front matter holds
``model-index: [{name, results: [{task: {type, name}, dataset: {type, name, split}, metrics:
[{type, value, name, args}]}]}]``. ``task.type`` is a Hub task id (``image-classification``,
``zero-shot-image-classification``, ``image-feature-extraction`` for retrieval); top-1 is the
Hub's ``accuracy`` (a fraction); each metric's ``args.featcache`` holds featcache's provenance as a JSON string (the
Hub's YAML drops null values)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from featcache.interop.formats import ExportContext, ResultFormat
from featcache.interop.runs import BLOCK, Imported, Run, by, external_rows, file_sha256, finite, safe_name

NAME = "model-index"
METRIC_TYPES = {"top1": "accuracy"}
TASK_TYPES = {"retrieval": "image-feature-extraction"}
KINDS = {"probe": "Linear probe", "knn": "k-NN classification", "finetune": "Fine-tuning", "retrieval": "Retrieval"}


def task_type(run: Run) -> str:
    if run.protocol == "zeroshot":
        return "zero-shot-image-classification"
    return TASK_TYPES.get(run.kind, "image-classification")


def eval_results(run: Run) -> list[Any]:
    """huggingface_hub ``EvalResult``s of one run, one per metric."""
    from huggingface_hub import EvalResult

    block = run.provenance()
    return [
        EvalResult(
            task_type=task_type(run),
            task_name=f"{KINDS.get(run.kind, run.kind)} ({run.protocol})",
            dataset_type=run.dataset,
            dataset_name=run.dataset,
            dataset_split=run.eval_split or None,
            metric_type=METRIC_TYPES.get(m, m),
            metric_value=v,
            metric_name=f"{m} ({run.protocol}, seed {run.seed})",
            metric_args={BLOCK: json.dumps({**block, "metric": m}, sort_keys=True)},
        )
        for m, v in run.metrics.items()
    ]


def card_text(backbone: str, runs: Sequence[Run], org: str) -> str:
    from huggingface_hub import ModelCardData

    evals = [e for r in runs for e in eval_results(r)]
    data = ModelCardData(model_name=f"{org}/{safe_name(backbone)}", eval_results=evals, tags=["featcache"])
    return (
        f"---\n{data.to_yaml()}\n---\n\n# {backbone}\n\nEvaluation results written by featcache "
        "from cached features (probe, retrieval and fine-tuning runs); each metric's `args` hold the run's provenance.\n"
    )


def write(runs: Sequence[Run], ctx: ExportContext) -> tuple[list[Path], list[str]]:
    """``{out}/{backbone}/README.md`` per backbone."""
    keep = [r for r in runs if r.kind not in ("similarity", "audit")]
    skipped = [f"run {r.run_id} ({r.kind}): a model card's model-index scores one model" for r in runs if r not in keep]
    files = []
    for (backbone,), group in by(keep, "backbone").items():
        folder = ctx.out / safe_name(backbone)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "README.md"
        path.write_text(card_text(backbone, group, ctx.org), encoding="utf-8")
        files.append(path)
    return files, skipped


def read_one(path: Path) -> Imported:
    from huggingface_hub import metadata_load
    from huggingface_hub.repocard_data import model_index_to_eval_results

    got, meta = Imported(), metadata_load(path) or {}
    if not meta.get("model-index"):
        got.problems.append(f"{path}: field 'model-index' missing from the card's YAML")
        return got
    name, evals = model_index_to_eval_results(meta["model-index"])
    sha = file_sha256(path)
    for i, e in enumerate(evals):
        block = (e.metric_args or {}).get(BLOCK)
        block = json.loads(block) if isinstance(block, str) else block
        v = e.metric_value
        if not finite(v) or (block is None and e.metric_type == "accuracy" and not 0 <= v <= 1):
            got.problems.append(f"{path}: field 'results[{i}].metrics.{e.metric_type}.value' is {v!r}, not a fraction")
            continue
        if block is None:
            if e.metric_type != "accuracy":
                got.problems.append(
                    f"{path}: field 'results[{i}].metrics.type' is {e.metric_type!r}; featcache reads accuracy"
                )
                continue
            block = foreign_base(name, e)
        metric = block.get("metric", "top1")
        got.rows += external_rows(block, {metric: v}, fmt=NAME, path=path, sha=sha)
    return got


def foreign_base(name: str, e: Any) -> dict[str, Any]:
    """The run-level columns of a card featcache did not write: the model's own result on the
    dataset (kind finetune, protocol ``model-card``)."""
    kind = "probe" if e.task_type == "zero-shot-image-classification" else "finetune"
    return {
        "kind": kind,
        "backbone": name,
        "dataset": e.dataset_type,
        "protocol": "zeroshot" if kind == "probe" else "model-card",
        "eval_split": e.dataset_split or "",
        "hparams": {"task_type": e.task_type, "dataset_name": e.dataset_name, "dataset_revision": e.dataset_revision},
    }


def read(path: Path) -> Imported:
    """A model card, or every ``README.md`` under a folder."""
    got = Imported()
    for p in [Path(path)] if Path(path).is_file() else sorted(Path(path).rglob("README.md")):
        got.extend(read_one(p))
    return got


def detect(path: Path) -> bool:
    files = [path] if path.is_file() else sorted(path.rglob("README.md"))[:1]
    return bool(files) and files[0].suffix == ".md" and "model-index:" in files[0].read_text(encoding="utf-8")


FORMAT = ResultFormat(write=write, read=read, detect=detect)
