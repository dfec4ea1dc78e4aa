"""The real-image dense sets of featcache.testing.dense_sets: the Fashion-MNIST mosaics (a
``segfolder:`` layout) and the synthetic depth scenes (the ``nyuv2:`` folder layout) are
deterministic given their seed, and the readers read back exactly what was written."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import ndimage as ndi

from featcache.data.readers import open_dataset
from featcache.data.readers.folders import FASHION_MNIST_DIR, read_idx
from featcache.testing.dense_sets import (
    GARMENT_THRESHOLD,
    MOSAIC_BACKGROUND,
    MOSAIC_CLASSES,
    render_scene,
    write_depth_scenes,
    write_mosaics,
)


@pytest.fixture(scope="module")
def mosaics(tmp_path_factory):
    return write_mosaics(tmp_path_factory.mktemp("mosaics") / "m", 12, 4, 5, seed=3)


def _read_all(spec: str) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    return {
        k: [(np.asarray(s.load(i)), s.extra["target"](i)) for i in range(len(s))] for k, s in open_dataset(spec).items()
    }


def test_mosaics_read_back_as_four_fashion_mnist_garments(mosaics):
    """Each quadrant is the recorded Fashion-MNIST garment, labelled with its class above the
    threshold and background elsewhere; train and val use distinct garments, test the test set."""
    rec = json.loads((mosaics / "mosaics.json").read_text())
    got = open_dataset(f"segfolder:{mosaics}")
    assert {k: len(v) for k, v in got.items()} == {"train": 12, "val": 4, "test": 5}
    info = got["train"].extra["dense"]
    assert (info.num_classes, info.class_names[MOSAIC_BACKGROUND]) == (11, "background")
    assert got["train"].class_names == list(MOSAIC_CLASSES)
    fm = {
        f: (
            read_idx(f"{FASHION_MNIST_DIR}/{f}-images-idx3-ubyte.gz"),
            read_idx(f"{FASHION_MNIST_DIR}/{f}-labels-idx1-ubyte.gz"),
        )
        for f in ("train", "t10k")
    }
    for split, s in got.items():
        x, y = fm[rec["splits"][split]["fashion_mnist_file"]]
        for i, rows in enumerate(rec["splits"][split]["rows"]):
            img, mask = np.asarray(s.load(i)), s.extra["target"](i)
            assert img.shape == (56, 56, 3)
            assert mask.shape == (56, 56)
            for q, r in enumerate(rows):
                sl = np.s_[28 * (q // 2) : 28 * (q // 2) + 28, 28 * (q % 2) : 28 * (q % 2) + 28]
                assert (img[sl] == x[r][..., None]).all()
                assert np.array_equal(mask[sl], np.where(x[r] > GARMENT_THRESHOLD, y[r], MOSAIC_BACKGROUND))
    used = [set(np.ravel(rec["splits"][s]["rows"]).tolist()) for s in ("train", "val")]
    assert not used[0] & used[1]
    assert len(used[0]) == 48


def test_garment_threshold_gives_one_piece_per_garment(mosaics):
    """The threshold's reason (testing/dense_sets.py): above it a garment is mostly one connected
    piece, while every pixel above 0 makes many specks."""
    x = read_idx(f"{FASHION_MNIST_DIR}/train-images-idx3-ubyte.gz")[:300]
    pieces = {t: np.mean([ndi.label(a > t)[1] for a in x]) for t in (0, GARMENT_THRESHOLD)}
    assert pieces[GARMENT_THRESHOLD] < 1.5 < 4 < pieces[0]


def test_mosaics_are_deterministic_given_the_seed(mosaics, tmp_path):
    again = write_mosaics(tmp_path / "again", 12, 4, 5, seed=3)
    other = write_mosaics(tmp_path / "other", 12, 4, 5, seed=4)
    a, b, c = (_read_all(f"segfolder:{p}") for p in (mosaics, again, other))
    for split in a:
        assert all(
            np.array_equal(u[0], v[0]) and np.array_equal(u[1], v[1]) for u, v in zip(a[split], b[split], strict=True)
        )
        assert not all(np.array_equal(u[0], v[0]) for u, v in zip(a[split], c[split], strict=True))


def test_depth_scenes_read_back_exactly_and_are_deterministic(tmp_path):
    root = write_depth_scenes(tmp_path / "d", 3, 2, seed=5)
    got = open_dataset(f"nyuv2:{root}")
    assert {k: len(v) for k, v in got.items()} == {"train": 3, "test": 2}
    assert got["test"].extra["dense"].depth_range == (0.001, 10.0)
    rng = np.random.default_rng(5)  # the writer's stream: train scenes, then test scenes
    for split in ("train", "test"):
        s = got[split]
        for i in range(len(s)):
            rgb, mm = render_scene(rng)
            assert np.array_equal(np.asarray(s.load(i)), rgb)
            depth = s.extra["target"](i)
            assert np.array_equal(depth, mm.astype(np.float32) / np.float32(1000))
            assert depth.max() <= 10.0
            assert depth[depth > 0].min() >= 1.0
            assert rgb.std() > 5  # textured, not flat
    again = _read_all(f"nyuv2:{write_depth_scenes(tmp_path / 'again', 3, 2, seed=5)}")
    first = _read_all(f"nyuv2:{root}")
    assert all(
        np.array_equal(u[0], v[0]) and np.array_equal(u[1], v[1])
        for k in first
        for u, v in zip(first[k], again[k], strict=True)
    )


def test_depth_scene_geometry_is_a_pinhole_view():
    """Above the horizon with no box, a scene row is the back wall (one depth); on the floor a
    row's depth is f * height / (v - cy): it falls toward the bottom."""
    _, mm = render_scene(np.random.default_rng(0), (60, 80))
    d = mm.astype(np.float64) / 1000
    top = d[0][d[0] > 0]
    assert np.ptp(top) == 0
    floor = np.median(d[-5:], axis=1)
    assert (np.diff(floor) < 0).all()
