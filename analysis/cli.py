"""``featcache rank | shift | report``: analysis commands (imports only argparse at top level)."""

from __future__ import annotations

import argparse

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 90


def _groups(items: list[str] | None) -> dict[str, str] | None:
    if not items:
        return None
    from featcache.errors import ResultsError

    out = {}
    for it in items:
        if "=" not in it:
            raise ResultsError(f"--group expects DATASET=GROUP, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", help="featcache results parquet (probe/knn/retrieval rows)")
    p.add_argument(
        "--external",
        action="append",
        default=[],
        metavar="TABLE",
        help="extra CSV/parquet table (backbone, dataset, metric, value, kind[, n_eval, seed, group]); repeatable",
    )
    p.add_argument(
        "--external-kind",
        choices=["probe", "knn", "retrieval", "finetune"],
        help="kind for external tables that have no kind column",
    )
    p.add_argument(
        "--percent", action="store_true", default=None, help="external accuracies are percentages (divide by 100)"
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "rank",
        help="rank backbones (z-scores, mean, avg rank; linear vs fine-tune)",
        description="Rank backbones across tasks from results tables; write tables and plots.",
    )
    _common(p)
    p.add_argument("--out", required=True, help="output folder (tables as parquet + Markdown, PNG plots)")
    p.add_argument(
        "--metric",
        default="auto",
        help="classification metric to rank on: auto (default) ranks each task on its declared metric "
        "(hparams.task_metric: top1, mean_per_class, map11, roc_auc_macro) where the results record "
        "one, else top1; or one metric for every task (top1, top5, mean_per_class, ...)",
    )
    p.add_argument(
        "--retrieval-metric",
        default="auto",
        help="retrieval metric to rank on: auto (default) ranks on map_bob (Battle of the Backbones' mAP, "
        "revisitop's trapezoidal AP) where every retrieval setting records it, else map (the "
        "scikit-learn-style AP); or any metric the retrieval rows hold (map, mrr, recall@5, mp@10, ...); "
        "several, comma-separated (map_bob,mrr_bob,recall@5): each (dataset, metric) is z-scored as its "
        "own setting, then averaged with the others (Battle of the Backbones' ranking)",
    )
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=["probe", "knn", "retrieval", "finetune"],
        help="kinds of settings to rank on (default all)",
    )
    p.add_argument(
        "--eval-split",
        action="append",
        dest="eval_splits",
        metavar="SPLIT",
        help="rank only on this eval split (repeatable; default: every split is its own setting)",
    )
    p.add_argument("--group", action="append", metavar="DATASET=GROUP", help="task group (repeatable)")
    p.add_argument(
        "--seed-reduce",
        choices=["auto", "median", "mean"],
        default="auto",
        help="how a setting's seeds are reduced to one score per backbone: auto (default) as its paper "
        "does (ELEVATER protocols: mean, shown +/- std; the rest: median, VTAB's rule), or one rule for all",
    )
    p.add_argument("--ddof", type=int, choices=[0, 1], default=0, help="z-score std: 0 population, 1 sample")
    p.add_argument(
        "--on-constant",
        choices=["error", "drop"],
        default="error",
        help="a setting where all backbones score the same: error (default) or drop it",
    )
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the intervals (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the bootstrap (default 0)")
    p.add_argument(
        "--resample",
        choices=["tasks", "seeds"],
        default="tasks",
        help="what the bootstrap draws with replacement: tasks (settings, default) or each setting's seeds",
    )
    p.add_argument("--no-plots", action="store_true", help="write the tables only, no PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for the bootstrap (implied by -q)")
    p.add_argument(
        "--index-effect",
        metavar="METRIC",
        help="also say whether approximate indexes (retrieve --index) changed the retrieval ranking: Kendall "
        "tau-b of each index's METRIC (e.g. map@10) against exact search's, per setting (index_effect.parquet)",
    )
    p.set_defaults(func=run_rank)

    p = subparsers.add_parser(
        "shift",
        help="test-set shift between two eval splits (Recht et al.)",
        description="Accuracy on an original and a new test split per backbone, gap, rank change and linear fit.",
    )
    _common(p)
    p.add_argument("--orig", required=True, help="original eval split (e.g. test)")
    p.add_argument("--new", required=True, help="new eval split (e.g. test_v2)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--metric", default="top1", help="classification metric to compare (default top1)")
    p.add_argument(
        "--kind", default="probe", choices=["probe", "knn", "finetune"], help="kind of result rows (default probe)"
    )
    p.add_argument("--n-boot", type=int, default=100_000, help="bootstrap resamples for the intervals (default 100000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the bootstrap (default 0)")
    p.add_argument("--no-plots", action="store_true", help="write the tables only, no PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for the bootstrap (implied by -q)")
    p.set_defaults(func=run_shift)

    p = subparsers.add_parser(
        "report",
        help="self-contained HTML report (catalog, results, rankings)",
        description="Write one HTML page with the store catalog, probe/retrieval results and rankings.",
    )
    _common(p)
    p.add_argument("--cache", help="feature cache root (its catalog goes into the report)")
    p.add_argument("--out", required=True, help="output .html file")
    p.add_argument("--shift", nargs=2, metavar=("ORIG", "NEW"), help="also include a test-set shift section")
    p.add_argument("--title", default="featcache report")
    p.set_defaults(func=run_report)


def _need_input(args) -> None:
    from featcache.errors import ResultsError

    if not args.results and not args.external:
        raise ResultsError("give --results R.parquet and/or --external TABLE")


def run_rank(args) -> int:
    _need_input(args)
    from featcache.analysis.api import rank

    # the depth curves first: a sweep of one backbone has curves but no ranking
    n_depth = _print_depth(args.results, args.out, plots=not args.no_plots) if args.results else 0
    n_depth += _print_dense(args.results, args.out, plots=not args.no_plots) if args.results else 0
    if n_depth and args.metric == "auto" and not args.external and _dense_only(args.results):
        print("note: the results hold dense rows only: rank them with --metric miou, hbird_miou or rmse")
        print(f"wrote {n_depth} files to {args.out}")
        return 0
    out = rank(
        args.results,
        args.external,
        args.out,
        metric=args.metric,
        retrieval_metric=args.retrieval_metric,
        kinds=args.kinds,
        eval_splits=args.eval_splits,
        groups=_groups(args.group),
        percent=args.percent,
        external_kind=args.external_kind,
        seed_reduce=args.seed_reduce,
        ddof=args.ddof,
        on_constant=args.on_constant,
        n_boot=args.n_boot,
        seed=args.seed,
        resample=args.resample,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )
    from featcache.core.formatting import format_table

    ov = out.overall
    groups = (
        ["group_mean", *[c for c in ov.columns if c.startswith("mean[")]] if ov["group_mean"].drop_nulls().len() else []
    )
    cols = ["position", "backbone", "zscore", "mean", "avg_rank", *groups, "n_settings"]
    print(format_table(ov.select(cols), "text", max_rows=10), end="")
    if out.mean_tau is not None and out.lin_ft is not None:
        print(f"linear vs fine-tune: mean Kendall tau-b {out.mean_tau:.3f} over {out.lin_ft.n_tasks} task(s)")
    for line in out.coverage.lines() + out.notes:
        print(f"note: {line}")
    if getattr(args, "index_effect", None):
        _print_index_effect(args.results, args.index_effect, args.out)
    print(f"wrote {len(out.files) + n_depth} files to {args.out}")
    return 0


def _print_index_effect(results, metric: str, out_dir) -> None:
    """``rank --index-effect``: per setting and index, whether it changed the backbone ranking."""
    from pathlib import Path

    from featcache.analysis.index_effect import index_rank_change

    eff = index_rank_change(results, metric)
    if eff.is_empty():
        print(f"index effect: no index run shares a setting with exact rows of >= 2 backbones ({metric})")
        return
    eff.write_parquet(Path(out_dir) / "index_effect.parquet")
    for r in eff.iter_rows(named=True):
        verdict = "changed the ranking" if r["ranking_changed"] else "kept the ranking"
        print(
            f"index {r['index']} on {r['dataset']}/{r['protocol']} @{r['eval_split']}: {verdict} "
            f"(Kendall tau-b {r['kendall_tau']:.3f} over {r['n_backbones']} backbones, {metric})"
        )


def _print_depth(results, out_dir, *, plots: bool = True) -> int:
    """The layer sweeps' accuracy against depth per backbone (:mod:`featcache.analysis.depth`):
    printed, written to ``depth_curves.csv`` (and ``depth_curves.png``); the files written."""
    from pathlib import Path

    from featcache.analysis.depth import depth_curves, depth_plot, depth_table
    from featcache.core.results import read_results

    if not Path(results).exists():  # rank says so, in its own words
        return 0
    curves = depth_curves(read_results(results))
    if not curves:
        return 0
    head = f"accuracy against depth ({len(curves)} layer sweep(s); selected: the layer chosen on validation data):"
    return _write_section(head, depth_table(curves), out_dir, "depth_curves", lambda p: depth_plot(curves, p), plots)


def _write_section(head: str, table, out_dir, stem: str, plot, plots: bool) -> int:
    """A rank section: ``head`` and ``table`` printed, ``STEM.csv`` written (and ``plot(STEM.png)``
    with ``plots``) under ``out_dir``; the number of files written."""
    from pathlib import Path

    from featcache.core.formatting import format_table

    print(head)
    print(format_table(table, "text", floatfmt="{:.4f}"), end="")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.write_csv(out / f"{stem}.csv")
    if plots:
        plot(out / f"{stem}.png")
    return 1 + int(plots)


def _dense_only(results) -> bool:
    """Whether a results table holds dense rows and no other kind (what ``--metric auto`` ranks)."""
    from featcache.analysis.dense import DENSE_KIND
    from featcache.core.results import read_results

    kinds = set(read_results(results)["kind"].unique().to_list())
    return kinds == {DENSE_KIND}


def _print_dense(results, out_dir, *, plots: bool = True) -> int:
    """The dense results per task (:mod:`featcache.analysis.dense`): printed, written to
    ``dense.csv`` (and ``dense.png``); the number of files written."""
    from pathlib import Path

    from featcache.analysis.dense import dense_plot, dense_table
    from featcache.core.results import read_results

    if not Path(results).exists():
        return 0
    df = read_results(results)
    table = dense_table(df)
    if table is None:
        return 0
    head = "dense evaluation (featcache dense; each task's backbones best first by ranked_by):"
    return _write_section(head, table, out_dir, "dense", lambda p: dense_plot(df, p), plots)


def run_shift(args) -> int:
    _need_input(args)
    from featcache.analysis.api import shift

    res = shift(
        args.results,
        args.orig,
        args.new,
        args.out,
        external=args.external,
        metric=args.metric,
        kind=args.kind,
        n_boot=args.n_boot,
        seed=args.seed,
        percent=args.percent,
        plots=not args.no_plots,
        progress=not args.no_progress,
    )
    for r in res["fit"].iter_rows(named=True):
        if r["a"] is None:
            print(f"{r['dataset']}: no fit ({r['reason']})")
        else:
            print(
                f"{r['dataset']}: acc_new = {r['a']:.3f} [{r['a_lo']:.3f}, {r['a_hi']:.3f}] * acc_orig "
                f"{r['b']:+.4f} [{r['b_lo']:+.4f}, {r['b_hi']:+.4f}]  ({r['n_points']} backbones)"
            )
    for m in res["missing"]:
        print(f"note: {m}")
    print(f"wrote {len(res['files'])} files to {args.out}")
    return 0


def run_report(args) -> int:
    _need_input(args)
    from featcache.analysis.report import write_report

    catalog = None
    if args.cache:
        # the CLI composes stages; the analysis library itself only takes DataFrames
        from featcache.store import open_cache

        cache = open_cache(args.cache)
        catalog = cache.catalog()  # carries images_per_s / peak_memory_mb (used for efficiency)
    path = write_report(
        args.out,
        args.results,
        catalog,
        external=args.external,
        shift_splits=tuple(args.shift) if args.shift else None,
        title=args.title,
        rank_kwargs={"percent": args.percent, "external_kind": args.external_kind},
    )
    print(f"report written to {path}")
    return 0
