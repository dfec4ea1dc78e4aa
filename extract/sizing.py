"""The store size an extraction will need, known before any image is read: rows x per-row
shape x dtype bytes for every feature kind of every split (the uncompressed upper bound: the
compressed size depends on the features), checked against the free space of the store's disk.

>>> size = StoreSize((("train", "tokens", 1000, (196, 192)),), "float16")
>>> size.total
75264000
>>> human(size.total)
'75.3 MB'
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featcache.errors import NoSpaceError

log = logging.getLogger(__name__)


def human(n: float) -> str:
    """Bytes in decimal units (kB, MB, GB, TB)."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


@dataclass(frozen=True)
class StoreSize:
    """``parts``: (split, kind, rows still to write, per-row shape[, its dtype]); ``dtype``: the
    stored dtype of the parts that name none (the model's kinds; a dense target names its own)."""

    parts: tuple[tuple[Any, ...], ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    def bytes_of(self, rows: int, shape: Sequence[int], dtype: str | None = None) -> int:
        size = self.itemsize if dtype is None else int(np.dtype(dtype).itemsize)
        return int(rows) * int(np.prod(shape, dtype=np.int64)) * size

    @property
    def total(self) -> int:
        return sum(self.bytes_of(*p[2:]) for p in self.parts)

    def describe(self) -> str:
        """A headline and one line per split: rows x per-row shape x dtype = bytes, per kind."""
        lines = [
            f"store size for this job: at most {human(self.total)} ({self.total:,} bytes) uncompressed "
            f"(rows x per-row shape x {self.itemsize} bytes {self.dtype}; the compressed size is not known before)"
        ]
        for split in dict.fromkeys(p[0] for p in self.parts):
            kinds = [p[1:] for p in self.parts if p[0] == split]
            each = ", ".join(
                f"{k} {n:,} x {tuple(s)}{' ' + d[0] if d else ''} = {human(self.bytes_of(n, s, *d))}"
                for k, n, s, *d in kinds
            )
            lines.append(f"  {split}: {each}")
        return "\n".join(lines)


def plan_size(
    rows: Mapping[str, int],
    dims: Mapping[str, Any],
    dtype: str,
    done: Mapping[tuple[str, str], float] | None = None,
    targets: Mapping[str, Mapping[str, tuple[Sequence[int], str]]] | None = None,
) -> StoreSize:
    """The size of writing ``rows[split]`` rows of every kind of ``dims`` (kind -> per-row shape,
    or an int width); ``done[(split, kind)]``: the fraction already stored (a resume);
    ``targets[split]``: a dense group's target kinds, kind -> (per-row shape, dtype).

    >>> plan_size({"val": 2}, {"tokens": (4, 8)}, "float16", targets={"val": {"mask": ((32, 32), "uint8")}}).total
    2176
    """
    done = done or {}
    parts: list[tuple[Any, ...]] = []
    for split, n in rows.items():
        for kind, shape in dims.items():
            shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
            left = round(n * (1.0 - done.get((split, kind), 0.0)))
            parts.append((split, kind, left, shape))
        for kind, (shape, tdtype) in (targets or {}).get(split, {}).items():
            left = round(n * (1.0 - done.get((split, kind), 0.0)))
            parts.append((split, kind, left, tuple(int(x) for x in shape), tdtype))
    return StoreSize(tuple(parts), dtype)


def is_remote(cache: str) -> bool:
    """Whether ``cache`` names a remote fsspec store (``s3://``, ``gs://``...), not a local path."""
    s = str(cache)
    return "://" in s and not s.startswith("file://")


def free_bytes(cache: str) -> tuple[int, str]:
    """(free bytes, the folder measured): the disk of ``cache``'s nearest existing parent."""
    probe = os.path.abspath(os.path.expanduser(str(cache).removeprefix("file://")))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return int(shutil.disk_usage(probe).free), probe


def check_space(cache: str, size: StoreSize, report: Callable[[str], None] | None = None) -> None:
    """Report ``size`` (``report``, else the log) and refuse, in one line naming the figure, when
    the local disk of ``cache`` has less free space; remote stores are not checked (logged)."""
    (report or log.info)(size.describe())
    if is_remote(cache):
        log.info("%s is a remote store: its free space is not checked", cache)
        return
    free, where = free_bytes(cache)
    if size.total > free:
        raise NoSpaceError(
            f"this extraction needs up to {human(size.total)} ({size.total:,} bytes, uncompressed) in {cache}, but "
            f"only {human(free)} are free on the disk of {where}: ask for tokens@GxG (e.g. tokens@4x4: 16 rows "
            "of D per image instead of every patch) or fewer kinds or rows, free space or use another --cache, "
            "or pass --no-size-check if compression will make it fit"
        )


def stored_fraction(store: Any, key: str, dataset: str, split: str, kinds: Sequence[str]) -> dict[str, float]:
    """kind -> the fraction of its row chunks already marked done in the store (a resume)."""
    try:
        stored = set(store.kinds(key, dataset, split))
        done = np.asarray(store.root[f"features/{key}/{dataset}/{split}"]["done"][:], dtype=bool)
    except Exception:  # nothing stored yet, or unreadable markers: count everything as to write
        return {}
    frac = float(done.mean()) if done.size else 0.0
    return {k: frac for k in kinds if k in stored}
