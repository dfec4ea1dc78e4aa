"""Attentive probes (``attentive:vjepa``, ``attentive:aim``) against their reference code.

The reference modules and V-JEPA's training step are ported below from
facebookresearch/jepa at 51c59d5 and apple/ml-aim at bd9e068 (file:line on each), with their
order of construction (so their random draws) and of operations. Dropped from the ports: the
``use_sdpa=False`` branches and ``Block`` (depth 1 only, as the eval runs it), and the
``torch.backends.cuda.sdp_kernel()`` context around SDPA (a deprecated no-op on CPU).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from featcache.core.protocols import get_protocol
from featcache.probes.attentive import (
    _grid_heads,
    cosine_wd,
    grid_step,
    param_groups,
    predict_logits,
    train_attentive_grid,
    warmup_cosine_lr,
)
from featcache.probes.attentive_modules import attention_heads


# ----------------------------------------------------------------------------- reference ports
def ref_trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0):
    """jepa src/utils/tensors.py:17-50 (_no_grad_trunc_normal_ / trunc_normal_)."""

    def norm_cdf(x):
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        lo, up = norm_cdf((a - mean) / std), norm_cdf((b - mean) / std)
        tensor.uniform_(2 * lo - 1, 2 * up - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
        return tensor


class RefMLP(nn.Module):  # jepa src/models/utils/modules.py:13-37
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        return self.drop(x)


class RefCrossAttention(nn.Module):  # jepa src/models/utils/modules.py:123-157
    def __init__(self, dim, num_heads=12, qkv_bias=False, use_sdpa=True):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, int(dim * 2), bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.use_sdpa = use_sdpa

    def forward(self, q, x):
        B, n, C = q.shape
        q = self.q(q).reshape(B, n, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        B, N, C = x.shape
        kv = self.kv(x).reshape(B, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        q = F.scaled_dot_product_attention(q, k, v)
        q = q.transpose(1, 2).reshape(B, n, C)
        return q  # (no self.proj: the reference's forward ends here)


class RefCrossAttentionBlock(nn.Module):  # jepa src/models/utils/modules.py:160-181
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, act_layer=nn.GELU, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.xattn = RefCrossAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.norm2 = norm_layer(dim)
        mlp_hidden_dim = int(dim * mlp_ratio)
        self.mlp = RefMLP(in_features=dim, hidden_features=mlp_hidden_dim, act_layer=act_layer)

    def forward(self, q, x):
        y = self.xattn(q, self.norm1(x))
        q = q + y
        return q + self.mlp(self.norm2(q))


class RefAttentivePooler(nn.Module):  # jepa src/models/attentive_pooler.py:21-102 (depth 1)
    def __init__(self, num_queries=1, embed_dim=768, num_heads=12, mlp_ratio=4.0, init_std=0.02, qkv_bias=True):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, embed_dim))
        self.complete_block = True
        self.cross_attention_block = RefCrossAttentionBlock(
            dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, norm_layer=nn.LayerNorm
        )
        self.blocks = None
        self.init_std = init_std
        ref_trunc_normal_(self.query_tokens, std=self.init_std)
        self.apply(self._init_weights)
        self._rescale_blocks()

    def _rescale_blocks(self):
        def rescale(param, layer_id):
            param.div_(math.sqrt(2.0 * layer_id))

        rescale(self.cross_attention_block.xattn.proj.weight.data, 1)
        rescale(self.cross_attention_block.mlp.fc2.weight.data, 1)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            ref_trunc_normal_(m.weight, std=self.init_std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def forward(self, x):
        q = self.query_tokens.repeat(len(x), 1, 1)
        return self.cross_attention_block(q, x)


class RefAttentiveClassifier(nn.Module):  # jepa src/models/attentive_pooler.py:105-136
    def __init__(self, embed_dim=768, num_heads=12, num_classes=1000):
        super().__init__()
        self.pooler = RefAttentivePooler(num_queries=1, embed_dim=embed_dim, num_heads=num_heads)
        self.linear = nn.Linear(embed_dim, num_classes, bias=True)

    def forward(self, x):
        x = self.pooler(x).squeeze(1)
        return self.linear(x)


class RefAttentionPoolingClassifier(nn.Module):  # ml-aim aim-v1/aim/v1/torch/layers.py:343-394
    def __init__(self, dim, out_features, num_heads=12, num_queries=1, use_batch_norm=True, qkv_bias=False,
                 linear_bias=False, average_pool=True):  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.num_queries = num_queries
        self.average_pool = average_pool
        self.k = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.cls_token = nn.Parameter(torch.randn(1, num_queries, dim) * 0.02)
        self.linear = nn.Linear(dim, out_features, bias=linear_bias)
        self.bn = nn.BatchNorm1d(dim, affine=False, eps=1e-6) if use_batch_norm else nn.Identity()

    def forward(self, x):
        B, N, C = x.shape
        x = self.bn(x.transpose(-2, -1)).transpose(-2, -1)
        cls_token = self.cls_token.expand(B, -1, -1)
        q = cls_token.reshape(B, self.num_queries, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        k = self.k(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        v = self.v(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        x_cls = F.scaled_dot_product_attention(q, k, v)
        x_cls = x_cls.transpose(1, 2).reshape(B, self.num_queries, C)
        x_cls = x_cls.mean(dim=1) if self.average_pool else x_cls
        return self.linear(x_cls)


class RefWarmupCosineSchedule:  # jepa src/utils/schedulers.py:11-45
    def __init__(self, optimizer, warmup_steps, start_lr, ref_lr, T_max, last_epoch=-1, final_lr=0.0):
        self.optimizer = optimizer
        self.start_lr, self.ref_lr, self.final_lr = start_lr, ref_lr, final_lr
        self.warmup_steps = warmup_steps
        self.T_max = T_max - warmup_steps
        self._step = 0.0

    def step(self):
        self._step += 1
        if self._step < self.warmup_steps:
            progress = float(self._step) / float(max(1, self.warmup_steps))
            new_lr = self.start_lr + progress * (self.ref_lr - self.start_lr)
        else:
            progress = float(self._step - self.warmup_steps) / float(max(1, self.T_max))
            new_lr = max(
                self.final_lr,
                self.final_lr + (self.ref_lr - self.final_lr) * 0.5 * (1.0 + math.cos(math.pi * progress)),
            )
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr
        return new_lr


class RefCosineWDSchedule:  # jepa src/utils/schedulers.py:48-77
    def __init__(self, optimizer, ref_wd, T_max, final_wd=0.0):
        self.optimizer, self.ref_wd, self.final_wd, self.T_max = optimizer, ref_wd, final_wd, T_max
        self._step = 0.0

    def step(self):
        self._step += 1
        progress = self._step / self.T_max
        new_wd = self.final_wd + (self.ref_wd - self.final_wd) * 0.5 * (1.0 + math.cos(math.pi * progress))
        new_wd = max(self.final_wd, new_wd) if self.final_wd <= self.ref_wd else min(self.final_wd, new_wd)
        for group in self.optimizer.param_groups:
            if ("WD_exclude" not in group) or not group["WD_exclude"]:
                group["weight_decay"] = new_wd
        return new_wd


def ref_init_opt(classifier, iterations_per_epoch, start_lr, ref_lr, warmup, num_epochs, wd=1e-6, final_wd=1e-6,
                 final_lr=0.0):  # fmt: skip
    """jepa evals/image_classification_frozen/eval.py:464-503 (no GradScaler: fp32)."""
    param_groups = [
        {"params": (p for n, p in classifier.named_parameters() if ("bias" not in n) and (len(p.shape) != 1))},
        {
            "params": (p for n, p in classifier.named_parameters() if ("bias" in n) or (len(p.shape) == 1)),
            "WD_exclude": True,
            "weight_decay": 0,
        },
    ]
    optimizer = torch.optim.AdamW(param_groups)
    T = int(num_epochs * iterations_per_epoch)
    scheduler = RefWarmupCosineSchedule(
        optimizer, int(warmup * iterations_per_epoch), start_lr, ref_lr, T, final_lr=final_lr
    )
    wd_scheduler = RefCosineWDSchedule(optimizer, ref_wd=wd, final_wd=final_wd, T_max=T)
    return optimizer, scheduler, wd_scheduler


def ref_train_step(classifier, optimizer, scheduler, wd_scheduler, imgs, labels):
    """jepa evals/image_classification_frozen/eval.py:279-310, training, use_bfloat16 False."""
    scheduler.step()
    wd_scheduler.step()
    outputs = classifier(imgs)
    loss = torch.nn.CrossEntropyLoss()(outputs, labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(classifier.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def ref_head(variant, dim, n_classes):
    heads = attention_heads(dim)
    if variant == "vjepa":
        return RefAttentiveClassifier(embed_dim=dim, num_heads=heads, num_classes=n_classes)
    return RefAttentionPoolingClassifier(dim, n_classes, num_heads=heads)


# ----------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def digit_tokens():
    """Digits as 8 tokens (one per image row): 8 pixels / 16 and the row's one-hot position."""
    d = load_digits()
    X = np.concatenate([d.images / 16.0, np.broadcast_to(np.eye(8), (len(d.images), 8, 8))], axis=2)
    return X.astype(np.float16), d.target.astype(np.int64)


@pytest.fixture(params=[1, 2])
def threads(request):
    prev = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(prev)


VARIANTS = ["vjepa", "aim"]


def _equal_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


# ----------------------------------------------------------------------------- modules
@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_heads_draw_as_the_reference(variant):
    """The grid's heads, built in turn from one seeded stream, equal the reference modules
    built in turn after the same ``torch.manual_seed`` (names, shapes, every value)."""
    ours = _grid_heads(variant, 16, 10, 3, seed=7)
    state = torch.random.get_rng_state()
    torch.manual_seed(7)
    refs = [ref_head(variant, 16, 10) for _ in range(3)]
    torch.random.set_rng_state(state)
    for o, r in zip(ours, refs):
        _equal_state(o, r)
    assert not torch.equal(ours[0].linear.weight, ours[1].linear.weight)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("train", [True, False])
def test_forward_equals_reference(variant, train, threads, digit_tokens):
    X, _ = digit_tokens
    ours = _grid_heads(variant, 16, 10, 1, seed=3)[0]
    ref = ref_head(variant, 16, 10)
    ref.load_state_dict(ours.state_dict())
    ours.train(train)
    ref.train(train)
    x = torch.from_numpy(X[:64].astype(np.float32))
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)


def test_vjepa_has_no_output_projection():
    """V-JEPA's CrossAttention builds ``proj`` but its forward does not apply it: changing it
    changes nothing, and it never gets a gradient (so AdamW leaves it as initialised)."""
    head = _grid_heads("vjepa", 16, 10, 1, seed=0)[0]
    x = torch.randn(4, 8, 16)
    before = head(x)
    with torch.no_grad():
        head.pooler.cross_attention_block.xattn.proj.weight.mul_(3.0)
    torch.testing.assert_close(head(x), before, rtol=0, atol=0)
    head(x).sum().backward()
    assert head.pooler.cross_attention_block.xattn.proj.weight.grad is None


# ----------------------------------------------------------------------------- optimisation
def test_schedules_equal_reference():
    opt = torch.optim.AdamW([{"params": [nn.Parameter(torch.zeros(2, 2))]}])
    lr_s = RefWarmupCosineSchedule(opt, 3, 2e-4, 1e-3, 40, final_lr=0.0)
    wd_s = RefCosineWDSchedule(opt, 1e-3, 40, final_wd=1e-6)
    for step in range(1, 41):
        assert warmup_cosine_lr(step, 3, 2e-4, 1e-3, 0.0, 40) == lr_s.step()
        assert cosine_wd(step, 1e-3, 1e-6, 40) == wd_s.step()


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_step_equals_reference(variant, threads, digit_tokens):
    """One grid step of three heads (their lr / wd at the schedules' first values, gradient
    clipping) gives the parameters of three reference heads each stepped by V-JEPA's code."""
    X, y = digit_tokens
    combos, t_max = [(1e-2, 1e-3), (5e-3, 8e-3), (1e-1, 5e-4)], 20
    heads = _grid_heads(variant, 16, 10, len(combos), seed=1)
    refs = []
    for h in heads:
        refs.append(ref_head(variant, 16, 10))
        refs[-1].load_state_dict(h.state_dict())
    opt = torch.optim.AdamW([g for h in heads for g in param_groups(h)])
    xb, yb = torch.from_numpy(X[:128].astype(np.float32)), torch.from_numpy(y[:128])
    for k, (lr, wd) in enumerate(combos):
        for g in opt.param_groups[2 * k : 2 * k + 2]:
            g["lr"] = warmup_cosine_lr(1, 0, lr, lr, 0.0, t_max)
            if not g.get("WD_exclude"):
                g["weight_decay"] = cosine_wd(1, wd, 1e-6, t_max)
    for h in heads:
        h.train()
    grid_step(heads, opt, xb, yb, clip=1.0)
    for r, (lr, wd) in zip(refs, combos):
        r.train()
        ref_train_step(r, *ref_init_opt(r, t_max, lr, lr, 0.0, 1, wd=wd, final_wd=1e-6), xb, yb)
    for h, r in zip(heads, refs):
        _equal_state(h, r)
    assert not torch.equal(heads[0].linear.weight, _grid_heads(variant, 16, 10, 1, seed=1)[0].linear.weight)


def _documented_batches(n: int, batch: int, epochs: int, seed: int):
    """The grid's batch order for one shuffle block of all rows (its docstring): per epoch a
    block permutation (of one block), then the rows' permutation, cut into batches."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        torch.randperm(1, generator=gen)
        perm = torch.randperm(n, generator=gen)
        yield from (perm[i : i + batch] for i in range(0, n, batch))


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_equals_reference_loop(variant, digit_tokens):
    """Two epochs of a 2-head grid equal two reference heads, each trained by V-JEPA's loop
    (its init_opt, schedulers stepped before each batch, clipping) on the same batches."""
    X, y = digit_tokens
    X, y = X[:300], y[:300]
    grid = replace(get_protocol(f"attentive:{variant}").grid, lrs=(1e-2, 3e-3), wds=(1e-3,), batch_size=128)
    heads, info = train_attentive_grid(X, y, 10, grid, epochs=2, seed=5, amp="fp32")
    assert info["steps"] == 6
    assert info["shuffle_block_rows"] == 300
    refs = _grid_heads(variant, 16, 10, 2, seed=5)  # the same initial weights (checked above)
    ref_refs = []
    for r in refs:
        ref_refs.append(ref_head(variant, 16, 10))
        ref_refs[-1].load_state_dict(r.state_dict())
    Xt, yt = torch.from_numpy(X.astype(np.float32)), torch.from_numpy(y)
    for r, lr in zip(ref_refs, grid.lrs):
        opt, sched, wd_sched = ref_init_opt(r, 3, lr, lr, 0.0, 2, wd=1e-3, final_wd=1e-6)
        r.train()
        for idx in _documented_batches(300, 128, 2, seed=5):
            ref_train_step(r, opt, sched, wd_sched, Xt[idx], yt[idx])
    for h, r in zip(heads, ref_refs):
        h.eval(), r.eval()
        torch.testing.assert_close(h.state_dict(), r.state_dict(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- streaming, protocol
def _stored(X: np.ndarray, chunk_rows: int):
    """``X`` as a store view: a float16 zarr array in memory read through StoredRows."""
    import zarr

    from featcache.store import StoredRows

    arr = zarr.create_array(store={}, shape=X.shape, chunks=(chunk_rows, *X.shape[1:]), dtype=X.dtype)
    arr[:] = X
    return StoredRows([arr])


def test_streaming_equals_in_memory(digit_tokens):
    """A split read from the store block by block (a shuffled view of it, as a protocol plan
    takes rows) trains the same heads and predicts the same logits as the array in memory."""
    X, y = digit_tokens
    pos = np.random.default_rng(0).permutation(len(y))[:300]
    grid = replace(
        get_protocol("attentive:aim").grid,
        lrs=(1e-2,),
        wds=(1e-3, 4e-3),
        batch_size=64,
        block_bytes=2 * 64 * 8 * 16 * 4,
    )
    view = _stored(X, chunk_rows=50).take(pos)
    mem, info = train_attentive_grid(X[pos], y[pos], 10, grid, epochs=2, seed=0, amp="fp32")
    lazy, info_lazy = train_attentive_grid(view, y[pos], 10, grid, epochs=2, seed=0, amp="fp32")
    assert info["shuffle_block_rows"] == 128
    assert info == info_lazy
    for a, b in zip(mem, lazy):
        _equal_state(a, b)
    np.testing.assert_array_equal(
        predict_logits(mem, X[:200], "cpu"), predict_logits(lazy, _stored(X, 64)[:200], "cpu", rows=70)
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_protocol_fits_on_digit_tokens(variant, digit_tokens):
    """attentive:VARIANT through its solver on a protocol plan of digits tokens: the best head
    on validation is reported, its hparams recorded, its test accuracy far above chance, and a
    second fit gives the same probabilities."""
    from types import SimpleNamespace

    from featcache.probes.solvers import FitRequest, get_solver

    X, y = digit_tokens
    test = np.arange(1400, len(y))
    proto = get_protocol(f"attentive:{variant}")
    proto = replace(proto, grid=replace(proto.grid, lrs=(1e-2, 1e-4), wds=(1e-3,), batch_size=64))
    sp = proto.plan(y[:1400], seed=0)
    assert sp.train_split == "train[90%]"
    np.testing.assert_array_equal(sp.final, sp.train)  # no refit: the final fit is the train fit
    plan = SimpleNamespace(tr=(X[sp.train], y[sp.train]), va=(X[sp.val], y[sp.val]), fin=(X[sp.final], y[sp.final]))
    fit = get_solver(proto.solver).fit
    req = FitRequest(proto, plan, {"sgd_epochs": 6, "metric": "top1"}, None, 0)
    out = fit(req)
    hp = out.hparams
    assert hp["variant"] == variant
    assert len(hp["heads"]) == 2
    assert hp["epochs"] == 6
    assert hp["scaled"]
    vals = [h["val"] for h in hp["heads"]]
    assert hp["lr"] == hp["heads"][int(np.argmax(vals))]["lr"] == 1e-2  # 1e-4 barely moves in 6 epochs
    P = out.predict(X[test])
    assert P.shape == (test.size, 10)
    assert (out.classes[P.argmax(1)] == y[test]).mean() > 0.7
    np.testing.assert_array_equal(fit(req).predict(X[test]), P)


def test_protocol_spec_and_errors():
    from featcache.errors import ProbeError, ProtocolError
    from featcache.probes.attentive import _check_tokens

    p = get_protocol("attentive:vjepa")
    assert (p.spec, p.solver, p.split, len(p.grid.lrs) * len(p.grid.wds)) == (
        "attentive:vjepa",
        "attentive",
        "no-refit",
        20,
    )
    with pytest.raises(ProtocolError, match="attentive:vjepa"):
        get_protocol("attentive")
    # the head variants are the attentive solver's registry: an unknown one is refused when the
    # probe config is made (before any read), naming the variants it builds
    from featcache.probes.config import ProbeConfig

    with pytest.raises(ProtocolError, match=r"no attentive head 'clip'.*built: vjepa, aim"):
        ProbeConfig("c.zarr", ("b",), "d", "attentive:clip")
    with pytest.raises(ProtocolError, match="needs a head variant"):
        get_protocol("attentive:")
    with pytest.raises(ProbeError, match="--features tokens"):
        _check_tokens(np.zeros((3, 8)), "attentive:aim")


def test_nonfinite_rows_of_token_rows():
    """The runner's finite check reads [n, T, D] rows whole (a NaN in any token marks its row)."""
    from featcache.probes._stream import nonfinite_rows

    X = np.zeros((300, 8, 16), np.float16)
    X[7, 3, 5] = np.nan
    X[250, 0, 0] = np.inf
    np.testing.assert_array_equal(np.flatnonzero(nonfinite_rows(X)), [7, 250])
    np.testing.assert_array_equal(np.flatnonzero(nonfinite_rows(_stored(X, 64))), [7, 250])


@pytest.mark.slow
def test_runner_reads_tokens_from_the_store_in_memory_or_streamed(tmp_path):
    """``featcache probe --protocol attentive:aim`` end to end: ``test_vit`` tokens of digits
    extracted into a store (``--features pooled,tokens``), the runner loads kind ``tokens`` by
    itself and writes result rows; with ``max_host_bytes=1`` the train split stays in the store
    and is read block by block, with the same numbers and run ids."""
    import json

    from featcache.extract import ExtractConfig, extract
    from featcache.probes import ProbeConfig
    from featcache.probes.runner import run_probes

    cache = str(tmp_path / "c.zarr")
    extract(ExtractConfig("test_vit", "random:0", "digits", ["train", "test"], cache, features=["pooled", "tokens"],
                          limit=160, batch_size=80, progress=False))  # fmt: skip
    cfg = ProbeConfig(cache, ("test_vit@random0",), "digits", "attentive:aim", results_path=str(tmp_path / "m.parquet"),
                      sgd_epochs=2, progress=False)  # fmt: skip
    assert cfg.resolve()[1].kind == "tokens"
    mem = run_probes(cfg)
    lazy = run_probes(replace(cfg, results_path=str(tmp_path / "s.parquet"), max_host_bytes=1))
    assert set(mem["protocol"]) == {"attentive:aim"}
    assert set(mem["train_split"]) == {"train[90%]"}
    assert "top1" in set(mem["metric"])
    hp_m, hp_s = json.loads(mem["hparams"][0]), json.loads(lazy["hparams"][0])
    assert (hp_m["tokens_read"], hp_s["tokens_read"]) == ("in memory", "from the store, block by block")
    assert len(hp_m["heads"]) == 20
    assert hp_m["heads"] == hp_s["heads"]
    assert mem["value"].to_list() == lazy["value"].to_list()
    assert mem["run_id"].to_list() == lazy["run_id"].to_list()
    import polars as pl

    again = run_probes(cfg)  # recorded: a second run finds its rows and appends nothing
    assert pl.read_parquet(cfg.results_path).height == mem.height
    assert again["value"].to_list() == mem["value"].to_list()


@pytest.mark.parametrize(("bound", "chosen"), [(0.98, "bf16"), (1.5, "fp32")])
def test_bf16_where_the_cpu_has_amx_and_the_check_holds(monkeypatch, digit_tokens, bound, chosen):
    """``amp="auto"`` on a CPU whose flags show AMX: bf16 autocast when the fresh heads' bf16
    logits agree with fp32 on the first batch (every row's cosine >= the bound), else fp32;
    the check is recorded. Without AMX (the suite's FEATCACHE_CPU_BF16=0): fp32, no check."""
    from featcache.core import cpu
    from featcache.probes import attentive

    X, y = digit_tokens
    grid = replace(get_protocol("attentive:aim").grid, lrs=(1e-2,), wds=(1e-3,), batch_size=64)
    _, plain = train_attentive_grid(X[:128], y[:128], 10, grid, epochs=1, seed=0)
    assert plain["amp"]["precision"] == "fp32"
    assert "cosine_min" not in plain["amp"]
    monkeypatch.setenv(cpu.BF16_ENV, "1")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    monkeypatch.setattr(attentive, "BF16_MIN_COSINE", bound)
    heads, info = train_attentive_grid(X[:128], y[:128], 10, grid, epochs=1, seed=0)
    assert info["amp"]["precision"] == chosen
    assert info["amp"]["why"] == "AMX (amx_bf16)"
    assert 0.98 < info["amp"]["cosine_min"] <= 1.0
    assert (info["amp_dtype"] is torch.bfloat16) == (chosen == "bf16")
    assert np.isfinite(predict_logits(heads, X[:10], "cpu", info["amp_dtype"])).all()
