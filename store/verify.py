"""Integrity check (and store-side repair) of a whole cache (``featcache verify [--repair]``).

``verify`` reads every chunk (each carries a crc32c checksum), recomputes every split's
fingerprint from its ids/labels/class names, and names each bad chunk. ``repair=True``
makes the store consistent again without knowing any stage: damaged row chunks are marked
not done and lost ``valid``/``error``/``done`` arrays recreated; re-running the same
``featcache extract`` then recomputes exactly those chunks (its normal resume). Damaged
ids/labels are rewritten by that re-run too (the split is rebuilt from the data).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from featcache.core.registry import Registry
from featcache.errors import FeatcacheError
from featcache.store.cache import FeatureCache, open_cache
from featcache.store.integrity import fill_problems, row_all
from featcache.store.locks import StoreLock

log = logging.getLogger(__name__)
#: what to do after a full disk stopped ``verify --repair`` (another --cache would lose the store)
REPAIR_NO_SPACE_THEN = (
    "Free space on that device, then run the same `featcache verify --repair` again: the write that "
    "failed changed nothing, and what was repaired before it stays repaired."
)


#: checks of what a stage keeps beside a store (the store knows no stage): name -> ``fn(path,
#: repair) -> problem lines``, registered by the stage, as ``"module:function"`` imported when
#: verify first runs it (``featcache verify`` registers what each stage's cli.py declares)
BESIDE_CHECKS: Registry[Callable[[str, bool], list[str]]] = Registry("check beside a store")


def register_beside_check(name: str, check: Callable[[str, bool], list[str]] | str) -> None:
    """Have ``verify`` run ``check(path, repair)`` too (or the ``"module:function"`` it names),
    its lines counted as problems."""
    BESIDE_CHECKS.register(name, check)


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)
    #: (backbone, dataset, split) -> row chunks that must be recomputed
    to_recompute: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    #: splits whose ids/labels must be rewritten by re-running extract
    bad_splits: list[tuple[str, str]] = field(default_factory=list)
    repaired: bool = False
    #: facts that are no damage (e.g. an old store without provenance digests)
    notes: list[str] = field(default_factory=list)
    #: metadata documents rebuilt by ``repair`` (one line each)
    rebuilt: list[str] = field(default_factory=list)


def verify(
    path, storage_options: dict | None = None, *, repair: bool = False, report: VerifyReport | None = None
) -> list[str]:
    """Return a list of problems (empty when the store is sound). Never raises for damage:
    every exception while checking becomes a problem line naming where it happened, and a
    damaged metadata document hides no other problem (every other node is still checked)."""
    import os

    rep = report if report is not None else VerifyReport()
    local = isinstance(path, (str, os.PathLike)) and os.path.isdir(path)
    skip = _metadata(os.fspath(path), rep, repair) if local else set()
    if "" in skip:
        rep.problems.append("the other checks need the store root's metadata document (see above)")
        return rep.problems
    try:
        cache = open_cache(path, "a" if repair else "r", storage_options=storage_options)
    except FeatcacheError as exc:
        rep.problems.append(str(exc))
        return rep.problems
    splits, entries = _listing(cache, os.fspath(path) if local else None, rep)
    for d, s in splits:
        if not _touches(f"datasets/{d}/{s}", skip):
            _check_split(cache, d, s, rep)
        else:  # its damaged documents are named above; the chunks below them are still read
            _scan_direct(os.fspath(path), f"datasets/{d}/{s}", skip, rep)
    for b, d, s in entries:
        where = f"features/{b}/{d}/{s}"
        if _touches(where, skip):
            _scan_direct(os.fspath(path), where, skip, rep)
            continue
        try:
            _check_group(cache, b, d, s, rep, repair)
        except Exception as exc:
            rep.problems.append(f"{where}: {type(exc).__name__}: {exc}")
    for name in BESIDE_CHECKS if local else ():
        try:
            rep.problems += BESIDE_CHECKS[name](os.fspath(path), repair)
        except Exception as exc:
            rep.problems.append(f"{name}: {type(exc).__name__}: {exc}")
    rep.repaired = repair
    for p in rep.problems:
        log.warning("verify: %s", p)
    for p in rep.notes:
        log.warning("verify: note: %s", p)
    return rep.problems


def _scan_direct(root: str, unit: str, skip: set[str], rep: VerifyReport) -> None:
    """Read every chunk of each array below ``unit`` whose own document zarr accepts, opened by
    its path (no group above it is read): a damaged or missing document of a folder above
    hides no corrupt chunk below it."""
    import os
    import warnings

    import zarr

    from featcache.store.metadata import read_only_store

    store = read_only_store(root)
    base = os.path.join(root, *unit.split("/"))
    names = (
        sorted(n for n in os.listdir(base) if os.path.isfile(os.path.join(base, n, "zarr.json")))
        if os.path.isdir(base)
        else []
    )
    for name in names:
        rel = f"{unit}/{name}"
        if rel in skip:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                arr = zarr.open_array(store=store, path=rel, mode="r", zarr_format=3)
        except Exception:
            continue  # not an array (a foreign node): nothing to read
        step = arr.chunks[0] if arr.chunks else 1
        for i, start in enumerate(range(0, arr.shape[0] if arr.shape else 0, step)):
            try:
                arr[start : start + step]
            except Exception as exc:
                rep.problems.append(
                    f"{rel}: chunk {i} (rows {start}-{min(start + step, arr.shape[0]) - 1}) unreadable "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
                )


def _touches(rel: str, damaged: set[str]) -> bool:
    """Whether node ``rel`` or a node above or inside it has a damaged document."""
    return any(x == rel or rel.startswith(x + "/") or x.startswith(rel + "/") for x in damaged)


def _listing(cache: FeatureCache, local: str | None, rep: VerifyReport):
    """(splits, feature groups): from the documents on disk for a local store (one damaged
    document does not end the listing), else through zarr; metadata digests of other stores."""
    import os

    if local is None:
        from featcache.store.metadata import changed

        moved, bad_units = changed(cache.root.store, set(), cache.path)
        rep.problems.extend(line for _, line in (*moved, *bad_units))
        dsets = _safe(rep, "datasets", cache.datasets) or []
        splits = [(d, s) for d in dsets for s in _safe(rep, f"datasets/{d}", cache.splits, d) or []]
        return splits, _safe(rep, "features", cache.entries) or []
    from featcache.store import manifest
    from featcache.store.metadata import local_nodes

    recorded = [u for u in manifest.units(cache.root.store) if os.path.isdir(os.path.join(local, *u.split("/")))]
    nodes = [
        rel.split("/") for rel in sorted(set(local_nodes(local)) | set(recorded))
    ]  # a unit whose document is gone too
    splits = [tuple(p[1:]) for p in nodes if len(p) == 3 and p[0] == "datasets"]
    entries = [tuple(p[1:]) for p in nodes if len(p) == 4 and p[0] == "features"]
    return splits, entries


def _metadata(path: str, rep: VerifyReport, repair: bool) -> set[str]:
    """Metadata documents of a local store that zarr refuses or that differ from their
    recorded digest, one named problem each. With ``repair`` each derivable one is rebuilt
    (under its unit's lock) and damaged manifests recorded again. Returns the nodes whose
    documents zarr still refuses."""
    from featcache.store import manifest
    from featcache.store.evidence import check_unit
    from featcache.store.metadata import between_changed, changed, damaged, local_nodes, read_only_store
    from featcache.store.metadata import where as where_of

    store = read_only_store(path)
    unlisted: list[tuple[str, str]] = []
    local_nodes(path, unlisted)
    for rel, why in unlisted:
        rep.problems.append(
            f"{rel or 'the store root'}: cannot list this folder ({why}); nothing under it is checked: "
            "make it readable for this user, then run `featcache verify` again"
        )
    found = damaged(path)
    moved, bad_units = changed(store, {rel for rel, _ in found}, path)
    moved += between_changed(store, local_nodes(path), {rel for rel, _ in found}, path)
    items = [*found, *moved]
    rep.problems.extend(line for _, line in (*items, *bad_units))
    lost = _note_undigested(store, path, rep)
    gone = {rel for rel, line in moved if line.startswith(f"{where_of(rel)}: missing")}
    gone_groups = {rel for rel in gone if manifest.unit_of(rel) == rel}  # a lost array is named by its group's check
    untrusted = [u for u, _ in bad_units] + lost  # no digest vouches for these units: the rest of each is the evidence
    named = {rel for rel, _ in found} | gone
    disagree, fixes = [], {}
    for u in untrusted:
        conflicts, rebuilds = check_unit(store, u, named)
        disagree += conflicts
        fixes.update(rebuilds)
    rep.problems.extend(line for _, line in (*disagree, *((rel, line) for rel, (_, line) in fixes.items())))
    blocked = {manifest.unit_of(rel) for rel, _ in disagree}
    # a changed document zarr reads is checked too; a missing one hides its node
    refused = {rel for rel, _ in found} | {rel for rel, _ in unlisted} | gone_groups
    if not repair:
        return refused
    return _rebuild(path, store, items, [u for u in untrusted if u not in blocked], rep, fixes) & refused


def _rebuild(path: str, store, items, units: list[str], rep: VerifyReport, fixes: dict | None = None) -> set[str]:
    from types import SimpleNamespace

    from zarr.storage import LocalStore

    from featcache.store import manifest
    from featcache.store.metadata import all_entries, where
    from featcache.store.space import no_space

    writable = SimpleNamespace(store=LocalStore(path))  # what StoreLock and record need of a root group
    entries = all_entries(store)
    left = set()
    fixes = fixes or {}
    todo = [*items, *((rel, line) for rel, (_, line) in fixes.items() if manifest.unit_of(rel) in units)]
    for rel, _ in sorted(todo, key=lambda it: it[0].count("/") + bool(it[0])):  # groups before their arrays
        try:
            data = fixes[rel][0] if rel in fixes else manifest.rebuild(store, rel, entries)
        except manifest.NotDerivable:
            left.add(rel)  # its problem line says why and what to run
            continue
        unit = manifest.unit_of(rel)
        name = (unit if unit is not None else rel) or "root"
        with (
            StoreLock(writable, name, timeout=0, what=name),
            no_space(path, f"the rebuilt {where(rel)}", len(data), REPAIR_NO_SPACE_THEN),
        ):
            manifest.write_raw(writable.store, manifest.doc_key(rel), data)
        task = rel.startswith("datasets/") and rel.count("/") == 1
        extra = " (a task metric declared for it is not kept: declare it again)" if task else ""
        rep.rebuilt.append(f"{where(rel)}: rebuilt from the store's own metadata{extra}")
    for unit in units:  # digests recorded again only from documents that agree with the rest of their unit
        if not any(manifest.unit_of(rel) == unit for rel in left):
            with (
                StoreLock(writable, unit or "root", timeout=0, what=unit or "root"),
                no_space(path, "digests", 4096, REPAIR_NO_SPACE_THEN),
            ):
                manifest.record(writable, unit)
            rep.rebuilt.append(
                f"{manifest.manifest_key(unit)}: digests recorded again from the documents (they agree with each other)"
            )
    return left


def _note_undigested(store, path: str, rep: VerifyReport) -> list[str]:
    """Units without a digest file: problems (and returned) in a store written with digests,
    where a missing one was deleted; else one note (a store written before digests)."""
    import json

    from featcache.store import manifest
    from featcache.store.metadata import local_nodes

    have = set(manifest.units(store))
    units = {u for rel in local_nodes(path) if (u := manifest.unit_of(rel)) is not None}
    missing = sorted(units - have)
    try:
        digested = manifest.DIGESTS_KEY in json.loads(manifest.read_raw(store, "zarr.json") or b"")["attributes"]
    except (ValueError, KeyError, TypeError):
        digested = False
    if missing and digested:
        cmd = f"featcache verify --repair {path}"
        for unit in missing:
            rep.problems.append(
                f"{manifest.manifest_key(unit)} (metadata digests of {unit or 'the store root'}): missing, though "
                f"the store was written with digests (deleted?); run `{cmd}` (it records them again only "
                "from documents that agree with the rest of their part of the store)"
            )
        return missing
    if missing:
        rep.notes.append(
            f"{len(missing)} of {len(units)} parts of the store have no metadata digests (written before "
            f"them, e.g. {missing[0] or 'the root'}): damage zarr accepts is not detected there"
        )
    return []


def _safe(rep: VerifyReport, where: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        rep.problems.append(f"{where}: {type(exc).__name__}: {exc}")
        return None


def _check_split(cache: FeatureCache, d: str, s: str, rep: VerifyReport) -> None:
    try:
        _ids, labels, meta = cache.split_rows(d, s, check=True)
    except Exception as exc:
        rep.problems.append(f"datasets/{d}/{s}: {exc}")
        rep.bad_splits.append((d, s))
        return
    if len(labels) and (labels.min() < 0 or labels.max() >= len(meta.class_names)):
        rep.problems.append(f"datasets/{d}/{s}: labels outside 0..{len(meta.class_names) - 1}")
        rep.bad_splits.append((d, s))


def _check_group(cache: FeatureCache, b: str, d: str, s: str, rep: VerifyReport, repair: bool) -> None:
    where = f"features/{b}/{d}/{s}"
    g = cache._feature_group(b, d, s)
    gm = cache.group_meta(b, d, s)
    try:
        smeta = cache.split_meta(d, s)
    except Exception:  # a damaged split is named on its own; this group's chunks are still checked
        smeta = None
    if not _check_shapes(cache, g, gm, None if smeta is None else smeta.n, (b, d, s), rep, repair):
        return  # its chunks would be read misaligned: the shape is named (above) first
    sc = cache.scan(b, d, s)
    todo = np.flatnonzero(~sc.done).tolist()
    if todo:
        rep.problems.append(
            f"{where}: {len(todo)} of {gm.n_chunks} chunks not marked done (e.g. {todo[:5]}); re-run extract"
        )
    lost_kinds = [k for k in sc.missing_arrays if k not in ("valid", "error", "done")]
    for name in sc.missing_arrays:
        rep.problems.append(
            f"{where}/{name}: array missing (a feature array, its provenance with it); re-run the "
            "extract that wrote it (below): it recreates the array and recomputes every chunk"
            if name in lost_kinds
            else f"{where}/{name}: array missing; `featcache verify --repair` recreates it, then re-run extract"
        )
    for name, chunks in sorted(sc.damaged.items()):
        missing = [i for i in chunks if sc.reasons[name][i].startswith("missing")]
        unreadable = [i for i in chunks if i not in missing]
        if missing:
            rep.problems.append(
                f"{where}/{name}: chunk objects missing for marked chunks {missing[:10]}; re-run extract to recompute"
            )
        for i in unreadable[:20]:
            rep.problems.append(
                f"{where}/{name}: chunk {i} (rows {i * gm.chunk_rows}-"
                f"{min((i + 1) * gm.chunk_rows, gm.n) - 1}) {sc.reasons[name][i]}"
            )
    if smeta is not None and gm.n != smeta.n:
        rep.problems.append(f"{where}: {gm.n} rows but split has {smeta.n}")
    for name in ("valid", "error"):
        if name in g and g[name].shape != (gm.n,):
            rep.problems.append(f"{where}/{name}: shape {g[name].shape} != ({gm.n},)")
    _check_kinds(cache, g, gm, smeta, sc, b, d, s, rep)
    moved = _check_place(g, where, gm, rep, skip=set(sc.damaged), complete=not todo, store=cache.path)
    for name, why in fill_problems(g, gm.kinds).items():
        rep.problems.append(
            f"{where}/{name}: {why}; `featcache verify --repair` marks every chunk for recomputation, then "
            "re-run the extract that wrote it (it recreates the array)"
        )
        moved.add(name)
    bad = sorted(set(sc.bad_chunks) | set(todo))
    if bad or sc.missing_arrays or moved:
        every = (set(sc.missing_arrays) & {"valid", "error", *lost_kinds}) | moved
        rep.to_recompute[(b, d, s)] = list(range(gm.n_chunks)) if every else bad
        if repair:
            _invalidate(cache, b, d, s, gm, sc, every=bool(moved))


def _check_shapes(
    cache: FeatureCache, g, gm, split_n: int | None, key: tuple[str, str, str], rep: VerifyReport, repair: bool
) -> bool:
    """Feature arrays whose shape or chunk rows differ from their group's (a ``zarr.json``
    changed after it was written, its digest perhaps recorded again), one line each; with
    ``repair`` restored from the group metadata and provenance where they agree with each
    other and the split. False while one is left: its chunks cannot be read aligned."""
    from featcache.store.integrity import feature_shape, shape_line, shape_problems, shape_restorable

    where = "features/" + "/".join(key)
    provs = {}
    for kind in gm.kinds:
        try:
            provs[kind] = cache.provenance(key[0], key[1], key[2], kind)
        except Exception:
            continue  # a missing or unreadable provenance is named by the kinds' check
    left = False
    for kind, why in shape_problems(g, gm, provs).items():
        ok = shape_restorable(g[kind], gm, provs[kind], split_n)
        shape = feature_shape(gm, provs[kind])
        rep.problems.append(shape_line(f"{where}/{kind}", why, cache.path, ok))
        if repair and ok and _restore_shape(cache, f"{where}/{kind}", shape, gm.chunk_rows):
            rep.rebuilt.append(
                f"{where}/{kind}/zarr.json: shape {shape} in chunks of {gm.chunk_rows} rows restored from its "
                "group metadata and provenance (no chunk touched)"
            )
        else:
            left = True
    return not left


def _restore_shape(cache: FeatureCache, rel: str, shape: tuple[int, ...], chunk_rows: int) -> bool:
    """Rewrite feature array ``rel``'s document with ``shape`` and row chunks of ``chunk_rows``
    (everything else as it is), and its unit's digests with it, under the unit's writer lock.
    False (nothing written) when another document of the unit differs from its digest: those
    are named on their own, and recording the digests now would bless them."""
    import json

    from featcache.store import manifest
    from featcache.store.space import no_space

    store, unit, key = cache.root.store, manifest.unit_of(rel) or "", manifest.doc_key(rel)
    try:
        body = manifest.load(store, unit)
    except ValueError:
        return False
    docs = (body or {}).get("documents", {})
    if any(manifest.sha256(manifest.read_raw(store, k) or b"") != e.get("sha256") for k, e in docs.items() if k != key):
        return False
    doc = json.loads(manifest.read_raw(store, key) or b"{}")
    doc["shape"] = list(shape)
    doc["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [chunk_rows, *shape[1:]]}}
    data = json.dumps(doc, indent=2).encode()  # as zarr writes its documents
    with (
        StoreLock(cache.root, unit, timeout=0, what=unit),
        no_space(cache.path, f"the restored {key}", len(data), REPAIR_NO_SPACE_THEN),
    ):
        manifest.write_raw(store, key, data)
        if body is not None:
            manifest.record(cache.root, unit)
    return True


def _check_place(g, where: str, gm, rep: VerifyReport, skip: set[str], complete: bool, store: str) -> set[str]:
    """The group bound to its place (:func:`~featcache.store.summary.check_place`); returns the
    arrays whose chunks were moved there from elsewhere, or ``summary`` for a complete group
    without its summary (every chunk must be recomputed: nothing binds them to it).
    ``skip``: arrays with damaged chunks, already named chunk by chunk (a truncated chunk also
    changes the array's chunk digest; naming it twice would say "moved" of a damaged chunk)."""
    from featcache.store.summary import check_place

    names = [n for n in (*gm.kinds, "valid", "error", "done") if n not in skip]
    found, note = check_place(g, where, gm, names, complete=complete, store=store)
    rep.problems.extend(line for _, line in found)
    if note:
        rep.notes.append(note)
    return {name for name, _ in found if name}


def _check_kinds(cache, g, gm, smeta, sc, b, d, s, rep: VerifyReport) -> None:
    where = f"features/{b}/{d}/{s}"
    try:
        valid = np.asarray(g["valid"][:], dtype=bool)
    except Exception:
        valid = np.zeros(gm.n, bool)
    ok = np.repeat(sc.done, gm.chunk_rows)[: gm.n]
    for i in sc.bad_chunks:
        ok[i * gm.chunk_rows : (i + 1) * gm.chunk_rows] = False
    check = valid & ok
    for kind in gm.kinds:
        if kind not in g:
            continue  # named as a missing array above
        try:
            prov = cache.provenance(b, d, s, kind)
        except FeatcacheError as exc:
            rep.problems.append(f"{where}/{kind}: {exc}")
            continue
        arr = g[kind]
        if arr.shape != (gm.n, *prov.row_shape):
            rep.problems.append(f"{where}/{kind}: shape {arr.shape} != {(gm.n, *prov.row_shape)}")
            continue
        _check_provenance_against(arr, prov, gm, f"{where}/{kind}", rep)
        if smeta is not None and prov.dataset_fingerprint != smeta.fingerprint:
            rep.problems.append(f"{where}/{kind}: computed on other rows of {d}/{s} (fingerprint mismatch)")
        for start in range(0, gm.n, gm.chunk_rows):
            stop = min(start + gm.chunk_rows, gm.n)
            if not check[start:stop].any():
                continue
            x = np.asarray(arr[start:stop])[check[start:stop]]
            bad = ~row_all(np.isfinite(x))
            if bad.any():
                rows = (np.flatnonzero(check[start:stop])[bad] + start)[:5].tolist()
                rep.problems.append(f"{where}/{kind}: {int(bad.sum())} valid row(s) with NaN/inf (rows {rows})")


def _check_provenance_against(arr, prov, gm, where: str, rep: VerifyReport) -> None:
    """The provenance document against the array it describes, and against its digest."""
    from featcache.store.schema import PROVENANCE_DIGEST_KEY, PROVENANCE_KEY, provenance_digest

    if str(arr.dtype) != prov.dtype:
        rep.problems.append(f"{where}: provenance says dtype {prov.dtype!r}, the array is {arr.dtype}")
    if prov.n != arr.shape[0]:
        rep.problems.append(f"{where}: provenance says n {prov.n}, the array has {arr.shape[0]} rows")
    if prov.chunk_rows != arr.chunks[0] or prov.chunk_rows != gm.chunk_rows:
        rep.problems.append(
            f"{where}: provenance says chunk_rows {prov.chunk_rows}, the array's chunks hold {arr.chunks[0]} rows"
        )
    attrs = arr.attrs
    stored = attrs.get(PROVENANCE_DIGEST_KEY)
    if stored is None:
        rep.notes.append(f"{where}: provenance digest absent (store written before digests); values checked only")
    elif stored != provenance_digest(dict(attrs[PROVENANCE_KEY])):
        rep.problems.append(
            f"{where}/zarr.json: provenance does not match its digest (a field was changed after writing); "
            "re-extract with --overwrite"
        )


def _invalidate(cache: FeatureCache, b: str, d: str, s: str, gm, sc, every: bool = False) -> None:
    """Store-side repair under the group's writer lock: lost aux arrays recreated, damaged
    chunks marked not done (every chunk when a feature array is lost: the re-run recreates
    it). Features are recomputed by re-running the same extract."""
    from featcache.store.space import no_space
    from featcache.store.writer import create_aux_array

    path = f"features/{b}/{d}/{s}"
    with (
        StoreLock(cache.root, path, timeout=0, what=path),
        no_space(cache.path, f"{path}'s chunk markers", 4096, REPAIR_NO_SPACE_THEN),
    ):
        g = cache._feature_group(b, d, s)
        for name in sc.missing_arrays:
            if name in ("valid", "error", "done"):
                create_aux_array(g, name, gm.n, gm.chunk_rows, gm.n_chunks)
        done = g["done"]
        if every or set(sc.missing_arrays) - {"done"}:  # valid/error, a feature array or moved chunks: every chunk
            done[:] = 0
        for i in sc.bad_chunks:
            done[i] = 0
        log.info("%s: %d chunk(s) marked for recomputation", path, len(sc.bad_chunks))
