"""Damaged metadata documents (``zarr.json``): one bad document hides no other problem, every
command names it in one line, each document is covered by a digest its writer records, and
``verify --repair`` rebuilds what is derivable byte-identical (see docs/store.md)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from featcache.cli import main
from featcache.store import write_features


@pytest.fixture(scope="module")
def digits_store(tmp_path_factory):
    """pix features of digits train and test (200 rows each, 4 chunks of 64)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    path = tmp_path_factory.mktemp("meta") / "ref.zarr"
    data = {}
    for split, sl in (("train", slice(0, 200)), ("test", slice(200, 400))):
        X, y = d.data[sl].astype(np.float32), d.target[sl]
        write_features(
            path,
            backbone="pix",
            dataset="digits",
            split=split,
            X=X,
            ids=[f"{split}{i}" for i in range(len(y))],
            labels=y,
            class_names=[str(c) for c in d.target_names],
            chunk_rows=64,
        )
        data[split] = X
    return path, data


def _copy(digits_store, tmp_path, name="c.zarr"):
    path = tmp_path / name
    shutil.copytree(digits_store[0], path)
    return path


def _truncate(doc) -> None:
    raw = doc.read_bytes()
    doc.write_bytes(raw[: len(raw) // 2])


def _flip_chunk(path, array="features/pix/digits/test/pooled", chunk="1/0") -> None:
    f = path / array / "c" / chunk
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(bytes(raw))


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


# ---------------------------------------------------------------- issue 26 item 5
def test_bad_split_document_hides_no_other_problem(digits_store, tmp_path, capsys):
    path = _copy(digits_store, tmp_path)
    _truncate(path / "datasets/digits/train/zarr.json")
    _flip_chunk(path)
    rc, out, _ = _run(capsys, "verify", str(path))
    assert rc == 1
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM ")]
    assert re.match(
        r"PROBLEM datasets/digits/train/zarr\.json \(metadata of datasets/digits/train\): not valid JSON \(",
        problems[0],
    ), problems
    assert any(
        p.startswith("PROBLEM features/pix/digits/test/pooled: chunk 1 (rows 64-127) unreadable") for p in problems
    ), problems
    assert len(problems) == 2, problems  # and every other group checked clean (train's features too)
    assert "JSONDecodeError" not in out


@pytest.mark.parametrize("doc", ["datasets/digits/train", "features/pix/digits/train"])
def test_ls_and_probe_on_a_bad_document_are_one_line(digits_store, tmp_path, capsys, doc):
    path = _copy(digits_store, tmp_path)
    _truncate(path / doc / "zarr.json")
    named = (
        f"damaged metadata document {doc}/zarr.json (metadata of {doc}): not valid JSON "
        "(Unterminated string starting at: line "  # where depends on the document's attributes
        if doc.startswith("features")
        else ""
    )
    commands = [["probe", "--cache", str(path), "--backbone", "pix", "--dataset", "digits", "--no-progress"]]
    commands[0] += ["--results", str(tmp_path / "r.parquet")]
    if doc.startswith("features"):
        commands.append(["ls", str(path)])  # ls needs no split document
    for argv in commands:
        rc, _, err = _run(capsys, *argv)
        assert rc == 1, argv
        (line,) = err.strip().splitlines()
        assert line.startswith(f"featcache {argv[0]}: error: {path}: damaged metadata document {doc}/zarr.json"), line
        assert named in line
        assert line.endswith(
            f"run `featcache verify --repair {path}` (it rebuilds this document from the store's own metadata)"
        )
    assert not (tmp_path / "r.parquet").exists()
