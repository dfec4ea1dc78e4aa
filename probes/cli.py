"""``featcache probe``: linear probes from the cache into a results table."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "probe",
        help="linear-probe cached features with a published protocol",
        description="Fit linear probes on cached features (C selected on validation only, "
        "test read once per final fit) and append one row per (run, metric) to a results table.",
    )
    p.add_argument("--cache", required=True, action="append",
                   help="feature cache path or URL (repeatable: each backbone is read from the "
                   "first cache holding it)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--backbone", action="append", help="backbone key (repeatable)")
    who.add_argument("--all", action="store_true", help="every backbone with features for --dataset")
    p.add_argument("--dataset", required=True)
    p.add_argument("--protocol", default="full",
                   help="full | fewshot:N | vtab1k | vtab1k-sgd | salman | subset:F%% (default: full)")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds (default 0,1,2 for fewshot/vtab1k, else 0)")
    p.add_argument("--backend", default="auto", choices=["auto", "sklearn", "cuml", "torch"])
    p.add_argument("--results", required=True, help="results parquet to append to")
    p.add_argument("--force", action="store_true", help="re-run runs already in the results table")
    p.add_argument("--eval-split", action="append", default=None,
                   help="split(s) to evaluate on (repeatable; default: test)")
    p.add_argument("--train-split", default="train")
    p.add_argument("--val-split", default="val",
                   help="the dataset's own validation split, used when present (default: val)")
    p.add_argument("--val-source", default="split-800-200", choices=["split-800-200", "official-val"],
                   help="vtab1k selection data (the paper's two readings)")
    p.add_argument("--head-init", default=None,
                   help="name of a class-embedding matrix stored beside the dataset (ELEVATER)")
    p.add_argument("--max-iter", type=int, default=1000)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--no-standardize", action="store_true",
                   help="fit on raw features (default: z-score with training statistics)")
    p.add_argument("--epochs", type=int, default=150, help="salman: SGD epochs (paper: 150)")
    p.add_argument("--kind", default="pooled", help="feature kind in the cache (default: pooled)")
    p.set_defaults(func=run)


def _parse_seeds(text: str | None):
    from featcache.errors import ProbeError

    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ProbeError(f"--seeds must be comma-separated integers, e.g. 0,1,2 (got {text!r})") from None


def run(args: argparse.Namespace) -> int:
    from featcache.probes.runner import run_probes
    from featcache.results import check_results_path

    check_results_path(args.results)  # a bad --results fails before any compute

    df = run_probes(
        args.cache if len(args.cache) > 1 else args.cache[0],
        "all" if args.all else args.backbone,
        args.dataset,
        args.protocol,
        seeds=_parse_seeds(args.seeds),
        results_path=args.results,
        force=args.force,
        backend=args.backend,
        max_iter=args.max_iter,
        tol=args.tol,
        standardize=not args.no_standardize,
        eval_splits=args.eval_split or ["test"],
        train_split=args.train_split,
        val_split=args.val_split,
        kind=args.kind,
        val_source=args.val_source,
        head_init=args.head_init,
        sgd_epochs=args.epochs,
    )
    print(format_table(df))
    print(f"{df['run_id'].n_unique()} run(s) -> {args.results}")
    return 0


def format_table(df) -> str:
    """Small wide table: one line per run, the metrics as columns."""
    import json

    import polars as pl

    if df.height == 0:
        return "(no results)"
    sel = df.with_columns(
        pl.col("hparams").map_elements(
            lambda h: _hp_short(json.loads(h)), return_dtype=pl.Utf8).alias("selected"))
    wide = sel.pivot(on="metric", index=["backbone", "protocol", "eval_split", "seed", "selected",
                                         "converged"], values="value", aggregate_function="first")
    metric_cols = [c for c in ("top1", "top5", "mean_per_class", "nll", "ece") if c in wide.columns]
    wide = wide.sort(["backbone", "eval_split", "seed"])
    cols = ["backbone", "protocol", "eval_split", "seed", "selected", "converged", *metric_cols]
    rows = [cols] + [[_fmt(v) for v in r] for r in wide.select(cols).rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows)


def _hp_short(h: dict) -> str:
    if h.get("aggregate"):
        return f"median of seeds {h.get('seeds')}"
    if "C" in h:
        return f"C={h['C']:.3g}"
    if "lr" in h:
        return f"lr={h['lr']:g}"
    return ""


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)
