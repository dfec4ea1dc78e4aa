"""Image-text retrieval as CLIP_benchmark computes it (``featcache retrieve-text``).

Image features (the backbone's stored ``pooled`` features: open_clip's ``encode_image``) and
caption embeddings (its text tower, ``featcache embed-captions``) are L2-normalised; scores are
their dot products. Recall@k is CLIP_benchmark's "any hit": a text query scores 1 when its image
is among the top k images (``t2i_recall@k``, CLIP_benchmark's ``image_retrieval_recall@k``); an
image query scores 1 when at least one of its captions is among the top k texts
(``i2t_recall@k``, its ``text_retrieval_recall@k``); both averaged over the queries. The gallery
is the split's captioned images (CLIP_benchmark's datasets are image-captions pairs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from featcache.errors import DataError

log = logging.getLogger(__name__)


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _any_hit(scores: np.ndarray, positive: np.ndarray, k: int) -> np.ndarray:
    """Per row: 1 when a positive column is among the row's top ``k`` scores (ties: lower column)."""
    k = min(k, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.asarray(np.take_along_axis(positive, top, axis=1).any(axis=1), np.float64)


def text_image_recall(
    images: np.ndarray, texts: np.ndarray, text_image: np.ndarray, ks: Sequence[int]
) -> dict[str, float]:
    """``{i2t_recall@k, t2i_recall@k}`` of images ``[N, D]`` and texts ``[T, D]`` where text ``t``
    describes image ``text_image[t]``; every image needs at least one text."""
    text_image = np.asarray(text_image, np.int64)
    n = images.shape[0]
    if texts.shape[0] != text_image.shape[0] or (text_image.size and not 0 <= text_image.min() <= text_image.max() < n):
        raise DataError(f"text_image needs one image index in [0, {n}) per text (got {text_image.shape[0]} texts)")
    if np.bincount(text_image, minlength=n).min() == 0:
        raise DataError(
            "every image needs at least one caption (CLIP_benchmark's recall@k is over image-caption pairs)"
        )
    scores = _normalise(texts) @ _normalise(images).T  # [T, N]
    positive = np.zeros(scores.shape, bool)
    positive[np.arange(len(text_image)), text_image] = True
    out = {}
    for k in ks:
        out[f"i2t_recall@{k}"] = float(_any_hit(scores.T, positive.T, k).mean())
        out[f"t2i_recall@{k}"] = float(_any_hit(scores, positive, k).mean())
    return out


def run_text_retrieval(
    cache_path: str,
    backbone: str,
    dataset: str,
    split: str = "test",
    ks: Sequence[int] = (1, 5, 10),
    results: str | None = None,
    force: bool = False,
):
    """Recall@k both ways of ``backbone``'s images and caption embeddings of ``dataset``/``split``;
    result rows (kind ``retrieval``, protocol ``image-text``) appended to ``results`` when set.

    A run already in ``results`` is skipped (its stored rows are returned) unless ``force``;
    deciding reads the caption embeddings (for their provenance), not the image features."""
    from featcache.core.stagerun import collect, finished, pending
    from featcache.store import open_cache

    t0 = time.perf_counter()
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise DataError(f"--recall-k needs integers >= 1 (got {ks})")
    cache = open_cache(cache_path, "r")
    emb, image_ids, prov = cache.load_caption_embeddings(dataset, split, backbone)
    done = finished(results, force)
    if done:
        rid = _run_id(backbone, dataset, split, ks, cache.stored_fingerprint(backbone, dataset, split), prov)
        if not pending({backbone: [rid]}, done, lambda b: f"image-text {b}/{dataset}/{split}", results, log):
            return collect("retrieval", results, [], [rid])
    rows = _text_rows(cache_path, cache.load(backbone, dataset, split), emb, image_ids, prov, ks, t0)
    return collect("retrieval", results, rows, [rows[0]["run_id"]])


def _run_id(backbone: str, dataset: str, split: str, ks: list[int], features_fp: str, prov: dict) -> str:
    from featcache.core.results import make_run_id
    from featcache.store import combine_fingerprints

    fp = combine_fingerprints(features_fp, prov.get("captions_sha256", ""))
    return make_run_id(
        kind="retrieval", backbone=backbone, dataset=dataset, protocol="image-text", split=split, ks=ks, fp=fp
    )


def _text_rows(cache_path: str, f, emb: np.ndarray, image_ids, prov: dict, ks: list[int], t0: float) -> list[dict]:
    """The result rows of loaded image features ``f`` and caption embeddings ``emb``
    (``fit_seconds`` since ``t0``)."""
    from featcache.store import combine_fingerprints

    backbone, dataset, split = f.backbone, f.dataset, f.split
    w_img, w_txt = f.provenance.get("weights_sha256", ""), prov.get("weights_sha256", "")
    if w_txt and w_img and w_txt != w_img:
        raise DataError(
            f"caption embeddings of {dataset}/{split} came from another tower than {backbone}'s image features: "
            f"stored weights sha256 {w_txt[:16]} ({prov.get('tower')}), features' {w_img[:16]} "
            f"({f.provenance.get('model_name')}, weights {f.provenance.get('weights_source')}); regenerate them: "
            f"featcache embed-captions --cache {cache_path} --model {f.provenance.get('model_name')} --weights "
            f"{f.provenance.get('weights_source')} --dataset {dataset} --split {split} --backbone {backbone} --captions SPEC"
        )
    row = {str(i): r for r, i in enumerate(np.asarray(f.ids).astype(str)) if f.valid[r]}
    lost = sorted({i for i in image_ids if i not in row})
    if lost:
        raise DataError(
            f"{len(lost)} captioned images have no valid features in {backbone}/{dataset}/{split} (e.g. {lost[0]!r})"
        )
    keep = list(dict.fromkeys(row[i] for i in image_ids))  # the captioned images, first-caption order
    pos = {r: j for j, r in enumerate(keep)}
    text_image = np.fromiter((pos[row[i]] for i in image_ids), np.int64, len(image_ids))
    means = text_image_recall(np.asarray(f.X)[keep], emb, text_image, ks)
    fp = combine_fingerprints(f.fingerprint, prov.get("captions_sha256", ""))
    hp = {"captions": prov.get("captions"), "tower": prov.get("tower"), "n_captions": len(image_ids), "ks": ks}
    hp["n_images_without_caption"] = int(sum(f.valid)) - len(keep)
    rid = _run_id(backbone, dataset, split, ks, f.fingerprint, prov)
    n_eval = {"i2t": len(keep), "t2i": len(image_ids)}
    log.info("%s %s/%s image-text: %s", backbone, dataset, split, means)
    return [
        {
            "run_id": rid,
            "kind": "retrieval",
            "backbone": backbone,
            "dataset": dataset,
            "protocol": "image-text",
            "train_split": split,
            "eval_split": split,
            "metric": m,
            "value": v,
            "n_eval": n_eval[m[:3]],
            "hparams": hp,
            "fit_seconds": time.perf_counter() - t0,
            "store_fingerprint": fp,
        }
        for m, v in means.items()
    ]
