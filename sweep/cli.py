"""``featcache sweep``: the evaluation grid on Dask."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "sweep",
        help="run the probe/retrieval/fine-tune grid on Dask",
        description="Expand backbones x datasets x protocols x seeds (and retrieval setups and fine-tunes) from the "
        "store catalog into work items and run the ones not yet in the results table on "
        "dask.distributed: an in-process LocalCluster by default, or an existing scheduler.",
    )
    p.add_argument("--cache", required=True, help="feature store path or URL (workers read it themselves)")
    p.add_argument("--results", required=True, help="results parquet to append to")
    p.add_argument("--backbone", action="append", default=[], help="backbone key (repeatable; default: all)")
    p.add_argument("--dataset", action="append", default=[], help="dataset (repeatable; default: all)")
    p.add_argument(
        "--protocol",
        action="append",
        default=[],
        help="probe protocol, e.g. full, fewshot:5, vtab1k (repeatable; default: full, or none with --retrieval)",
    )
    p.add_argument("--seeds", help="comma-separated seeds (default: each protocol's defaults)")
    p.add_argument("--retrieval", action="store_true", help="add a retrieval + k-NN run per backbone and dataset")
    ft = p.add_argument_group(
        "fine-tunes",
        "one item per backbone, dataset and seed, with the model and weights the store's "
        "provenance records for the backbone (backbones whose weights cannot be loaded again are left "
        "out, with a warning) and the backbone's extraction input size unless --ft-input-size; the "
        "paired probe protocol (protocol registry) is added to the probes",
    )
    ft.add_argument(
        "--finetune",
        action="append",
        default=[],
        metavar="PROTOCOL",
        help="fine-tune protocol, e.g. vtab1k-light or full (repeatable)",
    )
    ft.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=SPEC",
        help="images of dataset NAME for the fine-tunes (required for each swept dataset: "
        "the store does not record where its images are), e.g. digits=digits, "
        "fmnist=fashion-mnist, pets=imagefolder:DIR",
    )
    ft.add_argument("--ft-steps", help="comma-separated schedule lengths (scaled-down run; default: the protocol's)")
    ft.add_argument("--ft-lrs", help="comma-separated learning rates (default: the protocol's)")
    ft.add_argument("--ft-batch-size", type=int, help="SGD batch (default: the protocol's)")
    ft.add_argument("--ft-input-size", type=int, help="input resolution (default: the extraction's)")
    ft.add_argument("--ft-limit", type=int, help="first N images of every split")
    p.add_argument(
        "--scheduler",
        help="address of a running Dask scheduler (default: $DASK_SCHEDULER_ADDRESS, else an in-process LocalCluster)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="LocalCluster worker processes (default 2; 0: run here, one item at a time)",
    )
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


def _data(pairs: list[str]) -> dict[str, str]:
    from featcache.errors import SweepError

    out = {}
    for text in pairs:
        name, sep, spec = text.partition("=")
        if not sep or not name.strip() or not spec.strip():
            raise SweepError(f"--data takes NAME=SPEC, e.g. digits=digits (got {text!r})")
        out[name.strip()] = spec.strip()
    return out


def _finetune_options(args: argparse.Namespace) -> dict:
    from featcache.configs import float_list, int_list

    opts = {
        "steps": args.ft_steps and int_list(args.ft_steps),
        "lrs": args.ft_lrs and float_list(args.ft_lrs),
        "batch_size": args.ft_batch_size,
        "input_size": args.ft_input_size,
        "limit": args.ft_limit,
    }
    return {k: v for k, v in opts.items() if v is not None}


def run(args: argparse.Namespace) -> int:
    import logging

    from featcache.results import check_results_path
    from featcache.sweep import SweepConfig, plan, run_sweep

    check_results_path(args.results)
    if not args.verbose:  # the cluster's start/stop chatter (distributed sets INFO on import)
        import distributed  # noqa: F401

        logging.getLogger("distributed").setLevel(logging.WARNING)
    protocols = tuple(args.protocol) or (() if args.retrieval or args.finetune else ("full",))
    config = SweepConfig(
        cache=args.cache,
        results_path=args.results,
        backbones=tuple(args.backbone),
        datasets=tuple(args.dataset),
        protocols=protocols,
        seeds=_seeds(args.seeds),
        retrieval=args.retrieval,
        finetune=tuple(args.finetune),
        data=tuple(_data(args.data).items()),
        finetune_options=tuple(_finetune_options(args).items()),
        scheduler=args.scheduler,
        workers=args.workers,
        force=args.force,
    )
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
