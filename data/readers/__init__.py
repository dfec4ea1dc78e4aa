"""Data readers: a data spec ``KIND[:ARG]`` names a registered format, read by
:func:`open_dataset` into one :class:`~featcache.data.source.SplitSource` per split.

One module per family of formats, each registering its readers with
:func:`~featcache.data.readers.registry.register_format`:

* :mod:`~featcache.data.readers.folders`: ``digits``, ``fashion-mnist[:DIR]``,
  ``imagefolder:DIR``, ``manifest:FILE``;
* :mod:`~featcache.data.readers.webdataset`: ``webdataset:PATTERN`` tar shards;
* :mod:`~featcache.data.readers.benchmarks`: the layouts benchmarks are distributed in
  (``clip-benchmark:DIR``, ``hf:PATH``, ``vtab1k:DIR``).

Grey, palette, CMYK, 16-bit and RGBA images all become 8-bit RGB
(:mod:`featcache.data.decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# isort: off
# the built-in formats register on import, in the order the --data help and errors list them
from featcache.data.readers import folders  # noqa: F401
from featcache.data.readers import webdataset  # noqa: F401
from featcache.data.readers import benchmarks  # noqa: F401
from featcache.data.readers import dense  # noqa: F401

# isort: on
from featcache.data.readers.benchmarks import detect_spec
from featcache.data.readers.registry import (
    FORMATS,
    format_help,
    format_usages,
    official_val,
    open_format,
    parse_spec,
    register_format,
)
from featcache.data.source import ReadOptions, SplitSource
from featcache.errors import DataError

__all__ = [
    "FORMATS",
    "default_name",
    "detect_spec",
    "format_help",
    "official_val",
    "open_dataset",
    "parse_spec",
    "register_format",
    "select_splits",
]


def default_name(spec: str) -> str:
    """The dataset name a spec gets when none is given: its folder's or file's name (see each
    format's ``name_of``), else its format's canonical kind (an alias such as ``fmnist`` or
    ``fashion_mnist`` is stored as ``fashion-mnist``, where every later command finds it)."""
    kind, arg = parse_spec(spec)
    fmt = FORMATS.get(kind)
    if arg and fmt is not None and fmt.name_of is not None:
        return fmt.name_of(arg) or fmt.kind
    return fmt.kind if fmt is not None else kind


def open_dataset(spec: str, name: str | None = None, *, options: ReadOptions | None = None) -> dict[str, SplitSource]:
    """All splits of a data spec, keyed by split name (``options``: how image files decode).

    >>> splits = open_dataset("digits")
    >>> len(splits["train"]), len(splits["test"])
    (1347, 450)
    """
    kind, arg = parse_spec(spec)
    if kind not in FORMATS:
        close = " or ".join(repr(c) for c in FORMATS.close_matches(kind))
        hint = f"did you mean {close}? " * bool(close) + _path_hint(spec)
        raise DataError(f"unknown data spec {spec!r}; {hint}use {format_usages()}")
    dname = name or default_name(spec)
    out = open_format(kind, arg, dname, options or ReadOptions())
    for s in out.values():
        s.dataset = dname
    return out


def _path_hint(spec: str) -> str:
    """A bare path given as a data spec: the scheme it most likely needs, as a suggestion."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if any(c.is_dir() for c in p.iterdir()):
            return f"{spec!r} is a folder of folders: for class (or split/class) folders pass imagefolder:{spec}; "
        return f"{spec!r} is a folder without class folders: put images in one folder per class and pass imagefolder:{spec}; "
    if p.is_file() and p.suffix.lower() in (".csv", ".parquet"):
        return f"{spec!r} is a table: as a manifest (path, label[, split] columns) pass manifest:{spec}; "
    if p.is_file() and p.suffix.lower() == ".tar":
        return f"{spec!r} is a tar shard: pass webdataset:{spec}; "
    return ""


def select_splits(splits: dict[str, SplitSource], wanted: Sequence[str] | None) -> list[SplitSource]:
    """The splits named in ``wanted`` (all of them when ``wanted`` is empty)."""
    if not wanted:
        return list(splits.values())
    missing = [w for w in wanted if w not in splits]
    if missing:
        raise DataError(f"split(s) {missing} do not exist in this dataset; available: {sorted(splits)}")
    return [splits[w] for w in wanted]
