"""The "where to add" table of docs/development.md, tried as a contributor would: a new member
of each kind is ONE file (written here into a temporary folder, outside the package), and the
command line finds it with nothing else edited. The CLI imports the file as a user's module
through ``FEATCACHE_PLUGINS`` (``featcache.cli.load_plugins``), exactly as
``FEATCACHE_PLUGINS=mymodule featcache ...`` does from a shell.

Each row of :data:`KINDS` is one kind: the file's text, the registries its registration goes
into (restored after the test) and a check that drives the CLI and looks for the member. A new
extension point adds a row."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from featcache.cli import PLUGINS_ENV, main

#: ``cli(*argv)``: run ``featcache ARGV`` in this process; its stdout (``--help`` included), each
#: run of white space one blank
CLI = Callable[..., str]


@dataclass(frozen=True)
class Kind:
    """One extension point: ``source`` is the member's one file, ``registries`` the registries
    it registers into (restored afterwards), ``check(cli, tmp_path)`` finds it through the CLI."""

    source: str
    registries: Callable[[], tuple]
    check: Callable[[CLI, Path], None]


# ------------------------------------------------------------------ a model source
MODEL_SOURCE = '''
"""A model source in one file: ``--model wheresrc:WIDTH``, a tiny conv net of that width."""
from featcache.models import sources as S


def build(name, weights, *, device="cpu", trainable=False, **options):
    import torch  # on first use, as every source: `featcache extract --help` imports no torch
    from torchvision import transforms as T

    torch.manual_seed(int(weights.partition(":")[2] or 0))
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, int(name), 3, stride=2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    )
    sha = S.state_sha256(model)
    return S.finish(
        source="wheresrc", name=name, model=model, transform=T.Compose([T.Resize((32, 32)), T.ToTensor()]),
        weights=weights, device=device, trainable=trainable, kinds=("pooled",), library="torch",
        features_fn=lambda x, kinds: {"pooled": model(x)}, sha=sha, tag=f"@{sha[:8]}", wfile=None,
    )


S.register_source("wheresrc", __name__, usage="wheresrc:WIDTH", note="a tiny net for the table")
'''


def _model_source_registries() -> tuple:
    from featcache.models import sources

    return sources.SOURCES, sources.LISTINGS


def _find_model_source(cli: CLI, tmp_path: Path) -> None:
    for command in ("extract", "finetune"):
        assert "wheresrc:WIDTH (a tiny net for the table)" in cli(command, "--help")


# ------------------------------------------------------------------ a data format
DATA_FORMAT = '''
"""A data format in one file (docs/development.md's example): ``--data listfile:FILE``."""
from pathlib import Path

import numpy as np
import polars as pl

from featcache.data.decode import PathLoader
from featcache.data.readers.registry import register_format
from featcache.data.source import ReadOptions, SplitSource, StringColumn, integer_classes


@register_format("wherelist", usage="wherelist:FILE", note="lines 'path label'")
def listfile(file: str, name: str, options: ReadOptions) -> dict[str, SplitSource]:
    rows = [ln.rsplit(" ", 1) for ln in Path(file).read_text().splitlines() if ln.strip()]
    paths = StringColumn.from_polars(pl.Series([str(Path(file).parent / p) for p, _ in rows]))
    labels = np.array([int(lab) for _, lab in rows], np.int64)
    classes = integer_classes(labels, f"listfile {file}")
    ids = np.array([p for p, _ in rows])
    loader = PathLoader(paths, options)
    return {"all": SplitSource(name, "all", ids, labels, classes, loader, f"wherelist:{file}")}
'''


def _data_format_registries() -> tuple:
    from featcache.data.readers import registry

    return (registry.FORMATS,)


def _find_data_format(cli: CLI, tmp_path: Path) -> None:
    for command in ("extract", "finetune"):
        assert "wherelist:FILE (lines 'path label')" in cli(command, "--help")


# ------------------------------------------------------------------ a retrieval metric
RETRIEVAL_METRIC = '''
"""A retrieval metric in one file (docs/development.md's example): ``wherefound@k``."""
import numpy as np

from featcache.retrieval.metrics import RankedRelevance, register_retrieval_metric


@register_retrieval_metric("wherefound", full=False, at_k=True)
def found_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: how many relevant items lie within the top k."""
    return np.bincount(rr.query_index(), weights=rr.ranks <= k, minlength=rr.n_queries)
'''


def _retrieval_metric_registries() -> tuple:
    from featcache.retrieval import metrics

    return (metrics.RETRIEVAL_METRICS,)


def _find_retrieval_metric(cli: CLI, tmp_path: Path) -> None:
    """``featcache retrieve`` writes the new metric's rows: per query, the relevant items (same
    label) within the top k, each query itself left out."""
    import polars as pl

    from featcache.store import open_cache, write_features

    labels = np.repeat([0, 1, 2], 4)  # 12 rows, 4 per class: 3 relevant items per query
    X = np.eye(12, 8, dtype=np.float32) + labels[:, None].astype(np.float32)
    cache, results = str(tmp_path / "c.zarr"), str(tmp_path / "r.parquet")
    write_features(
        open_cache(cache, "a"),
        backbone="pix",
        dataset="toy",
        split="train",
        X=X,
        ids=[f"r{i}" for i in range(12)],
        labels=labels,
        class_names=["a", "b", "c"],
    )
    cli(*f"retrieve --cache {cache} --dataset toy --all --query train --gallery train".split(),
        *f"--k 1,3,20 --results {results} --no-progress".split())  # fmt: skip
    rows = pl.read_parquet(results).filter(pl.col("metric").str.starts_with("wherefound@"))
    got = dict(zip(rows["metric"], rows["value"]))
    assert set(got) == {"wherefound@1", "wherefound@3", "wherefound@20"}, got
    assert got["wherefound@20"] == 3.0  # every relevant item found at the full depth


# ------------------------------------------------------------------ a store backend
STORE_BACKEND = '''
"""A store backend in one file: a zarr Store (a local folder that counts its writes)."""
from zarr.storage import LocalStore


class WhereStore(LocalStore):
    writes = 0

    async def set(self, key, value):
        type(self).writes += 1
        await super().set(key, value)
'''


def _find_store_backend(cli: CLI, tmp_path: Path) -> None:
    """One round trip through the new Store, then ``featcache ls`` reads what it wrote."""
    from where_store_backend import WhereStore

    from featcache.store import open_cache, write_features

    X = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
    store = WhereStore(tmp_path / "c.zarr")
    write_features(
        open_cache(store, "a"),
        backbone="pix",
        dataset="toy",
        split="train",
        X=X,
        ids=[f"r{i}" for i in range(40)],
        labels=np.arange(40) % 2,
        class_names=["a", "b"],
        chunk_rows=16,
    )
    assert WhereStore.writes > 0  # the bytes went through the new Store
    np.testing.assert_array_equal(open_cache(WhereStore(tmp_path / "c.zarr"), "r").load("pix", "toy", "train").X, X)
    listing = cli("ls", str(tmp_path / "c.zarr"))
    assert "pix" in listing, listing
    assert "toy" in listing, listing


# ------------------------------------------------------------------ a toy store for the stage rows
def _toy_store(tmp_path: Path, backbones: tuple[str, ...] = ("pix",)) -> str:
    """Two splits (train 60 rows, test 30 rows) of three separable classes per backbone."""
    from featcache.store import open_cache, write_features

    cache = str(tmp_path / "toy.zarr")
    rng = np.random.default_rng(0)
    for b, backbone in enumerate(backbones):
        for split, n in (("train", 60), ("test", 30)):
            labels = np.arange(n) % 3
            X = (np.eye(3, 6)[labels] * 4 + rng.normal(size=(n, 6)) * (0.5 + b)).astype(np.float32)
            write_features(
                open_cache(cache, "a"),
                backbone=backbone,
                dataset="toy",
                split=split,
                X=X,
                ids=[f"{split}{i}" for i in range(n)],
                labels=labels,
                class_names=["a", "b", "c"],
            )
    return cache


def _probe_rows(cli: CLI, tmp_path: Path, protocol: str) -> dict[str, float]:
    """``featcache probe --protocol PROTOCOL`` on the toy store: its results rows, metric -> value."""
    import polars as pl

    cache, results = _toy_store(tmp_path), str(tmp_path / "r.parquet")
    cli("probe", "--cache", cache, "--dataset", "toy", "--all", "--protocol", protocol, "--results", results)
    rows = pl.read_parquet(results).filter(pl.col("protocol") == protocol)
    assert rows.height, f"no rows of {protocol}"
    return dict(zip(rows["metric"], rows["value"]))


# ------------------------------------------------------------------ a solver (and the protocol naming it)
SOLVER = '''
"""A solver in one file: the nearest class mean, with an option of its own (--where-shrink),
and the fixed protocol that names it."""
from dataclasses import dataclass

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.core.protocols import CGrid, register_fixed_protocol
from featcache.probes.solver_registry import FitOutcome, register_solver


@dataclass(frozen=True)
class WhereOptions:
    where_shrink: float = flag(0.0, "where-means: shrink the class means to 0", type=float, check=Interval(float, 0, 1))

    def __post_init__(self):
        check_fields(self)


@register_solver("where-means", options=WhereOptions)
def fit_means(req):
    X, y = np.asarray(req.plan.fin[0], np.float64), np.asarray(req.plan.fin[1])
    classes = np.unique(y)
    means = np.stack([X[y == c].mean(0) for c in classes]) * (1 - req.opts["where_shrink"])

    def predict(Z):
        d = -((np.asarray(Z, np.float64)[:, None, :] - means[None]) ** 2).sum(-1)
        e = np.exp(d - d.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return FitOutcome(predict, classes, {"where_shrink": req.opts["where_shrink"]}, True, 0.0)


register_fixed_protocol("where-ncm", note="nearest class mean", split="full", solver="where-means", grid=CGrid())
'''


def _solver_registries() -> tuple:
    from featcache.core import protocols
    from featcache.probes.solvers import SOLVERS

    return SOLVERS, protocols.PROTOCOLS["probe"]


def _find_solver(cli: CLI, tmp_path: Path) -> None:
    help_ = cli("probe", "--help")
    assert "--where-shrink" in help_
    assert "where-ncm (nearest class mean)" in help_
    rows = _probe_rows(cli, tmp_path, "where-ncm")
    assert rows["top1"] == 1.0  # three well separated classes


# ------------------------------------------------------------------ a protocol
PROTOCOL = '''
"""A protocol in one file: L-BFGS over a three-value C grid on the full training split."""
from featcache.core.protocols import CGrid, register_fixed_protocol

register_fixed_protocol(
    "where-lbfgs3", note="L-BFGS, C in 0.1, 1, 10", split="full", solver="lbfgs", grid=CGrid(Cs=(0.1, 1.0, 10.0))
)
'''


def _protocol_registries() -> tuple:
    from featcache.core import protocols

    return (protocols.PROTOCOLS["probe"],)


def _find_protocol(cli: CLI, tmp_path: Path) -> None:
    assert "where-lbfgs3 (L-BFGS, C in 0.1, 1, 10)" in cli("probe", "--help")
    assert _probe_rows(cli, tmp_path, "where-lbfgs3")["top1"] == 1.0


# ------------------------------------------------------------------ a split plan
SPLIT_PLAN = '''
"""A split plan in one file: the first half of train fits, the second half selects (and the
protocol that names it, which is how a plan is chosen)."""
import numpy as np

from featcache.core.protocols import CGrid, SplitPlan, register_fixed_protocol, register_split_plan


@register_split_plan("where-halves", val_split=False, note="first half fits, second half selects")
def halves(p, y, seed, n_val, val_source, train_name, val_name, **_):
    idx = np.arange(y.size)
    return SplitPlan(idx[: y.size // 2], idx[y.size // 2 :], idx, f"{train_name}[halves]", {"val": "second half"})


register_fixed_protocol("where-halved", note="C chosen on the second half", split="where-halves", solver="lbfgs",
                        grid=CGrid())
'''


def _split_plan_registries() -> tuple:
    from featcache.core import protocols

    return protocols.PROTOCOLS["probe"], protocols.SPLIT_PLANS


def _find_split_plan(cli: CLI, tmp_path: Path) -> None:
    from featcache.core.protocols import list_split_plans

    assert _probe_rows(cli, tmp_path, "where-halved")["top1"] == 1.0
    assert "where-halves" in list_split_plans()  # the CLI imported the module


# ------------------------------------------------------------------ a similarity measure
MEASURE = '''
"""A similarity measure in one file: squared linear CKA, from the shared streamed statistic."""
from featcache.similarity import register_measure
from featcache.similarity.streaming import LinearCKAStream


@register_measure("where_cka_sq", text="squared linear CKA", statistic=LinearCKAStream)
def cka_squared(stat, cfg):
    return stat.result() ** 2
'''


def _measure_registries() -> tuple:
    from featcache.similarity import MEASURES

    return (MEASURES,)


def _find_measure(cli: CLI, tmp_path: Path) -> None:
    import polars as pl

    assert "where_cka_sq" in cli("similarity", "--help")
    cache, results = _toy_store(tmp_path, ("pix", "pax")), str(tmp_path / "r.parquet")
    cli(
        *f"similarity --cache {cache} --dataset toy --all --measures where_cka_sq,cka_linear --results {results}".split()
    )
    got = dict(zip(*pl.read_parquet(results).select("metric", "value")))
    assert got["where_cka_sq"] == pytest.approx(got["cka_linear"] ** 2, rel=1e-12)


# ------------------------------------------------------------------ a retrieval search backend
SEARCH_BACKEND = '''
"""A search backend in one file: brute force over float64 scores, counting its calls."""
import numpy as np

from featcache.retrieval.search import BACKENDS, SearchBackend

CALLS = []


def search(Q, G, k, metric, max_memory, bar):
    CALLS.append(k)
    S = Q.block(0, Q.shape[0]).astype(np.float64) @ G.block(0, G.shape[0]).astype(np.float64).T
    kk = min(k, S.shape[1])
    idx = np.argsort(-S, axis=1, kind="stable")[:, :kk]
    bar.update(Q.shape[0])
    return np.take_along_axis(S, idx, 1).astype(np.float32), idx.astype(np.int64)


BACKENDS.register("where-brute", SearchBackend(search), note="brute force (a contributor's)")
'''


def _search_backend_registries() -> tuple:
    from featcache.retrieval.search import BACKENDS

    return (BACKENDS,)


def _find_search_backend(cli: CLI, tmp_path: Path) -> None:
    import polars as pl

    assert "where-brute" in cli("retrieve", "--help")
    cache = _toy_store(tmp_path)
    rows = {}
    for backend in ("where-brute", "numpy"):
        results = str(tmp_path / f"{backend}.parquet")
        cli(*f"retrieve --cache {cache} --dataset toy --all --query test --gallery train --top-k-only".split(),
            *f"--k 1,5 --backend {backend} --results {results} --no-progress".split())  # fmt: skip
        df = pl.read_parquet(results).sort("metric")
        rows[backend] = dict(zip(df["metric"], df["value"]))
    assert sys.modules["where_search_backend"].CALLS  # the new backend searched
    assert rows["where-brute"] == rows["numpy"]


# ------------------------------------------------------------------ an extraction backend
FORWARD_BACKEND = '''
"""An extraction (forward) backend in one file: the eager forward under torch.inference_mode."""
from featcache.extract.backends import BACKENDS, ForwardBackend


def make(head):
    import torch

    def forward(x):
        with torch.inference_mode():
            return head(x)

    return forward


BACKENDS.register("where-inference", ForwardBackend(make), note="eager under inference_mode")
'''


def _forward_backend_registries() -> tuple:
    from featcache.extract.backends import BACKENDS

    return (BACKENDS,)


def _find_forward_backend(cli: CLI, tmp_path: Path) -> None:
    assert "where-inference" in cli("extract", "--help")


# ------------------------------------------------------------------ a result format
RESULT_FORMAT = '''
"""A result format in one file: one TSV line per (run, metric)."""
from featcache.interop.formats import RESULT_FORMATS, ResultFormat
from featcache.interop.runs import Imported, external_rows


def write(runs, ctx):
    ctx.out.mkdir(parents=True, exist_ok=True)
    path = ctx.out / "rows.tsv"
    path.write_text("".join(f"{r.backbone}\\t{r.dataset}\\t{m}\\t{v!r}\\n" for r in runs for m, v in r.metrics.items()))
    return [path], []


def read(path):
    got = Imported()
    for line in (path / "rows.tsv").read_text().splitlines():
        b, d, m, v = line.split("\\t")
        base = {"kind": "probe", "backbone": b, "dataset": d, "protocol": "where-tsv"}
        got.rows += external_rows(base, {m: float(v)}, fmt="where-tsv", path=path, sha="-")
    return got


RESULT_FORMATS.register("where-tsv", ResultFormat(write, read, lambda p: (p / "rows.tsv").exists()))
'''


def _result_format_registries() -> tuple:
    from featcache.interop.formats import RESULT_FORMATS

    return (RESULT_FORMATS,)


def _find_result_format(cli: CLI, tmp_path: Path) -> None:
    import polars as pl

    top1 = _probe_rows(cli, tmp_path, "full")["top1"]
    results, out = str(tmp_path / "r.parquet"), str(tmp_path / "tsv")
    cli("export", "--format", "where-tsv", "--results", results, "--out", out)
    cli("import", out, "--results", results)  # --format auto finds it
    rows = pl.read_parquet(results).filter((pl.col("protocol") == "where-tsv") & (pl.col("metric") == "top1"))
    assert rows["value"].to_list() == [top1]


# ------------------------------------------------------------------ an experiment tracker
TRACKER = '''
"""An experiment tracker in one file: each run as a JSON line appended to the file the URI names."""
import json

from featcache.core.tracking import TrackerInfo, register_tracker


class JsonLines:
    def __init__(self, uri):
        self.path = uri

    def log_run(self, run, parent=None):
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"run_id": run.run_id, "metrics": dict(run.metrics), "parent": parent}) + "\\n")
        return run.run_id


register_tracker("wherelines", JsonLines, note="JSON lines", info=TrackerInfo("runs.jsonl", "json", "-"))
'''


def _tracker_registries() -> tuple:
    from featcache.core.tracking import TRACKERS

    return (TRACKERS,)


def _find_tracker(cli: CLI, tmp_path: Path) -> None:
    import json

    import polars as pl

    assert "wherelines[:URI] (JSON lines)" in cli("retrieve", "--help")
    cache, results, lines = _toy_store(tmp_path), tmp_path / "r.parquet", tmp_path / "runs.jsonl"
    cli(*f"retrieve --cache {cache} --dataset toy --all --query test --gallery train --k 1".split(),
        *f"--results {results} --no-progress --track wherelines:{lines}".split())  # fmt: skip
    logged = [json.loads(line) for line in lines.read_text().splitlines()]
    df = pl.read_parquet(results)
    assert sorted(r["run_id"] for r in logged) == sorted(set(df["run_id"]))
    for r in logged:
        mine = df.filter(pl.col("run_id") == r["run_id"])
        assert r["metrics"] == dict(zip(mine["metric"], mine["value"]))


#: kind -> its one file and how the CLI finds it
KINDS = {
    "model source": Kind(MODEL_SOURCE, _model_source_registries, _find_model_source),
    "data format": Kind(DATA_FORMAT, _data_format_registries, _find_data_format),
    "retrieval metric": Kind(RETRIEVAL_METRIC, _retrieval_metric_registries, _find_retrieval_metric),
    "store backend": Kind(STORE_BACKEND, lambda: (), _find_store_backend),
    "solver": Kind(SOLVER, _solver_registries, _find_solver),
    "protocol": Kind(PROTOCOL, _protocol_registries, _find_protocol),
    "split plan": Kind(SPLIT_PLAN, _split_plan_registries, _find_split_plan),
    "similarity measure": Kind(MEASURE, _measure_registries, _find_measure),
    "search backend": Kind(SEARCH_BACKEND, _search_backend_registries, _find_search_backend),
    "extraction backend": Kind(FORWARD_BACKEND, _forward_backend_registries, _find_forward_backend),
    "result format": Kind(RESULT_FORMAT, _result_format_registries, _find_result_format),
    "tracker": Kind(TRACKER, _tracker_registries, _find_tracker),
}


def _module_name(kind: str) -> str:
    return "where_" + kind.replace(" ", "_")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_new_member_is_one_file_the_cli_finds(kind, tmp_path, monkeypatch, capsys):
    row, name = KINDS[kind], _module_name(kind)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(textwrap.dedent(row.source))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv(PLUGINS_ENV, name)

    def cli(*argv: str) -> str:
        capsys.readouterr()
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # --help
            rc = exc.code
        out, err = capsys.readouterr()
        assert rc in (0, None), (argv, rc, err)
        return " ".join(out.split())  # argparse wraps the help at the terminal's width

    with contextlib.ExitStack() as stack:
        for registry in row.registries():
            stack.enter_context(registry.restored())
        try:
            row.check(cli, tmp_path)
        finally:
            sys.modules.pop(name, None)


def test_the_cli_imports_the_plugins_named_in_the_environment(tmp_path):
    """From a shell: ``FEATCACHE_PLUGINS=mod featcache extract --help`` with the module's folder on
    PYTHONPATH shows the module's data format; a module that is not there is one error line."""
    (tmp_path / "where_shell_format.py").write_text(textwrap.dedent(DATA_FORMAT))
    path = os.pathsep.join([str(tmp_path), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, PLUGINS_ENV: "where_shell_format"}
    run = [sys.executable, "-m", "featcache", "extract", "--help"]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wherelist:FILE" in out.stdout
    out = subprocess.run(run, capture_output=True, text=True, env={**env, PLUGINS_ENV: "no_such_plugin"}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"featcache: error: {PLUGINS_ENV} names module 'no_such_plugin', which cannot be imported: "
        f"put its folder on PYTHONPATH or take it out of {PLUGINS_ENV}"
    ]


OUTSIDE_TESTS = """
import pytest
from where_store_backend import WhereStore

from featcache.testing import FeatureCacheTests


class TestWhereStore(FeatureCacheTests):
    @pytest.fixture
    def target(self, tmp_path):
        return WhereStore(tmp_path / "c.zarr")

    def raw(self, target):
        return WhereStore(target.root)
"""


@pytest.mark.slow  # a pytest run of its own: about 10 s on 2 cores
def test_a_store_backend_outside_the_repository_runs_the_shipped_contract(tmp_path):
    """The store backend's file and a test module of its own, both outside the repository (no
    conftest of ours): the module subclasses featcache.testing.FeatureCacheTests, as a backend's
    own package would, and every test of the contract passes on it."""
    (tmp_path / "where_store_backend.py").write_text(textwrap.dedent(STORE_BACKEND))
    (tmp_path / "test_where_store.py").write_text(textwrap.dedent(OUTSIDE_TESTS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    run = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "test_where_store.py"]
    out = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    from featcache.testing import FeatureCacheTests

    contract = [n for n in dir(FeatureCacheTests) if n.startswith("test_")]
    assert f"{len(contract)} passed" in out.stdout, out.stdout[-1000:]


@pytest.mark.slow  # an extraction (torch): about 5 s
def test_the_one_file_model_source_passes_the_shipped_source_contract(tmp_path, monkeypatch):
    """The model source row's file is a whole source: featcache.testing.check_source extracts with
    it, resumes, and finds the features equal to the net's own forward."""
    (tmp_path / "where_model_source.py").write_text(textwrap.dedent(MODEL_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from featcache.testing import check_source

    with contextlib.ExitStack() as stack:
        for registry in _model_source_registries():
            stack.enter_context(registry.restored())
        try:
            import where_model_source

            def forward(x):
                return where_model_source.build("8", "random:0").model(x)

            got = check_source("wheresrc:8", "random:0", forward, tmp_path / "c.zarr")
        finally:
            sys.modules.pop("where_model_source", None)
    assert got.features.X.shape == (6, 8)
