"""Thin command-line front end: ``featcache extract|ls|verify|probe|retrieve|finetune|rank|shift|report|demo``.

Each stage owns a small ``cli`` module exposing ``register(subparsers)``; those modules
import only ``argparse`` at module level so ``featcache extract`` starts fast on a GPU box
that has torch and timm but not polars, faiss or matplotlib.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from featcache import __version__
from featcache.errors import FeatcacheError

#: modules whose ``register(subparsers)`` adds commands, in help order
COMMAND_MODULES = (
    "featcache.extract.cli",
    "featcache.suites.cli",
    "featcache.finetune.cli",
    "featcache.store.cli",
    "featcache.probes.cli",
    "featcache.retrieval.cli",
    "featcache.analysis.cli",
    "featcache.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="featcache",
        description="Run every backbone over every image once; probe, retrieve and rank from the cache.",
    )
    parser.add_argument("--version", action="version", version=f"featcache {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a stage not installed in this build
            if exc.name != name:
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose > 1 else logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        for noisy in ("urllib3", "botocore", "s3fs", "fsspec", "matplotlib", "PIL", "timm", "faiss.loader"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except FeatcacheError as exc:
        print(f"featcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
