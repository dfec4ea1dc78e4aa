"""The main job, end to end: `featcache demo` with all four backbones (small input size)."""

from __future__ import annotations

import polars as pl
import pytest

from featcache.cli import main


@pytest.mark.slow
def test_demo_end_to_end(tmp_path, capsys):
    cache, out = tmp_path / "demo.zarr", tmp_path / "out"
    rc = main(["demo", "--cache", str(cache), "--out", str(out), "--input-size", "64",
               "--no-progress", "--workers", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"report: {out / 'report.html'}" in printed
    table = pl.read_parquet(out / "results.parquet")
    probe = table.filter((pl.col("kind") == "probe") & (pl.col("metric") == "top1") & (pl.col("seed") >= 0))
    acc = dict(zip(probe["backbone"], probe["value"]))
    assert set(acc) == {"tf_efficientnet_lite0", "tf_efficientnet_lite1", "tf_efficientnet_lite2",
                        "tf_efficientnet_lite0@random0"}
    ret = table.filter((pl.col("kind") == "retrieval") & (pl.col("metric") == "map"))
    mAP = dict(zip(ret["backbone"], ret["value"]))
    for b in ("tf_efficientnet_lite0", "tf_efficientnet_lite1", "tf_efficientnet_lite2"):
        assert acc[b] > 0.85, acc  # ImageNet features separate digits linearly
        # (random conv features are strong linear features on 8x8 digits too, but their
        # neighbourhoods are worse: whole-gallery mAP separates pretrained from random)
        assert mAP[b] > mAP["tf_efficientnet_lite0@random0"], mAP
    assert set(table["kind"].unique()) >= {"probe", "retrieval", "knn"}
    html = (out / "report.html").read_text()
    assert "tf_efficientnet_lite2" in html and "data:image/png;base64," in html
    assert (out / "rank").is_dir() and any((out / "rank").iterdir())
    # a second run reuses everything already computed
    assert main(["demo", "--cache", str(cache), "--out", str(out), "--input-size", "64",
                 "--no-progress", "--workers", "1"]) == 0
    again = pl.read_parquet(out / "results.parquet")
    assert again.height == table.height
