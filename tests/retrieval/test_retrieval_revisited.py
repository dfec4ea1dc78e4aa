"""Revisited Oxford/Paris AP (revisitop's trapezoidal AP, Easy/Medium/Hard setups): the
vectorised metric against a brute-force PR-curve integration and the revisitop formula, and
end to end through run_retrieval on real digits pixels."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.errors import DataError
from featcache.retrieval import (
    ExplicitRelevance,
    RankedRelevance,
    RetrievalConfig,
    average_precision,
    full_ranking,
    prepare,
    revisited_ap,
    revisited_precision_at_k,
    revisited_table,
    run_retrieval,
)
from featcache.retrieval.revisited import is_revisited_table

_trapezoid = getattr(np, "trapezoid", None) or np.trapezoid


def test_positive_at_rank_two_is_a_quarter():
    rr = RankedRelevance([0, 1], [2], [1])
    assert revisited_ap(rr)[0] == pytest.approx(0.25)
    assert average_precision(rr)[0] == pytest.approx(0.5)  # sklearn-style AP of the same ranking
    assert revisited_ap(RankedRelevance([0, 1], [1], [1]))[0] == 1.0
    assert np.isnan(revisited_ap(RankedRelevance([0, 0], [], [0]))[0])


def brute_force_ap(ranked_is_pos: np.ndarray, n_pos: int) -> float:
    """Area under the PR curve (trapezoids) of a ranked list after junk removal; the curve
    starts at (recall 0, precision 1)."""
    seen = np.concatenate([[0], np.cumsum(ranked_is_pos)])
    depth = np.arange(seen.size)
    precision = np.where(depth == 0, 1.0, seen / np.maximum(depth, 1))
    return float(_trapezoid(precision, seen / n_pos))


def revisitop_formula(pos0: np.ndarray, n_pos: int) -> float:
    """revisitop's compute_ap as its paper/README state it: 0-based positive positions."""
    ap = 0.0
    for j, r in enumerate(pos0):
        p0 = 1.0 if r == 0 else j / r
        p1 = (j + 1) / (r + 1)
        ap += (p0 + p1) / (2 * n_pos)
    return ap


def brute_force_mp(pos1: np.ndarray, k: int) -> float:
    kq = min(int(pos1.max()), k)
    return float((pos1 <= kq).sum() / kq)


SETUP_POS = {"easy": {"easy"}, "medium": {"easy", "hard"}, "hard": {"hard"}}


@pytest.mark.parametrize("setup", ["easy", "medium", "hard"])
def test_against_brute_force_and_formula(setup):
    rng = np.random.default_rng(7)
    n_q, n_g = 12, 60
    Q = rng.normal(size=(n_q, 8)).astype(np.float32)
    G = rng.normal(size=(n_g, 8)).astype(np.float32)
    qids, gids = [f"q{i}" for i in range(n_q)], [f"g{j}" for j in range(n_g)]
    labels = rng.choice(["easy", "hard", "junk", "none", "none"], size=(n_q, n_g))
    labels[:, 0] = "easy"
    labels[:, 1] = "hard"  # every query has positives in every setup
    tq, tg, tr = zip(
        *[(qids[i], gids[j], labels[i, j]) for i in range(n_q) for j in range(n_g) if labels[i, j] != "none"]
    )
    rel = ExplicitRelevance(qids, gids, *revisited_table(tq, tg, tr, setup))
    Qp, Gp = prepare(Q, "cosine"), prepare(G, "cosine")
    rr = full_ranking(Qp, Gp, rel, "cosine", progress=False)
    got, mp5 = revisited_ap(rr), revisited_precision_at_k(rr, 5)
    S = Qp.astype(np.float64) @ Gp.T.astype(np.float64)
    for i in range(n_q):
        is_pos = np.isin(labels[i], list(SETUP_POS[setup]))
        is_junk = ~is_pos & np.isin(labels[i], ["easy", "hard", "junk"])
        order = np.argsort(-S[i], kind="stable")
        kept = order[~is_junk[order]]
        ranked_pos = is_pos[kept]
        pos0 = np.flatnonzero(ranked_pos)
        assert got[i] == pytest.approx(brute_force_ap(ranked_pos, int(is_pos.sum())), abs=1e-12)
        assert got[i] == pytest.approx(revisitop_formula(pos0, int(is_pos.sum())), abs=1e-12)
        assert mp5[i] == pytest.approx(brute_force_mp(pos0 + 1, 5))


def test_setup_tables_and_detection():
    q, g, r = ["q", "q", "q"], ["a", "b", "c"], ["easy", "hard", "junk"]
    assert is_revisited_table(r)
    assert not is_revisited_table(["positive", "junk"])
    assert list(revisited_table(q, g, r, "easy")[2]) == ["positive", "junk", "junk"]
    assert list(revisited_table(q, g, r, "medium")[2]) == ["positive", "positive", "junk"]
    assert list(revisited_table(q, g, r, "hard")[2]) == ["junk", "positive", "junk"]
    with pytest.raises(DataError, match="setup"):
        revisited_table(q, g, r, "extreme")
    with pytest.raises(DataError, match="easy"):
        revisited_table(q, g, ["easy", "positive", "junk"], "medium")


@pytest.fixture(scope="module")
def small_pix(tmp_path_factory):
    from featcache.store import write_features

    d = load_digits()
    X, y = d.data.astype(np.float32)[:330], d.target.astype(np.int64)[:330]
    ids = np.array([f"d{i:04d}" for i in range(len(y))])
    names = [str(i) for i in range(10)]
    path = str(tmp_path_factory.mktemp("rpix") / "cache.zarr")
    write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="train",
        X=X[:300],
        ids=ids[:300],
        labels=y[:300],
        class_names=names,
    )
    write_features(
        path,
        backbone="pix",
        dataset="digits",
        split="test",
        X=X[300:],
        ids=ids[300:],
        labels=y[300:],
        class_names=names,
    )
    return path, X, y, ids


def test_run_retrieval_revisited_file(small_pix, tmp_path):
    path, X, y, ids = small_pix
    rows = []
    for qi in range(300, 330):  # same label: every 3rd easy, the next hard, the next junk
        same = np.flatnonzero(y[:300] == y[qi])
        rows += [(ids[qi], ids[j], ["easy", "hard", "junk"][n % 3]) for n, j in enumerate(same)]
    f = tmp_path / "gnd.csv"
    f.write_text("query_id,gallery_id,relevance\n" + "\n".join(",".join(r) for r in rows) + "\n")
    cfg = RetrievalConfig(
        cache=path,
        dataset="digits",
        backbones=("pix",),
        relevance=f,
        ks=(1, 5),
        knn=False,
        progress=False,
        revisited=("medium", "hard"),
    )
    df = run_retrieval(cfg)
    assert set(df["protocol"].to_list()) == {"revisited-medium", "revisited-hard"}
    assert len(set(df["run_id"].to_list())) == 2
    Qp, Gp = prepare(X[300:], "cosine"), prepare(X[:300], "cosine")
    S = Qp.astype(np.float64) @ Gp.T.astype(np.float64)
    lab = {(a, b): c for a, b, c in rows}
    for setup in ("medium", "hard"):
        sub = df.filter(df["protocol"] == f"revisited-{setup}")
        vals = dict(zip(sub["metric"], sub["value"]))
        assert {"map", "map_revisitop", "mp_revisitop@5", "recall@5"} <= set(vals)
        aps = []
        for i in range(30):
            lbl = np.array([lab.get((ids[300 + i], ids[j]), "none") for j in range(300)])
            is_pos = np.isin(lbl, list(SETUP_POS[setup]))
            is_junk = ~is_pos & (lbl != "none")
            order = np.argsort(-S[i], kind="stable")
            kept = order[~is_junk[order]]
            aps.append(brute_force_ap(is_pos[kept], int(is_pos.sum())))
        assert vals["map_revisitop"] == pytest.approx(np.mean(aps), abs=1e-6)
        assert vals["map_revisitop"] < vals["map"]  # trapezoids sit below sklearn-style AP
        assert json.loads(sub["hparams"][0])["relevance_sha256"]
    with pytest.raises(DataError, match="full ranking"):
        run_retrieval(replace(cfg, full=False))


def test_table_from_revisitop_ground_truth():
    from featcache.retrieval import table_from_revisitop_gnd

    gnd = {
        "qimlist": ["q0", "q1"],
        "imlist": ["a", "b", "c"],
        "gnd": [{"easy": [0], "hard": [2], "junk": [1], "bbx": [0, 0, 9, 9]}, {"easy": [], "hard": [1, 0], "junk": []}],
    }
    q, g, r = table_from_revisitop_gnd(gnd)
    assert list(zip(q, g, r)) == [
        ("q0", "a", "easy"),
        ("q0", "c", "hard"),
        ("q0", "b", "junk"),
        ("q1", "b", "hard"),
        ("q1", "a", "hard"),
    ]
    assert is_revisited_table(r)
    with pytest.raises(DataError, match="outside imlist"):
        table_from_revisitop_gnd({**gnd, "gnd": [{"easy": [5]}, {}]})
    with pytest.raises(DataError, match="qimlist"):
        table_from_revisitop_gnd({"gnd": []})


def test_run_retrieval_prepares_features_once_per_backbone_and_split(small_pix, tmp_path, monkeypatch):
    """Every scored setup (each revisited setup, its revisitop AP, k-NN) shares one prepared
    copy of the query and gallery features: two PreparedRows per backbone x split, not 2 per
    setup (the numbers are the file's other tests')."""
    from featcache.retrieval import prepared as P

    path, _X, y, ids = small_pix
    rows = []
    for qi in range(300, 330):
        same = np.flatnonzero(y[:300] == y[qi])
        rows += [(ids[qi], ids[j], ["easy", "hard", "junk"][n % 3]) for n, j in enumerate(same)]
    f = tmp_path / "gnd.csv"
    f.write_text("query_id,gallery_id,relevance\n" + "\n".join(",".join(r) for r in rows) + "\n")
    made = []
    real = P.PreparedRows.__init__

    def counting(self, *a, **kw):
        made.append(1)
        real(self, *a, **kw)

    monkeypatch.setattr(P.PreparedRows, "__init__", counting)
    cfg = RetrievalConfig(
        cache=path,
        dataset="digits",
        backbones=("pix",),
        relevance=f,
        ks=(1, 5),
        knn=True,
        progress=False,
        revisited=("easy", "medium", "hard"),
    )
    df = run_retrieval(cfg)
    protocols = set(df["protocol"].to_list())
    assert {"revisited-easy", "revisited-medium", "revisited-hard"} <= protocols
    assert any(p.startswith("knn-k") for p in protocols)
    assert len(made) == 2
