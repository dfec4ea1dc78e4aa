"""``featcache finetune``: fine-tune a backbone + linear head, write ``kind="finetune"`` rows.

Every flag comes from :class:`~featcache.finetune.config.FinetuneConfig`'s fields; the
command builds the config, tunes the CPU allocator for its own process (never a library
call's side effect) and calls :func:`featcache.finetune.runner.finetune`.
"""

from __future__ import annotations

import argparse

from featcache.core.configs import add_arguments, from_namespace
from featcache.core.tracking import add_track_argument
from featcache.finetune.config import FinetuneConfig, selection_metrics

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 30


def add_finetune_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p, FinetuneConfig)
    for action in p._actions:  # --suite gives the data per task
        if action.dest == "data":
            action.required = False
    p.set_defaults(resize=None)  # None: the suite's (VTAB: whole-tf1), else timm
    from featcache.suites import suite_names

    p.add_argument(
        "--suite",
        default=None,
        help=f"fine-tune on every task of a suite ({suite_names()}; see `featcache suites`) whose "
        "data is under --data-root; the suite's resize and input size unless given",
    )
    p.add_argument("--data-root", default=None, help="with --suite: folder holding one entry per task (as extract)")
    add_track_argument(p)


def config_from_args(args: argparse.Namespace, **overrides) -> FinetuneConfig:
    """The :class:`FinetuneConfig` of parsed ``featcache finetune`` arguments."""
    from featcache.errors import ConfigError

    if not (overrides.get("data") or args.data):
        raise ConfigError("give --data SPEC (one dataset) or --suite NAME --data-root DIR (see `featcache suites`)")
    progress = getattr(args, "progress", True) and not getattr(args, "no_progress", False)  # -q: none
    return from_namespace(FinetuneConfig, args, **{"resize": args.resize or "timm", "progress": progress, **overrides})


def suite_configs(args: argparse.Namespace) -> list[FinetuneConfig]:
    """One :class:`FinetuneConfig` per task of ``--suite`` whose data is under ``--data-root``
    (dataset key = task name, or ``<--dataset-name>-<task>`` as extract); VTAB-1k file lists
    train on train800 and select on val200; each selects on its task's metric (one of
    :func:`selection_metrics`; multi-label tasks are skipped); the missing tasks are named in one warning."""
    from featcache.data import official_val
    from featcache.errors import ConfigError
    from featcache.suites import load_suite, present_tasks, warn_missing

    if args.data:
        raise ConfigError("give either --data (one dataset) or --suite with --data-root, not both")
    suite = load_suite(args.suite)
    kw = {"resize": args.resize or suite.resize, "input_size": args.input_size or suite.input_size}
    prefix = f"{args.dataset_name}-" if args.dataset_name else ""
    configs = []
    for task, spec in present_tasks(suite, args.data_root):
        splits = {}
        pair = official_val(spec)  # the format's own (train, val) pair, e.g. VTAB-1k's train800/val200
        if pair and (args.train_split, args.val_split) == (FinetuneConfig.train_split, FinetuneConfig.val_split):
            splits = {"train_split": pair[0], "val_split": pair[1], "val_source": "official-val"}
        if task.metric not in selection_metrics():
            warn_missing(suite, [task.name], f"declare {task.metric}, which fine-tuning cannot select on")
            continue
        configs.append(
            config_from_args(
                args, data=spec, dataset_name=prefix + task.name, metric=args.metric or task.metric, **kw, **splits
            )
        )
    return configs


def run_finetune(args: argparse.Namespace) -> int:
    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.finetune.runner import finetune

    if args.suite:
        configs = suite_configs(args)
    elif args.data_root:
        from featcache.errors import ConfigError

        raise ConfigError("--data-root goes with --suite NAME; for one dataset give --data SPEC")
    else:
        configs = [config_from_args(args)]
    cfg = configs[0]
    check_results_path(cfg.results_path)  # a bad --results fails before any compute
    tracking = open_tracking(args.track, cfg.results_path)
    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # CPU training allocates the same large activations every step
        from featcache.core.allocator import tune_cpu_allocator

        tune_cpu_allocator()
    for cfg in configs:
        rows = finetune(cfg)
        if tracking is not None:  # after the rows are written: a tracker never costs a result
            tracking.log_rows("finetune", rows, cfg)
        _print_rows(rows, cfg)
    return 0


def _print_rows(out, cfg: FinetuneConfig) -> None:
    import json

    import polars as pl

    from featcache.core.formatting import format_table

    top = out.filter(out["metric"] == "top1").sort(["eval_split", "seed"])
    hp = [json.loads(h) for h in top["hparams"]]
    steps = [h.get("steps") for h in hp]
    table = top.select("backbone", "dataset", "protocol", pl.col("eval_split").alias("split")).with_columns(
        seed=pl.Series([("med" if s < 0 else str(s)) for s in top["seed"]], dtype=pl.Utf8),
        top1=top["value"],
        lr=pl.Series([h.get("lr") for h in hp], dtype=pl.Float64),
        steps=pl.Series([s if isinstance(s, int) else None for s in steps], dtype=pl.Int64),
    )
    print(format_table(table, "text", floatfmt="{:.4f}"), end="")
    print(f"{out.height} row(s) in {cfg.results_path}")


def register(sub) -> None:
    p = sub.add_parser("finetune", help="fine-tune a backbone + linear head (VTAB lightweight protocol)")
    add_finetune_arguments(p)
    p.set_defaults(func=run_finetune)
