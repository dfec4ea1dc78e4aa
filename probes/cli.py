"""``featcache probe``: linear probes from the cache into a results table."""

from __future__ import annotations

import argparse

from featcache.core.configs import add_arguments, from_namespace
from featcache.core.tracking import add_track_argument
from featcache.probes.config import ProbeConfig

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 50


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "probe",
        help="linear-probe cached features with a published protocol",
        description="Fit linear probes on cached features (C selected on validation only, "
        "test read once per final fit) and append one row per (run, metric) to a results table.",
    )
    p.add_argument(
        "--cache",
        required=True,
        action="append",
        help="feature cache path or URL (repeatable: each backbone is read from the first cache holding it)",
    )
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--backbone", action="append", help="backbone key (repeatable)")
    who.add_argument("--all", action="store_true", help="every backbone with features for --dataset")
    add_arguments(p, ProbeConfig)  # every other flag comes from the config's fields
    add_solver_arguments(p)  # and from each registered solver's options
    optional_flag(p, "dataset")  # --suite names the datasets instead
    from featcache.suites import suite_names

    p.add_argument(
        "--suite",
        default=None,
        help=f"probe every task of a suite ({suite_names()}; see `featcache suites`) held in "
        "the cache, each selected on its declared metric; VTAB-1k lists: train800/val200",
    )
    p.add_argument(
        "--dataset-name",
        default=None,
        metavar="PREFIX",
        help="with --suite: the prefix extract --suite --dataset-name used (datasets PREFIX-<task>)",
    )
    add_track_argument(p)
    p.set_defaults(func=run)


def add_solver_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per option field of the registered solvers (a field several solvers read,
    e.g. ``--epochs``, once: as the first of them declares it)."""
    from featcache.probes.solvers import SOLVERS, option_fields

    for name, (_, owners) in option_fields().items():
        add_arguments(p, SOLVERS[owners[0]].options, only=(name,))


def solver_options_of(args: argparse.Namespace) -> dict:
    """The solver options on a parsed command line (every registered solver's; ``ProbeConfig``
    keeps the protocol's solver's and drops the others at their defaults)."""
    from featcache.probes.solvers import option_fields

    return {name: getattr(args, name) for name in option_fields() if hasattr(args, name)}


def optional_flag(p: argparse.ArgumentParser, dest: str) -> None:
    """Make the config flag ``dest`` optional on the command line (``--suite`` fills it per task)."""
    for action in p._actions:
        if action.dest == dest:
            action.required = False


def config_from_args(args: argparse.Namespace, **overrides) -> ProbeConfig:
    """The :class:`ProbeConfig` of parsed ``featcache probe`` arguments."""
    from featcache.errors import ConfigError

    if getattr(args, "dataset", None) is None and "dataset" not in overrides:
        raise ConfigError("give --dataset KEY (one dataset) or --suite NAME (every suite task in the cache)")
    progress = getattr(args, "progress", True) and not getattr(args, "no_progress", False)  # -q: none
    return from_namespace(
        ProbeConfig,
        args,
        cache=args.cache if len(args.cache) > 1 else args.cache[0],
        backbones="all" if args.all else args.backbone,
        **{"progress": progress, "options": solver_options_of(args), **overrides},
    )


def suite_configs(args: argparse.Namespace) -> list[ProbeConfig]:
    """One :class:`ProbeConfig` per task of ``--suite`` held in a ``--cache`` (dataset key =
    task name or ``<--dataset-name>-<task>``): the task's metric (the one recorded in the
    store, else the suite's; ``--metric`` forces one), VTAB-1k's train800/val200 where the
    store holds them; the missing tasks are named in one warning, none present is an error."""
    from featcache.errors import ConfigError, NotInStoreError
    from featcache.store import open_cache, task_metric
    from featcache.suites import load_suite, warn_missing

    if getattr(args, "dataset", None):
        raise ConfigError("give either --dataset KEY or --suite NAME, not both (--dataset-name sets a prefix)")
    suite = load_suite(args.suite)
    held = {}
    for c in map(open_cache, args.cache):
        held.update({d: c for d in c.datasets() if d not in held})
    prefix = f"{args.dataset_name}-" if args.dataset_name else ""
    configs = []
    tasks = [t for t in suite.tasks if t.kind == "classification"]  # retrieval tasks: featcache retrieve
    for task in tasks:
        ds = prefix + task.name
        if ds in held:
            kw = {}
            if {"train800", "val200"} <= set(held[ds].splits(ds)) and (args.train_split, args.val_split) == (
                ProbeConfig.train_split,
                ProbeConfig.val_split,
            ):
                kw = {"train_split": "train800", "val_split": "val200", "val_source": "official-val"}
            metric = args.metric or (None if task_metric(held[ds], ds) else task.metric)
            configs.append(config_from_args(args, dataset=ds, metric=metric, **kw))
    if not configs:
        raise NotInStoreError(
            f"no task of suite {suite.name} is in {', '.join(args.cache)} (expected datasets "
            f"{prefix}{suite.tasks[0].name}, ...); run `featcache extract --suite {suite.name}` first"
        )
    warn_missing(suite, [t.name for t in tasks if prefix + t.name not in held], f"are not in {', '.join(args.cache)}")
    return configs


def run(args: argparse.Namespace) -> int:
    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.probes.runner import run_probes

    configs = suite_configs(args) if args.suite else [config_from_args(args)]
    check_results_path(configs[0].results_path)  # a bad --results fails before any compute
    tracking = open_tracking(args.track, configs[0].results_path)
    for cfg in configs:
        df = run_probes(cfg)
        if tracking is not None:  # after the rows are written: a tracker never costs a result
            tracking.log_rows("probe", df, cfg)
        if args.suite:
            print(f"{cfg.dataset} (train {cfg.train_split}, metric {cfg.metric or 'from the store'}):")
        print(format_table(df))
        print(f"{df['run_id'].n_unique()} run(s) -> {cfg.results_path}")
    return 0


def format_table(df) -> str:
    """Small wide table: one line per run, the metrics as columns."""
    import json

    import polars as pl

    from featcache.core.formatting import format_table as render

    if df.height == 0:
        return "(no results)"
    sel = df.with_columns(
        pl.col("hparams").map_elements(lambda h: _hp_short(json.loads(h)), return_dtype=pl.Utf8).alias("selected")
    )
    wide = sel.pivot(
        on="metric",
        index=["backbone", "protocol", "eval_split", "seed", "selected", "converged"],
        values="value",
        aggregate_function="first",
    )
    metric_cols = [
        c for c in ("top1", "top5", "mean_per_class", "map11", "roc_auc_macro", "nll", "ece") if c in wide.columns
    ]
    wide = wide.sort(["backbone", "eval_split", "seed"])
    cols = ["backbone", "protocol", "eval_split", "seed", "selected", "converged", *metric_cols]
    return render(wide.select(cols), "text", floatfmt="{:.4f}").rstrip("\n")


def _hp_short(h: dict) -> str:
    if "layer_role" in h:  # a layer sweep's row (probes.layer_sweep): its layer, * where selected
        star = " *selected*" if h["layer_role"] == "selected" else ""
        return f"{h['layer_kind']}{star} " + _hp_short({k: v for k, v in h.items() if k != "layer_role"})
    if h.get("aggregate"):
        return f"median of seeds {h.get('seeds')}"
    if "C" in h:
        return f"C={h['C']:.3g}"
    if "lr" in h:
        return f"lr={h['lr']:g}"
    return ""
