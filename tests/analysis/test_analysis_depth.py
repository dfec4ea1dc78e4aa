"""Accuracy against depth (issue 56): a layer sweep's curve rows stay out of the rankings (its
selected layer's rows are the backbone's score), ``rank`` prints and writes the curves and the
report draws them, from a real sweep (two random test_vit backbones on digits,
tests/layer_stores.py)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from layer_stores import vit_layer_store

from featcache.analysis import write_report
from featcache.analysis.depth import depth_curves, depth_figure, depth_table
from featcache.analysis.loaded import load_results
from featcache.analysis.stats import clopper_pearson

#: fits and searches of seconds on a store built per session (tests/layer_stores.py)
pytestmark = pytest.mark.slow

BACKBONES = ("test_vit@random0", "test_vit@random1")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> str:
    from featcache.probes import ProbeConfig, run_probes

    store = vit_layer_store(tmp_path_factory)
    res = str(tmp_path_factory.mktemp("depth") / "res.parquet")
    run_probes(
        ProbeConfig(store, BACKBONES, "digits", "full", results_path=res, layers="0,2,5", Cs=(1.0,), progress=False)
    )
    return res


def test_curves_hold_every_layer_and_the_selected_one(results):
    table = pl.read_parquet(results)
    curves = depth_curves(table)
    assert [c.backbone for c in curves] == list(BACKBONES)
    for c in curves:
        rows = table.filter((pl.col("backbone") == c.backbone) & (pl.col("metric") == "top1"))
        marks = [json.loads(h) for h in rows["hparams"]]
        assert c.layers == (0, 2, 5)
        assert np.array_equal(c.values, rows["value"].to_numpy()[np.argsort([m["layer"] for m in marks])])
        assert c.selected == next(m["layer"] for m in marks if m["layer_role"] == "selected")
        n = np.full(3, rows["n_eval"][0])  # 150 test rows, one seed: the binomial interval of each layer
        lo, hi = clopper_pearson(c.values * n, n)
        assert np.allclose(c.lo, lo)
        assert np.allclose(c.hi, hi)
    wide = depth_table(curves)
    assert wide.columns[-6:] == ["layer0", "layer1", "layer2", "layer3", "layer4", "layer5"]
    assert wide["layer1"].null_count() == 2
    assert len(depth_figure(curves).axes) == 1


def test_rankings_read_the_selected_layer_only(results):
    loaded = load_results(results)
    top1 = loaded.rows.filter(pl.col("metric") == "top1")
    assert top1.height == 2  # one row per backbone, no duplicate cell
    sel = pl.read_parquet(results).filter(pl.col("hparams").str.contains('"layer_role": "selected"'))
    assert sorted(top1["value"].to_list()) == sorted(sel.filter(pl.col("metric") == "top1")["value"].to_list())


def test_rank_and_report_show_the_depth_curves(results, tmp_path, capsys):
    from featcache.cli import main

    assert main(["rank", "--results", results, "--out", str(tmp_path / "rank"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "accuracy against depth (2 layer sweep(s)" in out
    assert (tmp_path / "rank" / "depth_curves.png").stat().st_size > 0
    csv = pl.read_csv(tmp_path / "rank" / "depth_curves.csv")
    assert csv["backbone"].to_list() == list(BACKBONES)
    html = write_report(tmp_path / "r.html", results).read_text()
    assert '<section id="depth">' in html
    section = html.split('<section id="depth">')[1].split("</section>")[0]
    assert section.count("<img") == 1
    assert 'id="depth-table"' in section
    assert "test_vit@random1" in section
