"""Reading a dense split group (issue 57) as the dense protocols take it: its model kinds and its
targets, paired and checked on load.

A dense split is stored as feature groups of one backbone (:mod:`featcache.core.dense`): the
split's ``resize`` rows, its windows ``{split}@win``, its train views ``{split}@view{v}`` and its
flipped rows ``{split}@flip``. :func:`dense_groups` lists them; :func:`read_dense` reads one as
a :class:`~featcache.core.dense.DenseRows`: every kind through ``load(..., lazy=True)`` (chunk
checksums, row invariants, place and summary checked; rows read on demand by slices), the small
``window``/``image_size`` tables whole. A row's tokens and its target can never be paired
wrongly: the same group (one ``done`` marker per row chunk covers both), and on load

* every kind of the group records the same :class:`~featcache.core.dense.Geometry` and dense info;
* a token kind's ``T`` equals the recorded grid's ``gh * gw``;
* the target's ``[H, W]`` equals the geometry's ``target_size``;
* a ``win`` row points at an existing row of its base split, its id ``{image id}#w{j}``;
* a ``view``/``flip`` group's ids equal its base split's, in order.

Each refusal is one line saying what to run. :func:`iter_row_blocks` cuts ``n`` rows into blocks
within a memory budget for streaming.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from featcache.core.dense import (
    DEPTH_KIND,
    DEPTH_VALID_KIND,
    FULL_PREFIX,
    MASK_KIND,
    SIZE_FIELDS,
    SIZE_KIND,
    WINDOW_FIELDS,
    WINDOW_KIND,
    DenseInfo,
    DenseRows,
    Geometry,
    is_target_kind,
    parse_dense_split,
)
from featcache.errors import ConfigError, CorruptStoreError, NotInStoreError
from featcache.store.cache import FeatureCache

__all__ = ["EXTRACT_FLAGS", "dense_groups", "iter_row_blocks", "read_dense"]

#: the extraction flag that stores a split group of each geometry (named in refusals)
EXTRACT_FLAGS = {"win": "--windows", "flip": "--flip", "view": "--views K"}
#: a kind holding patch tokens on the recorded grid (``[N, gh * gw, D]``)
_TOKEN_KIND = re.compile(r"^(layer\d+_)?tokens$")
#: the per-row shape of each table kind
_TABLES = {SIZE_KIND: (len(SIZE_FIELDS),), WINDOW_KIND: (len(WINDOW_FIELDS),)}
_DENSE_SPECS = "ade20k:, voc:, cityscapes:, nyuv2: or segfolder:"


def dense_groups(cache: FeatureCache, backbone: str, dataset: str) -> dict[str, list[str]]:
    """``{base split: [its stored group splits]}`` of ``backbone`` on ``dataset``, each list the
    base split first (when stored), then ``@win``, ``@flip`` and the views in order; only groups
    that hold a target kind (a classification group of the same dataset is left out)."""
    out: dict[str, list[str]] = {}
    for b, d, s in cache.entries():
        if (b, d) == (backbone, dataset) and any(is_target_kind(k) for k in cache.kinds(b, d, s)):
            out.setdefault(parse_dense_split(s)[0], []).append(s)
    return {base: sorted(groups, key=lambda s: _group_order(base, s)) for base, groups in sorted(out.items())}


def _group_order(base: str, split: str) -> tuple[int, int]:
    geom = parse_dense_split(split)[1]
    if geom.startswith("view"):
        return 3, int(geom[4:])
    return {"resize": 0, "win": 1, "flip": 2}.get(geom, 4), 0


def read_dense(
    cache: FeatureCache,
    backbone: str,
    dataset: str,
    split: str,
    kinds: Sequence[str] = ("tokens",),
    *,
    check: bool = True,
) -> DenseRows:
    """One stored dense group (``val``, ``val@win``, ``train@view3``, ``val@flip``) with the model
    ``kinds`` asked for and every target the group holds, paired and checked (module docstring).

    ``kinds``/``target``/``target_valid``/``full`` are :class:`~featcache.store.StoredRows` views
    (``a[i:j]`` reads rows ``i:j`` in the stored dtype: float16 tokens, uint8 masks...);
    ``tables`` the ``window``/``image_size`` int32 arrays. ``check``: scan every chunk once for
    damage as ``load`` does (False: chunk checksums are still checked on every read)."""
    where = f"{backbone}/{dataset}/{split}"
    stored = cache.kinds(backbone, dataset, split)
    if not stored:
        raise NotInStoreError(_missing_group(cache, backbone, dataset, split))
    asked = _asked_kinds(kinds, stored, where)
    targets = [k for k in stored if is_target_kind(k)]
    if MASK_KIND not in targets and DEPTH_KIND not in targets:
        raise NotInStoreError(
            f"{where} holds features ({', '.join(stored)}) but no dense target (mask or depth), so it cannot "
            f"be used for dense evaluation: extract it from a dense dataset spec ({_DENSE_SPECS}) so the "
            "targets are stored beside the tokens, with --overwrite or into another --backbone-name"
        )
    loaded = {k: cache.load(backbone, dataset, split, kind=k, lazy=True, check=check) for k in (*asked, *targets)}
    geometry, info = _common_record(loaded, where)
    first = loaded[asked[0]]
    for k, f in loaded.items():
        _check_shape(k, f.X.shape, geometry, where)
    tables = {k: np.asarray(loaded[k].X[:]) for k in targets if k in _TABLES}
    _check_pairing(cache, backbone, dataset, split, first.ids, tables, where)
    target = MASK_KIND if MASK_KIND in targets else DEPTH_KIND
    return DenseRows(
        split=split,
        geometry=geometry,
        info=info,
        ids=first.ids,
        valid=np.asarray(first.valid, bool),
        kinds={k: loaded[k].X for k in asked},
        target=loaded[target].X,
        target_valid=loaded[DEPTH_VALID_KIND].X if DEPTH_VALID_KIND in loaded else None,
        tables=tables,
        full={k: loaded[k].X for k in targets if k.startswith(FULL_PREFIX)},
    )


def _missing_group(cache: FeatureCache, backbone: str, dataset: str, split: str) -> str:
    """The one line for a dense group that is not stored: the flag that stores it."""
    base, geom = parse_dense_split(split)
    have = dense_groups(cache, backbone, dataset).get(base, [])
    flag = EXTRACT_FLAGS.get(re.sub(r"\d+$", "", geom))
    how = f"re-run the dense extract of {base} with {flag}" if flag else f"extract {base} from a dense dataset spec"
    return (
        f"no dense group {split} for {backbone}/{dataset} (stored for {base}: {have or 'none'}): {how} "
        f"({_DENSE_SPECS}); `featcache ls` lists what the store holds"
    )


def _asked_kinds(kinds: Sequence[str], stored: list[str], where: str) -> list[str]:
    asked = list(dict.fromkeys(kinds))
    if not asked or any(is_target_kind(k) for k in asked):
        raise ConfigError(
            f"read_dense({where!r}, kinds={list(kinds)!r}): ask for one or more model kinds (tokens, cls, "
            "layer{i}_tokens...); the group's targets are read with them"
        )
    lost = [k for k in asked if k not in stored]
    if lost:
        raise NotInStoreError(
            f"{where} stores no {', '.join(lost)} (it holds {', '.join(stored)}): re-run its dense extract with "
            f"--features {','.join(k for k in dict.fromkeys([*stored, *lost]) if not is_target_kind(k))} and "
            "--overwrite"
        )
    return asked


def _common_record(loaded: dict[str, Any], where: str) -> tuple[Geometry, DenseInfo]:
    """The geometry and dense info every kind of the group records (one line when one records none
    or another one)."""
    recs = {}
    for k, f in loaded.items():
        extra = f.provenance.get("extra", {}) or {}
        if "geometry" not in extra or "dense" not in extra:
            raise CorruptStoreError(
                f"{where}/{k} records no dense geometry (provenance extra['geometry'] and extra['dense']): it was "
                f"not written by a dense extract; re-extract the split from a dense dataset spec ({_DENSE_SPECS}) "
                "with --overwrite"
            )
        recs[k] = (extra["geometry"], extra["dense"])
    (k0, r0), *rest = recs.items()
    for k, r in rest:
        for part, a, b in (("geometry", r0[0], r[0]), ("dense info", r0[1], r[1])):
            if a != b:
                raise CorruptStoreError(
                    f"{where}: {k} records another {part} than {k0} ({b} vs {a}), so its rows cannot be paired with "
                    "them; re-extract the split with --overwrite (every kind from one run)"
                )
    geometry = Geometry.from_record(r0[0])
    d = dict(r0[1])
    for name in ("class_names", "depth_range"):
        if isinstance(d.get(name), list):
            d[name] = tuple(d[name])
    return geometry, DenseInfo(**d)


def _check_shape(kind: str, shape: tuple[int, ...], geometry: Geometry, where: str) -> None:
    """A token kind's ``T`` against the grid; a target's ``[H, W]`` against ``target_size``; a table's width."""
    gh, gw = geometry.grid
    if _TOKEN_KIND.match(kind) and (len(shape) != 3 or shape[1] != gh * gw):
        raise CorruptStoreError(
            f"{where}/{kind}: {shape[1] if len(shape) > 1 else '?'} tokens a row, but the recorded grid "
            f"{gh}x{gw} gives {gh * gw}: tokens and targets would be paired on another grid; re-extract the "
            "split with --overwrite"
        )
    if kind in (MASK_KIND, DEPTH_KIND, DEPTH_VALID_KIND) and tuple(shape[1:]) != tuple(geometry.target_size):
        raise CorruptStoreError(
            f"{where}/{kind}: targets of {tuple(shape[1:])} a row, but the recorded geometry gives "
            f"{tuple(geometry.target_size)}; re-extract the split with --overwrite"
        )
    if kind in _TABLES and tuple(shape[1:]) != _TABLES[kind]:
        raise CorruptStoreError(f"{where}/{kind}: rows of {tuple(shape[1:])}, expected {_TABLES[kind]}")


def _check_pairing(
    cache: FeatureCache, backbone: str, dataset: str, split: str, ids: np.ndarray, tables: dict, where: str
) -> None:
    """A ``win`` group's rows against its base split's; a ``view``/``flip`` group's ids."""
    base, geom = parse_dense_split(split)
    if geom == "resize":
        return
    if base not in cache.splits(dataset):
        raise NotInStoreError(f"{where}: its base split {base} is not in {dataset}; extract {base} first")
    base_ids = cache.split_rows(dataset, base, check=True)[0]
    if geom != "win":
        if len(ids) != len(base_ids) or (np.asarray(ids) != np.asarray(base_ids)).any():
            raise CorruptStoreError(
                f"{where}: its ids are not {base}'s (a {geom} group holds the rows of {base}, in order), so its "
                "targets would be paired with other images; re-extract the split with --overwrite"
            )
        return
    if WINDOW_KIND not in tables:
        raise CorruptStoreError(f"{where}: a window group without its window table; re-extract it with --overwrite")
    _check_windows(tables[WINDOW_KIND], ids, base_ids, where)


def _check_windows(table: np.ndarray, ids: np.ndarray, base_ids: np.ndarray, where: str) -> None:
    """Each window row points at an existing row of the base split whose id prefixes its own."""
    rows = table[:, WINDOW_FIELDS.index("image_row")].astype(np.int64)
    outside = np.flatnonzero((rows < 0) | (rows >= len(base_ids)))
    if outside.size:
        i = int(outside[0])
        raise CorruptStoreError(
            f"{where}: window row {i} points at image row {int(rows[i])}, outside its base split's "
            f"{len(base_ids)} rows; re-extract the window group with --overwrite"
        )
    want = np.char.add(np.asarray(base_ids, dtype=str)[rows], "#w")
    have = np.asarray(ids, dtype=str)
    wrong = np.flatnonzero(~np.char.startswith(have, want) | ~_window_suffix(have, want))
    if wrong.size:
        i = int(wrong[0])
        raise CorruptStoreError(
            f"{where}: window row {i} has id {str(have[i])!r} but points at image {str(base_ids[rows[i]])!r} (ids are "
            "'{image id}#w{j}'); its target would be stitched into another image: re-extract the window group "
            "with --overwrite"
        )


def _window_suffix(have: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """Whether what follows each prefix is a window number (``#w`` then digits only)."""
    tails = [h[len(p) :] for h, p in zip(have.tolist(), prefix.tolist(), strict=True)]
    return np.asarray([t.isdigit() and t.isascii() for t in tails], bool)


def iter_row_blocks(n: int, bytes_per_row: int, max_memory: int, *, align: int = 1) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` blocks covering rows ``0..n`` whose rows take at most ``max_memory``
    bytes at ``bytes_per_row`` each; ``align``: block sizes a multiple of it where the budget
    holds that many rows (whole stored chunks: pass the group's ``chunk_rows``). A budget below
    one row is refused in one line naming the bytes a row needs."""
    if bytes_per_row < 1 or max_memory < 1 or align < 1 or n < 0:
        raise ConfigError(
            f"iter_row_blocks: n={n}, bytes_per_row={bytes_per_row}, max_memory={max_memory}, align={align}: "
            "give n >= 0 and positive sizes"
        )
    rows = max_memory // bytes_per_row
    if rows < 1:
        raise ConfigError(
            f"--max-memory {max_memory} bytes cannot hold one row ({bytes_per_row} bytes); raise it to at least "
            f"{bytes_per_row} bytes"
        )
    if rows >= align:
        rows -= rows % align
    for start in range(0, n, rows):
        yield start, min(n, start + rows)
