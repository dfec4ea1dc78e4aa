"""Battle of the Backbones' retrieval numbers (map_bob, mp@k, mrr_bob) against its own code,
and self-exclusion only within one split (WebDataset keys that restart per split)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sklearn.datasets import load_digits

from featcache.retrieval import RetrievalConfig, prepare, run_retrieval


# Ported from hsouri/bob-retrieval, retrieval/utils.py, compute_ap (revisitop's, via DINO).
def bob_compute_ap(ranks, nres):
    nimgranks = len(ranks)
    ap = 0
    recall_step = 1.0 / nres
    for j in np.arange(nimgranks):
        rank = ranks[j]
        if rank == 0:  # noqa: SIM108 (kept as in the source)
            precision_0 = 1.0
        else:
            precision_0 = float(j) / rank
        precision_1 = float(j + 1) / (rank + 1)
        ap += (precision_0 + precision_1) * recall_step / 2.0
    return ap


# Ported from hsouri/bob-retrieval, retrieval/utils.py, compute_map (returns map, pr, recs, mrr).
def bob_compute_map(ranks, gnd, kappas=()):
    map = 0.0
    nq = len(gnd)
    aps = np.zeros(nq)
    pr = np.zeros(len(kappas))
    prs = np.zeros((nq, len(kappas)))
    nempty = 0
    mrr = 0
    rec_array = []
    for i in np.arange(nq):
        qgnd = np.array(gnd[i]["ok"])
        if qgnd.shape[0] == 0:
            aps[i] = float("nan")
            prs[i, :] = float("nan")
            nempty += 1
            continue
        try:
            qgndj = np.array(gnd[i]["junk"])
        except KeyError:
            qgndj = np.empty(0)
        pos = np.arange(ranks.shape[0])[np.isin(ranks[:, i], qgnd)]
        junk = np.arange(ranks.shape[0])[np.isin(ranks[:, i], qgndj)]
        mrr += 1 / (np.min(pos) + 1)
        k = 0
        ij = 0
        if len(junk):
            ip = 0
            while ip < len(pos):
                while ij < len(junk) and pos[ip] > junk[ij]:
                    k += 1
                    ij += 1
                pos[ip] = pos[ip] - k
                ip += 1
        ap = bob_compute_ap(pos, len(qgnd))
        map = map + ap
        aps[i] = ap
        pos += 1
        for j in np.arange(len(kappas)):
            kq = min(max(pos), kappas[j])
            prs[i, j] = (pos <= kq).sum() / kq
        pr = pr + prs[i, :]
        rec_array.append([(pos < k + 1).sum() / len(qgnd) for k in kappas])
    map = map / (nq - nempty)
    pr = pr / (nq - nempty)
    recs = np.mean(np.array(rec_array), axis=0)
    mrr = mrr / nq
    return map, pr, recs, mrr


KS = (1, 5, 10)


def _write(path, X, y, ids_q, ids_g, n_g):
    from featcache.store import write_features

    names = [str(i) for i in range(10)]
    kw = {"backbone": "pix", "dataset": "digits", "class_names": names}
    write_features(path, split="train", X=X[:n_g], ids=ids_g, labels=y[:n_g], **kw)
    write_features(path, split="test", X=X[n_g:], ids=ids_q, labels=y[n_g:], **kw)


@pytest.fixture(scope="module")
def digits_pix():
    d = load_digits()
    X, y = d.data.astype(np.float32)[:400], d.target.astype(np.int64)[:400]
    return X, y, 300


def _ranks(X, n_g):
    Q, G = prepare(X[n_g:], "cosine"), prepare(X[:n_g], "cosine")
    S = G.astype(np.float64) @ Q.T.astype(np.float64)  # [G, Q] as BoB's sim
    return np.argsort(-S, axis=0)


def _values(df, protocol):
    sub = df.filter((df["kind"] == "retrieval") & (df["protocol"] == protocol))
    return dict(zip(sub["metric"], sub["value"]))


def test_semantic_retrieval_matches_bob_compute_map(digits_pix, tmp_path):
    X, y, n_g = digits_pix
    path = str(tmp_path / "c.zarr")
    ids = np.array([f"d{i:04d}" for i in range(len(y))])
    _write(path, X, y, ids[n_g:], ids[:n_g], n_g)
    cfg = RetrievalConfig(cache=path, dataset="digits", backbones=("pix",), ks=KS, knn=False, progress=False)
    v = _values(run_retrieval(cfg), "semantic")
    gnd = [{"ok": np.flatnonzero(y[:n_g] == y[n_g + i])} for i in range(len(y) - n_g)]
    m, pr, recs, mrr = bob_compute_map(_ranks(X, n_g), gnd, KS)
    assert v["map_bob"] == pytest.approx(m, abs=1e-9)
    assert [v[f"mp@{k}"] for k in KS] == pytest.approx(pr, abs=1e-9)
    assert [v[f"recall@{k}"] for k in KS] == pytest.approx(recs, abs=1e-9)
    assert v["mrr_bob"] == pytest.approx(mrr, abs=1e-9)
    assert v["map_bob"] < v["map"]  # trapezoids below the sklearn-style AP, which stays


def test_explicit_relevance_with_junk_matches_bob(digits_pix, tmp_path):
    """Junk is removed before AP and mP@k but counts in BoB's MRR; a query without positives
    adds 0 to the MRR and still counts in its denominator."""
    X, y, n_g = digits_pix
    path = str(tmp_path / "c.zarr")
    ids = np.array([f"d{i:04d}" for i in range(len(y))])
    _write(path, X, y, ids[n_g:], ids[:n_g], n_g)
    rows, gnd = [], []
    for i in range(len(y) - n_g):
        same = np.flatnonzero(y[:n_g] == y[n_g + i])
        other = np.flatnonzero(y[:n_g] != y[n_g + i])
        ok = same[1::2] if i % 17 else same[:0]  # every 17th query has no positive
        junk = np.concatenate([same[::2], other[:5]])  # junk includes likely top-ranked items
        gnd.append({"ok": ok, "junk": junk})
        rows += [(ids[n_g + i], ids[j], "positive") for j in ok]
        rows += [(ids[n_g + i], ids[j], "junk") for j in junk]
    f = tmp_path / "rel.csv"
    f.write_text("query_id,gallery_id,relevance\n" + "\n".join(",".join(r) for r in rows) + "\n")
    cfg = RetrievalConfig(
        cache=path, dataset="digits", backbones=("pix",), relevance=f, ks=KS, knn=False, progress=False
    )
    v = _values(run_retrieval(cfg), "content")
    m, pr, _, mrr = bob_compute_map(_ranks(X, n_g), gnd, KS)
    assert v["map_bob"] == pytest.approx(m, abs=1e-9)
    assert [v[f"mp@{k}"] for k in KS] == pytest.approx(pr, abs=1e-9)
    assert v["mrr_bob"] == pytest.approx(mrr, abs=1e-9)
    assert v["mrr_bob"] < v["mrr"]  # junk ranked above the first positive, and the empty queries


def test_equal_ids_in_different_splits_are_different_images(digits_pix, tmp_path):
    """CLIP_benchmark's WebDataset keys restart at s0000000 in every split: a gallery item whose
    id equals the query's is another image and stays in the ranking."""
    X, y, n_g = digits_pix
    a, b = str(tmp_path / "restart.zarr"), str(tmp_path / "unique.zarr")
    key = np.array([f"s{i:07d}" for i in range(n_g)])
    _write(a, X, y, key[: len(y) - n_g], key, n_g)  # test/s0000000 and train/s0000000 both exist
    ids = np.array([f"d{i:04d}" for i in range(len(y))])
    _write(b, X, y, ids[n_g:], ids[:n_g], n_g)
    cfg = RetrievalConfig(cache=a, dataset="digits", backbones=("pix",), ks=KS, knn=True, progress=False)
    ra, rb = run_retrieval(cfg), run_retrieval(replace(cfg, cache=b))
    for kind in ("retrieval", "knn"):
        va = dict(zip(*ra.filter(ra["kind"] == kind).select("metric", "value")))
        vb = dict(zip(*rb.filter(rb["kind"] == kind).select("metric", "value")))
        assert va == pytest.approx(vb, abs=1e-12), kind


def _bob_ranks(S):
    """bob-retrieval ``retrieval/main_ret.py`` (commit 032afe3): ``ranks = torch.argsort(-sim,
    dim=0)`` on the ``[gallery, query]`` similarity, read as a stable sort (exact ties in
    gallery order)."""
    import torch

    return torch.argsort(-torch.from_numpy(S), dim=0, stable=True).numpy()


def test_exact_ties_follow_bobs_order_and_featcache_keeps_its_block_rule(tmp_path):
    """Features shared by two classes tie exactly: BoB's metrics rank the tie group in gallery
    order (its argsort), featcache's ``map``/``mrr`` keep the block rule (a tie group ranked
    at its last position, whatever the gallery order)."""
    d = load_digits()
    y = d.target.astype(np.int64)[:400]
    X = np.eye(5, dtype=np.float32)[y // 2]  # classes 2k and 2k+1 share one vector
    n_g = 300
    path = str(tmp_path / "c.zarr")
    ids = np.array([f"d{i:04d}" for i in range(len(y))])
    _write(path, X, y, ids[n_g:], ids[:n_g], n_g)
    cfg = RetrievalConfig(cache=path, dataset="digits", backbones=("pix",), ks=KS, knn=False, progress=False)
    df = run_retrieval(cfg)
    v = _values(df, "semantic")
    Q, G = prepare(X[n_g:], "cosine"), prepare(X[:n_g], "cosine")
    S = G.astype(np.float64) @ Q.T.astype(np.float64)
    gnd = [{"ok": np.flatnonzero(y[:n_g] == y[n_g + i])} for i in range(len(y) - n_g)]
    m, pr, _, mrr = bob_compute_map(_bob_ranks(S), gnd, KS)
    assert v["mrr_bob"] == pytest.approx(mrr, abs=1e-12)
    assert v["map_bob"] == pytest.approx(m, abs=1e-12)
    assert [v[f"mp@{k}"] for k in KS] == pytest.approx(pr, abs=1e-12)
    # featcache's own MRR: the first positive's tie group (both classes) ends at its size
    group = np.array([np.sum(y[:n_g] // 2 == y[n_g + i] // 2) for i in range(len(y) - n_g)])
    assert v["mrr"] == pytest.approx(np.mean(1.0 / group), abs=1e-12)
    assert abs(v["mrr_bob"] - v["mrr"]) > 0.3  # the two rules differ a lot on this data
    hp = json.loads(df.filter(df["metric"] == "mrr_bob")["hparams"][0])
    assert "gallery order" in hp["bob_tie_policy"]
    assert "block" in hp["tie_policy"]


def test_index_ties_on_a_tiny_case():
    """``full_ranking(ties="index")`` against a hand count: one query, a gallery whose
    items 0-3 tie; item 1 excluded, items 2 and 3 positive."""
    from featcache.retrieval import full_ranking
    from featcache.retrieval.relevance import ExplicitRelevance

    G = np.array([[1, 0], [1, 0], [1, 0], [1, 0], [0, 1]], np.float32)
    Q = np.array([[1, 0]], np.float32)
    gid = np.array([f"g{i}" for i in range(5)])
    rel = ExplicitRelevance(
        np.array(["q"]), gid, np.array(["q", "q", "q"]), gid[[2, 3, 1]], np.array(["positive", "positive", "junk"])
    )
    rr = full_ranking(Q, G, rel, "cosine", ties="index", progress=False)
    assert rr.ranks.tolist() == [2, 3]
    assert rr.tp.tolist() == [1, 2]
    block = full_ranking(Q, G, rel, "cosine", progress=False)
    assert block.ranks.tolist() == [3, 3]
    assert block.tp.tolist() == [2, 2]
