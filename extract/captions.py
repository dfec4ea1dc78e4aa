"""Caption embeddings for image-text retrieval (``featcache embed-captions``).

Captions are read from CLIP_benchmark's retrieval export (``DIR/<split>/*.tar``, each sample an
image plus a ``.txt`` member holding its captions one per line, as ``webdataset_builder``'s
``convert_retrieval_dataset`` writes them; image ids ``<split>/<__key__>`` as the
``clip-benchmark:`` reader names them) or from a manifest (CSV/parquet) with a ``caption``
column and the image's ``id`` (default: its ``path``, as the ``manifest:`` reader names it):
several rows of one image, or several lines in one cell, are several captions. Each caption goes
through the backbone's text tower (open_clip ``encode_text``, HF ``CLIPModel``) and is stored,
unnormalised, with the id of its image (:func:`featcache.store.write_caption_embeddings`).
"""

from __future__ import annotations

import logging
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

BATCH = 256


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _wds_captions(d: Path, split: str) -> dict[str, list[str]]:
    """``{<split>/<key>: captions}`` from the ``.txt`` members of ``d/<split>/*.tar``."""
    shards = sorted((d / split).glob("*.tar"), key=_natural)
    if not shards:
        have = sorted(p.name for p in d.iterdir() if p.is_dir())
        raise DataError(f"{d}/{split} holds no *.tar shards (splits there: {have})")
    out: dict[str, list[str]] = {}
    for shard in shards:
        with tarfile.open(shard) as tf:
            for m in tf:
                base = m.name.rsplit("/", 1)[-1]
                stem, _, ext = base.partition(".")  # webdataset's key: up to the first dot
                if m.isfile() and ext == "txt":
                    key = m.name[: len(m.name) - len(base)] + stem
                    # convert_retrieval_dataset escapes newlines inside a caption as a literal \n
                    fh = tf.extractfile(m)
                    assert fh is not None  # a regular file member
                    lines = fh.read().decode("utf-8").splitlines()
                    out[f"{split}/{key}"] = [c for c in lines if c.strip()]
    return out


def _manifest_captions(f: Path, split: str | None) -> dict[str, list[str]]:
    import polars as pl

    df = pl.read_parquet(f) if f.suffix.lower() in (".parquet", ".pq") else pl.read_csv(f, infer_schema_length=10000)
    if "caption" not in df.columns or not ({"id", "path"} & set(df.columns)):
        raise DataError(f"captions manifest {f} needs a caption column and id or path (it has {df.columns})")
    if split is not None and "split" in df.columns:
        df = df.filter(pl.col("split").cast(pl.Utf8) == split)
    key = "id" if "id" in df.columns else "path"
    out: dict[str, list[str]] = {}
    for i, c in zip(df[key].cast(pl.Utf8).to_list(), df["caption"].cast(pl.Utf8).to_list()):
        out.setdefault(i, []).extend(x for x in (c or "").splitlines() if x.strip())
    return out


def read_captions(spec: str, split: str) -> dict[str, list[str]]:
    """``{image id: [caption, ...]}`` of ``split`` from a CLIP_benchmark export folder or a manifest."""
    p = Path(spec.split(":", 1)[1] if spec.startswith(("clip-benchmark:", "manifest:")) else spec).expanduser()
    if p.is_dir():
        out = _wds_captions(p, split)
    elif p.is_file():
        out = _manifest_captions(p, split)
    else:
        raise ConfigError(f"--captions {spec}: give CLIP_benchmark's export folder or a manifest with a caption column")
    if not any(out.values()):
        raise DataError(f"--captions {spec}: no captions for split {split!r}")
    return out


def run(
    cache_path: str,
    model: Any,
    weights: str | None,
    dataset: str,
    split: str,
    captions: str,
    *,
    backbone: str | None = None,
    device: str = "cpu",
) -> tuple[str, int, int]:
    """Embed the captions of ``dataset``/``split``'s stored images -> (backbone key, images, captions)."""
    import torch

    from featcache.core.prompts import templates_sha256
    from featcache.extract.text import text_tower_backbone
    from featcache.store import open_cache, write_caption_embeddings

    cache = open_cache(cache_path, "a")
    if dataset not in cache.datasets() or split not in cache.splits(dataset):
        raise ConfigError(f"{dataset}/{split} is not in {cache_path}; extract its images first (featcache extract)")
    ids = set(np.asarray(cache.split_rows(dataset, split)[0]).astype(str).tolist())
    caps = read_captions(captions, split)
    missing = [i for i in caps if i not in ids]
    if missing:
        raise DataError(
            f"{len(missing)} captioned images are not in {dataset}/{split} of the store (e.g. {missing[0]!r}); "
            "extract the same images (same --data) first"
        )
    bb = text_tower_backbone(cache, dataset, backbone, model, weights, device)  # after the captions are matched
    image_ids = [i for i, cs in caps.items() for _ in cs]
    texts = [c for cs in caps.values() for c in cs]
    with torch.no_grad():
        emb = torch.cat([bb.text_tower.encode(texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)])
    key = backbone or bb.default_key
    prov = {
        "tower": bb.text_tower.name,
        "weights_sha256": bb.weights_sha256,
        "captions": Path(captions).name,
        "captions_sha256": templates_sha256([f"{i}\t{c}" for i, c in zip(image_ids, texts)]),
        "n_captions": len(texts),
    }
    write_caption_embeddings(cache, dataset, split, key, emb.float().cpu().numpy(), np.asarray(image_ids), prov)
    logger.info("caption embeddings %s/%s/%s: %d captions of %d images", dataset, split, key, len(texts), len(caps))
    return key, len(caps), len(texts)
