"""Chunk-level integrity of a feature group, through zarr's public Array API only.

Every chunk carries a crc32c checksum (zarr v3 ``crc32c`` codec), so a flipped bit or a
truncated object fails to decode instead of returning other numbers. A chunk object that is
*missing* reads as the fill value; the writer's row invariants make that visible too:

* a row is valid  <=>  its features are not all-NaN (invalid rows are written as NaN)
* a row is valid  <=>  its error text is empty (invalid rows always carry a reason; the
  ``error`` array's fill value is a reason too, so a lost chunk of valid rows shows)

An integer target kind (a dense ``mask``, ``depth_valid``, ``image_size``, ``window``: issue 57)
has no NaN: its invalid rows hold 0 (its fill value), a valid row may hold anything (a window of
background only is all 0), so a lost chunk object of such an array is found by its absence from
the store (:func:`missing_chunks`: one existence check per marked chunk, no listing), and an
invalid row holding values breaks "invalid <=> fill".

A row chunk marked done whose arrays break an invariant (or fail to decode) is *damaged*:
readers refuse it, ``verify`` names it, and a re-run of the same extract recomputes it.
Works on every zarr store (local, memory, object stores), with no listing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

AUX_ARRAYS = ("valid", "error", "done")
#: fill value of the ``error`` array: a lost chunk of valid rows reads as this text, which
#: breaks "valid <=> empty error" (stores written before it filled with "": undetectable there)
UNWRITTEN_ERROR = "not computed (chunk not written)"


def as_str(a) -> np.ndarray:
    """zarr returns numpy's variable-width StringDType; hand out plain ``<U`` arrays."""
    a = np.asarray(a)
    if a.dtype.kind == "U":
        return a
    return np.asarray(a.astype(object), dtype=str) if a.size else np.asarray([], dtype=str)


@dataclass
class GroupScan:
    """What a scan of one feature group found."""

    n_chunks: int
    done: np.ndarray
    damaged: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, dict[int, str]] = field(default_factory=dict)
    missing_arrays: list[str] = field(default_factory=list)
    #: per feature kind, rows read and found all finite (False: NaN/inf, or not read)
    finite: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def bad_chunks(self) -> list[int]:
        return sorted({i for v in self.damaged.values() for i in v})

    @property
    def complete(self) -> bool:
        return bool(self.done.all()) and not self.damaged and not self.missing_arrays

    def add(self, name: str, i: int, why: str) -> None:
        if i not in self.damaged.setdefault(name, []):
            self.damaged[name].append(i)
            self.reasons.setdefault(name, {})[i] = why


def short_error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:120]}"


def read_done(g, n_chunks: int, scan: GroupScan | None = None) -> np.ndarray:
    """``done`` as bool; an unreadable marker counts as not done (and is recorded)."""
    try:
        arr = g["done"]
    except KeyError:
        if scan is not None:
            scan.missing_arrays.append("done")
        return np.zeros(n_chunks, bool)
    try:
        return np.asarray(arr[:], dtype=bool)
    except Exception:
        out = np.zeros(n_chunks, bool)
        for i in range(n_chunks):
            try:
                out[i] = bool(arr[i])
            except Exception as exc:
                if scan is not None:
                    scan.add("done", i, short_error(exc))
        return out


def scan_group(g, n: int, chunk_rows: int, n_chunks: int, kinds, *, chunks=None, finite: bool = False) -> GroupScan:
    """Read every marked row chunk of every array of a feature group and check it;
    ``finite``: also record which rows are all finite (``GroupScan.finite``)."""
    scan = GroupScan(n_chunks, np.zeros(n_chunks, bool))
    scan.done = read_done(g, n_chunks, scan)
    arrays = {}
    for name in (*kinds, "valid", "error"):
        try:
            arrays[name] = g[name]
        except KeyError:
            scan.missing_arrays.append(name)
    todo = np.flatnonzero(scan.done) if chunks is None else [i for i in chunks if scan.done[i]]
    if finite:
        scan.finite = {k: np.zeros(n, bool) for k in kinds if k in arrays}
    lost = {k: set(missing_chunks(arrays[k], todo)) for k in kinds if k in arrays and is_integer(arrays[k])}
    for i in todo:
        i = int(i)
        for k in [k for k, gone in lost.items() if i in gone]:
            scan.add(k, i, "missing (chunk object not found)")
        s, e = i * chunk_rows, min((i + 1) * chunk_rows, n)
        data = {}
        for name, arr in arrays.items():
            try:
                data[name] = np.asarray(arr[s:e])
            except Exception as exc:
                scan.add(name, i, f"unreadable ({short_error(exc)})")
        for k, fin in scan.finite.items():
            if k in data:
                fin[s:e] = row_all(np.isfinite(data[k]))
        check_chunk_rows(scan, i, data, kinds)
    for name in scan.damaged:
        scan.damaged[name].sort()
    return scan


def check_chunk_rows(scan: GroupScan, i: int, data: dict, kinds) -> None:
    if "valid" not in data:
        return
    valid = data["valid"].astype(bool)
    err = as_str(data["error"]) != "" if "error" in data else ~valid
    if "error" in data and (err == valid).any():
        # a lost error chunk reads "", a lost valid chunk reads False: blame the one that disagrees
        # with the features
        blame = "error"
        for k in kinds:
            if k in data and data[k].dtype.kind == "f" and (present_rows(data[k]) == ~err).all():
                blame = "valid"
                break
        scan.add(blame, i, "missing or overwritten (valid and error disagree)")
    for k in kinds:
        if k not in data:
            continue
        if data[k].dtype.kind != "f":
            check_integer_rows(scan, i, k, data[k], valid)
            continue
        present = present_rows(data[k])
        if (present != valid).any():
            lost_valid = (present & ~valid).any() and not valid.any()
            if lost_valid:
                scan.add("valid", i, "missing (rows with features are marked invalid)")
            else:
                scan.add(k, i, "missing (valid rows without features)")


def is_integer(arr) -> bool:
    """Whether a stored array holds integers (an integer target kind: no NaN fill value)."""
    return np.dtype(arr.dtype).kind in "iub"


def check_integer_rows(scan: GroupScan, i: int, kind: str, x: np.ndarray, valid: np.ndarray) -> None:
    """An integer target's rows of chunk ``i``: an invalid row holds only its fill value (0);
    every row invalid while some hold values means the ``valid`` chunk was lost."""
    held = ~row_all(x == 0) if x.size else np.zeros(len(valid), bool)
    if (held & ~valid).any():
        if not valid.any():
            scan.add("valid", i, "missing (rows with targets are marked invalid)")
        else:
            scan.add(kind, i, "overwritten (invalid rows hold values, featcache writes 0)")


def missing_chunks(arr, chunks) -> list[int]:
    """Row chunks of ``chunks`` whose chunk object ``arr`` does not hold (one existence check
    each, gathered: no listing). A missing object reads as the fill value, which for an
    integer array is a legal value, so this is how its loss shows."""
    import asyncio

    from featcache.store._zarr_internal import sync

    chunks = [int(c) for c in chunks]
    if not chunks:
        return []
    enc, st, rest = arr.metadata.encode_chunk_key, arr.store_path.store, (0,) * (len(arr.shape) - 1)
    keys = [f"{arr.path}/{enc((c, *rest))}" for c in chunks]

    async def probe():
        return await asyncio.gather(*(st.exists(k) for k in keys))

    return [c for c, there in zip(chunks, sync(probe()), strict=True) if not there]


def row_all(mask: np.ndarray) -> np.ndarray:
    """Per row (axis 0), whether every value of a ``[n, ...]`` boolean mask is set."""
    flat = mask.reshape(mask.shape[0], int(np.prod(mask.shape[1:])))  # no -1: 0 rows reshape too
    return np.asarray(flat.all(axis=1))


def present_rows(x: np.ndarray, block_rows: int = 8192) -> np.ndarray:
    """Rows that hold features (not all NaN), checked in row blocks: the NaN mask of a
    whole split would be one byte per value (2.6 GB at 1.28M x 2048). ``x`` is ``[n, D]``
    or ``[n, *inner, D]`` (a row is every value behind its index)."""
    out = np.empty(x.shape[0], bool)
    step = max(1, block_rows // max(1, int(np.prod(x.shape[1:-1]))))  # the same mask size per block
    for s in range(0, x.shape[0], step):
        b = x[s : s + step]
        out[s : s + step] = ~row_all(np.isnan(b if b.dtype.kind == "f" else b.astype(np.float32)))
    return out


def fill_problems(g, kinds) -> dict[str, str]:
    """Arrays of a feature group whose fill value is not the one featcache's writer sets, as
    name -> why. A chunk object that is missing reads as the fill value, and the writer's
    fill values (NaN features, invalid rows, an error text, not done) are what make a lost
    chunk break the row invariants; any other fill value would hide it (features of zeros
    marked valid), so the array is damage whatever its chunks hold."""
    out = {}
    for name in (*kinds, "valid", "error", "done"):
        try:
            fill = g[name].fill_value
        except KeyError:
            continue  # a missing array is named on its own
        if name in kinds and is_integer(g[name]):
            ok, want = fill is not None and not isinstance(fill, (float, np.floating)) and int(fill) == 0, "0"
        elif name in kinds:
            ok = isinstance(fill, (float, np.floating)) and bool(np.isnan(fill))
            want = "NaN"
        elif name == "valid":
            ok, want = fill is not None and not bool(fill), "false"
        elif name == "error":
            ok, want = str(fill) in (UNWRITTEN_ERROR, ""), repr(UNWRITTEN_ERROR)
        else:
            ok, want = fill is not None and int(fill) == 0, "0"
        if not ok:
            shown = fill.item() if isinstance(fill, np.generic) else fill
            out[name] = (
                f"fill_value {shown!r} in its zarr.json, featcache writes {want} (a missing chunk would read as data)"
            )
    return out


def feature_shape(gm, prov) -> tuple[int, ...]:
    """The shape featcache's writer gives a feature array: the group's rows, the provenance's
    inner dimensions (none for pooled features), its width."""
    return (gm.n, *tuple(getattr(prov, "inner", None) or ()), prov.dim)


def shape_problems(g, gm, provs: dict) -> dict[str, str]:
    """Feature arrays of a group whose shape or chunk rows differ from what its group metadata
    and their provenance give, as kind -> what differs: a ``zarr.json`` changed after it was
    written (its digest perhaps recorded again). Reading such an array would misalign rows
    with their ids, so nothing reads one before it is restored."""
    out = {}
    for kind, prov in provs.items():
        try:
            arr = g[kind]
        except KeyError:
            continue  # a missing array is named on its own
        want = feature_shape(gm, prov)
        chunk = arr.chunks[0] if arr.chunks else None
        # a provenance changed after writing is named on its own: its width is no evidence
        got = tuple(arr.shape) if provenance_sound(arr) else tuple(arr.shape[:1]) + want[1:]
        if got != want or chunk != gm.chunk_rows:
            out[kind] = (
                f"shape {tuple(arr.shape)} in chunks of {chunk} rows, but its group metadata and provenance "
                f"give {want} in chunks of {gm.chunk_rows} rows (changed after it was written)"
            )
    return out


def provenance_sound(arr) -> bool:
    """Whether a feature array's provenance matches the digest its writer kept beside it (or
    none was kept: a store written before provenance digests)."""
    from featcache.store.schema import PROVENANCE_DIGEST_KEY, PROVENANCE_KEY, provenance_digest

    digest = arr.attrs.get(PROVENANCE_DIGEST_KEY)
    return digest is None or digest == provenance_digest(dict(arr.attrs.get(PROVENANCE_KEY, {})))


def shape_restorable(arr, gm, prov, split_n: int | None) -> bool:
    """Whether the evidence a feature array's shape is restored from agrees with itself: the
    group metadata, the provenance (matching its own digest) and the split (when known) on
    rows and chunk rows."""
    return provenance_sound(arr) and gm.n == prov.n and gm.chunk_rows == prov.chunk_rows and split_n in (None, gm.n)


def shape_line(where: str, why: str, path: str, restorable: bool) -> str:
    """The one line for a feature array whose shape differs from its group's: what differs and
    what to run (``verify --repair`` restores it when the evidence agrees, else ``--overwrite``)."""
    if restorable:
        todo = (
            f"run `featcache verify --repair {path}`: it restores the document from them "
            "(no chunk is touched or recomputed)"
        )
    else:
        todo = (
            "they disagree with each other or with the split too, so nothing says which is right: "
            "re-run the extract that wrote it with --overwrite"
        )
    return f"{where}/zarr.json: {why}; {todo}"


def refuse_bad_shape(g, gm, provs: dict, split_n: int | None, path: str) -> None:
    """Raise :class:`~featcache.errors.CorruptStoreError` (one line: what differs, what to
    run) when a feature array of ``provs`` has another shape than its group gives it."""
    from featcache.errors import CorruptStoreError

    for kind, why in shape_problems(g, gm, provs).items():
        ok = shape_restorable(g[kind], gm, provs[kind], split_n)
        raise CorruptStoreError(shape_line(f"{g.path}/{kind}", why, path, ok))
