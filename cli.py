"""Thin command-line front end: ``featcache extract|ls|verify|probe|retrieve|finetune|sweep|rank|shift|report|demo``.

Each stage owns a small ``cli`` module exposing ``register(subparsers)``; those modules
import only ``argparse`` at module level so ``featcache extract`` starts fast on a GPU box
that has torch and timm but not polars, faiss or matplotlib. ``featcache COMMAND`` imports
and builds only the module that registers COMMAND (:data:`COMMANDS`); the command listing
(``featcache --help``) and an unknown command build every one.
"""

from __future__ import annotations

import argparse
import ast
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from featcache import __version__
from featcache.core.registry import Registry
from featcache.errors import FeatcacheError

#: the attribute that marks the logging handlers main() added (removed again by the next main())
_CLI_MARK = "featcache_cli"

#: command word -> the ``register(subparsers)`` of the stage package that adds it (imported when
#: the parser is built): :func:`discover` fills it from each ``featcache/<package>/cli.py``
#: without importing one, so ``featcache probe`` imports and builds the probes package's parsers
#: only (tests/cli/test_cli_lazy.py holds these words to what each module registers)
COMMANDS: Registry[Callable[[Any], None]] = Registry("command")
#: a check ``featcache verify`` runs beside a store that a stage keeps there: check name ->
#: ``"module:function"`` (the store knows no stage: each stage's cli.py declares its own in a
#: literal ``BESIDE_STORE = {name: "module:function"}``, registered lazily before verify runs)
BESIDE_STORE: dict[str, str] = {}


#: a command word as a stage's cli.py adds it: ``add_parser("word"`` (a literal first argument)
_ADD_PARSER = re.compile(r"""\.add_parser\(\s*["']([\w-]+)["']""")
_HELP_ORDER = re.compile(r"^HELP_ORDER = (\d+)", re.M)


def _declared(path: Path) -> tuple[list[str], dict[str, str], int]:
    """The command words a stage's cli.py adds (the literal first argument of each
    ``add_parser`` call, in source order), its literal ``BESIDE_STORE`` and its literal
    ``HELP_ORDER`` (where its commands stand in ``featcache --help``; default 100), read from its
    text (regular expressions, then ``ast`` only for a module that has a ``BESIDE_STORE``)."""
    text = path.read_text(encoding="utf-8")
    beside: dict[str, str] = {}
    if "\nBESIDE_STORE" in text:
        for node in ast.parse(text, str(path)).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BESIDE_STORE" for t in node.targets):
                beside = dict(ast.literal_eval(node.value))
    order = _HELP_ORDER.search(text)
    return _ADD_PARSER.findall(text), beside, int(order.group(1)) if order else 100


def discover() -> None:
    """Register the commands (and checks beside a store) of every ``featcache/<package>/cli.py``
    found on the package's path, in the order their ``HELP_ORDER`` gives (then by name); a package
    missing from this build adds none. A new stage is its package's cli.py with
    ``register(subparsers)``: no list to edit."""
    import featcache

    paths = {p.parent.name: p for base in featcache.__path__ for p in Path(base).glob("*/cli.py")}
    found = sorted(((*_declared(path), package) for package, path in paths.items()), key=lambda d: (d[2], d[3]))
    for words, beside, _, package in found:
        for word in words:
            COMMANDS.register(word, f"featcache.{package}.cli:register")
        BESIDE_STORE.update(beside)


discover()


def _register_beside_checks() -> None:
    """Register each of :data:`BESIDE_STORE` in the store's checks, lazily (its module is
    imported when ``verify`` runs the check)."""
    from featcache.store import register_beside_check

    for name, spec in BESIDE_STORE.items():
        register_beside_check(name, spec)


#: the environment variable naming a user's own modules (comma-separated, importable from
#: PYTHONPATH) that the CLI imports before it builds its parser: what they register (a model
#: source, a data format, a retrieval metric...) is then a member like a built-in one
PLUGINS_ENV = "FEATCACHE_PLUGINS"


def load_plugins() -> list[str]:
    """Import each module named in ``$FEATCACHE_PLUGINS``; the names imported (one missing: a
    :class:`~featcache.errors.ConfigError` saying how to fix it)."""
    import importlib
    import os

    from featcache.errors import ConfigError

    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the plugin itself imports something missing: its own error
                raise
            raise ConfigError(
                f"{PLUGINS_ENV} names module {name!r}, which cannot be imported: "
                f"put its folder on PYTHONPATH or take it out of {PLUGINS_ENV}"
            ) from exc
    return names


def command_modules() -> list[str]:
    """The modules that register commands, each once, in help order."""
    return list(dict.fromkeys((e.spec or "").partition(":")[0] for e in COMMANDS.entries()))


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
    found = COMMANDS.get_entry(command) if command else None
    done: list[Callable[[Any], None]] = []
    for entry in [found] if found is not None else COMMANDS.entries():
        try:
            register = entry.load()
        except ModuleNotFoundError as exc:  # a stage not installed in this build
            if exc.name != (entry.spec or "").partition(":")[0]:
                raise
            continue
        if register not in done:  # once per module, however many commands it adds
            done.append(register)
            register(sub)
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
        for noisy in ("urllib3", "botocore", "s3fs", "fsspec", "matplotlib", "PIL", "timm", "faiss.loader", "alembic"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    return fh


#: what an interrupted command leaves, and how to go on
RESUME = {
    "extract": (
        ": the chunks written so far are kept; run the same `featcache extract` command again to resume "
        "(`featcache ls` shows the rows not computed yet)"
    ),
}


def _log_to_file(handler: logging.Handler | None, msg: str, exc_info: bool = False) -> None:
    """An error the CLI prints to stderr itself, also recorded in --log-file (not printed twice)."""
    if handler is not None:
        handler.handle(
            logging.getLogger("featcache.cli").makeRecord(
                "featcache.cli", logging.ERROR, __file__, 0, msg, (), sys.exc_info() if exc_info else None
            )
        )


def main(argv: list[str] | None = None) -> int:
    try:
        load_plugins()
    except FeatcacheError as exc:
        print(f"featcache: error: {exc}", file=sys.stderr)
        return 2
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
    if getattr(args, "beside_checks", False):  # a command that checks what the stages keep beside a store
        _register_beside_checks()
    log = logging.getLogger("featcache.cli")
    log.debug("featcache %s: %s", __version__, " ".join(sys.argv if argv is None else ["featcache", *argv]))
    try:
        rc = args.func(args)
    except FeatcacheError as exc:
        msg = f"featcache {args.command}: error: {exc}"
        _log_to_file(file_handler, msg, exc_info=True)
        print(msg, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        msg = "interrupted" + RESUME.get(args.command, "")
        _log_to_file(file_handler, msg)
        print(msg, file=sys.stderr)
        return 130
    finally:
        if file_handler is not None:  # main() called in-process (tests, notebooks) leaves no open file
            logging.getLogger().removeHandler(file_handler)
            file_handler.close()
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
