"""``featcache audit`` on real features (lite0 on the first 2,000 / 1,000 Fashion-MNIST images)
against a brute-force search, hashes of the real IDX bytes, and a brute-force kNN vote."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from featcache.similarity import AuditConfig, run_audit
from featcache.similarity.neighbours import default_threshold

LITE0 = "tf_efficientnet_lite0"  # the conftest session stores' backbone

DS = "fashion-mnist-small"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
COPIES = {0: 10, 1: 11, 2: 12, 3: 1999, 4: 500}  # test row -> train row whose image it becomes


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    shape = struct.unpack(">III", data[4:16])
    return np.frombuffer(data, np.uint8, offset=16).reshape(shape)


def _write_idx(path: Path, a: np.ndarray) -> None:
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + struct.pack(">III", *a.shape) + a.tobytes())


@pytest.fixture(scope="module")
def images_with_copies(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """A Fashion-MNIST folder whose test images COPIES are byte copies of training images."""
    d = tmp_path_factory.mktemp("fmnist-copies")
    shutil.copy(FMNIST / "train-images-idx3-ubyte.gz", d)
    tr, te = _idx(FMNIST / "train-images-idx3-ubyte.gz"), _idx(FMNIST / "t10k-images-idx3-ubyte.gz").copy()
    for q, t in COPIES.items():
        te[q] = tr[t]
    _write_idx(d / "t10k-images-idx3-ubyte.gz", te)
    return d, tr[:2000], te[:1000]


def _features(cache: str):
    from featcache.store import open_cache

    c = open_cache(cache)
    return c.load(LITE0, DS, "train"), c.load(LITE0, DS, "test")


def _brute(tr, te):
    u = lambda X: X / np.linalg.norm(X, axis=1, keepdims=True)  # noqa: E731
    return u(te.X.astype(np.float64)) @ u(tr.X.astype(np.float64)).T


def _knn(S, ytr, y, k, T=0.07):
    nb = np.argsort(-S, axis=1, kind="stable")[:, :k]
    scores = np.zeros((len(y), 10))
    for i in range(len(y)):
        for j in nb[i]:
            scores[i, ytr[j]] += np.exp(S[i, j] / T)
    return float((scores.argmax(1) == y).mean())


def test_audit_matches_brute_force_and_content_hashes(fmnist_cache, images_with_copies, tmp_path):
    folder, tr_img, te_img = images_with_copies
    cfg = AuditConfig(
        cache=fmnist_cache,
        dataset=DS,
        backbone=LITE0,
        out=str(tmp_path / "pairs.csv"),
        threshold=0.9,
        data_root=str(folder),
        results_path=str(tmp_path / "r.parquet"),
        progress=False,
    )
    rep = run_audit(cfg)
    tr, te = _features(fmnist_cache)
    S = _brute(tr, te)
    top = np.sort(S, axis=1)[:, ::-1][:, : cfg.k]
    near = {(i, int(j)) for i in range(len(te.ids)) for j in np.flatnonzero(S[i] >= 0.9) if S[i, j] >= top[i, -1]}
    h = lambda a: [hashlib.sha256(x.tobytes()).hexdigest() for x in a]  # noqa: E731
    tr_h = {}
    for j, x in enumerate(h(tr_img)):
        tr_h.setdefault(x, []).append(j)
    exact = {(i, j) for i, x in enumerate(h(te_img)) for j in tr_h.get(x, ())}
    assert set(COPIES.items()) <= exact
    got = rep.pairs
    pairs = {(int(q[5:]), int(t[6:])) for q, t in zip(got["query_id"], got["train_id"])}
    assert pairs == near | exact
    flagged_exact = {
        (int(q[5:]), int(t[6:])) for q, t, e in got.select("query_id", "train_id", "exact_content").rows() if e
    }
    assert flagged_exact == exact
    for q, t, c in got.select("query_id", "train_id", "cosine").rows():
        assert c == pytest.approx(S[int(q[5:]), int(t[6:])], abs=1e-5)
    m = rep.splits["test"]
    flagged = np.zeros(len(te.ids), bool)
    flagged[[p[0] for p in pairs]] = True
    assert m["n_flagged"] == flagged.sum()
    assert m["n_exact"] == len({p[0] for p in exact})
    y, ytr = np.asarray(te.labels), np.asarray(tr.labels)
    assert m["knn_top1"] == pytest.approx(_knn(S, ytr, y, cfg.knn_k))
    assert m["knn_top1_clean"] == pytest.approx(_knn(S[~flagged], ytr, y[~flagged], cfg.knn_k))
    assert m["nn1_top1_clean"] == pytest.approx(float((ytr[S[~flagged].argmax(1)] == y[~flagged]).mean()))
    assert Path(tmp_path / "pairs.nn.png").stat().st_size > 0
    assert Path(tmp_path / "pairs.pairs.png").stat().st_size > 0
    assert (
        Path(tmp_path / "pairs.csv").read_text().splitlines()[0] == "query_split,query_id,train_id,cosine,exact_content"
    )


def test_default_threshold_from_the_nearest_neighbour_distribution(fmnist_cache, tmp_path):
    rep = run_audit(AuditConfig(cache=fmnist_cache, dataset=DS, backbone=LITE0, out=str(tmp_path / "p.parquet")))
    tr, te = _features(fmnist_cache)
    nn1 = _brute(tr, te).max(1)
    assert rep.threshold == pytest.approx(1 - 0.1 * np.median(1 - nn1), abs=1e-6)
    assert rep.threshold == pytest.approx(default_threshold(nn1), abs=1e-6)
    assert rep.threshold_rule != "given"
    import polars as pl

    assert pl.read_parquet(tmp_path / "p.parquet").columns == [
        "query_split",
        "query_id",
        "train_id",
        "cosine",
        "exact_content",
    ]


def test_bad_audit_input_is_refused(fmnist_cache, tmp_path):
    from featcache.errors import ConfigError, DataError

    with pytest.raises(ConfigError, match=r"\.csv or \.parquet"):
        AuditConfig(cache=fmnist_cache, dataset=DS, backbone=LITE0, out="pairs.txt")
    with pytest.raises(ConfigError, match="the searched split"):
        AuditConfig(cache=fmnist_cache, dataset=DS, backbone=LITE0, out="p.csv", query_splits="train")
    with pytest.raises(DataError, match="holds none of the query splits"):
        run_audit(
            AuditConfig(cache=fmnist_cache, dataset=DS, backbone=LITE0, out=str(tmp_path / "p.csv"), query_splits="val")
        )


def test_audit_cli_on_digits(digits_cache, tmp_path, capsys):
    """The command line: digits through lite0, images reachable through scikit-learn."""
    from featcache.cli import main

    out = tmp_path / "pairs.parquet"
    argv = ["audit", "--cache", digits_cache, "--dataset", "digits", "--backbone", LITE0, "--out", str(out)]
    assert main([*argv, "--k", "3", "--knn-k", "10"]) == 0
    text = capsys.readouterr().out
    assert "exact duplicates checked by content hash" in text
    assert "test: " in text
    assert out.exists()
    assert (tmp_path / "pairs.nn.png").exists()
    assert main([*argv[:-1], str(tmp_path / "pairs.txt")]) == 1  # one-line error, nothing written
    assert "end it in .csv or .parquet" in capsys.readouterr().err
