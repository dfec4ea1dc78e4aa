"""The data-format registry: a data spec ``KIND[:ARG]`` names a registered reader.

Every format, the built-in ones included, registers with :func:`register_format`; the
``--data`` help and the error for an unknown spec are built from :data:`FORMATS`, so a new
format appears in both by being registered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcache.core.registry import Registry
from featcache.data.source import ReadOptions, SplitSource
from featcache.errors import ConfigError, DataError

__all__ = [
    "FORMATS",
    "DataFormat",
    "format_help",
    "format_usages",
    "official_val",
    "open_format",
    "parse_spec",
    "register_format",
]

#: ``(ARG, dataset name, options) -> {split: SplitSource}``; ARG is a ``str``, or ``None`` for a
#: format registered with ``missing=None`` only, so a reader of a path may declare ``str`` (``Any``
#: here: a type cannot say which formats take no ARG)
Reader = Callable[[Any, str, ReadOptions], dict[str, SplitSource]]


def path_name(arg: str) -> str:
    """The default dataset name of a path argument: a file's stem, a folder's name."""
    p = Path(arg).resolve()
    return p.stem if p.is_file() else p.name


@dataclass(frozen=True)
class DataFormat:
    """One registered format: its reader and how the ``--data`` help and errors name it."""

    kind: str  # the first name it was registered under
    reader: Reader
    usage: str  # as the help lists it, e.g. ``imagefolder:DIR``
    note: str = ""  # a short gloss after the usage in the help
    #: the error when the spec has no ``:ARG`` (``{kind}`` is replaced); None: ARG is optional
    missing: str | None = "{kind} needs a path: --data {kind}:PATH"
    #: the default dataset name of ``ARG``; None: the dataset is named by its kind
    name_of: Callable[[str], str] | None = path_name
    #: the (train, val) splits the format ships as its official selection pair (VTAB-1k:
    #: train800, val200), which fine-tuning selects on by default; None: it ships none
    official_val: tuple[str, str] | None = None


#: every registered format by its first kind, in registration order (its other kinds are aliases:
#: ``FORMATS[alias]`` gives the format too, ``FORMATS.names(aliases=True)`` lists every kind)
FORMATS: Registry[DataFormat] = Registry("data format", ConfigError, key=lambda f: f.reader)


def register_format(
    *kinds: str,
    usage: str | None = None,
    note: str = "",
    missing: str | None = DataFormat.missing,
    name_of: Callable[[str], str] | None = path_name,
    official_val: tuple[str, str] | None = None,
) -> Callable[[Reader], Reader]:
    """Register a reader ``(ARG, dataset name, options) -> {split: SplitSource}`` under the spec
    kinds ``kinds`` (the first is the name the help lists, as ``usage``, default
    ``KIND:PATH``). A kind taken by another reader is refused; the same reader again is a no-op."""
    if not kinds:
        raise ConfigError("register_format needs at least one spec kind, e.g. @register_format('myformat')")

    def deco(fn: Reader) -> Reader:
        fmt = DataFormat(kinds[0], fn, usage or f"{kinds[0]}:PATH", note, missing, name_of, official_val)
        FORMATS.register(kinds[0], fmt, usage=fmt.usage, note=note, aliases=kinds[1:])
        return fn

    return deco


def format_help() -> str:
    """The ``--data`` help: every registered format's usage, ``|``-separated."""
    return FORMATS.help()


def format_usages() -> str:
    """The registered formats' usages as a list in prose (``a, b or c``), for error messages."""
    u = FORMATS.usages()
    return ", ".join(u[:-1]) + f" or {u[-1]}" if len(u) > 1 else "".join(u)


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``KIND[:ARG]`` -> (lower-case kind, ARG or None)."""
    kind, _, arg = spec.partition(":")
    return kind.strip().lower(), (arg or None)


def official_val(spec: str) -> tuple[str, str] | None:
    """The (train, val) splits the format of ``spec`` ships as its official selection pair
    (:attr:`DataFormat.official_val`), read from the registry alone (nothing opened)."""
    kind, _ = parse_spec(spec)
    fmt = FORMATS.get(kind)
    return None if fmt is None else fmt.official_val


def open_format(kind: str, arg: str | None, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    """The splits the reader registered as ``kind`` reads from ``arg``."""
    fmt = FORMATS[kind]
    if not arg and fmt.missing is not None:
        raise DataError(fmt.missing.replace("{kind}", kind))
    return fmt.reader(arg, name, options)
