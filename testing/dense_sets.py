"""Small real-image dense datasets written in the readers' layouts, for tests, benchmarks and the
evidence scripts of issue 57 (no ADE20K or NYU here):

- :func:`write_mosaics`: a segmentation set from Fashion-MNIST, each image a 2 x 2 mosaic of four
  real garments, every garment pixel labelled with its garment's class, written as a
  ``segfolder:`` layout;
- :func:`write_depth_scenes`: synthetic scenes with exact depth (a back wall, a floor and boxes
  seen by a pinhole camera, textured with scikit-image's photos), written as the ``nyuv2:``
  folder layout. It tests the depth path end to end; it is **not evidence about backbones**.

Both are deterministic given ``seed`` (the same pixels on every machine: numpy's seeded generator,
IEEE arithmetic without transcendental functions, lossless PNG files).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from featcache.data.readers.folders import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, read_idx

__all__ = [
    "DEPTH_SCENE_SIZE",
    "GARMENT_THRESHOLD",
    "MOSAIC_BACKGROUND",
    "MOSAIC_CLASSES",
    "make_mosaics",
    "render_scene",
    "write_depth_scenes",
    "write_mosaics",
]

#: a garment pixel has a value above this: Fashion-MNIST's background is exactly 0, and the
#: values 1..8 (about 3% of the pixels) are isolated specks around the garment: with ``> 0`` a
#: garment falls into 7.4 connected pieces on average (the first 500 training images), with ``> 8``
#: into 1.2, while the holes inside the filled silhouette stay at 1.9% (1.7% with ``> 0``); above
#: 8 the holes and pieces grow again (``> 32``: 2.5%, 1.4 pieces)
GARMENT_THRESHOLD = 8
#: the background's class id (the ten garment classes are 0..9)
MOSAIC_BACKGROUND = 10
MOSAIC_CLASSES = (*FASHION_MNIST_CLASSES, "background")
#: the depth scenes' image size (h, w): NYU's 480 x 640 divided by 8
DEPTH_SCENE_SIZE = (60, 80)


# --------------------------------------------------------------------------- mosaics
def make_mosaics(images: np.ndarray, labels: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(grey images uint8 [n, 56, 56], masks uint8 [n, 56, 56])`` of the garments ``picks``
    ``[n, 4]`` (indices into ``images`` [N, 28, 28] / ``labels``), placed top-left, top-right,
    bottom-left, bottom-right; a pixel above :data:`GARMENT_THRESHOLD` gets its garment's class,
    every other pixel :data:`MOSAIC_BACKGROUND`."""
    n = len(picks)
    img = np.zeros((n, 56, 56), np.uint8)
    mask = np.full((n, 56, 56), MOSAIC_BACKGROUND, np.uint8)
    for q in range(4):
        r, c = 28 * (q // 2), 28 * (q % 2)
        tile = images[picks[:, q]]
        img[:, r : r + 28, c : c + 28] = tile
        cls = labels[picks[:, q]].astype(np.uint8)[:, None, None]
        mask[:, r : r + 28, c : c + 28] = np.where(tile > GARMENT_THRESHOLD, cls, MOSAIC_BACKGROUND)
    return img, mask


def _save_png(path: Path, a: np.ndarray) -> None:
    """A PNG of ``a``: uint8 [h, w] as L, uint8 [h, w, 3] as RGB, uint16 [h, w] as 16-bit."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(a)).save(path, format="PNG")


def write_mosaics(
    root: str | Path, n_train: int, n_val: int, n_test: int, seed: int = 0, fmnist_dir: str = FASHION_MNIST_DIR
) -> Path:
    """Write ``n_train`` / ``n_val`` / ``n_test`` 56 x 56 mosaics as ``root/{train,val,test}/
    {images,masks}/<split>-<j>.png`` (RGB photos, grey replicated; L masks of ids 0..10) plus
    ``root/classes.txt`` and ``root/mosaics.json`` (the seed, the threshold and the Fashion-MNIST
    rows of every mosaic). Train and val draw distinct garments from Fashion-MNIST's training
    set, test from its test set. Read it with ``--data segfolder:ROOT``."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    fm = Path(fmnist_dir)
    tr_x, tr_y = read_idx(fm / "train-images-idx3-ubyte.gz"), read_idx(fm / "train-labels-idx1-ubyte.gz")
    te_x, te_y = read_idx(fm / "t10k-images-idx3-ubyte.gz"), read_idx(fm / "t10k-labels-idx1-ubyte.gz")
    pool = rng.permutation(len(tr_y))[: 4 * (n_train + n_val)].reshape(-1, 4)
    plan = {
        "train": (tr_x, tr_y, "train", pool[:n_train]),
        "val": (tr_x, tr_y, "train", pool[n_train:]),
        "test": (te_x, te_y, "t10k", rng.permutation(len(te_y))[: 4 * n_test].reshape(-1, 4)),
    }
    record = {"seed": seed, "threshold": GARMENT_THRESHOLD, "background": MOSAIC_BACKGROUND, "splits": {}}
    for split, (x, y, src, picks) in plan.items():
        img, mask = make_mosaics(x, y, picks)
        for j in range(len(picks)):
            _save_png(root / split / "images" / f"{split}-{j:05d}.png", np.repeat(img[j][..., None], 3, 2))
            _save_png(root / split / "masks" / f"{split}-{j:05d}.png", mask[j])
        record["splits"][split] = {"fashion_mnist_file": src, "rows": picks.tolist()}
    (root / "classes.txt").write_text("\n".join(MOSAIC_CLASSES) + "\n", encoding="utf-8")
    (root / "mosaics.json").write_text(json.dumps(record) + "\n", encoding="utf-8")
    return root


# --------------------------------------------------------------------------- depth scenes
_TEXTURES = ("brick", "grass", "gravel", "camera", "moon")


def _textures() -> list[np.ndarray]:
    """Grey photos bundled with scikit-image (no download), as uint8 [512, 512]."""
    import skimage.data

    return [np.asarray(getattr(skimage.data, n)(), np.uint8) for n in _TEXTURES]


def _scene_params(rng: np.random.Generator) -> dict:
    """A scene's random layout: wall depth, camera height and 1-3 boxes (metres)."""
    wall = float(rng.uniform(4.0, 9.0))
    boxes = []
    for _ in range(int(rng.integers(1, 4))):
        z = float(rng.uniform(1.2, wall - 0.5))
        boxes.append((z, float(rng.uniform(-1.5, 1.0)), float(rng.uniform(0.4, 1.2)), float(rng.uniform(0.3, 1.2))))
    return {
        "wall": wall,
        "height": float(rng.uniform(1.0, 1.6)),
        "boxes": sorted(boxes, reverse=True),  # far to near: a nearer box paints over
        "tex": rng.permutation(len(_TEXTURES))[: 2 + len(boxes)].tolist(),
        "tint": rng.uniform(0.6, 1.0, (2 + len(boxes), 3)).tolist(),
        "hole": rng.integers(0, 2) == 1,
        "hole_at": rng.uniform(0.0, 0.8, 2).tolist(),
    }


def render_scene(rng: np.random.Generator, size: tuple[int, int] = DEPTH_SCENE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``(RGB uint8 [h, w, 3], depth uint16 [h, w] millimetres)`` of one random scene seen by a
    pinhole camera (focal = w px, principal point at the centre, y down): a fronto-parallel back
    wall, the floor below the camera and boxes standing on it; each surface carries a photo texture
    fixed to the surface in metres (so it shrinks with distance) and darkens with depth. Depth is
    the z-distance (as NYU's), exact up to the millimetre; a scene may carry a small hole of 0
    (invalid), as a depth sensor's."""
    h, w = size
    p, texs = _scene_params(rng), _textures()
    f, cy, cx = float(w), (h - 1) / 2, (w - 1) / 2
    v, u = np.mgrid[0:h, 0:w].astype(np.float64)
    z = np.full((h, w), p["wall"])
    below = v > cy
    floor_z = np.where(below, f * p["height"] / np.maximum(v - cy, 1e-9), np.inf)
    z = np.minimum(z, floor_z)
    surf = np.where(floor_z < p["wall"], 1, 0)
    for k, (bz, bx, bw, bh) in enumerate(p["boxes"]):
        inside = (u >= cx + f * bx / bz) & (u < cx + f * (bx + bw) / bz)
        inside &= (v >= cy + f * (p["height"] - bh) / bz) & (v < cy + f * p["height"] / bz) & (bz < z)
        z, surf = np.where(inside, bz, z), np.where(inside, 2 + k, surf)
    x_m, y_m = (u - cx) * z / f, (v - cy) * z / f
    rgb = np.zeros((h, w, 3))
    for s in range(2 + len(p["boxes"])):
        tex = texs[p["tex"][s % len(p["tex"])]]
        a, b = (z, x_m) if s == 1 else (y_m, x_m)  # the floor is textured over (depth, x)
        grey = tex[(np.floor(a * 100).astype(np.int64)) % 512, (np.floor(b * 100).astype(np.int64)) % 512]
        rgb += (surf == s)[..., None] * grey[..., None] * np.array(p["tint"][s]) / (1.0 + 0.15 * z[..., None])
    depth = np.round(z * 1000).astype(np.uint16)
    if p["hole"]:
        r0, c0 = int(p["hole_at"][0] * h), int(p["hole_at"][1] * w)
        depth[r0 : r0 + h // 6, c0 : c0 + w // 6] = 0
    return np.clip(np.round(rgb), 0, 255).astype(np.uint8), depth


def write_depth_scenes(
    root: str | Path, n_train: int, n_test: int, seed: int = 0, size: tuple[int, int] = DEPTH_SCENE_SIZE
) -> Path:
    """Write ``n_train`` / ``n_test`` synthetic scenes (:func:`render_scene`) as NYU's folder
    layout ``root/{train,test}/rgb/<split>-<j>.png`` + ``root/{train,test}/depth/<split>-<j>.png``
    (16-bit PNG millimetres, 0 = invalid). Read it with ``--data nyuv2:ROOT``. The scenes test
    the depth path end to end; a score on them is not evidence about backbones."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("test", n_test)):
        for j in range(n):
            rgb, depth = render_scene(rng, size)
            _save_png(root / split / "rgb" / f"{split}-{j:05d}.png", rgb)
            _save_png(root / split / "depth" / f"{split}-{j:05d}.png", depth)
    return root
