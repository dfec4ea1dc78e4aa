"""Retrieval metrics against a brute-force reference and scikit-learn, on real features
(sklearn digits pixels) and on Hypothesis-generated small cases full of ties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits
from sklearn.metrics import average_precision_score

from featcache.retrieval import (
    RankedRelevance,
    SemanticRelevance,
    compute_metrics,
    full_ranking,
    prepare,
    ranks_from_hits,
    ranks_from_scores,
    summarize,
    topk,
)
from featcache.retrieval.search import score_block

KS = (1, 3, 5, 10)


# ------------------------------------------------------------------ brute-force reference


def ref_query_metrics(scores: np.ndarray, relevant: set[int], exclude: set[int], ks) -> dict[str, float] | None:
    """Walk the distinct similarity thresholds from the top, as sklearn's AP does: a tie
    group enters the ranking as a block (all its items at the group's last position)."""
    R = len(relevant)
    if R == 0:
        return None
    kept = [i for i in range(len(scores)) if i not in exclude]
    groups = []  # (n items ranked so far, relevant so far, relevant entering now)
    n = tp = 0
    for t in sorted({float(scores[i]) for i in kept}, reverse=True):
        members = [i for i in kept if float(scores[i]) == t]
        new = sum(1 for i in members if i in relevant)
        n += len(members)
        tp += new
        groups.append((n, tp, new))
    out = {"map": sum(new * tp / n for n, tp, new in groups) / R}
    first = next(n for n, tp, new in groups if new)
    out["mrr"] = 1.0 / first
    for k in ks:
        inside = [(n, tp, new) for n, tp, new in groups if n <= k]
        found = inside[-1][1] if inside else 0
        out[f"precision@{k}"] = found / k
        out[f"recall@{k}"] = found / R
        out[f"hit@{k}"] = float(found > 0)
        out[f"mrr@{k}"] = 1.0 / first if first <= k else 0.0
        out[f"map@{k}"] = sum(new * tp / n for n, tp, new in inside) / min(R, k)
    return out


def ref_all(S: np.ndarray, qlab, glab, qids, gids, ks):
    """Per-metric list over queries with >= 1 relevant item, plus count without."""
    res: dict[str, list[float]] = {}
    none = 0
    for q in range(S.shape[0]):
        ex = {j for j in range(S.shape[1]) if gids[j] == qids[q]}
        relevant = {j for j in range(S.shape[1]) if glab[j] == qlab[q] and j not in ex}
        m = ref_query_metrics(S[q], relevant, ex, ks)
        if m is None:
            none += 1
            continue
        for k, v in m.items():
            res.setdefault(k, []).append(v)
    return res, none


def ours_full(Q, G, rel, metric, ks, **kw):
    rr = full_ranking(Q, G, rel, metric, progress=False, **kw)
    return compute_metrics(rr, ks), rr


def ours_topk(Q, G, rel, metric, ks, backend):
    sc, idx, _ = topk(Q, G, max(ks) + 1, metric, relevance=rel, backend=backend, prepared=True)
    rows = np.broadcast_to(np.arange(Q.shape[0])[:, None], idx.shape)
    rr = ranks_from_hits(rel.is_positive(rows, idx), rel.n_relevant(), scores=sc, depth=max(ks))
    return compute_metrics(rr, ks)


def assert_matches_ref(ours: dict, ref: dict, n_rel: np.ndarray, atol=1e-12):
    scored = n_rel > 0
    for name, vals in ours.items():
        assert np.all(np.isnan(vals[~scored])), name
        np.testing.assert_allclose(vals[scored], ref.get(name, []), atol=atol, err_msg=name)


# ------------------------------------------------------------------ real data


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    X = d.data.astype(np.float32)
    return X, d.target.astype(np.int64), np.array([f"d{i}" for i in range(len(X))])


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_full_and_topk_match_reference_on_digits(digits, metric):
    X, y, ids = digits
    Xq, yq, iq = X[:60], y[:60], ids[:60]
    Xg, yg, ig = X[1000:1400], y[1000:1400], ids[1000:1400]
    Q, G = prepare(Xq, metric), prepare(Xg, metric)
    rel = SemanticRelevance(yq, yg, iq, ig)
    S = score_block(Q, G, metric)
    ref, none = ref_all(S, yq, yg, iq, ig, KS)
    assert none == 0
    full, _ = ours_full(Q, G, rel, metric, KS)
    assert_matches_ref(full, ref, rel.n_relevant())
    for backend in ("numpy", "faiss-cpu", "torch-cpu"):
        tk = ours_topk(Q, G, rel, metric, KS, backend)
        for name, vals in tk.items():  # @k metrics of the top-k search == full ranking
            # (backends round float32 dot products differently; near-equal scores may swap)
            assert np.mean(np.abs(vals - full[name]) < 1e-12) > 0.95, f"{backend} {name}"
            np.testing.assert_allclose(vals.mean(), full[name].mean(), atol=1e-3, err_msg=f"{backend} {name}")


@pytest.mark.slow
def test_leave_one_out_on_digits_matches_reference(digits):
    # integer pixel vectors: real duplicates and exact score ties occur in this split
    X, y, ids = digits
    Xs, ys, is_ = X[:300], y[:300], ids[:300]
    Q = prepare(Xs, "ip")
    rel = SemanticRelevance(ys, ys, is_, is_)
    S = score_block(Q, Q, "ip")
    ref, _ = ref_all(S, ys, ys, is_, is_, KS)
    full, _ = ours_full(Q, Q, rel, "ip", KS)
    assert_matches_ref(full, ref, rel.n_relevant())
    assert np.array_equal(rel.n_relevant(), np.bincount(ys)[ys] - 1)


def test_average_precision_equals_sklearn_on_real_features(digits):
    X, y, ids = digits
    rng = np.random.default_rng(0)
    # small noise: continuous features, so no exact ties and sklearn's AP applies directly
    Xf = X + rng.normal(0, 1e-2, X.shape).astype(np.float32)
    Q, G = prepare(Xf[:40], "cosine"), prepare(Xf[500:1300], "cosine")
    rel = SemanticRelevance(y[:40], y[500:1300], ids[:40], ids[500:1300])
    full, _ = ours_full(Q, G, rel, "cosine", KS)
    S = score_block(Q, G, "cosine")
    sk = [average_precision_score(y[500:1300] == y[q], S[q]) for q in range(40)]
    np.testing.assert_allclose(full["map"], sk, atol=1e-9)


def test_average_precision_equals_sklearn_with_ties(digits):
    # integer pixels, inner product: exact score ties between relevant and non-relevant items
    X, y, ids = digits
    Q = prepare(X[:200], "ip")
    rel = SemanticRelevance(y[:200], y[:200], ids[:200], ids[:200])
    full, _ = ours_full(Q, Q, rel, "ip", KS)
    S = score_block(Q, Q, "ip")
    n_tied = 0
    for q in range(200):
        keep = np.arange(200) != q
        n_tied += len(np.unique(S[q, keep])) < keep.sum()
        assert average_precision_score(y[:200][keep] == y[q], S[q, keep]) == pytest.approx(full["map"][q], abs=1e-12)
    assert n_tied > 50  # the ties are really there


# ------------------------------------------------------------------ Hypothesis, ties everywhere


@st.composite
def small_case(draw):
    n_q = draw(st.integers(1, 4))
    n_g = draw(st.integers(1, 12))
    d = draw(st.integers(1, 3))
    vals = st.integers(-2, 2)
    Xq = np.array(draw(st.lists(st.lists(vals, min_size=d, max_size=d), min_size=n_q, max_size=n_q)), np.float32)
    Xg = np.array(draw(st.lists(st.lists(vals, min_size=d, max_size=d), min_size=n_g, max_size=n_g)), np.float32)
    yq = np.array(draw(st.lists(st.integers(0, 2), min_size=n_q, max_size=n_q)))
    yg = np.array(draw(st.lists(st.integers(0, 2), min_size=n_g, max_size=n_g)))
    gids = np.array([f"g{i}" for i in range(n_g)])
    # some queries share an id with a gallery item (must be excluded by id, wherever it is)
    use_g = draw(st.lists(st.booleans(), min_size=n_q, max_size=n_q))
    perm = draw(st.permutations(range(n_g)))
    qids = np.array([gids[perm[i]] if use_g[i] and i < n_g else f"q{i}" for i in range(n_q)])
    ks = draw(st.lists(st.integers(1, 15), min_size=1, max_size=3))
    metric = draw(st.sampled_from(["ip", "l2"]))  # exact integer arithmetic -> exact ties
    return Xq, Xg, yq, yg, qids, gids, ks, metric


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_case())
def test_hypothesis_full_and_topk_vs_reference(case):
    Xq, Xg, yq, yg, qids, gids, ks, metric = case
    rel = SemanticRelevance(yq, yg, qids, gids)
    S = score_block(Xq, Xg, metric)
    ref, none = ref_all(S, yq, yg, qids, gids, ks)
    full, _rr = ours_full(Xq, Xg, rel, metric, ks, max_memory=1024**2)
    assert_matches_ref(full, ref, rel.n_relevant())
    _, n_scored, n_none = summarize(full, rel.n_relevant())
    assert n_none == none
    assert n_scored + n_none == len(yq)
    for backend in ("numpy", "faiss-cpu", "torch-cpu"):
        assert_matches_ref(
            ours_topk(Xq, Xg, rel, metric, ks, backend), {k: v for k, v in ref.items() if "@" in k}, rel.n_relevant()
        )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4)), min_size=1, max_size=30))
def test_hypothesis_ap_equals_sklearn_with_ties(items):
    labels = np.array([b for b, _ in items])
    scores = np.array([v for _, v in items], np.float32)
    r, tp = ranks_from_scores(scores, labels)
    full = RankedRelevance([0, r.size], r, [labels.sum()], depth=None, tp=tp)
    ap = compute_metrics(full, [1])["map"][0]
    if labels.sum() == 0:
        assert np.isnan(ap)
    else:
        assert average_precision_score(labels, scores) == pytest.approx(ap, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(1, 40))
def test_hypothesis_metric_invariants(rel_list, k):
    hits = np.array([rel_list])
    n_rel = hits.sum(1)
    rr = ranks_from_hits(hits, n_rel, full=True)
    m = compute_metrics(rr, [k])
    if n_rel[0] == 0:
        assert all(np.isnan(v[0]) for v in m.values())
        return
    for name, v in m.items():
        assert 0.0 <= v[0] <= 1.0, name
    assert m[f"hit@{k}"][0] == float(m[f"recall@{k}"][0] > 0)
    assert m[f"map@{k}"][0] <= 1.0
    assert m["mrr"][0] >= m[f"mrr@{k}"][0]
    if k >= len(rel_list):
        assert m[f"recall@{k}"][0] == 1.0
        assert m[f"map@{k}"][0] == pytest.approx(m["map"][0] * n_rel[0] / min(n_rel[0], k))
    # sklearn on the strict order
    assert average_precision_score(hits[0], -np.arange(hits.shape[1])) == pytest.approx(m["map"][0], abs=1e-12)


# ------------------------------------------------------------------ named edge cases


def test_all_equal_scores_form_one_tie_group():
    G = np.ones((10, 4), np.float32)
    Q = np.ones((1, 4), np.float32)
    yg = np.zeros(10, np.int64)
    yg[[2, 5]] = 1
    rel = SemanticRelevance(np.array([1]), yg, np.array(["q"]), np.array([f"g{i}" for i in range(10)]))
    full, rr = ours_full(Q, G, rel, "cosine", [1, 3, 5, 10, 20])
    assert rr.ranks.tolist() == [10, 10]
    assert rr.tp.tolist() == [2, 2]
    assert full["map"][0] == pytest.approx(2 / 10) == average_precision_score(yg == 1, np.ones(10))
    assert full["mrr"][0] == pytest.approx(1 / 10)
    assert full["hit@5"][0] == 0
    assert full["recall@5"][0] == 0
    assert full["hit@10"][0] == 1
    assert full["precision@20"][0] == pytest.approx(2 / 20)  # denominator k, even with 10 items
    for backend in ("numpy", "faiss-cpu", "torch-cpu"):
        tk = ours_topk(Q, G, rel, "cosine", [1, 3, 5, 10, 20], backend)
        for name, v in tk.items():
            assert v[0] == pytest.approx(full[name][0]), (backend, name)
    # the metrics do not depend on where the relevant items sit in the gallery
    rel2 = SemanticRelevance(np.array([1]), yg[::-1].copy(), np.array(["q"]), np.array([f"g{i}" for i in range(10)]))
    full2, _ = ours_full(Q, G, rel2, "cosine", [1, 3, 5, 10, 20])
    assert all(np.allclose(full[k], full2[k]) for k in full)


@pytest.mark.parametrize("dup_before_self", [True, False])
def test_duplicate_of_query_in_gallery_is_a_match_and_self_is_excluded_by_id(digits, dup_before_self):
    X, y, ids = digits
    G = X[:50].copy()
    gids = ids[:50].copy()
    yg = y[:50].copy()
    q = 10
    dup = 3 if dup_before_self else 40  # an exact copy of the query under another id
    G[dup], yg[dup], gids[dup] = G[q], yg[q], "copy-of-" + gids[q]
    rel = SemanticRelevance(yg[[q]], yg, gids[[q]], gids)
    Q, Gp = prepare(G[[q]], "cosine"), prepare(G, "cosine")
    full, rr = ours_full(Q, Gp, rel, "cosine", [1])
    assert rr.ranks[0] == 1
    assert full["mrr"][0] == 1.0
    assert rel.n_relevant()[0] == int((yg == yg[q]).sum()) - 1
    _, idx, _ = topk(Q, Gp, 3, "cosine", relevance=rel, backend="faiss-cpu", prepared=True)
    assert idx[0, 0] == dup
    assert q not in idx[0]


def test_k_larger_than_gallery_and_minus_one_never_hits():
    rng = np.random.default_rng(1)
    G = rng.normal(size=(6, 5)).astype(np.float32)
    Q = rng.normal(size=(3, 5)).astype(np.float32)
    # the last gallery item shares every query's label: a -1 index read as "the last item"
    # would be a (wrong) hit
    yg = np.array([0, 1, 2, 0, 1, 7])
    yq = np.array([7, 7, 0])
    rel = SemanticRelevance(yq, yg, np.array(["a", "b", "c"]), np.array([f"g{i}" for i in range(6)]))
    for backend in ("numpy", "faiss-cpu", "torch-cpu"):
        sc, idx, _ = topk(Q, G, 10, "cosine", relevance=rel, backend=backend)
        assert (idx[:, 6:] == -1).all()
        assert np.isneginf(sc[:, 6:]).all()
        rows = np.broadcast_to(np.arange(3)[:, None], idx.shape)
        hits = rel.is_positive(rows, idx)
        assert not hits[:, 6:].any()
        assert (hits.sum(1) == rel.n_relevant()).all()
        m = compute_metrics(ranks_from_hits(hits, rel.n_relevant()), [10])
        assert np.allclose(m["recall@10"], 1.0)
        assert np.allclose(m["precision@10"], rel.n_relevant() / 10)


def test_queries_without_relevant_items_are_excluded_and_counted(digits):
    X, y, ids = digits
    yq = y[:20].copy()
    yq[:5] = 99  # a label absent from the gallery
    rel = SemanticRelevance(yq, y[100:400], ids[:20], ids[100:400])
    full, _ = ours_full(prepare(X[:20], "cosine"), prepare(X[100:400], "cosine"), rel, "cosine", [5])
    means, n_scored, n_none = summarize(full, rel.n_relevant())
    assert (n_scored, n_none) == (15, 5)
    assert means["map"] == pytest.approx(np.mean(full["map"][5:]))


def test_cosine_on_normalised_vectors_ranks_like_l2(digits):
    X, y, ids = digits
    rng = np.random.default_rng(2)
    Xn = prepare(X + rng.normal(0, 1e-2, X.shape).astype(np.float32), "cosine")
    Q, G = Xn[:50], Xn[300:900]
    rel = SemanticRelevance(y[:50], y[300:900], ids[:50], ids[300:900])
    _, i_cos, _ = topk(Q, G, 20, "cosine", relevance=rel, backend="faiss-cpu", prepared=True)
    _, i_l2, _ = topk(Q, G, 20, "l2", relevance=rel, backend="faiss-cpu", prepared=True)
    assert (i_cos == i_l2).mean() > 0.999
    a, _ = ours_full(Q, G, rel, "cosine", [10])
    b, _ = ours_full(Q, G, rel, "l2", [10])
    np.testing.assert_allclose(a["map"], b["map"], atol=1e-4)


def test_blockwise_memory_bound_gives_identical_ranks(digits):
    X, y, ids = digits
    Q, G = prepare(X[:64], "cosine"), prepare(X[200:1000], "cosine")
    rel = SemanticRelevance(y[:64], y[200:1000], ids[:64], ids[200:1000])
    big = full_ranking(Q, G, rel, "cosine", max_memory=2 * 1024**3, progress=False)
    small = full_ranking(Q, G, rel, "cosine", max_memory=1024**2 + 1, progress=False)  # ~100 rows/block
    tiny = full_ranking(Q, G, rel, "cosine", max_memory=1024**2, backend="torch-cpu", progress=False)
    assert np.array_equal(big.ranks, small.ranks)
    assert np.array_equal(big.indptr, small.indptr)
    assert np.array_equal(big.ranks, tiny.ranks)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_torch_block_path_equals_numpy_with_junk_and_self(digits, metric):
    # the batched torch code (GPU path, run here on the CPU) against the numpy rows, with an
    # explicit relevance table (positives, junk) and queries that are also gallery items
    X, y, ids = digits
    from featcache.retrieval import ExplicitRelevance

    qx, gx = X[:40], X[:500]
    tq, tg, tr = [], [], []
    for q in range(40):
        same = np.flatnonzero(y[:500] == y[q])
        for j in same[::2]:
            tq.append(ids[q]), tg.append(ids[j]), tr.append("positive")
        for j in same[1::4]:
            tq.append(ids[q]), tg.append(ids[j]), tr.append("junk")
    rel = ExplicitRelevance(ids[:40], ids[:500], tq, tg, tr)
    assert all(q not in rel.positives(q) for q in range(40))  # self never its own match
    Q, G = prepare(qx, metric), prepare(gx, metric)
    a = full_ranking(Q, G, rel, metric, backend="numpy", progress=False)
    b = full_ranking(Q, G, rel, metric, backend="torch-cpu", max_memory=2**20, progress=False)
    assert np.array_equal(a.indptr, b.indptr)
    assert np.array_equal(a.ranks, b.ranks)
    assert np.array_equal(a.tp, b.tp)
    S = score_block(Q, G, metric)
    for q in range(0, 40, 5):
        ex = set(rel.excluded(q).tolist())
        ref = ref_query_metrics(S[q], set(rel.positives(q).tolist()), ex, [5])
        assert compute_metrics(a, [5])["map"][q] == pytest.approx(ref["map"], abs=1e-12)


@pytest.mark.parametrize("backend", ["numpy", "torch-cpu"])
def test_full_ranking_metrics_equal_compute_metrics_of_full_ranking(digits, backend):
    from featcache.retrieval import full_ranking_metrics

    X, y, ids = digits
    Q = prepare(X[:150], "ip")
    rel = SemanticRelevance(y[:150], y[:150], ids[:150], ids[:150])  # leave-one-out, exact ties
    ks = (1, 5, 10, 100)
    a = compute_metrics(full_ranking(Q, Q, rel, "ip", progress=False), ks)
    b = full_ranking_metrics(Q, Q, rel, "ip", ks, backend=backend, max_memory=2**20, progress=False)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=1e-12, err_msg=name)


def test_a_registered_retrieval_metric_is_computed_and_accepted_by_suites(digits, monkeypatch):
    """Adding a retrieval metric is one function plus its registration: compute_metrics writes
    it for every k, and a suite may declare it; a taken name is refused."""
    from featcache import suites
    from featcache.errors import MetricInputError
    from featcache.retrieval import metrics as RM

    monkeypatch.setattr(RM, "RETRIEVAL_METRICS", RM.RETRIEVAL_METRICS.copy())  # restored after

    @RM.register_retrieval_metric("found", full=False, at_k=True)
    def found_at_k(rr, k):  # how many relevant items lie within the top k
        return np.bincount(rr.query_index(), weights=rr.ranks <= k, minlength=rr.n_queries)

    X, y, ids = digits
    Q, G = prepare(X[:40], "cosine"), prepare(X[1000:1200], "cosine")
    full, _ = ours_full(Q, G, SemanticRelevance(y[:40], y[1000:1200], ids[:40], ids[1000:1200]), "cosine", KS)
    for k in KS:
        np.testing.assert_allclose(full[f"found@{k}"], full[f"recall@{k}"] * full_relevant(y[:40], y[1000:1200]))
    assert "found@k" in RM.written_metric_names()
    assert suites._retrieval_metric_ok("found@10")
    assert not suites._retrieval_metric_ok("found")  # written per k only
    with pytest.raises(MetricInputError, match="already registered"):
        RM.register_retrieval_metric("map", full=True, at_k=True)(found_at_k)


def full_relevant(yq, yg):
    return (yq[:, None] == yg[None, :]).sum(1)
