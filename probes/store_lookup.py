"""What the caches hold for a probe config, read from their records alone (no feature is
read): the caches it names, the one holding a backbone's features for the dataset, the
backbones ``all`` stands for, and the store fingerprints a run id covers.

The stage (:mod:`featcache.probes.runner`) and :func:`run_ids` (the ids a run of a config would
make, which the sweep plans with) use these; they read a :class:`~featcache.probes.config.ProbeConfig`,
which imports nothing of them (a config reads no store).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import TYPE_CHECKING

from featcache.errors import NotInStoreError
from featcache.store import combine_fingerprints

if TYPE_CHECKING:
    from featcache.core.protocols import Protocol
    from featcache.probes.config import ProbeConfig
    from featcache.store import FeatureCache

log = logging.getLogger(__name__)

__all__ = ["TEXT_SOURCE_KEYS", "resolve_val_source", "run_ids", "store_fingerprints", "text_fingerprint"]


def open_caches(cache_path) -> list:
    from featcache.store import open_cache

    paths = (
        [cache_path] if isinstance(cache_path, (str, bytes)) or hasattr(cache_path, "__fspath__") else list(cache_path)
    )
    return [open_cache(str(p)) for p in paths]


def _held(caches) -> dict[str, list[str]]:
    """Dataset -> the backbones with features for it (pairs actually extracted)."""
    out: dict[str, set[str]] = {}
    for c in caches:
        for b, d, _ in c.entries():
            out.setdefault(d, set()).add(b)
    return {d: sorted(bs) for d, bs in sorted(out.items())}


def _not_held(caches, dataset: str, what: str) -> NotInStoreError:
    held = _held(caches)
    if dataset not in held:
        have = f"datasets with features: {list(held)}" if held else "the cache(s) hold no features yet"
        return NotInStoreError(
            f"no dataset {dataset!r} in the given cache(s); {have}. Pass one of them as --dataset "
            "(dataset=), or run `featcache extract` for it first"
        )
    return NotInStoreError(
        f"{what} in the given cache(s); backbones with features for {dataset!r}: {held[dataset]} "
        f"(extracted backbone/dataset pairs: {held}); run `featcache extract` for it first"
    )


def cache_for(caches, backbone: str, dataset: str):
    for c in caches:
        if any(b == backbone and d == dataset for b, d, _ in c.entries()):
            return c
    raise _not_held(caches, dataset, f"no features for backbone {backbone!r} on dataset {dataset!r}")


def _has(cache, backbone, dataset, split) -> bool:
    return any(e == (backbone, dataset, split) for e in cache.entries())


def resolve_backbones(caches, cfg: ProbeConfig) -> list[str]:
    backbones = list(cfg.backbones)
    if backbones == ["all"]:
        backbones = sorted(
            {
                b
                for c in caches
                for b in c.backbones()
                if cfg.dataset in c.datasets() and _has(c, b, cfg.dataset, cfg.train_split)
            }
        )
        if not backbones:
            raise _not_held(caches, cfg.dataset, f"no backbone has features for {cfg.dataset}/{cfg.train_split}")
    return backbones


#: the class-embedding provenance fields a results row records
TEXT_SOURCE_KEYS = ("tower", "weights_sha256", "templates", "templates_sha256", "n_templates", "classnames_sha256")


def text_fingerprint(cache: FeatureCache, b: str, cfg: ProbeConfig) -> str:
    """The part of a head-init run's id that says which class embeddings it read: a digest of
    their recorded provenance (tower weights, templates, class names), so embeddings made
    again from another template set or tower give a new run id and rerun; ``""`` without
    head_init or for a matrix written with ``write_class_embeddings`` (nothing recorded), whose
    runs keep the ids they always had."""
    if not cfg.head_init:
        return ""
    prov = cache.class_embeddings_provenance(cfg.dataset, cfg.head_init, backbone=b)
    rec = {k: prov[k] for k in TEXT_SOURCE_KEYS if k in prov}
    if not rec:
        return ""
    return hashlib.sha256(json.dumps(rec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def store_fingerprints(cfg: ProbeConfig, proto: Protocol) -> dict[str, dict[str, str]]:
    """``{backbone: {eval split: store fingerprint}}`` of a resolved config, as
    :func:`run_probes` computes them, from provenance records only (no feature is read)."""
    caches = open_caches(cfg.cache)
    out = {}
    for b in resolve_backbones(caches, cfg):
        c = cache_for(caches, b, cfg.dataset)
        val = cfg.val_split_used(proto, c.splits(cfg.dataset))
        names: list[str] = [cfg.train_split, *([val] if val else []), *cfg.eval_splits]
        read = dict.fromkeys(names)
        stored = cfg.solver.input_fingerprint or type(c).stored_fingerprint
        fp = {s: stored(c, b, cfg.dataset, s, cfg.kind) for s in read}
        if cfg.views:  # the views' features join the train split's (as run_probes combines them)
            from featcache.probes.views import view_splits

            views = [stored(c, b, cfg.dataset, v, cfg.kind) for v in view_splits(cfg.train_split, cfg.views)]
            fp[cfg.train_split] = combine_fingerprints(fp[cfg.train_split], *views)
        text = [t] if (t := text_fingerprint(c, b, cfg)) else []
        out[b] = {
            es: combine_fingerprints(fp[cfg.train_split], fp[val] if val else "", fp[es], *text)
            for es in cfg.eval_splits
        }
    return out


def resolve_val_source(cfg: ProbeConfig, proto: Protocol, caches: list | None = None) -> ProbeConfig:
    """``cfg`` with ``val_source="auto"`` resolved against the store (``caches``: the opened
    ``cfg.cache``). A protocol whose split plan says so (:attr:`Protocol.auto_official_val`: the
    ``vtab1k`` plan) selects on VTAB's ``val200`` wherever the store holds it: with the default
    split names, on ``train800``/``val200`` when both are stored (as ``--suite vtab-1k``), else
    on the first 200 of the ``val200`` or the dataset's own val split (``official-val``);
    without one, on ``train[800:1000]`` (``split-800-200``). Every other protocol:
    ``split-800-200`` (their plans ignore it; ``vtab1k-stratified`` keeps its earlier rule)."""
    from dataclasses import replace

    if cfg.val_source != "auto":
        return cfg
    if not proto.auto_official_val:
        return replace(cfg, val_source="split-800-200")
    caches = open_caches(cfg.cache) if caches is None else caches
    splits = set(next((c.splits(cfg.dataset) for c in caches if cfg.dataset in c.datasets()), []))
    official = replace(cfg, val_source="official-val")
    default_names = (cfg.train_split, cfg.val_split) == (type(cfg).train_split, type(cfg).val_split)
    if default_names and {"train800", "val200"} <= splits:
        official = replace(official, train_split="train800", val_split="val200")
    elif cfg.val_split == type(cfg).val_split and "val200" in splits and not official.val_split_used(proto, splits):
        official = replace(official, val_split="val200")
    if official.val_split_used(proto, splits):
        log.info(
            "%s: %s selects on VTAB's val200 (%s[:200], official-val); pass val_source='split-800-200' "
            "(--val-source) for train[800:1000]",
            cfg.dataset,
            proto.spec,
            official.val_split_used(proto, splits),
        )
        return official
    log.info("%s: no val split in the store; %s selects on %s[800:1000]", cfg.dataset, proto.spec, cfg.train_split)
    return replace(cfg, val_source="split-800-200")


def run_ids(config: ProbeConfig) -> dict[tuple[str, int, str], str]:
    """``{(backbone, seed, eval split): run id}`` of every run ``config`` makes, from the
    store's provenance records alone (no feature is read): the ids :func:`run_probes`
    skips when they are in the results."""
    proto, cfg = config.resolve()
    cfg = resolve_val_source(cfg, proto)
    return {
        (b, s, es): cfg.run_id(proto, b, s, es, fp)
        for b, fps in store_fingerprints(cfg, proto).items()
        for s in cfg.seeds or ()
        for es, fp in fps.items()
    }
