"""``featcache ls`` and ``featcache verify``."""

from __future__ import annotations

import argparse


def run_ls(args: argparse.Namespace) -> int:
    import polars as pl

    from featcache.store import open_cache

    cat = open_cache(args.path).catalog()
    if cat.is_empty():
        print(f"{args.path}: no features yet")
        return 0
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
        print(cat.drop("created") if not args.long else cat)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from featcache.store.verify import verify

    problems = verify(args.path)
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{args.path}: {len(problems)} problem(s)")
        return 1
    print(f"{args.path}: OK")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ls", help="print the catalog of a feature cache")
    p.add_argument("path")
    p.add_argument("-l", "--long", action="store_true", help="all columns")
    p.set_defaults(func=run_ls)
    p = sub.add_parser("verify", help="re-check every chunk, shape and provenance of a cache")
    p.add_argument("path")
    p.set_defaults(func=run_verify)
