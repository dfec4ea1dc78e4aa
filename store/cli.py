"""``featcache ls`` and ``featcache verify``."""

from __future__ import annotations

import argparse


def parse_storage_options(pairs: list[str] | None) -> dict | None:
    """``k=v`` pairs (plus ``FEATCACHE_STORAGE_OPTIONS``, a JSON object) -> fsspec storage
    options; values that parse as JSON (numbers, true/false, objects) are decoded, e.g.
    ``endpoint_url=http://127.0.0.1:9000`` or ``client_kwargs={"region_name": "eu-west-1"}``."""
    import json
    import os

    from featcache.errors import FeatcacheError

    opts: dict = {}
    env = os.environ.get("FEATCACHE_STORAGE_OPTIONS")
    if env:
        try:
            opts.update(json.loads(env))
        except ValueError as exc:
            raise FeatcacheError(f"FEATCACHE_STORAGE_OPTIONS is not a JSON object: {exc}") from exc
    for pair in pairs or []:
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise FeatcacheError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        try:
            opts[k] = json.loads(v)
        except ValueError:
            opts[k] = v
    return opts or None


def add_storage_option_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", action="append", dest="storage_options", metavar="KEY=VALUE",
                   help="fsspec option for an s3://... cache (repeatable), e.g. endpoint_url=http://host:9000, "
                        "key=..., secret=...; or env FEATCACHE_STORAGE_OPTIONS='{json}'")


def run_ls(args: argparse.Namespace) -> int:
    import polars as pl

    from featcache.store import open_cache

    cat = open_cache(args.path, storage_options=parse_storage_options(args.storage_options)).catalog()
    if cat.is_empty():
        print(f"{args.path}: no features yet")
        return 0
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
        print(cat.drop("created") if not args.long else cat)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from featcache.store.verify import verify

    problems = verify(args.path, storage_options=parse_storage_options(args.storage_options))
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
    add_storage_option_argument(p)
    p.set_defaults(func=run_ls)
    p = sub.add_parser("verify", help="re-check every chunk, shape and provenance of a cache")
    p.add_argument("path")
    add_storage_option_argument(p)
    p.set_defaults(func=run_verify)
