"""``featcache export | import``: results in the field's formats, out and in (imports only
argparse at top level)."""

from __future__ import annotations

import argparse

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 92

#: the formats each command offers (checked against the registry by tests/interop)
EXPORT_FORMATS = ("clip_benchmark", "mteb", "lm-eval", "model-index")
IMPORT_FORMATS = ("auto", "clip_benchmark", "mteb", "lm-eval", "model-index", "timm")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a results table in CLIP_benchmark, MTEB, lm-eval or model-card format",
        description="Write every run of a results table as the named tool writes its results "
        "(file layout, field names, metric names and scales), featcache's provenance kept in the "
        "fields each format has for it.",
    )
    p.add_argument("--format", required=True, help=f"result format: {', '.join(EXPORT_FORMATS)}")
    p.add_argument("--results", required=True, help="featcache results parquet")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument(
        "--cache",
        action="append",
        default=[],
        help="store the runs read (repeatable): its provenance gives each backbone's weights sha256",
    )
    p.add_argument("--org", default="featcache", help="organisation of the org/name model names (default featcache)")
    p.add_argument("--include-external", action="store_true", help="also export rows imported with featcache import")
    p.set_defaults(func=run_export)
    q = subparsers.add_parser(
        "import",
        help="read published results (CLIP_benchmark, MTEB, timm CSV...) into a results table",
        description="Append published results to a results table as external rows (marked with "
        "their format and source file), so rank and report put them beside featcache's own.",
    )
    q.add_argument("source", help="a results file or folder")
    q.add_argument("--format", default="auto", help=f"result format: {', '.join(IMPORT_FORMATS)} (default auto)")
    q.add_argument("--results", required=True, help="featcache results parquet to append to")
    q.set_defaults(func=run_import)


def run_export(args: argparse.Namespace) -> int:
    from featcache.interop.export import ExportConfig, export_results

    cfg = ExportConfig(args.results, args.out, args.format, tuple(args.cache), args.org, args.include_external)
    rep = export_results(cfg)
    print(f"{rep.runs} run(s) -> {len(rep.files)} file(s) under {args.out} ({args.format})")
    if rep.skipped:
        print(f"{len(rep.skipped)} run(s) not exported: {rep.skipped[0]}" + (" ..." if len(rep.skipped) > 1 else ""))
    return 0


def run_import(args: argparse.Namespace) -> int:
    from featcache.interop.import_ import ImportConfig, import_results

    rep = import_results(ImportConfig(args.source, args.results, args.format))
    print(f"{rep.runs} external run(s), {rep.rows} row(s) ({rep.format}) -> {args.results}")
    if rep.problems:
        print(f"{len(rep.problems)} row(s) skipped (warnings above name each file and field)")
    return 0
