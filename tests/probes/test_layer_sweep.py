"""``probe --layers`` (issue 56): a protocol run on each stored layer, the layer selected on the
protocol's validation data (never test), the whole curve recorded, each curve row equal to a
single-layer run of that kind. The store: timm's test_vit (random weights) on digits, every
block's class and mean patch token from timm's ``forward_intermediates`` (tests/layer_stores.py)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from layer_stores import LITE0, VIT, lite0_layer_store, vit_layer_store

from featcache.errors import NotInStoreError, ProbeError
from featcache.probes import ProbeConfig, run_probes

#: fits and searches of seconds on a store built per session (tests/layer_stores.py)
pytestmark = pytest.mark.slow

FAST = {"Cs": (0.1, 1.0, 10.0), "progress": False}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return vit_layer_store(tmp_path_factory)


@pytest.fixture(scope="module")
def sweep(store, tmp_path_factory):
    res = str(tmp_path_factory.mktemp("r") / "res.parquet")
    df = run_probes(ProbeConfig(store, (VIT,), "digits", "full", results_path=res, layers="all", **FAST))
    return df, res


def _marks(df: pl.DataFrame) -> list[dict]:
    return [json.loads(h) for h in df.filter(pl.col("metric") == "top1")["hparams"]]


def test_one_row_per_layer_selected_on_val(sweep):
    df, res = sweep
    hp = _marks(df)
    assert [h["layer"] for h in hp] == list(range(6))
    assert [h["layer_kind"] for h in hp] == [f"layer{i}_cls" for i in range(6)]  # auto: cls first
    roles = [h["layer_role"] for h in hp]
    assert roles.count("selected") == 1
    assert roles.count("curve") == 5
    val = [h["layer_val_score"] for h in hp]
    assert val == [h["val_top1"] for h in hp]  # full's own C selection score on the val split
    best = int(np.argmax(val))
    assert roles[best] == "selected"
    assert {h["layer_selection"]["selected"] for h in hp} == {best}
    assert set(df["eval_split"]) == {"test"}
    assert pl.read_parquet(res).height == df.height  # the whole curve is written


def test_a_rerun_is_skipped_from_the_provenance(store, sweep, monkeypatch):
    from featcache.probes import layer_sweep

    df, res = sweep
    monkeypatch.setattr(layer_sweep, "_sweep_backbone", None)  # a rerun must not probe again
    again = run_probes(ProbeConfig(store, (VIT,), "digits", "full", results_path=res, layers="all", **FAST))
    assert sorted(again["run_id"]) == sorted(df["run_id"])
    assert pl.read_parquet(res).height == df.height


def test_curve_rows_equal_single_layer_runs(store, sweep):
    df, _ = sweep
    for i in (0, 4):
        one = run_probes(ProbeConfig(store, (VIT,), "digits", "full", kind=f"layer{i}_cls", **FAST))
        row = df.filter(pl.col("hparams").str.contains(f'"layer_kind": "layer{i}_cls"'))
        for m, v in zip(one["metric"], one["value"]):
            assert row.filter(pl.col("metric") == m)["value"][0] == v
        assert json.loads(one["hparams"][0])["C"] == _marks(row)[0]["C"]


def test_cnn_stage_sweep_rows_equal_single_stage_runs(tmp_path_factory):
    """A store that ``extract --features layers:all`` wrote from EfficientNet-Lite0 (CNN stages,
    ``layer{i}_avg`` of five widths): one row per stage, each equal to ``--kind layer{i}_avg``."""
    store = lite0_layer_store(tmp_path_factory)
    df = run_probes(ProbeConfig(store, (LITE0,), "digits", "full", layers="all", **FAST))
    hp = _marks(df)
    assert [(h["layer"], h["layer_kind"]) for h in hp] == [(i, f"layer{i}_avg") for i in range(5)]
    assert [h["layer_role"] for h in hp].count("selected") == 1
    for i, h in enumerate(hp):
        one = run_probes(ProbeConfig(store, (LITE0,), "digits", "full", kind=f"layer{i}_avg", **FAST))
        row = df.filter(pl.col("hparams").str.contains(f'"layer_kind": "layer{i}_avg"'))
        assert dict(zip(one["metric"], one["value"])) == dict(zip(row["metric"], row["value"]))
        assert json.loads(one["hparams"][0])["C"] == h["C"]


def test_selection_never_reads_test(store, sweep, tmp_path):
    """A copy of the store whose test labels are what a non-selected layer predicts: test would
    now pick that layer (top-1 1.0), yet the sweep selects the same layer with the same scores."""
    from layer_stores import relabel_test

    df, _ = sweep
    hp = _marks(df)
    sel = next(h["layer"] for h in hp if h["layer_role"] == "selected")
    other = (sel + 3) % 6
    pred = tmp_path / "pred.parquet"
    run_probes(ProbeConfig(store, (VIT,), "digits", "full", kind=f"layer{other}_cls", predictions=str(pred), **FAST))
    flipped = relabel_test(store, str(tmp_path / "flipped.zarr"), pl.read_parquet(pred))
    df2 = run_probes(ProbeConfig(flipped, (VIT,), "digits", "full", layers="all", **FAST))
    hp2 = _marks(df2)
    assert [h["layer_val_score"] for h in hp2] == [h["layer_val_score"] for h in hp]
    assert next(h["layer"] for h in hp2 if h["layer_role"] == "selected") == sel
    top1 = df2.filter(pl.col("metric") == "top1")["value"].to_list()
    assert top1[other] == 1.0
    assert int(np.argmax(top1)) == other != sel


def test_all_skips_backbones_without_layers(store, tmp_path):
    import shutil

    from featcache.store import open_cache, write_features

    path = str(tmp_path / "mixed.zarr")
    shutil.copytree(store, path)
    for split in ("train", "val", "test"):
        f = open_cache(store).load(VIT, "digits", split, kind="layer5_cls")
        write_features(path, backbone="pooled-only", dataset="digits", split=split, X=f.X, ids=f.ids, labels=f.labels)
    df = run_probes(ProbeConfig(path, "all", "digits", "full", layers="-1", **FAST))
    assert sorted(set(df["backbone"])) == ["test_vit@random0", "test_vit@random1"]
    with pytest.raises(Exception, match="no per-layer kinds"):
        run_probes(ProbeConfig(path, ("pooled-only",), "digits", "full", layers="all", **FAST))


def test_layer_lists_and_parts(store):
    df = run_probes(ProbeConfig(store, (VIT,), "digits", "full", layers="1,-1", layer_part="mean", **FAST))
    assert [h["layer_kind"] for h in _marks(df)] == ["layer1_mean", "layer5_mean"]
    with pytest.raises(Exception, match="layer 7 is not stored"):
        run_probes(ProbeConfig(store, (VIT,), "digits", "full", layers="7", **FAST))
    with pytest.raises(ProbeError, match="--predictions with --layers"):
        run_probes(ProbeConfig(store, (VIT,), "digits", "full", layers="all", predictions="p.parquet", **FAST))
    with pytest.raises(ProbeError, match="drop --kind"):
        run_probes(ProbeConfig(store, (VIT,), "digits", "full", layers="all", kind="layer0_cls", **FAST))


def test_bob_linear_selects_on_the_val_split(store):
    df = run_probes(ProbeConfig(store, (VIT,), "digits", "bob-linear", layers="0,5", sgd_epochs=2, progress=False))
    hp = _marks(df)
    assert {h["layer_selection"]["rule"] for h in hp} == {"val-split"}
    assert {h["layer_selection"]["split"] for h in hp} == {"val"}
    assert set(df["eval_split"]) == {"test"}  # the val rows are the selection's, not reported
    one = run_probes(
        ProbeConfig(
            store, (VIT,), "digits", "bob-linear", kind="layer5_cls", eval_splits=("val",), sgd_epochs=2, progress=False
        )
    )
    assert hp[1]["layer_val_score"] == one.filter(pl.col("metric") == "top1")["value"][0]
    with pytest.raises(NotInStoreError, match="holds out nothing"):
        run_probes(
            ProbeConfig(
                store, (VIT,), "digits", "bob-linear", layers="0", val_split="holdout", sgd_epochs=1, progress=False
            )
        )


def test_dinov2_linear_from_chosen_layers(store):
    from featcache.probes.dinov2_linear import load_linear_input
    from featcache.store import open_cache

    c = open_cache(store)
    f = load_linear_input(c, VIT, "digits", "train", "layers:1,3,4,5")
    want = [c.load(VIT, "digits", "train", kind=k).X for k in ("layer1_cls", "layer3_cls", "layer4_cls", "layer5_cls")]
    assert np.array_equal(f.X, np.stack([*want, c.load(VIT, "digits", "train", kind="layer5_mean").X], axis=1))
    kw = {"sgd_epochs": 1, "epoch_length": 20, "batch_size": 64, "progress": False}
    df = run_probes(ProbeConfig(store, (VIT,), "digits", "dinov2-linear", kind="layers:1,3,4,5", **kw))
    hp = json.loads(df["hparams"][0])
    assert hp["slots"] == 5
    assert hp["n_last_blocks_list"] == [1, 4]
    sw = run_probes(ProbeConfig(store, (VIT,), "digits", "dinov2-linear", layers="2,5", **kw))
    marks = _marks(sw)
    assert [h["input"] for h in marks] == ["layer2_cls+layer2_mean", "layer5_cls+layer5_mean"]
    assert [h["layer_val_score"] for h in marks] == [h["val_top1"] for h in marks]


def test_every_protocol_names_a_layer_rule_that_is_scored():
    from featcache.core.protocols import LAYER_SELECTIONS, CGrid, Protocol, get_protocol, list_protocols
    from featcache.errors import ProtocolError
    from featcache.probes.layer_sweep import LAYER_SCORERS

    assert set(LAYER_SCORERS) == set(LAYER_SELECTIONS)
    fixed = [p for p in list_protocols() if p not in ("fewshot", "elevater-fewshot", "subset", "attentive")]
    rules = {p: get_protocol(p).layer_selection for p in fixed}
    assert rules["bob-linear"] == "val-split"  # it holds out nothing
    assert rules["full"] == rules["dinov2-linear"] == "val-score"
    with pytest.raises(ProtocolError, match="layer_selection must be one of"):
        Protocol(spec="x", name="x", stage="probe", split="full", solver="lbfgs", grid=CGrid(), layer_selection="test")
