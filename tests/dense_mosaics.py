"""Fashion-MNIST 2 x 2 mosaics as a dense SplitSource, for the dense extraction tests: four 28 x 28
garments of the real t10k set make one 56 x 56 image; the mask holds each garment pixel's class
(pixel > 0) and background class 10 elsewhere. Built in memory (the segfolder reader is another
branch's); the loaders are module-level classes, so they pickle to DataLoader workers."""

from __future__ import annotations

import functools

import numpy as np

FMNIST = "/usr/share/datasets/fashion-mnist"
BACKGROUND = 10
CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot", "background",
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def _garments() -> tuple[np.ndarray, np.ndarray]:
    from featcache.data.readers.folders import read_idx

    x = read_idx(f"{FMNIST}/t10k-images-idx3-ubyte.gz")[:2000]
    y = read_idx(f"{FMNIST}/t10k-labels-idx1-ubyte.gz")[:2000].astype(np.int64)
    return x, y


def mosaic(i: int, size: tuple[int, int] = (56, 56)) -> tuple[np.ndarray, np.ndarray]:
    """Mosaic ``i``: (uint8 [H, W, 3] image, uint8 [H, W] mask); ``size`` other than 56 x 56
    stretches it (nearest) so tests get non-square images."""
    x, y = _garments()
    img = np.zeros((56, 56), np.uint8)
    mask = np.full((56, 56), BACKGROUND, np.uint8)
    for q in range(4):
        g = (4 * i + q) % len(x)
        r, c = 28 * (q // 2), 28 * (q % 2)
        img[r : r + 28, c : c + 28] = x[g]
        mask[r : r + 28, c : c + 28][x[g] > 0] = y[g]
    if size != (56, 56):
        ri = np.arange(size[0]) * 56 // size[0]
        ci = np.arange(size[1]) * 56 // size[1]
        img, mask = img[ri][:, ci], mask[ri][:, ci]
    rgb = np.stack([img, (img * 0.8).astype(np.uint8), 255 - img], axis=-1)
    return rgb, mask


class _Rows:
    """Row ``i`` -> mosaic ``start + i`` at ``sizes[i]``."""

    def __init__(self, sizes, start: int = 0):
        self.sizes, self.start = tuple(sizes), int(start)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return mosaic(self.start + i, self.sizes[i])


class MosaicImage(_Rows):
    def __call__(self, i: int):
        from PIL import Image

        return Image.fromarray(self.pair(i)[0])


class MosaicMask(_Rows):
    def __call__(self, i: int) -> np.ndarray:
        return self.pair(i)[1]


class MosaicDepth(_Rows):
    """A depth map from the mosaic: metres 0.5 + class / 4 on garments, 0 (invalid) on background."""

    def __call__(self, i: int) -> np.ndarray:
        m = self.pair(i)[1].astype(np.float32)
        return np.where(m == BACKGROUND, 0.0, 0.5 + m / 4).astype(np.float32)


def mosaic_split(split: str, n: int, *, start: int = 0, sizes=None, depth: bool = False):
    """A dense ``SplitSource`` of ``n`` mosaics (``sizes[i]``: image ``i``'s (h, w))."""
    from featcache.core.dense import DenseInfo
    from featcache.data.source import SplitSource

    sizes = tuple(sizes or [(56, 56)] * n)
    target = (MosaicDepth if depth else MosaicMask)(sizes, start)
    info = (
        DenseInfo("depth", depth_range=(0.001, 10.0))
        if depth
        else DenseInfo("seg", num_classes=11, ignore_index=255, class_names=CLASSES)
    )
    return SplitSource(
        "mosaics-depth" if depth else "mosaics",
        split,
        np.array([f"{split}-{start + i:04d}" for i in range(n)]),
        np.zeros(n, np.int64),
        list(CLASSES),
        MosaicImage(sizes, start),
        f"fashion-mnist mosaics {split}",
        {"dense": info, "target": target},
    )


def write_segfolder(root, splits: dict) -> str:
    """Write mosaics as a ``segfolder:`` (``root/<split>/images/*.png`` + ``masks/*.png`` and a
    classes.txt); ``splits[split] = (n, start, sizes or None)``. Returns ``root``."""
    from pathlib import Path

    from PIL import Image

    root = Path(root)
    for split, (n, start, sizes) in splits.items():
        sizes = sizes or [(56, 56)] * n
        (root / split / "images").mkdir(parents=True, exist_ok=True)
        (root / split / "masks").mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img, mask = mosaic(start + i, sizes[i])
            Image.fromarray(img).save(root / split / "images" / f"m{start + i:04d}.png")
            Image.fromarray(mask).save(root / split / "masks" / f"m{start + i:04d}.png")
    (root / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    return str(root)
