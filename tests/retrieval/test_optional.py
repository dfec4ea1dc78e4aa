"""faiss is optional and its CPU and GPU builds cannot sit side by side (pip cannot say so)."""

from __future__ import annotations

import sys

import pytest

from featcache.core.optional import faiss_conflict, import_faiss
from featcache.errors import BackendUnavailableError, DependencyConflictError, FeatcacheError


def _fake_dist(root, name: str) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")


def test_cpu_and_gpu_builds_together_are_refused(tmp_path, monkeypatch):
    pytest.importorskip("faiss")
    assert faiss_conflict() == []  # the test environment installs featcache[cpu] only
    _fake_dist(tmp_path, "faiss-gpu-cu12")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert faiss_conflict() == ["faiss-cpu", "faiss-gpu-cu12"]
    with pytest.raises(DependencyConflictError, match="pip uninstall -y faiss-cpu") as exc:
        import_faiss()
    assert isinstance(exc.value, ImportError)
    assert isinstance(exc.value, FeatcacheError)


def test_missing_faiss_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError
    with pytest.raises(BackendUnavailableError, match=r"featcache\[cpu\]"):
        import_faiss()


def test_retrieval_falls_back_without_faiss(monkeypatch):
    import numpy as np

    from featcache.retrieval.search import choose_backend, raw_search

    monkeypatch.setitem(sys.modules, "faiss", None)
    assert choose_backend("auto") in ("numpy", "torch-cuda")
    X = np.eye(4, dtype=np.float32)
    with pytest.raises(BackendUnavailableError, match=r"featcache\[cpu\]"):
        raw_search(X, X, 2, "ip", "faiss-cpu")
