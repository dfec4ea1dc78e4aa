"""Fine-tuning reads its backbone through the model-source seam (``torchvision:``,
``open_clip:``, ``python:``, an ``nn.Module``) with the source's own preprocessing and records
its provenance; a bare timm name keeps its run ids."""

from __future__ import annotations

import pytest

from featcache.finetune import FinetuneConfig
from featcache.finetune import runner as F

#: one short epoch on real digits: 60 training images, batches of 8, 7 steps
TINY = {
    "steps": (7,),
    "lrs": (0.01,),
    "batch_size": 8,
    "limit": {"train": 60, "test": 20},
    "progress": False,
    "workers": 0,
}


@pytest.fixture(scope="module")
def one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_timm_run_ids_unchanged(one_thread):
    """A bare timm name goes through the same seam with the run id it had before the seam."""
    df = F.finetune(
        FinetuneConfig(
            "test_resnet", "random:0", "digits", "full", input_size=32, **{**TINY, "steps": (1,), "batch_size": 4}
        )
    )
    assert set(df["run_id"]) == {"3660600e33a42101"}
    assert set(df["backbone"]) == {"test_resnet@random0"}


@pytest.fixture(scope="module")
def user_net(tmp_path_factory):
    """The user module of the model-source tests, importable as ``featcache_user_net``."""
    import sys

    from model_source_fixtures import USER_MODULE

    d = tmp_path_factory.mktemp("usermods")
    (d / "featcache_user_net.py").write_text(USER_MODULE)
    sys.path.insert(0, str(d))
    yield "featcache_user_net"
    sys.path.remove(str(d))
    sys.modules.pop("featcache_user_net", None)


def _check_rows(df, bb, source: str, arch: str, model: str):
    import json

    import numpy as np

    assert set(df["backbone"]) == {bb.default_key}
    top1 = df.filter(df["metric"] == "top1")["value"].to_numpy()
    assert top1.size == 1
    assert np.isfinite(top1).all()
    hp = json.loads(df["hparams"][0])
    assert hp["model"] == model
    assert hp["data_config"]["source"] == source
    assert hp["data_config"]["arch"] == arch
    assert hp["data_config"]["library_version"]
    assert hp["data_config"]["transform"] == bb.data_config["transform"]  # the source's own preprocessing
    assert hp["weights_sha256"] == bb.weights_sha256
    assert np.isfinite(hp["final_loss"])
    assert hp["candidates"][0]["steps"] == 7


@pytest.mark.slow
def test_finetune_torchvision_model(one_thread, tmp_path):
    from featcache.models import create_backbone

    spec = "torchvision:mobilenet_v3_small"
    df = F.finetune(FinetuneConfig(spec, "random:0", "digits", "full", results_path=tmp_path / "r.parquet", **TINY))
    _check_rows(df, create_backbone(spec, "random:0"), "torchvision", "mobilenet_v3_small", spec)


@pytest.mark.slow
def test_finetune_open_clip_image_tower(one_thread, tmp_path):
    pytest.importorskip("open_clip")
    from model_source_fixtures import register_tiny_open_clip

    from featcache.models import create_backbone

    spec = f"open_clip:{register_tiny_open_clip(tmp_path / 'oc')}"
    df = F.finetune(FinetuneConfig(spec, "random:0", "digits", "full", **TINY))
    _check_rows(df, create_backbone(spec, "random:0"), "open_clip", spec.split(":", 1)[1], spec)


def test_finetune_python_module_from_the_cli(one_thread, user_net, tmp_path):
    import polars as pl

    from featcache.cli import main
    from featcache.models import create_backbone

    spec, res = f"python:{user_net}:make", tmp_path / "r.parquet"
    argv = ["finetune", "--model", spec, "--weights", "random:3", "--data", "digits", "--protocol", "full"]
    argv += ["--steps", "7", "--lrs", "0.01", "--batch-size", "8", "--limit", "train=60,test=20"]
    assert main([*argv, "--workers", "0", "--no-progress", "--results", str(res)]) == 0
    _check_rows(pl.read_parquet(res), create_backbone(spec, "random:3"), "python", f"{user_net}:make", spec)


def test_finetune_an_nn_module_object_leaves_it_untouched(one_thread, user_net):
    import importlib

    import torch

    from featcache.models import create_backbone

    torch.manual_seed(5)
    net = importlib.import_module(user_net).make()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    df = F.finetune(FinetuneConfig(net, "module", "digits", "full", **TINY))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    _check_rows(df, create_backbone(net, "module"), "module", "TinyNet", "module:TinyNet")


def test_finetune_reads_the_layers_through_their_public_names_only():
    """The model-source seam is :func:`featcache.models.create_backbone`: fine-tuning imports the
    models and data layers' public names, never a module inside them (sources, backbones,
    readers...), and nothing of the extract stage."""
    import ast
    import importlib
    from pathlib import Path

    layers = ("featcache.models", "featcache.data")
    root = Path(F.__file__).parent
    for f in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith((*layers, "featcache.extract")):
                assert node.module in layers, f"{f.name} imports {node.module}"
                assert {a.name for a in node.names} <= set(importlib.import_module(node.module).__all__), f.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith((*layers, "featcache.extract")) for a in node.names), f.name


def test_finetune_selects_on_the_metrics_registered_for_it(monkeypatch):
    from featcache.cli import build_parser
    from featcache.core import metrics
    from featcache.finetune.config import FinetuneConfigError, selection_metrics

    def choices():
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices
        return list(next(a for a in sub["finetune"]._actions if a.dest == "metric").choices)

    assert selection_metrics() == ("top1", "mean_per_class") == tuple(choices())
    cfg = FinetuneConfig("m", data="d", results_path="r.parquet", metric="t55_top1")
    with pytest.raises(FinetuneConfigError, match="selects on top1 or mean_per_class, not 't55_top1'"):
        cfg.resolve()
    monkeypatch.setattr(metrics, "TASK_METRICS", metrics.TASK_METRICS)  # restored after
    with metrics.METRICS.restored():
        metrics.register_metric("t55_top1", metrics.top1, task=True, finetune=True)
        assert selection_metrics() == ("top1", "mean_per_class", "t55_top1") == tuple(choices())
        assert cfg.resolve()[1].metric == "t55_top1"
    assert "t55_top1" not in selection_metrics()
