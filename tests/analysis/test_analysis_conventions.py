"""Each paper's aggregation as the analysis default (issue 22 items 7 and 8): ELEVATER's seeds
as mean +/- std, VTAB's as the median of 3; retrieval ranked on Battle of the Backbones'
``map_bob`` where the results record it, the scikit-learn-style ``map`` still available.
Real probes and rankings on scikit-learn's digits."""

from __future__ import annotations

import statistics

import numpy as np
import polars as pl
import pytest

from featcache.analysis import api
from featcache.analysis.report import write_report
from featcache.core.results import make_run_id, rows_to_frame
from featcache.errors import ResultsError

BACKBONES = ("pixels", "pca:12", "pca:4")


def _features(X: np.ndarray, name: str, fit: np.ndarray) -> np.ndarray:
    from sklearn.decomposition import PCA

    if name == "pixels":
        return X
    return PCA(int(name[4:]), random_state=0).fit(fit).transform(X)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    return X[:1000], y[:1000], X[1000:], y[1000:]


@pytest.fixture(scope="module")
def seeded_rows(digits):
    """Top-1 of a logistic probe per backbone and seed under an ELEVATER few-shot protocol
    (5 per class drawn per seed) and a VTAB-1k-like one (300 drawn per seed)."""
    from sklearn.linear_model import LogisticRegression

    Xtr, ytr, Xte, yte = digits
    rows = []
    for b in BACKBONES:
        Ftr, Fte = _features(Xtr, b, Xtr), _features(Xte, b, Xtr)
        for protocol in ("elevater-fewshot:5", "vtab1k"):
            for seed in (0, 1, 2):
                rng = np.random.default_rng(seed)
                if protocol.startswith("elevater"):
                    sub = np.concatenate([rng.choice(np.flatnonzero(ytr == c), 5, replace=False) for c in range(10)])
                else:
                    sub = rng.choice(len(ytr), 300, replace=False)
                acc = LogisticRegression(C=1.0, max_iter=200).fit(Ftr[sub], ytr[sub]).score(Fte, yte)
                base = {"kind": "probe", "backbone": b, "dataset": "digits", "protocol": protocol}
                base |= {"eval_split": "test", "seed": seed, "n_eval": len(yte)}
                rows.append({**base, "run_id": make_run_id(**base), "metric": "top1", "value": float(acc)})
    return rows_to_frame(rows)


def _per_seed(frame, protocol: str) -> dict[str, list[float]]:
    sub = frame.filter(pl.col("protocol") == protocol).sort("seed")
    return {b: sub.filter(pl.col("backbone") == b)["value"].to_list() for b in BACKBONES}


def test_elevater_seeds_are_averaged_and_vtab_seeds_take_the_median(seeded_rows, tmp_path):
    r = api.rank(seeded_rows, n_boot=20)
    rules = dict(zip(r.seed_rules["setting"].to_list(), r.seed_rules["seed_reduce"].to_list()))
    assert rules == {"probe:digits (elevater-fewshot:5)": "mean", "probe:digits (vtab1k)": "median"}
    assert r.seed_rules["n_seeds"].to_list() == [3, 3]
    scores = {row["backbone"]: row for row in r.scores.iter_rows(named=True)}
    ele, vtab = _per_seed(seeded_rows, "elevater-fewshot:5"), _per_seed(seeded_rows, "vtab1k")
    for b in BACKBONES:
        assert scores[b]["probe:digits (elevater-fewshot:5)"] == pytest.approx(statistics.mean(ele[b]), abs=1e-15)
        assert scores[b]["probe:digits (vtab1k)"] == statistics.median(vtab[b])
    # one rule for every setting stays available
    forced = api.rank(seeded_rows, n_boot=20, seed_reduce="median")
    fs = {row["backbone"]: row for row in forced.scores.iter_rows(named=True)}
    assert all(fs[b]["probe:digits (elevater-fewshot:5)"] == statistics.median(ele[b]) for b in BACKBONES)


def test_report_states_each_settings_seed_rule_with_the_std(seeded_rows, tmp_path):
    out = write_report(tmp_path / "r.html", seeded_rows, rank_kwargs={"n_boot": 20})
    text = out.read_text()
    assert "Seeds (each setting as its paper reports it): median over seeds (VTAB&#39;s rule) on 1 setting(s); " in text
    assert "mean +/- sample std over seeds (ELEVATER&#39;s tables) on 1 setting(s)." in text
    assert "probe:digits (elevater-fewshot:5) (mean +/- std of 3 seeds, as ELEVATER reports)" in text
    assert "probe:digits (vtab1k) (median of 3 seed(s))" in text
    from featcache.core.formatting import format_cell

    ele = _per_seed(seeded_rows, "elevater-fewshot:5")["pca:4"]
    assert f"{format_cell(statistics.mean(ele))} +/- {format_cell(statistics.stdev(ele))}" in text


# --------------------------------------------------------------------------- retrieval's AP
def _retrieval_rows(digits, with_bob: bool = True) -> list[dict]:
    """featcache's retrieval metrics on digits (a query never its own match): ``map`` (the
    scikit-learn-style AP) and, as ``featcache retrieve`` writes them, BoB's ``map_bob``."""
    from featcache.retrieval.metrics import compute_metrics, ranks_from_hits, summarize
    from featcache.retrieval.revisited import revisited_ap

    Xtr, _, Xte, yte = digits
    rows = []
    for b in BACKBONES:
        F = _features(Xte, b, Xtr)
        F = F / np.maximum(np.linalg.norm(F, axis=1, keepdims=True), 1e-12)
        q = np.arange(0, len(F), 5)
        S = F[q] @ F.T
        S[np.arange(len(q)), q] = -np.inf
        order = np.argsort(-S, axis=1, kind="stable")[:, :-1]
        hits = yte[order] == yte[q][:, None]
        rr = ranks_from_hits(hits, hits.sum(axis=1), scores=np.take_along_axis(S, order, axis=1), full=True)
        per_query = compute_metrics(rr, (1,))
        if with_bob:
            per_query["map_bob"] = revisited_ap(rr)
        means, n, _ = summarize(per_query, hits.sum(axis=1))
        base = {"kind": "retrieval", "backbone": b, "dataset": "digits", "eval_split": "test", "n_eval": n}
        rows += [{**base, "run_id": make_run_id(**base), "metric": m, "value": v} for m, v in means.items()]
    return rows


def _brute_force_trapezoid_ap(ranks_of_positives: np.ndarray) -> float:
    """revisitop's compute_ap (filipradenovic/revisitop, python/evaluate.py): trapezoids
    between the precision before and after each positive (0-based ranks, sorted)."""
    ap, recall_step = 0.0, 1.0 / len(ranks_of_positives)
    for j, rank in enumerate(ranks_of_positives):
        precision_0 = 1.0 if rank == 0 else j / rank
        precision_1 = (j + 1) / (rank + 1)
        ap += (precision_0 + precision_1) * recall_step / 2.0
    return ap


def test_retrieval_ranks_on_bobs_map_by_default_and_sklearn_ap_by_name(digits, seeded_rows, tmp_path):
    rows = _retrieval_rows(digits)
    frame = pl.concat([seeded_rows, rows_to_frame(rows)], how="diagonal_relaxed")
    bob = {r["backbone"]: r["value"] for r in rows if r["metric"] == "map_bob"}
    skl = {r["backbone"]: r["value"] for r in rows if r["metric"] == "map"}
    assert any(abs(bob[b] - skl[b]) > 1e-4 for b in BACKBONES)  # two different numbers
    # map_bob is revisitop's AP: one query checked by hand
    _, _, Xte, yte = digits
    F = Xte / np.linalg.norm(Xte, axis=1, keepdims=True)
    s = F[0] @ F.T
    s[0] = -np.inf
    order = np.argsort(-s, kind="stable")[:-1]
    pos = np.flatnonzero(yte[order] == yte[0])
    from featcache.retrieval.metrics import ranks_from_hits
    from featcache.retrieval.revisited import revisited_ap

    hits = (yte[order] == yte[0])[None, :]
    rr = ranks_from_hits(hits, hits.sum(axis=1), scores=s[order][None, :], full=True)
    assert revisited_ap(rr)[0] == pytest.approx(_brute_force_trapezoid_ap(pos), abs=1e-12)

    r = api.rank(frame, n_boot=20, retrieval_metric="auto")
    assert r.retrieval_metric == "map_bob"
    col = dict(zip(r.scores["backbone"].to_list(), r.scores["retrieval:digits"].to_list()))
    assert col == pytest.approx(bob, abs=0)
    r_skl = api.rank(frame, n_boot=20, retrieval_metric="map")
    col = dict(zip(r_skl.scores["backbone"].to_list(), r_skl.scores["retrieval:digits"].to_list()))
    assert col == pytest.approx(skl, abs=0)
    text = write_report(tmp_path / "r.html", frame, rank_kwargs={"n_boot": 20}).read_text()
    assert "Retrieval settings are ranked on map_bob: Battle of the Backbones&#39; mAP" in text
    assert "Overview of map_bob: Battle of the Backbones&#39; mAP" in text
    # results without map_bob (e.g. --top-k-only) rank on the scikit-learn-style AP, saying so
    old = pl.concat([seeded_rows, rows_to_frame(_retrieval_rows(digits, with_bob=False))], how="diagonal_relaxed")
    r_old = api.rank(old, n_boot=20, retrieval_metric="auto")
    assert r_old.retrieval_metric == "map"
    assert any("record no map_bob" in n for n in r_old.notes)


# --------------------------------------------------------------------------- two backbones
def test_two_backbones_show_per_setting_differences_with_paired_seed_intervals(seeded_rows, tmp_path):
    """Issue 24 item 11: each setting's difference to the first backbone with its own
    interval, checked against the exact paired bootstrap enumerated by hand (3 seeds: 27 draws)."""
    import itertools

    two = seeded_rows.filter(pl.col("backbone").is_in(["pixels", "pca:4"]))
    r = api.rank(two, n_boot=20)
    first, other = r.overall["backbone"].to_list()
    assert r.overall["zscore"].to_list() == pytest.approx([1.0, -1.0], abs=1e-12)  # two backbones: always +/-1
    d = r.setting_differences
    assert d.height == 2
    assert set(d["reference"].to_list()) == {first}
    for row in d.iter_rows(named=True):
        protocol = row["setting"].split("(")[1].rstrip(")")
        reduce = statistics.mean if protocol.startswith("elevater") else statistics.median
        a, ref = _per_seed(two, protocol)[other], _per_seed(two, protocol)[first]
        diffs = [
            reduce([a[k] for k in ks]) - reduce([ref[k] for k in ks]) for ks in itertools.product(range(3), repeat=3)
        ]
        assert row["diff"] == pytest.approx(reduce(a) - reduce(ref), abs=1e-15)
        assert row["lo"] == pytest.approx(float(np.quantile(diffs, 0.025)), abs=1e-15)
        assert row["hi"] == pytest.approx(float(np.quantile(diffs, 0.975)), abs=1e-15)
        assert row["n_seeds"] == 3
        assert row["interval"] == "paired seed bootstrap, exact (all 27 draws of 3 seeds)"
    text = write_report(tmp_path / "two.html", two, rank_kwargs={"n_boot": 20}).read_text()
    assert "with 2 backbones every z-score is +1 or -1" in text
    assert "rank correlations are undefined" in text
    assert "interval lies above the runner-up" not in text
    assert f"minus {first} [95% interval]" in text
    lo, hi = d["lo"][0], d["hi"][0]
    assert f"{d['diff'][0]:+.4f} [{lo:+.4f}, {hi:+.4f}]" in text
    # one seed: no interval to give, and the table says why
    one = api.rank(two.filter(pl.col("seed") == 0), n_boot=20)
    assert one.setting_differences["lo"].null_count() == 2
    assert set(one.setting_differences["interval"].to_list()) == {"none: 1 paired seed(s), nothing to resample"}


def test_three_backbones_say_what_little_follows(seeded_rows, tmp_path):
    text = write_report(tmp_path / "three.html", seeded_rows, rank_kwargs={"n_boot": 20}).read_text()
    assert "with 3 backbones the z-scores take few values and their intervals say little" in text
    assert "interval lies above the runner-up" not in text
    assert 'id="gaps-table"' in text


def test_rank_on_several_retrieval_metrics_zscores_each_dataset_and_metric(digits, seeded_rows, tmp_path, capsys):
    """Issue 33 item 6: ``--retrieval-metric map_bob,mrr,recall@1`` z-scores each (dataset,
    metric) as its own setting (BoB's "setting-specific z-scores"), then takes the mean over
    all settings; the notes and the report name the metrics that entered."""
    from featcache.cli import main

    rows = _retrieval_rows(digits)
    names = ["map_bob", "mrr", "recall@1"]
    frame = pl.concat([seeded_rows, rows_to_frame(rows)], how="diagonal_relaxed")
    r = api.rank(frame, n_boot=20, retrieval_metric=",".join(names))
    ret_cols = [c for c in r.scores.columns if c.startswith("retrieval:")]
    assert ret_cols == [f"retrieval:digits [{m}]" for m in names]
    # brute force: every setting's z-scores over the backbones (ddof 0), then the mean
    z = {b: [] for b in BACKBONES}
    for m in names:
        v = np.array([next(x["value"] for x in rows if x["backbone"] == b and x["metric"] == m) for b in BACKBONES])
        for b, zb in zip(BACKBONES, (v - v.mean()) / v.std()):
            z[b].append(zb)
    for protocol, reduce in (("elevater-fewshot:5", statistics.mean), ("vtab1k", statistics.median)):
        v = np.array([reduce(x) for x in _per_seed(seeded_rows, protocol).values()])
        for b, zb in zip(BACKBONES, (v - v.mean()) / v.std()):
            z[b].append(zb)
    got = dict(zip(r.overall["backbone"].to_list(), r.overall["zscore"].to_list()))
    assert got == pytest.approx({b: float(np.mean(z[b])) for b in BACKBONES}, abs=1e-12)
    assert r.overall["n_settings"].to_list() == [5, 5, 5]
    assert any("3 metrics (map_bob, mrr, recall@1)" in n for n in r.notes)
    with pytest.raises(ResultsError, match=r"mp@7"):
        api.rank(frame, n_boot=20, retrieval_metric="map_bob,mp@7")
    res = tmp_path / "r.parquet"
    frame.write_parquet(res)
    argv = ["rank", "--results", str(res), "--out", str(tmp_path / "out"), "--n-boot", "20", "--no-plots"]
    assert main([*argv, "--retrieval-metric", "map_bob,mrr,recall@1"]) == 0
    assert "retrieval ranked on 3 metrics (map_bob, mrr, recall@1)" in capsys.readouterr().out
    text = write_report(
        tmp_path / "r.html", frame, rank_kwargs={"n_boot": 20, "retrieval_metric": "map_bob,mrr,recall@1"}
    ).read_text()
    assert "Retrieval settings are ranked on 3 metrics" in text
