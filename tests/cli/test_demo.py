"""The main job, end to end: `featcache demo` on Fashion-MNIST at a tiny size (lite0 + random:0,
small inputs, a few fine-tune steps), its summary claims checked against the results table and
the report; the digits fallback and the summary's checks on their own."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import polars as pl
import pytest

from featcache.cli import main
from featcache.data.readers.folders import FASHION_MNIST_DIR
from featcache.demo.run import (
    BASELINE,
    FT_PROTOCOL,
    _paired_probe_protocol,
    check_pretrained_beat_random,
    choose_data,
    count_plots,
    probe_top1,
)
from featcache.errors import DataError

LITE0, RANDOM = "tf_efficientnet_lite0", "tf_efficientnet_lite0@random0"
TINY = [
    "--train-size",
    "1100",
    "--test-size",
    "300",
    "--input-size",
    "64",
    "--n-backbones",
    "1",
    "--finetune-steps",
    "4",
    "--finetune-input-size",
    "32",
    "--finetune-batch-size",
    "16",
    "--no-progress",
    "--workers",
    "0",
]
needs_fmnist = pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR).is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
)


def _summary(printed: str) -> list[str]:
    assert "summary:" in printed, printed
    return printed.split("summary:", 1)[1].strip().splitlines()


@pytest.mark.slow
@needs_fmnist
def test_demo_tiny_end_to_end(tmp_path, capsys):
    cache, out = tmp_path / "demo.zarr", tmp_path / "out"
    assert main(["demo", "--cache", str(cache), "--out", str(out), *TINY]) == 0
    lines = _summary(capsys.readouterr().out)
    text = "\n".join(lines)
    table = pl.read_parquet(out / "results.parquet")

    # data: Fashion-MNIST, the requested prefix
    assert lines[0].startswith("data: Fashion-MNIST")
    assert "1100 train / 300 test" in lines[0]
    assert set(table["dataset"].unique()) == {"fashion-mnist"}

    # ranking lists both backbones with their role, in rank order
    ranking = [ln for ln in lines if re.match(r"\s+\d+\. ", ln)]
    assert len(ranking) == 2
    assert {("random" if RANDOM in ln else "pretrained") for ln in ranking} == {"random", "pretrained"}
    assert all(("random " in ln) == (RANDOM in ln) for ln in ranking)

    # the pretrained-vs-random claim is what the results table says
    acc = probe_top1(table)
    holds = acc[LITE0] > acc[RANDOM]
    beat = next(ln for ln in lines if ln.startswith("pretrained beat random:"))
    assert beat.startswith("pretrained beat random: YES" if holds else "pretrained beat random: NO"), (beat, acc)
    assert f"{acc[RANDOM]:.3f}" in beat
    assert f"{acc[LITE0]:.3f}" in beat

    # fine-tuning ran for every backbone, scaled down, paired with the matching probe protocol
    paired = _paired_probe_protocol()  # what the fine-tune stage pairs vtab1k-light with
    ft = table.filter(pl.col("kind") == "finetune")
    assert set(ft["backbone"].unique()) == {LITE0, RANDOM}
    assert set(ft["protocol"].unique()) == {paired}
    hp = [json.loads(h) for h in ft["hparams"]]
    assert all(h["scaled"] is True and h["finetune_protocol"] == FT_PROTOCOL for h in hp)
    assert all(h["scaled_from"].get("input_size") == 224 for h in hp)
    probes = table.filter((pl.col("kind") == "probe") & (pl.col("protocol") == paired))
    assert set(probes["backbone"].unique()) == {LITE0, RANDOM}
    assert "scaled down for the CPU" in text
    assert "scaled=true" in text

    # Kendall tau per task, for the paired task
    taus = [ln for ln in lines if "Kendall tau-b linear vs fine-tune" in ln]
    assert taus, lines
    assert any(re.search(r": [+-]\d\.\d{3} over 2 backbones", ln) for ln in taus), taus
    assert any("fashion-mnist" in ln and paired in ln for ln in taus), taus

    # plots, report path, wall time; the report has the linear-vs-fine-tune section filled
    html = (out / "report.html").read_text(encoding="utf-8")
    n_plots = int(re.search(r"^plots in the report: (\d+)$", text, re.M).group(1))
    assert n_plots == count_plots(html)
    assert n_plots >= 3
    assert f"report: {out / 'report.html'}" in lines
    assert re.search(r"^wall time: \d+ s \(\d+\.\d min\)$", text, re.M)
    section = re.search(r"Linear probe vs fine-tune(.*?)(<h[23][ >]|$)", html, re.S)
    assert section, "no linear-vs-fine-tune section in the report"
    assert "skipped" not in section.group(1).lower()
    assert 'alt="Kendall tau-b between linear-probe and fine-tune rankings per setting"' in section.group(1)
    assert 'alt="Rank of each backbone under linear probing and under fine-tuning"' in section.group(1)
    assert "Kendall tau-b" in section.group(1)

    saved = json.loads((out / "summary.json").read_text())
    assert saved["n_plots"] == n_plots
    assert saved["pretrained_beat_random"] == holds
    assert not saved["fallback"]

    # --finetune off still skips it (features reused from the store)
    out2 = tmp_path / "off"
    assert main(["demo", "--cache", str(cache), "--out", str(out2), *TINY, "--finetune", "off"]) == 0
    lines2 = _summary(capsys.readouterr().out)
    assert "fine-tuning: skipped (--finetune off): no linear-vs-fine-tune comparison" in lines2
    assert not any("Kendall tau-b linear vs fine-tune" in ln for ln in lines2)
    assert "finetune" not in set(pl.read_parquet(out2 / "results.parquet")["kind"].unique())


def test_fallback_to_digits_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="featcache.demo"):
        data = choose_data("auto", fmnist_dir=str(tmp_path / "no-fashion-mnist"))
    assert data.spec == "digits"
    assert data.name == "digits"
    assert data.note.startswith("digits FALLBACK")
    assert str(tmp_path / "no-fashion-mnist") in data.note
    assert any("FALLBACK" in r.getMessage() for r in caplog.records)
    # asked for explicitly, a missing Fashion-MNIST is an error, not a silent fallback
    with pytest.raises(DataError, match="dataset-fashion-mnist"):
        choose_data(f"fashion-mnist:{tmp_path / 'missing'}")
    with pytest.raises(DataError, match="auto, fashion-mnist"):
        choose_data("imagefolder:/x")


@needs_fmnist
def test_fashion_mnist_sizes_are_clamped():
    data = choose_data("auto", train=10**9, test=500)
    assert data.name == "fashion-mnist"
    assert data.limit == {"train": 60000, "test": 500}


def test_pretrained_vs_random_check():
    ok, line = check_pretrained_beat_random({"a": 0.9, "b": 0.8, "r": 0.7}, ["a", "b"], "r")
    assert ok is True
    assert line.startswith("pretrained beat random: YES")
    bad, line = check_pretrained_beat_random({"a": 0.9, "b": 0.7, "r": 0.7}, ["a", "b"], "r")
    assert bad is False
    assert "NO" in line
    assert "b not above" in line
    unk, line = check_pretrained_beat_random({"a": 0.9}, ["a"], "r")
    assert unk is None
    assert "CANNOT CHECK" in line
    assert "r" in line
    assert BASELINE[1] == "random:0"


def test_count_plots():
    html = (
        '<img alt="x" src="data:image/png;base64,AAAA"><img src="a.png">'
        "<IMG class=y src='data:image/svg+xml;base64,BB'> data:image/png;base64, in text"
    )
    assert count_plots(html) == 2  # embedded images only, any case


def test_an_out_of_range_n_backbones_is_one_error_line(tmp_path, capsys):
    """A usage error is a FeatcacheError the CLI prints as one line (it was a SystemExit)."""
    rc = main(["demo", "--cache", str(tmp_path / "c.zarr"), "--out", str(tmp_path / "o"), "--n-backbones", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [err[0]]
    assert err[0].startswith("featcache demo: error: --n-backbones must be between 1 and ")
    assert not (tmp_path / "c.zarr").exists()
