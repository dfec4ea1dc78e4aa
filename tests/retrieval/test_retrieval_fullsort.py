"""The full ranking from one sort per row (issue 48) against the implementation it replaced
(per-row binary searches over a sorted row, retrieval/ranking.py at 9272b53, ported below),
on real lite0 features (digits, Fashion-MNIST) and on Hypothesis-made score rows full of
ties, under the block and the index tie rules, at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from threadpoolctl import threadpool_limits

from featcache.retrieval import SemanticRelevance, compute_metrics, prepare, sortedrows
from featcache.retrieval import ranking as ranking_mod
from featcache.retrieval.metrics import RankedRelevance
from featcache.retrieval.ranking import full_ranking, full_ranking_metrics
from featcache.retrieval.revisited import bob_mrr, revisited_ap, revisited_precision_at_k
from featcache.retrieval.search import score_block
from featcache.retrieval.sortedrows import rank_block

KS = (1, 5, 10)
LITE0 = "tf_efficientnet_lite0"


# ------------------------------------------- the replaced implementation (9272b53), ported


def old_row_ranks(s, s_sorted, pos, excl):
    """ranking.py:row_ranks at 9272b53: ranks by binary search in the sorted row."""
    R = pos.size
    if R == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pv = s[pos]
    pv.sort()
    n_ge = s_sorted.size - np.searchsorted(s_sorted, pv, "left")
    if excl.size:
        ev = np.sort(s[excl])
        n_ge -= ev.size - np.searchsorted(ev, pv, "left")
    new_group = np.empty(R, bool)
    new_group[0] = True
    np.not_equal(pv[1:], pv[:-1], out=new_group[1:])
    if new_group.all():
        tp = np.arange(1, R + 1, dtype=np.int64)
    else:
        starts = np.flatnonzero(new_group)
        first = np.repeat(starts, np.diff(np.append(starts, R)))
        tp = (R - first)[::-1].astype(np.int64)
    return n_ge[::-1].astype(np.int64), tp


def old_row_ranks_index(s, pos, excl):
    """ranking.py:row_ranks_index at 9272b53: a stable argsort of the negated row."""
    R = pos.size
    if R == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(-s, kind="stable")
    place = np.empty(s.size, np.int64)
    place[order] = np.arange(s.size)
    r = np.sort(place[pos])
    if excl.size:
        r -= np.searchsorted(np.sort(place[excl]), r, "left")
    return r + 1, np.arange(1, R + 1, dtype=np.int64)


def old_ranked(S, rel, ties):
    """The old full ranking's RankedRelevance of the scores ``S``."""
    rs, tps = [], []
    for i in range(S.shape[0]):
        pos, ex = rel.positives(i), rel.excluded(i)
        r, tp = old_row_ranks(S[i], np.sort(S[i]), pos, ex) if ties == "block" else old_row_ranks_index(S[i], pos, ex)
        rs.append(r)
        tps.append(tp)
    indptr = np.concatenate([[0], np.cumsum([r.size for r in rs])])
    return RankedRelevance(indptr, np.concatenate(rs), rel.n_relevant(), tp=np.concatenate(tps))


def old_metrics(S, rel, ks=KS) -> dict[str, np.ndarray]:
    """Every metric the old code computed from scores ``S`` (featcache's and BoB's)."""
    out = compute_metrics(old_ranked(S, rel, "block"), ks)
    rr = old_ranked(S, rel, "index")
    out["map_bob"] = revisited_ap(rr)
    out.update({f"mp@{k}": revisited_precision_at_k(rr, k) for k in ks})
    out["mrr_bob"] = bob_mrr(rr)
    return out


def float32_scores(Q, G):
    return (Q @ G.T).astype(np.float32)


def new_metrics(Q, G, rel, threads, monkeypatch, record: bool = False, **kw):
    """The new full ranking's metrics; ``record``: also the float32 scores it ranked, as
    ``"_scores"`` (each block copied as ``ranking._scores`` returns it)."""
    monkeypatch.setattr(ranking_mod, "_n_threads", lambda: threads)
    blocks: list[np.ndarray] = []
    if record:
        scores = ranking_mod._scores

        def recording(*a, **k):
            S = scores(*a, **k)
            blocks.append(S.copy())
            return S

        monkeypatch.setattr(ranking_mod, "_scores", recording)
    with threadpool_limits(threads):
        got = full_ranking_metrics(Q, G, rel, "cosine", KS, progress=False, bob=True, max_memory=2**22, **kw)
    got["mrr_bob"] = float(np.sum(got.pop("rr_bob")) / rel.n_queries)
    if record:
        got["_scores"] = np.concatenate(blocks)
    return got


def assert_equal_metrics(got, want, atol):
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=atol, rtol=0, err_msg=name)


# ------------------------------------------------------------------ real lite0 features


def _stored(cache, dataset, nq, ng, same: bool):
    from featcache.store import open_cache

    c = open_cache(cache)
    ng = nq if same else ng
    q = c.load(LITE0, dataset, "test")
    g = q if same else c.load(LITE0, dataset, "train")
    Q, G = prepare(np.asarray(q.X)[:nq], "cosine"), prepare(np.asarray(g.X)[:ng], "cosine")
    ids_q, ids_g = np.asarray(q.ids).astype(str)[:nq], np.asarray(g.ids).astype(str)[:ng]
    rel = SemanticRelevance(np.asarray(q.labels)[:nq], np.asarray(g.labels)[:ng], ids_q, ids_g, exclude_self=same)
    return Q, G, rel


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("which", ["digits", "fmnist", "digits-leave-one-out"])
def test_equals_the_replaced_implementation_on_real_features(which, threads, request, monkeypatch):
    if which == "fmnist":
        Q, G, rel = _stored(request.getfixturevalue("fmnist_cache"), "fashion-mnist-small", 300, 2000, False)
    else:
        same = which == "digits-leave-one-out"
        Q, G, rel = _stored(request.getfixturevalue("digits_cache"), "digits", 360, 1437, same)
    # --exact-scores: the old scores, so every value equals the old one
    exact = new_metrics(Q, G, rel, threads, monkeypatch, exact_scores=True)
    assert_equal_metrics(exact, old_metrics(score_block(Q, G, "cosine"), rel), atol=1e-12)
    # float32 scores: the old ranking of the same float32 scores exactly, and every mean
    # within 1e-6 of the exact scores' (only near-ties within a rounding step may swap). The
    # scores are the ones the new path ranked, recorded block by block: a GEMM over a block of
    # rows may round otherwise than one over all rows (OpenBLAS picks kernels by shape and CPU)
    fast = new_metrics(Q, G, rel, threads, monkeypatch, record=True)
    S32 = fast.pop("_scores")
    assert np.abs(S32 - float32_scores(Q, G)).max() <= 1e-5  # measured: under 1e-6 (AMD EPYC)
    assert_equal_metrics(fast, old_metrics(S32, rel), atol=1e-12)
    for name in exact:
        assert abs(np.nanmean(fast[name]) - np.nanmean(exact[name])) <= 1e-6, name


def test_threads_and_block_sizes_do_not_move_exact_scores(digits_cache, monkeypatch):
    Q, G, rel = _stored(digits_cache, "digits", 200, 1437, False)
    one = new_metrics(Q, G, rel, 1, monkeypatch, exact_scores=True)
    two = new_metrics(Q, G, rel, 2, monkeypatch, exact_scores=True)
    monkeypatch.setattr(ranking_mod, "NUMPY_MAX_BLOCK_ROWS", 48)
    small = new_metrics(Q, G, rel, 2, monkeypatch, exact_scores=True)
    for name in one:
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)
        np.testing.assert_array_equal(small[name], one[name], err_msg=name)


def test_torch_path_equals_numpy_on_its_own_scores(digits_cache):
    Q, G, rel = _stored(digits_cache, "digits", 120, 1437, False)
    for ties in ("block", "index"):
        got = full_ranking(Q, G, rel, "cosine", backend="torch-cpu", ties=ties, progress=False, max_memory=2**22)
        import torch

        want = old_ranked((torch.from_numpy(Q) @ torch.from_numpy(G).T).numpy(), rel, ties)
        np.testing.assert_array_equal(got.ranks, want.ranks)
        np.testing.assert_array_equal(got.tp, want.tp)


# ------------------------------------------------------------------ constructed ties


@st.composite
def tied_block(draw):
    b = draw(st.integers(1, 5))
    n = draw(st.integers(1, 40))
    levels = draw(st.integers(1, 6))
    S = draw(arrays(np.int8, (b, n), elements=st.integers(0, levels - 1))).astype(np.float32)
    P = draw(arrays(np.bool_, (b, n)))
    E = draw(arrays(np.bool_, (b, n))) & ~P
    return S, P, E


@pytest.mark.parametrize(("steps", "pairs"), [(64, 1 << 22), (1, 1 << 22), (64, 2)])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=tied_block())
def test_one_sort_ranks_ties_as_the_binary_searches_did(data, steps, pairs, monkeypatch):
    """Every path of the tie resolution (group walks, the pair count, the stable-sort
    fallback) gives the old ranks under both rules, excluded items removed."""
    monkeypatch.setattr(sortedrows, "MAX_STEPS", steps)
    monkeypatch.setattr(sortedrows, "MAX_PAIRS", pairs)
    S, P, E = data
    neg = -S
    neg[E] = np.inf
    got = rank_block(neg, P)
    for i in range(S.shape[0]):
        pos, ex = np.flatnonzero(P[i]), np.flatnonzero(E[i])
        rb, tb = old_row_ranks(S[i], np.sort(S[i]), pos, ex)
        ri, _ = old_row_ranks_index(S[i], pos, ex)
        lo, hi = got.indptr[i], got.indptr[i + 1]
        np.testing.assert_array_equal(got.r_block[lo:hi], rb)
        np.testing.assert_array_equal(got.tp_block[lo:hi], tb)
        np.testing.assert_array_equal(got.r_index[lo:hi], ri)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    X=arrays(np.int8, st.tuples(st.integers(2, 30), st.integers(1, 4)), elements=st.integers(-2, 2)),
    seed=st.integers(0, 2**16),
)
def test_metrics_with_ties_equal_the_old_ones_at_1_and_2_threads(X, seed, monkeypatch):
    """Integer features: every float32 score is exact, so ties are exact and many; leave-one-out
    with ids, both tie rules, through full_ranking_metrics (numpy and torch-cpu)."""
    rng = np.random.default_rng(seed)
    Xf = X.astype(np.float32)
    y = rng.integers(0, 3, X.shape[0])
    ids = np.array([f"i{k}" for k in range(X.shape[0])])
    rel = SemanticRelevance(y, y, ids, ids)
    Q = prepare(Xf, "ip")
    want = old_metrics(score_block(Q, Q, "ip"), rel)
    for threads in (1, 2):
        monkeypatch.setattr(ranking_mod, "_n_threads", lambda t=threads: t)
        for backend in ("numpy", "torch-cpu"):
            with threadpool_limits(threads):
                got = full_ranking_metrics(Q, Q, rel, "ip", KS, progress=False, bob=True, backend=backend)
            got["mrr_bob"] = float(np.sum(got.pop("rr_bob")) / rel.n_queries)
            assert_equal_metrics(got, want, atol=1e-12)


def test_exact_scores_flag_reaches_the_config_and_the_hparams():
    import argparse

    from featcache.retrieval import RetrievalConfig

    p = argparse.ArgumentParser()
    RetrievalConfig.add_arguments(p)
    base = ["--cache", "c.zarr", "--dataset", "d", "--backbone", "b", "--results", "r.parquet"]
    base += ["--query", "test", "--gallery", "train"]
    fast = RetrievalConfig.from_args(p.parse_args(base))
    exact = RetrievalConfig.from_args(p.parse_args([*base, "--exact-scores"]))
    assert (fast.exact_scores, exact.exact_scores) == (False, True)
    assert fast.hparams(backend="numpy", relevance_sha="")["scores"] == "float32"
    assert exact.hparams(backend="numpy", relevance_sha="")["scores"] == "float64-rounded"
    # the run id does not depend on it (stored runs are not recomputed)
    assert fast.run_definition("b", "semantic", "", "fp") == exact.run_definition("b", "semantic", "", "fp")
