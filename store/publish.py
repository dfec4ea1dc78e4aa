"""``featcache publish`` and ``featcache pull``: a store as a Hub-ready dataset folder, and back.

The folder ``publish`` writes::

    OUT/store.zarr/                     the store (byte for byte; with --kinds, those kinds rewritten
                                        through the store's writer, checksums and digests new)
    OUT/data/<backbone>--<dataset>/<split>.parquet
                                        the [N, D] kinds: id, label, valid and one list<float32>
                                        column per kind, rows in the store's order
    OUT/README.md                       the dataset card: the Hub's YAML (configs naming the Parquet
                                        files, license, the backbones with their weights' sha256,
                                        datasets, splits, kinds and shapes) and the same as text
    OUT/croissant.json                  Croissant 1.1 JSON-LD, written last: a folder holding it is
                                        complete

The store knows no stage, and publishing or pulling reads and writes only the store, so this
module is store-level (as ``featcache verify``); ``hf://`` URLs open through store/hub.py
wherever a store path is accepted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from featcache.core.dense import is_target_kind
from featcache.errors import ConfigError, CorruptStoreError, NotInStoreError
from featcache.store.cache import FeatureCache, open_cache
from featcache.store.hub import STORE_DIR, HubPath, hub_snapshot

__all__ = ["CROISSANT_1_1", "CROISSANT_CONTEXT", "PublishConfig", "publish", "pull"]

log = logging.getLogger(__name__)

CROISSANT_1_1 = "http://mlcommons.org/croissant/1.1"
#: the Croissant 1.1 JSON-LD context, as mlcroissant writes it for a 1.1 dataset
#: (mlcroissant/_src/core/rdf.py ``make_context`` with a 1.1 context; the test compares them)
CROISSANT_CONTEXT: dict[str, Any] = {
    "@language": "en",
    "@vocab": "https://schema.org/",
    "arrayShape": "cr:arrayShape",
    "citeAs": "cr:citeAs",
    "column": "cr:column",
    "conformsTo": "dct:conformsTo",
    "containedIn": "cr:containedIn",
    "cr": "http://mlcommons.org/croissant/",
    "rai": "http://mlcommons.org/croissant/RAI/",
    "data": {"@id": "cr:data", "@type": "@json"},
    "dataType": {"@id": "cr:dataType", "@type": "@vocab"},
    "dct": "http://purl.org/dc/terms/",
    "description": {"@container": "@language"},
    "equivalentProperty": "cr:equivalentProperty",
    "examples": {"@id": "cr:examples", "@type": "@json"},
    "extract": "cr:extract",
    "field": "cr:field",
    "fileProperty": "cr:fileProperty",
    "fileObject": "cr:fileObject",
    "fileSet": "cr:fileSet",
    "format": "cr:format",
    "includes": "cr:includes",
    "isArray": "cr:isArray",
    "isLiveDataset": "cr:isLiveDataset",
    "jsonPath": "cr:jsonPath",
    "key": "cr:key",
    "md5": "cr:md5",
    "name": {"@container": "@language"},
    "parentField": "cr:parentField",
    "path": "cr:path",
    "recordSet": "cr:recordSet",
    "references": "cr:references",
    "regex": "cr:regex",
    "repeated": "cr:repeated",
    "replace": "cr:replace",
    "samplingRate": "cr:samplingRate",
    "sc": "https://schema.org/",
    "separator": "cr:separator",
    "source": "cr:source",
    "subField": "cr:subField",
    "transform": "cr:transform",
}
_NO_LICENSE = "other"


@dataclass(frozen=True)
class PublishConfig:
    """What ``featcache publish`` writes: ``store`` into the new folder ``out``."""

    store: str
    out: str
    kinds: tuple[str, ...] | None = None  # None: every kind (the Parquet mirror: every [N, D] kind)
    license: str | None = None  # a Hub license id; None: the store's recorded one, else "other"
    name: str | None = None  # ORG/NAME (its Hub repo: Croissant's url) or a title; None: OUT's folder name
    storage_options: dict | None = None


@dataclass(frozen=True)
class _Group:
    backbone: str
    dataset: str
    split: str
    kinds: tuple[str, ...]  # what the published store holds
    vectors: tuple[str, ...]  # the [N, D] ones, mirrored in Parquet

    @property
    def config(self) -> str:
        return _safe(f"{self.backbone}--{self.dataset}")

    @property
    def hf_split(self) -> str:
        return re.sub(r"[^\w]", "_", self.split)  # datasets takes \w+ split names (train@view0 -> train_view0)

    @property
    def parquet(self) -> str:
        return f"data/{self.config}/{self.hf_split}.parquet"


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish(config: PublishConfig) -> Path:
    """Write the Hub-ready folder ``config.out`` (see the module); returns its path. ``out`` must
    not exist or be empty: nothing already there is overwritten."""
    out = Path(config.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder: publish into a new folder (nothing was written)")
    cache = open_cache(config.store, "r", storage_options=config.storage_options)
    groups = _plan(cache, config.kinds)
    out.mkdir(parents=True, exist_ok=True)
    _copy_store(cache, config, out / STORE_DIR, groups)
    files = {g: _write_parquet(cache, g, out / g.parquet) for g in groups if g.vectors}
    lic = config.license or _recorded_license(cache)
    if lic is None:
        log.warning("the store records no license: the card says license: other (give --license ID)")
    name = config.name or out.resolve().name
    (out / "README.md").write_text(_card(cache, groups, name, lic or _NO_LICENSE), encoding="utf-8")
    doc = _croissant(cache, groups, files, name, lic or _NO_LICENSE, out)
    tmp = out / ".croissant.json.partial"
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    os.replace(tmp, out / "croissant.json")  # last: a folder with croissant.json is complete
    return out


def _plan(cache: FeatureCache, kinds: tuple[str, ...] | None) -> list[_Group]:
    """The feature groups and kinds to publish; kinds the store does not hold are refused."""
    entries = cache.entries()
    if not entries:
        raise NotInStoreError(f"{cache.path} holds no features: nothing to publish")
    held = {k for e in entries for k in cache.kinds(*e)}
    missing = sorted(set(kinds or ()) - held)
    if missing:
        raise NotInStoreError(f"kinds {missing} are not in {cache.path}; it holds {sorted(held)}")
    groups = []
    for b, d, s in entries:
        ks = tuple(k for k in cache.kinds(b, d, s) if kinds is None or k in kinds)
        if ks and not all(is_target_kind(k) for k in ks):  # a dense group's targets travel with its features
            ks = tuple(k for k in cache.kinds(b, d, s) if k in ks or is_target_kind(k))
        if ks:
            vec = tuple(  # N-d kinds and dense targets (image_size, window: int tables) stay in Zarr only
                k for k in ks if len(cache.provenance(b, d, s, k).row_shape) == 1 and not is_target_kind(k)
            )
            groups.append(_Group(b, d, s, ks, vec))
    return groups


def _recorded_license(cache: FeatureCache) -> str | None:
    """A license the store recorded (root attribute ``featcache_license``), if any."""
    value = cache.root.attrs.get("featcache_license")
    return str(value) if value else None


def _copy_store(cache: FeatureCache, config: PublishConfig, dst: Path, groups: list[_Group]) -> None:
    """Every kind of a local store: its files byte for byte (locks left out); else the chosen
    kinds through the store's writer (a subset of a group is a new group)."""
    src = config.store
    if config.kinds is None and isinstance(src, str) and os.path.isdir(src):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".featcache-locks", "*.partial", "*.lock"))
        return
    target = open_cache(str(dst), "a")
    for g in groups:
        _copy_group(cache, target, g)


def _copy_group(cache: FeatureCache, target: FeatureCache, g: _Group) -> None:
    """One feature group's chosen kinds written into ``target`` chunk by chunk (each read
    checked against its checksum), with the split's ids, labels and class names."""
    from featcache.store.writer import FeatureWriter
    from featcache.store.writing import ensure_split

    first = cache.load(g.backbone, g.dataset, g.split, g.kinds[0], lazy=True)
    meta = cache.split_meta(g.dataset, g.split)
    ensure_split(target, g.dataset, g.split, first.ids, first.labels, list(first.class_names), meta.source)
    provs = {k: cache.provenance(g.backbone, g.dataset, g.split, k) for k in g.kinds}
    lazy = {k: first if k == g.kinds[0] else cache.load(g.backbone, g.dataset, g.split, k, lazy=True) for k in g.kinds}
    w = FeatureWriter(target, g.backbone, g.dataset, g.split, provs).prepare()
    try:
        for i in w.pending_chunks():
            a, b = w.chunk_range(i)
            feats = {k: np.asarray(f.X[a:b]) for k, f in lazy.items()}
            errs = first.errors[a:b] if first.errors is not None else None
            w.write_chunk(i, feats, first.valid[a:b], errs)
        w.mark_complete()
    finally:
        w.release()


def _write_parquet(cache: FeatureCache, g: _Group, path: Path) -> dict[str, Any]:
    """The group's [N, D] kinds as one Parquet file (float32 lists), streamed a stored chunk of
    rows at a time; returns what the card and Croissant say of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    feats = {k: cache.load(g.backbone, g.dataset, g.split, k, lazy=True) for k in g.vectors}
    f0 = feats[g.vectors[0]]
    n, rows = len(f0), max(1, cache.provenance(g.backbone, g.dataset, g.split, g.vectors[0]).chunk_rows)
    schema = pa.schema(
        [("id", pa.string()), ("label", pa.int64()), ("valid", pa.bool_())]
        + [(k, pa.list_(pa.float32())) for k in g.vectors]
    )
    with pq.ParquetWriter(path, schema) as pw:
        for a in range(0, n, rows):
            b = min(n, a + rows)
            cols = {"id": [str(x) for x in f0.ids[a:b]], "label": f0.labels[a:b], "valid": f0.valid[a:b]}
            for k, f in feats.items():
                X = np.asarray(f.X[a:b], dtype=np.float32)
                cols[k] = pa.ListArray.from_arrays(
                    pa.array(np.arange(0, X.size + 1, X.shape[1], dtype=np.int32)), pa.array(X.reshape(-1))
                )
            pw.write_table(pa.table(cols, schema=schema))
    return {"n": n, "sha256": sha256_file(path), "dims": {k: int(feats[k].X.shape[1]) for k in g.vectors}}


def _card(cache: FeatureCache, groups: list[_Group], name: str, lic: str) -> str:
    """README.md: the Hub's YAML front matter and the same facts as text."""
    from huggingface_hub import DatasetCardData

    configs: dict[str, list[dict[str, str]]] = {}
    for g in groups:
        if g.vectors:
            configs.setdefault(g.config, []).append({"split": g.hf_split, "path": g.parquet})
    facts = _facts(cache, groups)
    data = DatasetCardData(
        license=lic,
        pretty_name=name,
        tags=["featcache", "embeddings", "croissant"],
        task_categories=["image-feature-extraction"],
        configs=[
            {"config_name": c, "data_files": files, **({"default": True} if i == 0 else {})}
            for i, (c, files) in enumerate(configs.items())
        ],
        featcache=facts,
    )
    lines = [f"---\n{data.to_yaml()}\n---", f"# {name}", "", "Features extracted with featcache.", ""]
    if lic == _NO_LICENSE:
        lines += ["The store records no license (`license: other`): set one with `featcache publish --license`.", ""]
    lines += ["| backbone | model | weights | weights sha256 |", "|---|---|---|---|"]
    lines += [
        f"| {b['backbone']} | {b['model']} | {b['weights']} | `{b['weights_sha256']}` |" for b in facts["backbones"]
    ]
    lines += ["", "| dataset | split | rows | classes | source |", "|---|---|---|---|---|"]
    lines += [f"| {d['dataset']} | {d['split']} | {d['n']} | {d['classes']} | {d['source']} |" for d in facts["splits"]]
    lines += ["", "| backbone | dataset | split | kind | shape | dtype | parquet |", "|---|---|---|---|---|---|---|"]
    lines += [
        f"| {k['backbone']} | {k['dataset']} | {k['split']} | {k['kind']} | {k['shape']} | {k['dtype']} | {k['parquet']} |"
        for k in facts["kinds"]
    ]
    lines += [
        "",
        f"The Zarr store is `{STORE_DIR}/`: `featcache pull hf://datasets/ORG/NAME DEST` fetches and verifies it.",
    ]
    return "\n".join(lines) + "\n"


def _facts(cache: FeatureCache, groups: list[_Group]) -> dict[str, list[dict[str, Any]]]:
    """Backbones (model, weights and their sha256), splits, kinds and shapes, as recorded."""
    backbones: dict[str, dict[str, Any]] = {}
    splits: dict[tuple[str, str], dict[str, Any]] = {}
    kinds = []
    for g in groups:
        for k in g.kinds:
            p = cache.provenance(g.backbone, g.dataset, g.split, k)
            backbones.setdefault(
                g.backbone,
                {
                    "backbone": g.backbone,
                    "model": p.model_name,
                    "weights": p.weights_source,
                    "weights_sha256": p.weights_sha256,
                },
            )
            shape = [p.n, *p.row_shape]
            kinds.append(
                {
                    "backbone": g.backbone,
                    "dataset": g.dataset,
                    "split": g.split,
                    "kind": k,
                    "shape": shape,
                    "dtype": p.dtype,
                }
                | {"parquet": g.parquet if k in g.vectors else None}
            )
        if (g.dataset, g.split) not in splits:
            m = cache.split_meta(g.dataset, g.split)
            splits[(g.dataset, g.split)] = {
                "dataset": g.dataset,
                "split": g.split,
                "n": m.n,
                "classes": len(m.class_names),
                "source": m.source,
                "fingerprint": m.fingerprint,
            }
    return {"backbones": list(backbones.values()), "splits": list(splits.values()), "kinds": kinds}


def _croissant(
    cache: FeatureCache, groups: list[_Group], files: dict[_Group, dict[str, Any]], name: str, lic: str, out: Path
) -> dict[str, Any]:
    """The Croissant 1.1 JSON-LD document: one FileObject per Parquet file (sha256, relative
    contentUrl), one RecordSet per feature group (id, label, valid, each kind an array of floats)."""
    facts = _facts(cache, groups)
    models = ", ".join(
        f"{b['backbone']} ({b['model']}, weights sha256 {b['weights_sha256']})" for b in facts["backbones"]
    )
    dist, record_sets = [], []
    for g, info in files.items():
        fid = g.parquet
        dist.append(
            {
                "@type": "cr:FileObject",
                "@id": fid,
                "name": fid,
                "contentUrl": g.parquet,
                "contentSize": f"{(out / g.parquet).stat().st_size} B",
                "encodingFormat": "application/x-parquet",
                "sha256": info["sha256"],
            }
        )
        record_sets.append(_record_set(g, fid, info))
    return {
        "@context": CROISSANT_CONTEXT,
        "@type": "sc:Dataset",
        "name": name,
        "description": f"featcache features of {models}: {len(groups)} feature group(s).",
        "conformsTo": CROISSANT_1_1,
        "citeAs": f"@misc{{{_safe(name)}, title={{{name}}}, note={{featcache features}}}}",
        "datePublished": date.today().isoformat(),
        "license": lic,
        "version": "1.0.0",
        "distribution": dist,
        "recordSet": record_sets,
    } | ({"url": f"https://huggingface.co/datasets/{name}"} if re.fullmatch(r"[\w.-]+/[\w.-]+", name) else {})


def _record_set(g: _Group, fid: str, info: dict[str, Any]) -> dict[str, Any]:
    rs = f"{g.config}/{g.hf_split}"

    def field(col: str, dtype: str, **extra: Any) -> dict[str, Any]:
        return {
            "@type": "cr:Field",
            "@id": f"{rs}/{col}",
            "name": col,
            "dataType": dtype,
            **extra,
            "source": {"fileObject": {"@id": fid}, "extract": {"column": col}},
        }

    fields = [field("id", "sc:Text"), field("label", "sc:Integer"), field("valid", "sc:Boolean")]
    for k in g.vectors:
        fields.append(field(k, "cr:Float32", isArray=True, arrayShape=str(info["dims"][k])))
    return {
        "@type": "cr:RecordSet",
        "@id": rs,
        "name": rs,
        "description": f"{g.backbone} features of {g.dataset}/{g.split}: {info['n']} rows",
        "key": {"@id": f"{rs}/id"},
        "field": fields,
    }


def pull(url: str, dest: str | os.PathLike, *, cache_dir: str | None = None) -> Path:
    """Fetch the store of ``hf://datasets/ORG/NAME[@REV]`` into ``dest`` (through the local Hub
    cache; offline, from it) and verify every chunk's checksum before ``dest`` appears: a damaged
    copy is named and never left as a store."""
    from featcache.store.verify import verify

    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(f"{dest} exists and is not an empty folder: pull into a new folder (nothing was written)")
    folder = hub_snapshot(HubPath.parse(url), cache_dir=cache_dir)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp)  # the Hub cache links to its blobs: the copy holds the files
    problems = verify(str(tmp))
    if problems:
        shutil.rmtree(tmp, ignore_errors=True)
        shown = "; ".join(p.replace(str(tmp), str(dest)) for p in problems[:5])
        raise CorruptStoreError(
            f"{url}: the pulled store does not verify ({len(problems)} problem(s): {shown}); nothing was written to "
            f"{dest}. The copy on the Hub or in the local Hub cache is damaged: delete that snapshot from the cache "
            "(`hf cache rm`) and pull again, or ask the publisher to re-upload"
        )
    if dest.exists():
        dest.rmdir()
    os.replace(tmp, dest)
    return dest
