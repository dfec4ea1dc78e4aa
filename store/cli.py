"""``featcache ls``, ``featcache open``, ``featcache verify``, ``featcache publish`` and ``featcache pull``."""

from __future__ import annotations

import argparse
from typing import Any

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 40


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
    p.add_argument(
        "--storage-option",
        action="append",
        dest="storage_options",
        metavar="KEY=VALUE",
        help="fsspec option for an s3://... cache (repeatable), e.g. endpoint_url=http://host:9000, "
        "key=..., secret=...; or env FEATCACHE_STORAGE_OPTIONS='{json}'",
    )


def run_ls(args: argparse.Namespace) -> int:
    from featcache.store.cache import open_cache

    cache = open_cache(args.path, storage_options=parse_storage_options(args.storage_options))
    print_catalog(cache, args.path, args.long)
    return 0


def print_catalog(cache, path: str, long: bool = False) -> None:
    """What ``featcache ls`` prints: the catalog (backbones, datasets, splits, kinds, shapes,
    rows) and a line per group that is not complete."""
    import polars as pl

    cat = cache.catalog()
    if cat.is_empty():
        print(f"{path}: no features yet")
        return
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=60, tbl_width_chars=200):
        # the short view: what a store holds; when and how fast it was extracted is in -l
        short = [c for c in ("created", "extract_threads", "load_avg") if c in cat.columns]
        print(cat.drop(short) if not long else cat)
    for line in _not_complete(cache, cat, path):
        print(line)


def run_open(args: argparse.Namespace) -> int:
    """Open any store path (local, s3://, hf://), say where it was read from, check its metadata
    documents against their digests (``--verify``: every chunk's checksum too) and print its
    catalog as ``ls`` does."""
    import os

    from featcache.store.cache import open_cache
    from featcache.store.hub import hub_origin, is_hub_url
    from featcache.store.metadata import changed
    from featcache.store.verify import verify

    opts = parse_storage_options(args.storage_options)
    cache = open_cache(args.path, storage_options=opts)
    if is_hub_url(args.path):
        origin = hub_origin(args.path, cache.root.store)
    else:
        local = os.path.isdir(args.path)
        store = type(cache.root.store).__name__
        origin = f"a local store at {os.path.abspath(args.path)}" if local else f"read through zarr's {store}"
    print(f"{args.path}: {origin}")
    if args.verify:
        problems, what = verify(args.path, storage_options=opts), "every chunk's checksum and the metadata"
    else:
        moved, bad_units = changed(cache.root.store, set(), args.path)
        problems, what = [line for _, line in (*moved, *bad_units)], "the metadata documents against their digests"
    print_catalog(cache, args.path, args.long)
    for p in problems:
        print(f"PROBLEM {p}")
    if problems:
        print(f"{args.path}: {len(problems)} problem(s); {_what_next(args.path)}")
        return 1
    print(f"{args.path}: OK ({what} checked" + ("" if args.verify else "; --verify reads every chunk") + ")")
    return 0


def _what_next(path: str) -> str:
    from featcache.store.hub import is_hub_url

    if is_hub_url(path):  # read-only here: nothing to repair or re-run in place
        return (
            "a published store is read-only here: pull it again (`featcache pull URL DEST` verifies every chunk "
            "before DEST appears), or ask its publisher to re-upload it"
        )
    return f"`featcache verify {path}` names what to run"


def _not_complete(cache, cat, path: str) -> list[str]:
    """One line per group that is not complete: rows never computed (an interrupted extract,
    resumed by the same command) or damage (what `verify` names)."""
    out = []
    seen = set()
    for r in cat.filter(~cat["complete"]).iter_rows(named=True):
        key = (r["backbone"], r["dataset"], r["split"])
        if key in seen:
            continue
        seen.add(key)
        where = "/".join(key)
        if r["n_not_computed"]:
            out.append(
                f"{where}: {r['n_not_computed']} of {r['n']} rows not computed yet (an extract was interrupted, "
                f"or is running): resume with {_extract_hint(cache, *key, path)}"
            )
        else:
            out.append(f"{where}: damaged; `featcache verify {path}` names what, and what to run")
    return out


def run_verify(args: argparse.Namespace) -> int:
    from featcache.errors import ConfigError
    from featcache.store.cache import open_cache
    from featcache.store.hub import is_hub_url
    from featcache.store.verify import VerifyReport, verify

    if args.repair and is_hub_url(args.path):
        raise ConfigError(
            f"{args.path} is read-only here, nothing to repair in place: pull it (`featcache pull URL DEST`) and "
            "verify or repair the copy, or ask its publisher to re-upload it"
        )
    opts = parse_storage_options(args.storage_options)
    rep = VerifyReport()
    problems = verify(args.path, storage_options=opts, repair=args.repair, report=rep)
    for note in rep.notes:
        print(f"NOTE {note}")
    if not problems:
        print(f"{args.path}: OK")
        return 0
    for p in problems:
        print(f"PROBLEM {p}")
    for line in rep.rebuilt:
        print(f"REPAIRED {line}")
    if args.repair and not rep.to_recompute and not rep.bad_splits and not verify(args.path, storage_options=opts):
        print(f"{args.path}: {len(problems)} problem(s) repaired; it verifies OK now")
        return 0
    print(
        f"{args.path}: {len(problems)} problem(s)"
        + (f", {len(rep.rebuilt)} metadata document(s) rebuilt" if rep.rebuilt else "")
    )
    if is_hub_url(args.path):
        print(_what_next(args.path))
        return 1
    if rep.to_recompute or rep.bad_splits:
        print("to repair:" if not args.repair else "repaired the store side; now recompute:")
        for d, s in rep.bad_splits:
            print(f"  datasets/{d}/{s}: re-run any `featcache extract` of this split (ids/labels are rewritten)")
        cache = open_cache(args.path, storage_options=opts)
        for (b, d, s), chunks in sorted(rep.to_recompute.items()):
            print(
                f"  features/{b}/{d}/{s}: {len(chunks)} chunk(s) {chunks[:10]} -> re-run "
                f"{_extract_hint(cache, b, d, s, args.path)}"
            )
        if not args.repair:
            print(
                "`featcache verify --repair` marks them for recomputation first (needed when done/valid/error "
                "arrays are missing); the re-run then recomputes exactly those chunks (a lost feature array "
                "needs no --repair: the re-run recreates it)"
            )
    return 1


def _dense_flags(split: str, p: Any) -> tuple[str, list[str]]:
    """A dense window or flip group's base split and the extract flags that store it
    (``val@win`` -> ``val``, ``--windows --window-short-side S``; ``val@flip`` -> ``--flip``)."""
    geom = (p.extra or {}).get("geometry") or {}
    if split.endswith("@win"):
        side = (geom.get("params") or {}).get("short_side")
        return split[: -len("@win")], ["--windows", *(["--window-short-side", str(side)] if side else [])]
    if split.endswith("@flip"):
        return split[: -len("@flip")], ["--flip"]
    return split, []


def _extract_hint(cache, b: str, d: str, s: str, path: str) -> str:
    """The extract command that recomputes a feature group's damaged chunks, with the settings
    its provenance and its split recorded: data source, limit, views and view seed (a view split
    ``train@viewV`` is re-run as ``--split train --views V+1``), input size, precision."""
    import shlex

    try:
        from featcache.core.dense import is_target_kind

        kinds = [k for k in cache.kinds(b, d, s) if not is_target_kind(k)]  # targets come with the dense split
        g = cache._feature_group(b, d, s)
        p = cache.provenance(b, d, s, next(k for k in kinds if k in g))  # a kind whose array survives
        dc = p.data_config or {}
        base, view = s.split("@view", 1) if "@view" in s else (s, None)
        base, dense = _dense_flags(base, p)
        source = cache.split_meta(d, base).source
        args = ["--model", p.model_name, "--weights", p.weights_source, "--data", data_spec(source) or f"<{source}>"]
        args += ["--dataset-name", d, "--split", base, "--backbone-name", b, *dense]
        if "input_size" in dc:
            h, w = (int(x) for x in dc["input_size"][-2:])
            args += ["--input-size", str(w) if h == w else f"{h}x{w}"]
        if isinstance(dc.get("view"), dict):
            args += ["--views", str(int(dc["view"]["index"]) + 1), "--view-seed", str(int(dc["view"]["seed"]))]
        elif view is not None:
            args += ["--views", str(int(view) + 1)]
        args += ["--chunk-rows", str(p.chunk_rows), "--dtype", p.dtype, "--features", ",".join(kinds)]
        args += [
            "--limit",
            str(cache.split_meta(d, base).n if dense else p.n),
            "--precision",
            {"none": "fp32"}.get(p.amp, p.amp),
            "--cache",
            path,
        ]
        return f"`featcache extract {shlex.join(args)}` (the command that wrote it, as the store recorded it)"
    except Exception:
        try:
            kinds = f"--features {','.join(cache.kinds(b, d, s))} "
        except Exception:
            kinds = ""
        return f"the `featcache extract` command that wrote it ({kinds}--split {s} --cache {path})"


#: recorded split sources (``SplitSource.source``) that are not themselves a data spec
_SOURCE_SPECS = {"sklearn.datasets.load_digits": "digits"}


def data_spec(source: str) -> str | None:
    """The ``--data`` spec that reads a recorded split source again (a ``[:N]`` limit dropped:
    the command gives ``--limit``), None where the source does not say."""
    import re

    source = re.sub(r"(\[:\d+\])+$", "", source)
    if source in _SOURCE_SPECS:
        return _SOURCE_SPECS[source]
    if source.startswith("vtab1k:"):  # vtab1k:DIR/<split>.txt
        return source.rsplit("/", 1)[0]
    if source.startswith("/"):  # the Fashion-MNIST reader records its folder
        return f"fashion-mnist:{source}"
    if re.match(r"^(imagefolder|manifest|webdataset):", source):
        return source
    return None


def run_publish(args: argparse.Namespace) -> int:
    from featcache.store.publish import PublishConfig, publish

    kinds = tuple(k for item in args.kinds or [] for k in item.split(",") if k) or None
    cfg = PublishConfig(
        args.store, args.out, kinds, args.license, args.name, parse_storage_options(args.storage_options)
    )
    out = publish(cfg)
    print(f"{out}: published (store.zarr/, data/*.parquet, README.md, croissant.json); upload it with")
    print(f"  hf upload ORG/NAME {out} --repo-type dataset")
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from featcache.store.publish import pull

    dest = pull(args.url, args.dest)
    print(f"{dest}: pulled from {args.url}, every chunk verified; read it with `featcache ls {dest}`")
    return 0


def register(sub) -> None:
    p = sub.add_parser("ls", help="print the catalog of a feature cache")
    p.add_argument("path")
    p.add_argument("-l", "--long", action="store_true", help="all columns")
    add_storage_option_argument(p)
    p.set_defaults(func=run_ls)
    p = sub.add_parser(
        "open",
        help="open a store (a path, s3://..., hf://datasets/ORG/NAME[@REV]): where it was read from, its "
        "metadata checked, and its catalog as ls shows it",
    )
    p.add_argument("path")
    p.add_argument("--verify", action="store_true", help="also read every chunk and check its checksum (verify)")
    p.add_argument("-l", "--long", action="store_true", help="all catalog columns")
    add_storage_option_argument(p)
    p.set_defaults(func=run_open)
    p = sub.add_parser("verify", help="re-check every chunk (checksums), fingerprint, shape and provenance")
    p.add_argument("path")
    p.add_argument(
        "--repair",
        action="store_true",
        help="rebuild damaged metadata documents (zarr.json) from the store's own metadata, mark damaged "
        "chunks for recomputation and recreate lost done/valid/error arrays; then re-run the same "
        "extract to recompute exactly those chunks",
    )
    add_storage_option_argument(p)
    p.set_defaults(func=run_verify, beside_checks=True)  # featcache.cli registers the stages' checks
    p = sub.add_parser(
        "publish",
        help="write a store as a Hub-ready dataset folder (the store, Parquet, dataset card, Croissant 1.1)",
    )
    p.add_argument("store", help="the store to publish (a path, s3://..., hf://datasets/ORG/NAME)")
    p.add_argument("out", help="a new folder: upload it as a Hub dataset (hf upload ORG/NAME OUT --repo-type dataset)")
    p.add_argument(
        "--kinds",
        nargs="+",
        metavar="KIND",
        help="publish only these feature kinds (e.g. pooled; comma-separated or repeated); default: all",
    )
    p.add_argument(
        "--license",
        help="the dataset card's license (a Hub license id, e.g. cc-by-4.0); default: the store's recorded one, else other",
    )
    p.add_argument(
        "--name",
        help="the dataset's name in the card and croissant.json: ORG/NAME (its Hub repo, also croissant.json's url) "
        "or a title (default: OUT's folder name)",
    )
    add_storage_option_argument(p)
    p.set_defaults(func=run_publish)
    p = sub.add_parser(
        "pull",
        help="fetch a published store (hf://datasets/ORG/NAME[@REV]) into DEST, every chunk verified "
        "(HF_HUB_OFFLINE=1: from the local Hub cache)",
    )
    p.add_argument("url", help="hf://datasets/ORG/NAME[@REVISION][/FOLDER] (HF_ENDPOINT: another Hub)")
    p.add_argument("dest", help="a new folder: the store (featcache ls DEST)")
    p.set_defaults(func=run_pull)
