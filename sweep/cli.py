"""``featcache sweep``: the evaluation grid on Dask."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "sweep", help="run the probe/retrieval grid on Dask",
        description="Expand backbones x datasets x protocols x seeds (and retrieval setups) from the "
        "store catalog into work items and run the ones not yet in the results table on "
        "dask.distributed: an in-process LocalCluster by default, or an existing scheduler.")
    p.add_argument("--cache", required=True, help="feature store path or URL (workers read it themselves)")
    p.add_argument("--results", required=True, help="results parquet to append to")
    p.add_argument("--backbone", action="append", default=[], help="backbone key (repeatable; default: all)")
    p.add_argument("--dataset", action="append", default=[], help="dataset (repeatable; default: all)")
    p.add_argument("--protocol", action="append", default=[],
                   help="probe protocol, e.g. full, fewshot:5, vtab1k (repeatable; default: full, "
                   "or none with --retrieval)")
    p.add_argument("--seeds", help="comma-separated seeds (default: each protocol's defaults)")
    p.add_argument("--retrieval", action="store_true", help="add a retrieval + k-NN run per backbone and dataset")
    p.add_argument("--scheduler", help="address of a running Dask scheduler (default: $DASK_SCHEDULER_ADDRESS, "
                   "else an in-process LocalCluster)")
    p.add_argument("--workers", type=int, default=2,
                   help="LocalCluster worker processes (default 2; 0: run here, one item at a time)")
    p.add_argument("--force", action="store_true", help="rerun items already done")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.set_defaults(func=run)


def _seeds(text: str | None):
    from featcache.errors import SweepError

    if text is None:
        return None
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise SweepError(f"--seeds must be comma-separated integers, e.g. 0,1,2 (got {text!r})") from None


def run(args: argparse.Namespace) -> int:
    import logging

    from featcache.results import check_results_path
    from featcache.sweep import SweepConfig, plan, run_sweep

    check_results_path(args.results)
    if not args.verbose:  # the cluster's start/stop chatter (distributed sets INFO on import)
        import distributed  # noqa: F401

        logging.getLogger("distributed").setLevel(logging.WARNING)
    protocols = tuple(args.protocol) or (() if args.retrieval else ("full",))
    config = SweepConfig(cache=args.cache, results=args.results, backbones=tuple(args.backbone),
                         datasets=tuple(args.dataset), protocols=protocols, seeds=_seeds(args.seeds),
                         retrieval=args.retrieval, scheduler=args.scheduler, workers=args.workers,
                         force=args.force)
    if args.dry_run:
        p = plan(config)
        for it in p.items:
            print(f"run   {it.run_id}  {it.label}")
        for it in p.done:
            print(f"done  {it.run_id}  {it.label}")
        return 0
    report = run_sweep(config, progress=not args.quiet)
    for o in report.failed:
        print(f"FAILED {o.run_id}  {o.label}: {o.error}")
    print(f"{report.summary()} -> {args.results}")
    return 1 if report.failed else 0
