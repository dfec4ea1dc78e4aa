"""FAISS indexes in retrieval (--index): IVF probing every list equals exact search, HNSW/PQ
recall against exact search is measured and recorded, the stored index is reused (and a
corrupted one rebuilt), --index auto keeps to its memory budget (autofaiss's candidates),
a bad factory string is a one-line error; and --shards on a real Dask LocalCluster gives the
single-process rows. lite0 features of real digits (1347 gallery x 1280) and small synthetic
galleries."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from featcache.errors import ConfigError
from featcache.retrieval import RetrievalConfig, run_retrieval
from featcache.retrieval.approx import IndexSpec, choose_index, topk_recall
from featcache.retrieval.index import (
    IndexFactoryError,
    candidate_factories,
    estimated_index_bytes,
    get_optimal_nb_clusters,
    get_optimal_quantization,
    index_dir,
)
from featcache.retrieval.prepared import PreparedRows, prepare

LITE0 = "tf_efficientnet_lite0"
KS = (1, 5, 10)


def _cfg(cache, tmp_path, name="r.parquet", **kw) -> RetrievalConfig:
    return RetrievalConfig(
        cache=cache,
        dataset="digits",
        backbones=(LITE0,),
        query_split="test",
        gallery_split="train",
        ks=KS,
        knn=False,
        progress=False,
        results_path=str(tmp_path / name),
        **kw,
    )


def _hp(df: pl.DataFrame) -> dict:
    import json

    h = df["hparams"][0]
    return json.loads(h) if isinstance(h, str) else h


def _values(df: pl.DataFrame) -> dict[str, float]:
    return dict(zip(df["metric"].to_list(), df["value"].to_list()))


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("factory", ["IVF4096,Flta", "HNSWx", "PQ64,banana"])
def test_bad_factory_is_a_one_line_error(factory):
    with pytest.raises(IndexFactoryError) as ei:
        RetrievalConfig(cache="c.zarr", dataset="d", index=factory, results_path="r.parquet")
    msg = str(ei.value)
    assert "\n" not in msg
    assert factory in msg
    assert "index_factory" in msg
    assert "std::" not in msg  # FAISS's C++ location is cut off


def test_bad_factory_on_the_command_line(capsys, tmp_path):
    from featcache.cli import main

    rc = main(
        [
            "retrieve",
            "--cache",
            str(tmp_path / "c.zarr"),
            "--dataset",
            "d",
            "--query",
            "test",
            "--gallery",
            "train",
            "--all",
            "--results",
            str(tmp_path / "r.parquet"),
            "--index",
            "IVF8,Flta",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1
    assert "IVF8,Flta" in err
    assert not (tmp_path / "r.parquet").exists()


def test_search_flags_need_an_index_that_has_them(digits_cache, tmp_path):
    with pytest.raises(ConfigError, match="--nprobe"):
        _cfg(digits_cache, tmp_path, nprobe=4)  # exact search has no nprobe
    where = tmp_path / "idx"
    with pytest.raises(IndexFactoryError, match="--nprobe does not apply"):
        run_retrieval(_cfg(digits_cache, tmp_path, index="HNSW16", nprobe=4, index_dir=str(where)))
    assert not where.exists()  # refused before anything was built or stored
    assert not (tmp_path / "r.parquet").exists()
    with pytest.raises(ConfigError, match="--shards searches exactly"):
        run_retrieval(_cfg(digits_cache, tmp_path, index="HNSW16", shards=2))


# ------------------------------------------------------------------ exactness and recall
def test_ivf_probing_every_list_equals_exact(digits_cache, tmp_path):
    exact = run_retrieval(_cfg(digits_cache, tmp_path, "exact.parquet", full=False))
    cfg = _cfg(digits_cache, tmp_path, index="IVF16,Flat", nprobe=16)
    assert cfg.full_ranking is False  # --index implies the top-k-only metrics
    approx = run_retrieval(cfg)
    a, e = _values(approx), _values(exact)
    assert set(e) < set(a)
    for name, value in e.items():
        assert a[name] == pytest.approx(value, abs=1e-12), name
    for k in KS:
        assert a[f"index_recall@{k}"] == 1.0
        assert a[f"delta_recall@{k}"] == pytest.approx(0.0, abs=1e-12)
        assert a[f"delta_map@{k}"] == pytest.approx(0.0, abs=1e-12)
        assert a[f"delta_mrr@{k}"] == pytest.approx(0.0, abs=1e-12)
    hp = _hp(approx)
    assert hp["index"]["factory"] == "IVF16,Flat"
    assert hp["index"]["nprobe"] == 16
    assert hp["index"]["n_train"] == 1347  # autofaiss: 100 per list, at most the gallery
    assert approx["run_id"][0] != exact["run_id"][0]  # the index spec is in the run id


def test_stored_index_reused_and_a_corrupt_one_rebuilt(digits_cache, tmp_path, caplog):
    where = str(tmp_path / "idx")
    cfg = _cfg(digits_cache, tmp_path, index="IVF8,Flat", nprobe=2, index_dir=where)
    first = run_retrieval(cfg)
    h1 = _hp(first)["index"]
    assert h1["reused"] is False
    assert len(h1["sha256"]) == 64
    files = sorted(os.listdir(where))
    assert [f.rsplit(".", 1)[1] for f in files] == ["faiss", "json"]
    again = run_retrieval(replace(cfg, force=True))
    assert _hp(again)["index"]["reused"] is True
    assert _values(again) == _values(first)
    blob = os.path.join(where, files[0])
    with open(blob, "rb") as fh:
        data = bytearray(fh.read())
    data[-5] ^= 0xFF
    with open(blob, "wb") as fh:
        fh.write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="featcache.retrieval.index"):
        third = run_retrieval(replace(cfg, force=True))
    assert "does not match its recorded sha256" in caplog.text
    assert _hp(third)["index"]["reused"] is False
    assert _values(third) == _values(first)  # same seed, same sample: the same index again
    assert index_dir(digits_cache) == digits_cache + ".indexes"


def _exact_lists(Q: np.ndarray, G: np.ndarray, k: int) -> np.ndarray:
    """Brute force: every score, sorted by (score desc, index asc)."""
    S = Q.astype(np.float64) @ G.astype(np.float64).T
    return np.lexsort((np.broadcast_to(np.arange(G.shape[0]), S.shape), -S), axis=1)[:, :k]


@pytest.mark.parametrize(("factory", "params"), [("HNSW16", {"ef_search": 16}), ("IVF8,PQ16x4", {"nprobe": 8})])
def test_hnsw_and_pq_recall_measured_and_recorded(digits_cache, tmp_path, factory, params):
    import faiss

    from featcache.store import open_cache

    where = str(tmp_path / "idx")
    cfg = _cfg(digits_cache, tmp_path, index=factory, index_dir=where, recall_queries=200, **params)
    df = run_retrieval(cfg)
    got = _values(df)
    hp = _hp(df)
    assert hp["n_compared_queries"] == 200
    # recompute: the stored index's lists vs brute-force exact lists on the same query sample
    c = open_cache(digits_cache)
    Q = prepare(c.load(LITE0, "digits", "test").X, "cosine")
    G = prepare(c.load(LITE0, "digits", "train").X, "cosine")
    index = faiss.read_index(os.path.join(where, next(f for f in os.listdir(where) if f.endswith(".faiss"))))
    faiss.ParameterSpace().set_index_parameter(
        index, "nprobe" if "nprobe" in params else "efSearch", 8 if "nprobe" in params else 16
    )
    rows = np.sort(np.random.default_rng(0).permutation(Q.shape[0])[:200])
    _, approx = index.search(Q[rows], 10)
    exact = _exact_lists(Q[rows], G, 10)
    for k in KS:
        mine = float(np.mean(topk_recall(approx[:, :k], exact[:, :k])))
        assert got[f"index_recall@{k}"] == pytest.approx(mine, abs=1e-9), k
        assert 0.0 < got[f"index_recall@{k}"] <= 1.0
    if "PQ" in factory:  # 16 x 4-bit codes of 1280-d features lose most neighbours; IVF trains on them all
        assert got["index_recall@10"] < 0.9
        assert hp["index"]["n_train"] == 800  # autofaiss: 100 per list (8 lists)
    else:  # HNSW16 at efSearch 16 finds almost all of them; it needs no training
        assert got["index_recall@10"] > 0.9
        assert hp["index"]["n_train"] == 0


# ------------------------------------------------------------------ --index auto (autofaiss)
def _autofaiss_keys(nb_vectors, dim_vector, max_size_in_bytes):
    """criteo/autofaiss 709c6dba, autofaiss/external/optimize.py get_optimal_index_keys_v2
    (defaults; flat/quantization thresholds 1000/10000), verbatim but for the IndexMetadata
    call (its IVF_FLAT size: vectors + centroids, x4 bytes)."""
    from math import floor

    if nb_vectors < 1000:
        return ["Flat"]
    if nb_vectors < 10000:
        return ["HNSW15"]
    m_hnsw = int(floor((max_size_in_bytes / (4 * nb_vectors) - dim_vector) / 2))  # noqa: RUF046 (verbatim)
    if m_hnsw >= 8:
        return [f"HNSW{min(m_hnsw, 32)}"]
    if nb_vectors < 1_000_000:
        index_keys = [f"IVF{nb_clusters},Flat" for nb_clusters in get_optimal_nb_clusters(nb_vectors)]
        nc = get_optimal_nb_clusters(nb_vectors)[0]
        if nb_vectors * dim_vector * 4 + nc * dim_vector * 4 <= max_size_in_bytes:
            return index_keys
    return get_optimal_quantization(nb_vectors, dim_vector, max_size_in_bytes)


@pytest.mark.parametrize(
    ("n", "d", "budget"),
    [(5000, 64, 4e6), (5000, 64, 1.2e6), (200_000, 512, 8e9), (200_000, 512, 5e8), (1_281_167, 2048, 4e9)],
)
def test_auto_candidates_are_autofaiss_and_fit_the_budget(n, d, budget):
    budget = int(budget)
    cands = candidate_factories(n, d, budget)
    assert cands
    assert all(0 <= estimated_index_bytes(f, n, d) <= budget for f in cands)
    ref = [f for f in dict.fromkeys(_autofaiss_keys(n, d, budget)) if estimated_index_bytes(f, n, d) <= budget]
    if ref:
        assert cands == ref


def test_autofaiss_size_estimates():
    # autofaiss IndexMetadata.estimated_index_size_in_bytes, worked by hand from its formulas
    assert estimated_index_bytes("Flat", 1000, 64) == 1000 * 64 * 4
    assert estimated_index_bytes("HNSW32", 1000, 64) == 1000 * 32 * 2 * 4 + 1000 * 64 * 4
    assert estimated_index_bytes("IVF256,Flat", 1000, 64) == 1000 * 64 * 4 + 256 * 64 * 4
    opq = 1000 * (64 + 8) + 4096 * 2048 * 4 + 4096 * 32 * 2 * 4 + 64 * 448 * 4
    assert estimated_index_bytes("OPQ64_448,IVF4096_HNSW32,PQ64x8", 1000, 2048) == opq


def test_auto_index_respects_the_memory_budget():
    import faiss

    rng = np.random.default_rng(0)
    C = rng.normal(size=(20, 32))
    X = (C[rng.integers(0, 20, 5000)] + 0.8 * rng.normal(size=(5000, 32))).astype(np.float16)
    G = PreparedRows(X, "cosine")
    budget = 2 * 10**6
    built = choose_index(G, IndexSpec("auto", "cosine", max_bytes=budget, min_recall=0.95, k=10))
    assert built.factory == "HNSW15"  # autofaiss below 10,000 vectors
    size = faiss.serialize_index(built.index).size
    assert size <= budget
    trial = built.provenance["auto"]["trials"][-1]
    assert trial["bytes"] == size
    assert trial["recall"] >= 0.95
    with pytest.raises(ConfigError, match="max-memory"):
        choose_index(G, IndexSpec("auto", "cosine", max_bytes=10**4, k=10))


# ------------------------------------------------------------------ --shards on Dask
def test_sharded_dask_equals_single_process(digits_cache, tmp_path):
    pytest.importorskip("dask.distributed")
    single = run_retrieval(replace(_cfg(digits_cache, tmp_path, "one.parquet", full=False), knn=True))
    cfg = replace(_cfg(digits_cache, tmp_path, "sharded.parquet"), knn=True, shards=2, shard_processes=False)
    sharded = run_retrieval(cfg)
    cols = ["run_id", "kind", "protocol", "metric", "value", "n_eval"]
    assert sharded.select(cols).equals(single.select(cols))
    assert _hp(sharded.filter(pl.col("kind") == "retrieval"))["shards"] == 2


def test_index_streams_to_and_from_files_as_faiss_serialises_it(tmp_path):
    """save_index writes FAISS's own serialisation in blocks (the same bytes and sha256 as
    ``faiss.serialize_index``, never a second copy in memory); load_index reads it back to the
    same search results, and refuses bytes that are not the recorded ones."""
    import hashlib

    import faiss

    from featcache.retrieval.index import BuiltIndex, load_index, save_index

    X = np.random.default_rng(0).standard_normal((3000, 16)).astype(np.float32)
    index = faiss.index_factory(16, "IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(X)
    index.add(X)
    ref = faiss.serialize_index(index).tobytes()
    record = {"factory": "IVF4,Flat", "metric": "ip", "dim": 16, "n_gallery": 3000}  # as build_index records
    prov = save_index(BuiltIndex(index, "IVF4,Flat", record), str(tmp_path), "k", {"n": 3000})
    with open(tmp_path / "k.faiss", "rb") as fh:
        assert fh.read() == ref
    assert prov["sha256"] == hashlib.sha256(ref).hexdigest()
    assert prov["bytes"] == len(ref)
    back = load_index(str(tmp_path), "k", {"n": 3000})
    assert back is not None
    assert back.reused
    assert [a.tolist() for a in back.index.search(X[:5], 7)] == [a.tolist() for a in index.search(X[:5], 7)]
    assert load_index(str(tmp_path), "k", {"n": 2999}) is None  # another gallery's record
    with open(tmp_path / "k.faiss", "ab") as fh:  # trailing bytes FAISS would not even read
        fh.write(b"\0")
    assert load_index(str(tmp_path), "k", {"n": 3000}) is None


@pytest.mark.parametrize(
    "factory",
    [
        "Flat",
        "IVF16,Flat",
        pytest.param("IVF16,PQ8", marks=pytest.mark.slow),  # product-quantiser training
        "HNSW8",
        "IVF16_HNSW8,Flat",
        pytest.param("OPQ8,IVF16,PQ8", marks=pytest.mark.slow),
        "IVF16,SQ8",
    ],
)
def test_rows_added_into_final_size_buffers_make_the_same_index(monkeypatch, factory):
    """add_rows allocates flat stores and IVF lists at their final size (no doubling
    buffers), IVF rows added with their precomputed lists: the index is byte for byte the one
    ``index.add`` of every block makes (RESERVE_BYTES 0: every index takes that path)."""
    import faiss

    from featcache.retrieval import index as I

    monkeypatch.setattr(I, "RESERVE_BYTES", 0)
    X = np.random.default_rng(0).standard_normal((5000, 32)).astype(np.float16)
    G = PreparedRows(X, "cosine", cache_bytes=0)
    assert len(G.bounds()) > 1  # several blocks
    plain, reserved = (faiss.index_factory(32, factory, faiss.METRIC_INNER_PRODUCT) for _ in range(2))
    if not plain.is_trained:
        sample = G.take(np.arange(0, 5000, 2))
        plain.train(sample)
        reserved.train(sample)
    for _, _, Gb in G.blocks():
        plain.add(Gb)
    I.add_rows(reserved, G)
    assert reserved.ntotal == 5000
    assert faiss.serialize_index(reserved).tobytes() == faiss.serialize_index(plain).tobytes()
