"""``featcache sweep``: the evaluation grid on Dask."""

from __future__ import annotations

import argparse
from typing import Any

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 80

#: SweepConfig fields whose flags are in the "fine-tunes" group
_FT_FIELDS = ("finetune", "data")


def register(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="run the probe/retrieval/fine-tune grid on Dask",
        description="Expand backbones x datasets x protocols x seeds (and retrieval setups and fine-tunes) from the "
        "store catalog into work items and run the ones not yet in the results table on "
        "dask.distributed: an in-process LocalCluster by default, or an existing scheduler.",
    )
    from featcache.core.configs import add_arguments
    from featcache.sweep.planner import FinetuneFlags, SweepConfig

    add_arguments(p, SweepConfig, skip=_FT_FIELDS)  # every flag comes from the config's fields
    ft = p.add_argument_group(
        "fine-tunes",
        "one item per backbone, dataset and seed, with the model and weights the store's "
        "provenance records for the backbone (backbones whose weights cannot be loaded again are left "
        "out, with a warning) and the backbone's extraction input size unless --ft-input-size; the "
        "paired probe protocol (protocol registry) is added to the probes",
    )
    add_arguments(ft, SweepConfig, only=_FT_FIELDS)
    add_arguments(ft, FinetuneFlags)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    from featcache.core.tracking import add_track_argument

    add_track_argument(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The :class:`~featcache.sweep.SweepConfig` of parsed ``featcache sweep`` arguments."""
    from featcache.core.configs import from_namespace
    from featcache.sweep.planner import FinetuneFlags, SweepConfig

    extra: dict[str, Any] = {"finetune_options": from_namespace(FinetuneFlags, args).options()}
    if not hasattr(args, "protocols") and (args.retrieval or hasattr(args, "finetune") or hasattr(args, "dense")):
        extra["protocols"] = ()  # no --protocol: retrieval, fine-tunes and dense protocols only
    return from_namespace(SweepConfig, args, **extra)


def run(args: argparse.Namespace) -> int:
    import logging

    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.sweep import plan, run_sweep

    check_results_path(args.results_path)
    tracking = open_tracking(args.track, args.results_path)
    if not args.verbose:  # the cluster's start/stop chatter (distributed sets INFO on import)
        import distributed  # noqa: F401

        logging.getLogger("distributed").setLevel(logging.WARNING)
    config = config_from_args(args)
    if args.dry_run:
        p = plan(config)
        for it in p.items:
            print(f"run   {it.run_id}  {it.label}")
        for it in p.done:
            print(f"done  {it.run_id}  {it.label}")
        return 0
    report = run_sweep(config, progress=not args.quiet, tracking=tracking)
    for o in report.failed:
        print(f"FAILED {o.run_id}  {o.label}: {o.error}")
    print(f"{report.summary()} -> {config.results_path}")
    return 1 if report.failed else 0
