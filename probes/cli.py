"""``featcache probe``: linear probes from the cache into a results table."""

from __future__ import annotations

import argparse

from featcache.configs import add_arguments, from_namespace
from featcache.probes.config import ProbeConfig


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
    add_arguments(p, ProbeConfig)  # every other flag comes from the config's fields
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ProbeConfig:
    """The :class:`ProbeConfig` of parsed ``featcache probe`` arguments."""
    return from_namespace(ProbeConfig, args, cache=args.cache if len(args.cache) > 1 else args.cache[0],
                          backbones="all" if args.all else args.backbone)


def run(args: argparse.Namespace) -> int:
    from featcache.probes.runner import run_probes
    from featcache.results import check_results_path

    check_results_path(args.results_path)  # a bad --results fails before any compute

    cfg = config_from_args(args)
    df = run_probes(cfg)
    print(format_table(df))
    print(f"{df['run_id'].n_unique()} run(s) -> {cfg.results_path}")
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
