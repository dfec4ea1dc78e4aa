"""Thin command-line front end: ``featcache extract|ls|verify|probe|retrieve|finetune|sweep|rank|shift|report|demo``.

Each stage owns a small ``cli`` module exposing ``register(subparsers)``; those modules
import only ``argparse`` at module level so ``featcache extract`` starts fast on a GPU box
that has torch and timm but not polars, faiss or matplotlib. ``featcache COMMAND`` imports
and builds only the module that registers COMMAND (:data:`COMMANDS`); the command listing
(``featcache --help``) and an unknown command build every one.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from featcache import __version__
from featcache.errors import FeatcacheError

#: the attribute that marks the logging handlers main() added (removed again by the next main())
_CLI_MARK = "featcache_cli"

#: modules whose ``register(subparsers)`` adds commands, in help order
COMMAND_MODULES = (
    "featcache.extract.cli",
    "featcache.suites.cli",
    "featcache.finetune.cli",
    "featcache.store.cli",
    "featcache.probes.cli",
    "featcache.retrieval.cli",
    "featcache.sweep.cli",
    "featcache.analysis.cli",
    "featcache.demo.cli",
)


#: command -> the module in COMMAND_MODULES that registers it: ``featcache probe`` imports and
#: builds that module's parsers only (tests/cli/test_cli_lazy.py holds the table to the modules)
COMMANDS = {
    **dict.fromkeys(("extract", "embed-classes", "embed-captions", "models", "fetch-weights"), "featcache.extract.cli"),
    "suites": "featcache.suites.cli",
    "finetune": "featcache.finetune.cli",
    **dict.fromkeys(("ls", "verify"), "featcache.store.cli"),
    "probe": "featcache.probes.cli",
    **dict.fromkeys(("retrieve", "retrieve-text"), "featcache.retrieval.cli"),
    "sweep": "featcache.sweep.cli",
    **dict.fromkeys(("rank", "shift", "report"), "featcache.analysis.cli"),
    "demo": "featcache.demo.cli",
}


def command_of(argv: list[str]) -> str | None:
    """The command word of a command line (after the global flags), None when there is none or
    help or the version is asked for before it."""
    words = iter(argv)
    for w in words:
        if w in ("-h", "--help", "--version") or w == "--":
            return None
        if w == "--log-file":
            next(words, None)
        elif not w.startswith("-"):
            return w
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command-line parser: every command's, or (``argv`` naming a command in
    :data:`COMMANDS`) only the parsers of the module that registers that command."""
    parser = argparse.ArgumentParser(
        prog="featcache",
        description="Run every backbone over every image once; probe, retrieve and rank from the cache.",
    )
    parser.add_argument("--version", action="version", version=f"featcache {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, and no progress bars")
    parser.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="also append the log to PATH (at INFO even with -q; DEBUG with -vv)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = command_of(argv) if argv is not None else None
    only = COMMANDS.get(command) if command else None
    for name in (only,) if only in COMMAND_MODULES else COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a stage not installed in this build
            if exc.name != name:
                raise
            continue
        mod.register(sub)
    return parser


def configure_logging(verbose: int = 0, quiet: bool = False, log_file: str | None = None) -> logging.Handler | None:
    """Logging for one CLI run: stderr at WARNING (``-q``), INFO or DEBUG (``-vv``); with
    ``log_file`` the same records, at INFO or finer, are also appended to that file, whose
    handler is returned (the CLI's own errors go to it too)."""
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO)
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, _CLI_MARK, False)]:  # an earlier main()
        root.removeHandler(h)
        h.close()
    fmt = "%(levelname)s %(name)s: %(message)s"
    if not root.handlers:  # like logging.basicConfig: a host that configured logging keeps its own
        sh = logging.StreamHandler()
        sh.setLevel(level)
        sh.setFormatter(logging.Formatter(fmt))
        setattr(sh, _CLI_MARK, True)
        root.addHandler(sh)
        root.setLevel(level)
    fh = None
    if log_file:
        try:
            fh = logging.FileHandler(log_file, mode="a", encoding="utf-8")
        except OSError as exc:
            raise FeatcacheError(f"cannot open --log-file {log_file!r}: {exc.strerror}; give a writable path") from exc
        fh.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
        fh.setFormatter(logging.Formatter("%(asctime)s %(process)d " + fmt))
        setattr(fh, _CLI_MARK, True)
        root.addHandler(fh)
        if root.level == logging.NOTSET or root.level > fh.level:
            root.setLevel(fh.level)
    if not verbose:
        for noisy in ("urllib3", "botocore", "s3fs", "fsspec", "matplotlib", "PIL", "timm", "faiss.loader"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    return fh


def _log_to_file(handler: logging.Handler | None, msg: str, exc_info: bool = False) -> None:
    """An error the CLI prints to stderr itself, also recorded in --log-file (not printed twice)."""
    if handler is not None:
        handler.handle(
            logging.getLogger("featcache.cli").makeRecord(
                "featcache.cli", logging.ERROR, __file__, 0, msg, (), sys.exc_info() if exc_info else None
            )
        )


def _damaged_store(args, exc: Exception):
    """zarr's error for a damaged metadata document of the command's local store, as one
    named line (which document, what is wrong, what to run); None for any other error."""
    from featcache.store.metadata import is_metadata_error, named_metadata_error

    path = getattr(args, "cache", None) or getattr(args, "path", None)
    if not is_metadata_error(exc) or not isinstance(path, str):
        return None
    return named_metadata_error(path, exc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    # Stages read ``args.no_progress`` (their --no-progress flag) to set ``progress=``; -q implies it.
    args.no_progress = bool(getattr(args, "no_progress", False) or args.quiet)
    try:
        file_handler = configure_logging(args.verbose, args.quiet, args.log_file)
    except FeatcacheError as exc:
        print(f"featcache: error: {exc}", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    log = logging.getLogger("featcache.cli")
    log.debug("featcache %s: %s", __version__, " ".join(sys.argv if argv is None else ["featcache", *argv]))
    try:
        rc = args.func(args)
    except FeatcacheError as exc:
        msg = f"featcache {args.command}: error: {exc}"
        _log_to_file(file_handler, msg, exc_info=True)
        print(msg, file=sys.stderr)
        return 1
    except Exception as exc:
        named = _damaged_store(args, exc)
        if named is None:
            raise
        msg = f"featcache {args.command}: error: {named}"
        _log_to_file(file_handler, msg, exc_info=True)
        print(msg, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _log_to_file(file_handler, "interrupted")
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if file_handler is not None:  # main() called in-process (tests, notebooks) leaves no open file
            logging.getLogger().removeHandler(file_handler)
            file_handler.close()
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
