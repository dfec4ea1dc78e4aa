"""``dinov2-linear`` against a port of DINOv2's own linear evaluation (facebookresearch/dinov2 at
b8931f7, ``dinov2/eval/linear.py`` and ``dinov2/data/samplers.py``): the same linear inputs, head
initialisations, sample order, learning rates and weights after one and several SGD steps, at 1
and 2 torch threads, on real cached features (lite0 digits features arranged as ``[n, 5, 256]``:
four class-token slots and a mean-patch slot); then the protocol end to end from a store."""

from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from featcache.core.protocols import DINOV2_LINEAR, get_protocol
from featcache.errors import NotInStoreError, ProbeError
from featcache.probes.dinov2_linear import (
    JointHeads,
    cosine_lrs,
    head_specs,
    infinite_batches,
    linear_input,
    resolve_input_kinds,
    sharded_infinite_pass,
    train_joint,
)

LITE0 = "tf_efficientnet_lite0"
LRS = list(DINOV2_LINEAR.lrs)


# ---------------------------------------------------------------- the port
# Ported from dinov2/eval/linear.py:171-183 (create_linear_input)
def create_linear_input(x_tokens_list, use_n_blocks, use_avgpool):
    intermediate_output = x_tokens_list[-use_n_blocks:]
    output = torch.cat([class_token for _, class_token in intermediate_output], dim=-1)
    if use_avgpool:
        output = torch.cat(
            (
                output,
                torch.mean(intermediate_output[-1][0], dim=1),  # patch tokens
            ),
            dim=-1,
        )
        output = output.reshape(output.shape[0], -1)
    return output.float()


# Ported from dinov2/eval/linear.py:186-201 (LinearClassifier)
class LinearClassifier(nn.Module):
    def __init__(self, out_dim, use_n_blocks, use_avgpool, num_classes=1000):
        super().__init__()
        self.out_dim = out_dim
        self.use_n_blocks = use_n_blocks
        self.use_avgpool = use_avgpool
        self.num_classes = num_classes
        self.linear = nn.Linear(out_dim, num_classes)
        self.linear.weight.data.normal_(mean=0.0, std=0.01)
        self.linear.bias.data.zero_()

    def forward(self, x_tokens_list):
        output = create_linear_input(x_tokens_list, self.use_n_blocks, self.use_avgpool)
        return self.linear(output)


# Ported from dinov2/eval/linear.py:204-214 (AllClassifiers)
class AllClassifiers(nn.Module):
    def __init__(self, classifiers_dict):
        super().__init__()
        self.classifiers_dict = nn.ModuleDict()
        self.classifiers_dict.update(classifiers_dict)

    def forward(self, inputs):
        return {k: v.forward(inputs) for k, v in self.classifiers_dict.items()}

    def __len__(self):
        return len(self.classifiers_dict)


# Ported from dinov2/eval/linear.py:231-232 (scale_lr; distributed.get_global_size() = 1)
def scale_lr(learning_rates, batch_size):
    return learning_rates * (batch_size * 1) / 256.0


# Ported from dinov2/eval/linear.py:235-256 (setup_linear_classifiers; no .cuda(), no DDP)
def setup_linear_classifiers(sample_output, n_last_blocks_list, learning_rates, batch_size, num_classes=1000):
    linear_classifiers_dict = nn.ModuleDict()
    optim_param_groups = []
    for n in n_last_blocks_list:
        for avgpool in [False, True]:
            for _lr in learning_rates:
                lr = scale_lr(_lr, batch_size)
                out_dim = create_linear_input(sample_output, use_n_blocks=n, use_avgpool=avgpool).shape[1]
                linear_classifier = LinearClassifier(
                    out_dim, use_n_blocks=n, use_avgpool=avgpool, num_classes=num_classes
                )
                linear_classifiers_dict[f"classifier_{n}_blocks_avgpool_{avgpool}_lr_{lr:.5f}".replace(".", "_")] = (
                    linear_classifier
                )
                optim_param_groups.append({"params": linear_classifier.parameters(), "lr": lr})
    linear_classifiers = AllClassifiers(linear_classifiers_dict)
    return linear_classifiers, optim_param_groups


# Ported from dinov2/data/samplers.py:125-143 (_shuffle_tensor_slice)
def _shuffle_tensor_slice(*, tensor, start=0, step=1, generator):
    stop = len(tensor)
    count = stop // step
    drop_count = stop - step * count
    if drop_count:
        warnings.warn(f"# of dropped samples: {drop_count}")  # noqa: B028 (the reference's line)
    dtype = np.int32 if stop <= 2**31 else np.int64
    result = np.empty(count, dtype=dtype)
    for i in range(count):
        j = torch.randint(0, i + 1, size=(1,), generator=generator).item() if i > 0 else 0
        result[i] = result[j]
        result[j] = tensor[start + i * step].item()
    return result


# Ported from dinov2/data/samplers.py:160-162 (_make_seed)
def _make_seed(seed, start, iter_count):
    return seed + start + (iter_count << 24)


# Ported from dinov2/data/samplers.py:208-229 (ShardedInfiniteSampler._shuffled_iterator; start 0,
# step 1, _iter_count from 0)
def sharded_infinite_sampler(sample_count, seed):
    generator = torch.Generator()
    generator.manual_seed(seed)
    dtype = torch.int32 if sample_count <= 2**31 else torch.int64
    perm = torch.randperm(sample_count, dtype=dtype, generator=generator)
    iter_count = 0
    while True:
        generator.manual_seed(_make_seed(seed, 0, iter_count))
        yield from _shuffle_tensor_slice(tensor=perm, start=0, step=1, generator=generator)
        iter_count += 1


# Ported from dinov2/eval/linear.py:517-519 (run_eval_linear's optimiser and scheduler) and
# 342-364 (eval_linear's loop: forward, summed losses, zero_grad, backward, step, scheduler.step);
# the loader's batches are consecutive batch_size slices of the sampler (make_data_loader).
def reference_train(x_tokens_list_of, y, n_last_blocks_list, batch_size, n_classes, seed, max_iter, steps):
    torch.manual_seed(seed)
    sample_output = x_tokens_list_of(np.arange(1))
    linear_classifiers, optim_param_groups = setup_linear_classifiers(
        sample_output, n_last_blocks_list, LRS, batch_size, n_classes
    )
    optimizer = torch.optim.SGD(optim_param_groups, momentum=0.9, weight_decay=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max_iter, eta_min=0)
    init = [[p.detach().clone() for p in g["params"]] for g in optimizer.param_groups]
    stream = sharded_infinite_sampler(len(y), 0)
    for _ in range(steps):
        idx = np.fromiter(itertools.islice(stream, batch_size), np.int64)
        features = x_tokens_list_of(idx)
        labels = torch.from_numpy(y[idx])
        outputs = linear_classifiers(features)
        losses = {f"loss_{k}": nn.CrossEntropyLoss()(v, labels) for k, v in outputs.items()}
        loss = sum(losses.values())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return linear_classifiers, optimizer, init


# ---------------------------------------------------------------- data
@pytest.fixture(scope="module")
def slots(digits_cache):
    """Real features as [n, 5, 256] (lite0 digits pooled, 1280 = 5 x 256) and labels; the port's
    x_tokens_list: 4 blocks of (patch tokens [n, 3, 256], class token [n, 256]) whose last patch
    tokens average to slot 4 exactly (they are slot 4 - e, slot 4, slot 4 + e)."""
    from featcache.store import open_cache

    f = open_cache(digits_cache).load(LITE0, "digits", "train")
    X = np.asarray(f.X, np.float32).reshape(-1, 5, 256)[:600]
    y = np.asarray(f.labels, np.int64)[:600]
    return X, y


def tokens_list(X: np.ndarray):
    """The port's ``x_tokens_list`` of rows ``idx`` of X (class tokens slots 0..3, oldest first;
    the last block's patch tokens three copies of slot 4, whose torch.mean is slot 4 again)."""
    Xt = torch.from_numpy(X)

    def of(idx):
        x = Xt[torch.from_numpy(np.asarray(idx, np.int64))]
        patch = x[:, 4:5].expand(-1, 3, -1).contiguous()
        return [(patch, x[:, i]) for i in range(4)]

    return of


def test_linear_inputs_equal_create_linear_input(slots):
    X, _ = slots
    of = tokens_list(X)
    idx = np.arange(37)
    for n, avg in itertools.product((1, 4), (False, True)):
        ours = linear_input(torch.from_numpy(X[idx]), n, avg)
        ref = create_linear_input(of(idx), n, avg)
        assert ours.shape == ref.shape == (37, (n + avg) * 256)
        assert torch.equal(ours, ref)
    with pytest.raises(ProbeError, match=r"n_blocks must lie in 1\.\.4"):
        linear_input(torch.from_numpy(X[idx]), 5, False)


@pytest.mark.parametrize("batch_size", [128, 256])
def test_heads_and_init_equal_setup_linear_classifiers(slots, batch_size):
    X, _ = slots
    torch.manual_seed(3)
    clf, groups = setup_linear_classifiers(tokens_list(X)(np.arange(1)), [1, 4], LRS, batch_size, 10)
    groups = [{"params": list(g["params"]), "lr": g["lr"]} for g in groups]
    specs = head_specs((1, 4), LRS, batch_size)
    heads = JointHeads(specs, 256, 10, torch.Generator().manual_seed(3))
    assert len(specs) == len(groups) == 52
    for i, (s, g) in enumerate(zip(specs, groups)):
        W, b = heads.head(i)
        assert s.lr == g["lr"]
        assert torch.equal(W, g["params"][0])
        assert torch.equal(b, g["params"][1])
    # the reference's names (scaled lr, .5f) collide at batch 128: 48 heads in its dict; ours are unique
    assert len(clf) == (48 if batch_size == 128 else 52)
    assert len({s.name for s in specs}) == 52


def test_sampler_and_cosine_schedule_equal_the_reference():
    for n, seed in ((50, 0), (7, 5), (1, 0)):
        ref = np.fromiter(itertools.islice(sharded_infinite_sampler(n, seed), 4 * n + 3), np.int64)
        ours = np.concatenate(list(itertools.islice(infinite_batches(n, 3, seed), (4 * n + 3) // 3 + 1)))
        assert np.array_equal(ours[: ref.size], ref)
    perm = torch.randperm(40, dtype=torch.int32, generator=torch.Generator().manual_seed(9))
    for it in (0, 255, 256, 300):  # seed + (it << 24) past 2**32: torch keeps the low 32 bits
        g = torch.Generator()
        g.manual_seed(_make_seed(9, 0, it))
        ref = _shuffle_tensor_slice(tensor=perm, generator=g)
        assert np.array_equal(sharded_infinite_pass(perm.numpy(), 9, it), ref)
    base = np.array([scale_lr(lr, 128) for lr in LRS])
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in base], momentum=0.9)
    sch = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 17, eta_min=0)
    ours = cosine_lrs(base, 17)
    for _ in range(17):
        assert np.array_equal(next(ours), [g["lr"] for g in opt.param_groups])
        opt.step()
        sch.step()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("steps", [1, 4])
def test_sgd_steps_equal_the_reference_loop(slots, threads, steps):
    X, y = slots
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        clf, opt, init = reference_train(tokens_list(X), y, [1, 4], 128, 10, 0, 10, steps)
        specs = head_specs((1, 4), LRS, 128)
        heads = JointHeads(specs, 256, 10, torch.Generator().manual_seed(0))
        train_joint(heads, torch.from_numpy(X), torch.from_numpy(y), 10, 128, 0, 0.9, steps=steps)
    finally:
        torch.set_num_threads(prev)
    in_dict = {id(m.linear.weight) for m in clf.classifiers_dict.values()}
    compared = 0
    for i, g in enumerate(opt.param_groups):
        w_ref, b_ref = g["params"]
        W, b = heads.head(i)
        if id(w_ref) not in in_dict:  # a head the reference's name collision dropped: it never trains
            assert torch.equal(w_ref, init[i][0])
            continue
        compared += 1
        assert not torch.equal(w_ref, init[i][0])
        # float32 rounding: the stacked matmuls and the written-out softmax gradient sum in
        # another order than nn.Linear + autograd: a few ulps of the weights' scale per step,
        # while the smallest lr's update is ~100x that per step
        for ours, ref in ((W, w_ref), (b, b_ref)):
            ref = ref.detach().numpy()
            ulp = np.finfo(np.float32).eps * float(np.abs(ref).max())
            np.testing.assert_allclose(ours.numpy(), ref, rtol=0, atol=4 * steps * ulp)
    assert compared == 48


# ---------------------------------------------------------------- the protocol from a store
VIT = "test_vit"  # timm's tiny ViT (64-d, class token), random weights: the real extract path
VIT_KEY = f"{VIT}@random0"


@pytest.fixture(scope="module")
def vit_store(tmp_path_factory):
    """digits through a random-weight tiny ViT: class token (``cls``: the last block's, through
    the final norm) and mean patch token (``tokens_mean``), 300 train / 120 test rows."""
    from featcache.extract import ExtractConfig, extract

    path = str(tmp_path_factory.mktemp("dl") / "vit.zarr")
    extract(
        ExtractConfig(
            VIT,
            "random:0",
            "digits",
            ["train", "test"],
            path,
            features=["cls", "tokens_mean"],
            limit={"train": 300, "test": 120},
            batch_size=60,
            chunk_rows=64,
            workers=0,
            dtype="float32",
            amp="fp32",
            progress=False,
        )
    )
    return path


def _cfg(cache, results, **kw):
    from featcache.probes import ProbeConfig

    base = {"sgd_epochs": 2, "epoch_length": 100, "batch_size": 64, "progress": False}
    return ProbeConfig(cache, (VIT_KEY,), "digits", "dinov2-linear", results_path=str(results), **{**base, **kw})


def test_input_kinds_are_resolved_from_the_store():
    assert resolve_input_kinds(["pooled", "blocks:4", "blocks:1", "cls", "tokens@2x2", "tokens"]) == (
        "blocks:4",
        "tokens",
    )
    assert resolve_input_kinds(["pooled", "cls", "tokens@2x2", "tokens@4x4", "tokens_mean"]) == ("cls", "tokens_mean")
    assert resolve_input_kinds(["pooled", "tokens@2x2", "tokens@4x4"]) == ("pooled", "tokens@4x4")
    assert resolve_input_kinds(["blocks:4", "tokens@2x2", "tokens"], "blocks:4+tokens@2x2") == (
        "blocks:4",
        "tokens@2x2",
    )
    with pytest.raises(NotInStoreError, match="--features blocks:4,tokens_mean"):
        resolve_input_kinds(["pooled"])
    with pytest.raises(NotInStoreError, match="no kind"):
        resolve_input_kinds(["pooled", "tokens"], "blocks:4+tokens")
    with pytest.raises(ProbeError, match="CLS\\+PATCH"):
        resolve_input_kinds(["pooled", "tokens"], "tokens+pooled")


def test_store_without_patch_tokens_is_refused(digits_cache, tmp_path):
    from featcache.probes import ProbeConfig, run_probes

    cfg = ProbeConfig(digits_cache, (LITE0,), "digits", "dinov2-linear", results_path=str(tmp_path / "r.parquet"))
    with pytest.raises(NotInStoreError, match="mean patch token"):
        run_probes(cfg)


def test_batch_options_belong_to_dinov2_linear(tmp_path):
    from featcache.probes import ProbeConfig

    with pytest.raises(ProbeError, match="--batch-size"):
        ProbeConfig("c.zarr", ("a",), "digits", "full", results_path="r.parquet", batch_size=64).resolve()
    proto, cfg = ProbeConfig("c.zarr", ("a",), "digits", "dinov2-linear", results_path="r.parquet").resolve()
    assert (cfg.sgd_epochs, cfg.epoch_length, cfg.batch_size) == (10, 1250, 128)
    assert proto.split == "no-refit"
    assert {"sgd_epochs": 10, "batch_size": 128, "epoch_length": 1250}.items() <= cfg.run_options(proto).items()
    assert get_protocol("dinov2-linear").grid.lrs[0] == 1e-5


def _recomputed_top1(cache: str, head: str, iters: int, batch: int) -> float:
    """The reported head's test top-1 rebuilt outside the runner: the store's input in id order,
    the protocol's plan for seed 0, the joint heads trained on its train rows, the named head."""
    from featcache.core.stagerun import canonical_order
    from featcache.probes.dinov2_linear import load_linear_input
    from featcache.store import open_cache

    c = open_cache(cache)
    (Xtr, ytr), (Xte, yte) = (
        (f.X[o], np.asarray(f.labels)[o])
        for f in (load_linear_input(c, VIT_KEY, "digits", s) for s in ("train", "test"))
        for o in [canonical_order(np.asarray(f.ids).astype(str))]
    )
    sp = get_protocol("dinov2-linear").plan(ytr, 0)
    specs = head_specs((1,), LRS, batch)
    heads = JointHeads(specs, Xtr.shape[2], 10, torch.Generator().manual_seed(0))
    train_joint(heads, torch.from_numpy(Xtr[sp.train]), torch.from_numpy(ytr[sp.train]), iters, batch, 0, 0.9)
    i = [s.name for s in specs].index(head)
    W, b = heads.head(i)
    Z = linear_input(torch.from_numpy(Xte), specs[i].n_blocks, specs[i].avgpool) @ W.T + b
    return float(np.mean(Z.argmax(1).numpy() == yte))


@pytest.mark.slow
def test_protocol_end_to_end_on_digits(vit_store, tmp_path):
    from featcache.probes import run_probes
    from featcache.probes.store_lookup import run_ids

    cfg = _cfg(vit_store, tmp_path / "r.parquet")
    df = run_probes(cfg)
    top1 = df.filter(df["metric"] == "top1").row(0, named=True)
    hp = top1["hparams"] if isinstance(top1["hparams"], dict) else json.loads(top1["hparams"])
    assert top1["protocol"] == "dinov2-linear"
    assert top1["train_split"] == "train[90%]"
    assert (hp["cls_source"], hp["patch_source"], hp["input"], hp["slots"]) == (
        "cls",
        "tokens_mean",
        "cls+tokens_mean",
        2,
    )
    assert hp["heads"] == 26  # a class token of one block: n_last_blocks {1} x avgpool x 13 lrs
    assert hp["n_last_blocks_list"] == [1]
    assert (hp["epochs"], hp["epoch_length"], hp["batch_size"], hp["iterations"]) == (2, 100, 64, 200)
    assert hp["scaled"] is True
    scores = list(hp["per_head"].values())
    best = int(np.argmax(scores))
    assert hp["head"] == list(hp["per_head"])[best]
    assert hp["val_top1"] == scores[best]
    assert hp["lr"] == hp["base_lr"] * 64 / 256
    assert hp["n_train"] == hp["n_train_final"] == 270  # no refit: the heads trained on train
    assert hp["n_val"] == 30
    assert top1["value"] == _recomputed_top1(vit_store, hp["head"], 200, 64)
    # the run ids planned from provenance alone (sweep) are the runner's
    assert set(run_ids(cfg).values()) == set(df["run_id"].to_list())
    # the same seed is the same run: skipped, the same rows
    again = run_probes(cfg)
    assert again.sort("metric")["value"].to_list() == df.sort("metric")["value"].to_list()


@pytest.mark.slow
def test_cli_and_sweep_accept_dinov2_linear(vit_store, tmp_path):
    import polars as pl

    from featcache.cli import main
    from featcache.probes.store_lookup import run_ids
    from featcache.sweep.planner import SweepConfig, plan

    res = str(tmp_path / "r.parquet")
    argv = ["probe", "--cache", vit_store, "--backbone", VIT_KEY, "--dataset", "digits"]
    argv += ["--protocol", "dinov2-linear", "--epochs", "1", "--epoch-length", "20", "--batch-size", "32"]
    assert main([*argv, "--results", res, "--no-progress"]) == 0
    rows = pl.read_parquet(res)
    assert set(rows["protocol"]) == {"dinov2-linear"}
    p = plan(SweepConfig(cache=vit_store, results_path=res, backbones=(VIT_KEY,), protocols=("dinov2-linear",)))
    assert [i.label for i in p.items] == [f"probe {VIT_KEY}/digits dinov2-linear seed 0"]
    cfg = _cfg(vit_store, res, sgd_epochs=None, epoch_length=None, batch_size=None)
    assert p.items[0].run_id in set(run_ids(cfg).values())


# ---------------------------------------------------------------- N-d kinds in the store
def _digits_kinds() -> tuple[dict[str, np.ndarray], np.ndarray, list[str]]:
    """Real rows shaped like the N-d kinds, from scikit-learn's digits (8 x 8 pixels, D = 16):
    ``blocks:4`` the four 4 x 4 quadrants (as four class tokens), ``tokens`` a 3 x 3 grid of
    4 x 4 windows at stride 2 (as nine patch tokens), ``tokens@2x2`` its area-pooled 2 x 2 grid
    would need overlapping windows, so the quadrants again; ``pooled`` the quadrants' mean."""
    from sklearn.datasets import load_digits

    d = load_digits()
    img = d.images.astype(np.float32) / 16
    n = img.shape[0]
    quads = img.reshape(n, 2, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(n, 4, 16)
    win = np.stack([img[:, r : r + 4, c : c + 4].reshape(n, 16) for r in (0, 2, 4) for c in (0, 2, 4)], axis=1)
    feats = {"blocks:4": quads, "tokens": win, "tokens@2x2": quads, "pooled": quads.mean(1)}
    return feats, d.target, [str(c) for c in d.target_names]


def _write_store(path: str, backbone: str, kinds: tuple[str, ...]) -> None:
    """``kinds`` of :func:`_digits_kinds` as train (first 1,200 rows) and test (the rest) of one
    backbone, through the store's writer API (float16, as an extract stores them)."""
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    feats, y, names = _digits_kinds()
    cache = open_cache(path, "a")
    for split, rows in (("train", slice(0, 1200)), ("test", slice(1200, None))):
        ids = np.array([f"d{i:04d}" for i in range(y.size)])[rows]
        meta = ensure_split(cache, "digits", split, ids, y[rows], names, "digits")
        provs = {
            k: make_provenance(
                backbone=backbone,
                dataset="digits",
                split=split,
                kind=k,
                dim=feats[k].shape[1:],
                n=ids.size,
                dataset_fingerprint=meta.fingerprint,
                chunk_rows=256,
            )
            for k in kinds
        }
        w = FeatureWriter(cache, backbone, "digits", split, provs).prepare()
        for i in w.pending_chunks():
            a, e = w.chunk_range(i)
            w.write_chunk(i, {k: feats[k][rows][a:e] for k in kinds}, np.ones(e - a, bool))
        w.mark_complete()


@pytest.mark.parametrize(
    ("kinds", "cls_source", "patch", "heads", "floor"),
    [
        (("blocks:4", "tokens"), "blocks:4", "mean(tokens)", 52, 0.8),
        # a CNN: no class token; its pooled is its tokens' mean, so the input is one 16-d vector twice
        (("pooled", "tokens@2x2"), "pooled", "mean(tokens@2x2)", 26, 0.6),
    ],
)
def test_nd_kinds_from_the_store(tmp_path, kinds, cls_source, patch, heads, floor):
    from featcache.core.stagerun import canonical_order
    from featcache.probes import ProbeConfig, run_probes
    from featcache.probes.dinov2_linear import load_linear_input
    from featcache.store import open_cache

    path = str(tmp_path / "nd.zarr")
    _write_store(path, "pix", kinds)
    f = load_linear_input(open_cache(path), "pix", "digits", "train")
    feats, _, _ = _digits_kinds()
    stored = {k: feats[k][:1200].astype(np.float16).astype(np.float32) for k in kinds}
    cls = stored[kinds[0]] if stored[kinds[0]].ndim == 3 else stored[kinds[0]][:, None]
    assert np.array_equal(f.X[:, :-1], cls)
    np.testing.assert_allclose(f.X[:, -1], stored[kinds[1]].mean(1), rtol=1e-6, atol=1e-7)
    assert f.X.shape == (1200, cls.shape[1] + 1, 16)
    cfg = ProbeConfig(
        path,
        ("pix",),
        "digits",
        "dinov2-linear",
        results_path=str(tmp_path / "r.parquet"),
        sgd_epochs=2,
        epoch_length=100,
        batch_size=64,
        progress=False,
    )
    df = run_probes(cfg)
    top1 = df.filter(df["metric"] == "top1").row(0, named=True)
    hp = top1["hparams"] if isinstance(top1["hparams"], dict) else json.loads(top1["hparams"])
    assert (hp["cls_source"], hp["patch_source"], hp["heads"]) == (cls_source, patch, heads)
    assert hp["n_last_blocks_list"] == ([1, 4] if heads == 52 else [1])
    assert top1["value"] > floor  # digits pixels, 200 steps of batch 64; ten classes
    from featcache.probes.store_lookup import run_ids

    assert set(run_ids(cfg).values()) == set(df["run_id"].to_list())  # planned from provenance alone
    # the reported head, rebuilt outside the runner on the plan's train rows
    te = load_linear_input(open_cache(path), "pix", "digits", "test")
    o, ot = canonical_order(np.asarray(f.ids).astype(str)), canonical_order(np.asarray(te.ids).astype(str))
    (Xtr, ytr), (Xte, yte) = (f.X[o], np.asarray(f.labels)[o]), (te.X[ot], np.asarray(te.labels)[ot])
    sp = get_protocol("dinov2-linear").plan(ytr, 0)
    specs = head_specs(hp["n_last_blocks_list"], LRS, 64)
    jh = JointHeads(specs, 16, 10, torch.Generator().manual_seed(0))
    train_joint(jh, torch.from_numpy(Xtr[sp.train]), torch.from_numpy(ytr[sp.train]), 200, 64, 0, 0.9)
    i = [s.name for s in specs].index(hp["head"])
    W, b = jh.head(i)
    Z = linear_input(torch.from_numpy(Xte), specs[i].n_blocks, specs[i].avgpool) @ W.T + b
    assert top1["value"] == float(np.mean(Z.argmax(1).numpy() == yte))


@pytest.mark.parametrize(("bound", "chosen"), [(0.98, "bf16"), (1.5, "fp32")])
def test_bf16_where_the_cpu_has_amx_and_the_check_holds(monkeypatch, slots, bound, chosen):
    """On a CPU whose flags show AMX, the heads train under bf16 autocast when the fresh heads'
    bf16 logits agree with fp32 on the first batch (every row's cosine >= the bound), else in
    fp32; bf16 training ends near the fp32 heads (the weights, buffers and softmax stay fp32).
    Without AMX (the suite's FEATCACHE_CPU_BF16=0): fp32, no check."""
    from featcache.core import cpu
    from featcache.probes import dinov2_linear as dl

    X, y = slots
    specs = head_specs((1, 4), LRS, 128)

    def trained(amp):
        heads = JointHeads(specs, 256, 10, torch.Generator().manual_seed(0))
        train_joint(heads, torch.from_numpy(X), torch.from_numpy(y), 20, 128, 0, 0.9, amp=amp)
        return heads

    heads = JointHeads(specs, 256, 10, torch.Generator().manual_seed(0))
    amp, rec = dl._precision(heads, torch.from_numpy(X), "cpu", 128)
    assert (amp, rec["precision"]) == (None, "fp32")
    assert "cosine_min" not in rec
    monkeypatch.setenv(cpu.BF16_ENV, "1")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    monkeypatch.setattr(dl, "BF16_MIN_COSINE", bound)
    amp, rec = dl._precision(heads, torch.from_numpy(X), "cpu", 128)
    assert rec["precision"] == chosen
    assert rec["why"] == "AMX (amx_bf16)"
    assert 0.98 < rec["cosine_min"] <= 1.0
    assert (amp is torch.bfloat16) == (chosen == "bf16")
    low, ref = trained(torch.bfloat16), trained(None)
    for v in ref.variants:
        assert low.W[v].dtype == torch.float32
        err = float((low.W[v] - ref.W[v]).norm() / ref.W[v].norm())
        assert err < 2e-2, (v, err)


@pytest.mark.slow
def test_a_batch_larger_than_the_data_is_capped_and_recorded(vit_store, tmp_path):
    """Issue 60: ``--batch-size 1000000000`` ran for the whole 600 s limit (the sampler stacked
    10^9 rows); it is capped at the rows fitted, and the row records both."""
    import time

    from featcache.probes import run_probes

    t0 = time.perf_counter()
    df = run_probes(_cfg(vit_store, tmp_path / "r.parquet", batch_size=10**9, sgd_epochs=1, epoch_length=5))
    assert time.perf_counter() - t0 < 120
    top1 = df.filter(df["metric"] == "top1").row(0, named=True)
    hp = top1["hparams"] if isinstance(top1["hparams"], dict) else json.loads(top1["hparams"])
    assert (hp["batch_size"], hp["batch_size_given"]) == (270, 10**9)
