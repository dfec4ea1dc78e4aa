"""DINOv2's linear evaluation (``dinov2-linear``) on cached features.

facebookresearch/dinov2 ``dinov2/eval/linear.py`` trains one linear head per (n_last_blocks,
avgpool, lr) on the same batches: n_last_blocks {1, 4} x avgpool {False, True} x 13 learning
rates = 52 heads. A head's input (``create_linear_input``) concatenates the class tokens of
the last ``n`` blocks (oldest first, each through the final norm) and, with avgpool, the mean
patch token of the last block. The loss is the sum over heads of each head's cross-entropy;
SGD (momentum 0.9, weight decay 0) with a param group per head, lr = lr x batch x world / 256
(``scale_lr``), ``CosineAnnealingLR`` to 0 over ``epochs x epoch_length`` iterations (10 x
1250 at batch 128: an "epoch" is 1250 iterations, not a pass over the data); batches come
from ``ShardedInfiniteSampler`` (seed 0), so they run across passes. Each head is an
``nn.Linear`` (its default initialisation drawn, then weight N(0, 0.01) and bias 0). At the
end every head is scored on val (top-1, micro) and the first best one is reported: there is
no refit on train+val.

Here the rows' input is an ``[n, S, D]`` array (:func:`load_linear_input`): slots 0..K-1 the
class tokens of the last K blocks (kind ``blocks:K``; a backbone without class tokens gives
``pooled``, or ``cls`` stands for the last block's, so K = 1 and n_last_blocks {1}), slot K the
mean patch token (kind ``tokens_mean``, or the mean over ``tokens`` / ``tokens@GxG``).
All heads are trained in ONE pass per step: the batch is gathered once, each input variant
(n, avgpool) is built once and its 13 heads are one stacked weight ``[13, C, d]`` (one matmul
forward, one backward), the momentum update one tensor op per variant. The head
initialisation consumes the random stream draw for draw as the reference's ``nn.Linear``
constructions, and the sample order is the reference sampler's (world size 1).

Differences from the reference, recorded in each row's ``hparams.differs_from_dinov2``:
the reference names heads by the scaled lr formatted ``.5f``, so at batch x world = 128 the
heads of lr 1e-5 and 2e-5 (scaled 5e-6 and 1e-5) share a name and the first is trained but
never evaluated (48 of 52 heads scored); featcache scores all 52. The reference's test
split defaults to its val split (selection and report on the same rows); featcache selects
on val (the dataset's own, else a seeded 10% holdout of train) and reports on test.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from featcache.core.configs import Interval, check_fields, flag
from featcache.core.layers import parse_layer_kind
from featcache.errors import NotInStoreError, ProbeError
from featcache.probes.head_grid import grid_schedule_option, halving_eta_option, max_memory_option
from featcache.probes.solver_registry import FitOutcome, FitRequest, ProbeConfigError, epochs_option, register_solver

if TYPE_CHECKING:
    import torch

    from featcache.store import FeatureCache, Features

__all__ = [
    "HeadSpec",
    "JointHeads",
    "fit_dinov2_linear",
    "head_specs",
    "infinite_batches",
    "linear_input",
    "load_linear_input",
    "resolve_input_kinds",
    "scale_lr",
    "sharded_infinite_pass",
    "stored_input_fingerprint",
]

log = logging.getLogger(__name__)

REFERENCE = "facebookresearch/dinov2 dinov2/eval/linear.py"
#: the bf16 agreement bound (the extract stage's ``--precision auto`` bound, as the attentive probes')
BF16_MIN_COSINE = 0.98


@dataclass(frozen=True)
class HeadSpec:
    """One head of the grid: its input variant and learning rates (``lr``: scaled)."""

    n_blocks: int
    avgpool: bool
    base_lr: float
    lr: float

    @property
    def name(self) -> str:
        """Unique name (the reference's ``classifier_{n}_blocks_avgpool_{avgpool}_lr_...`` with the
        unscaled lr in full, since its ``.5f`` of the scaled lr can collide)."""
        return f"classifier_{self.n_blocks}_blocks_avgpool_{self.avgpool}_lr_{self.base_lr:g}"


def scale_lr(lr: float, batch_size: int, world_size: int = 1) -> float:
    """The reference's ``scale_lr``: ``lr * (batch_size * world_size) / 256.0``."""
    return lr * (batch_size * world_size) / 256.0


def head_specs(
    n_last_blocks: Sequence[int], lrs: Sequence[float], batch_size: int, world_size: int = 1
) -> list[HeadSpec]:
    """The heads in ``setup_linear_classifiers``' order: n, then avgpool (False, True), then lr."""
    return [
        HeadSpec(int(n), avg, float(lr), scale_lr(lr, batch_size, world_size))
        for n in n_last_blocks
        for avg in (False, True)
        for lr in lrs
    ]


def linear_input(X: torch.Tensor, n_blocks: int, avgpool: bool) -> torch.Tensor:
    """``create_linear_input`` on an ``[B, S, D]`` batch (slots 0..S-2 class tokens oldest
    first, slot S-1 the mean patch token): the last ``n_blocks`` class tokens concatenated,
    then the mean patch token with ``avgpool``; float32. Those slots are contiguous, so the
    concatenation is one reshape of slots ``K - n .. K`` (``K - n .. K - 1`` without avgpool)."""
    B, S, D = X.shape
    K = S - 1
    if not 1 <= n_blocks <= K:
        raise ProbeError(f"n_blocks must lie in 1..{K} for an input of {K} class-token slot(s), got {n_blocks}")
    return X[:, K - n_blocks : K + int(avgpool)].reshape(B, (n_blocks + int(avgpool)) * D).float()


def softmax_rows(Z: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis, in place: ``exp(z - max) / sum`` (torch's own kernel is several
    times slower over 10-class rows on CPUs)."""
    Z.sub_(Z.amax(-1, keepdim=True)).exp_()
    return Z.div_(Z.sum(-1, keepdim=True))


# ------------------------------------------------------------------ sampling
def sharded_infinite_pass(perm: np.ndarray, seed: int, iter_count: int) -> np.ndarray:
    """One pass of dinov2's ``ShardedInfiniteSampler`` (world size 1, start 0): the
    generator re-seeded ``seed + (iter_count << 24)`` and ``_shuffle_tensor_slice`` (an
    inside-out Fisher-Yates: ``j = torch.randint(0, i + 1)``) over ``perm``. torch's CPU
    generator is an MT19937 seeded with the low 32 bits and ``randint`` below 2**32 takes one
    32-bit draw modulo the range, so the draws are numpy's ``RandomState`` words (tested)."""
    n = perm.size
    rs = np.random.RandomState((seed + (iter_count << 24)) & 0xFFFFFFFF)
    js = [0]
    if n > 1:
        words = rs.randint(0, 2**32, size=n - 1, dtype=np.uint32).astype(np.int64)
        js += (words % np.arange(2, n + 1)).tolist()
    src = perm.tolist()
    out = [0] * n
    for i in range(n):
        j = js[i]
        out[i] = out[j]
        out[j] = src[i]
    return np.asarray(out, np.int64)


def infinite_batches(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Batches of row indices as the reference's loader yields them: consecutive
    ``batch_size`` slices of the sampler's endless stream (a batch may span two passes)."""
    import torch

    dtype = torch.int32 if n <= 2**31 else torch.int64
    perm = torch.randperm(n, dtype=dtype, generator=torch.Generator().manual_seed(int(seed))).numpy()
    buf, p = np.zeros(0, np.int64), 0
    while True:
        while buf.size < batch_size:
            buf = np.concatenate([buf, sharded_infinite_pass(perm, int(seed), p)])
            p += 1
        yield buf[:batch_size]
        buf = buf[batch_size:]


def cosine_lrs(base: np.ndarray, max_iter: int) -> Iterator[np.ndarray]:
    """Each iteration's lrs as ``CosineAnnealingLR(T_max=max_iter, eta_min=0)`` sets them:
    the base lrs, then its recursive update (float64, the same operations per head)."""
    lr = np.array(base, np.float64)
    t = 0
    while True:
        yield lr
        t += 1
        if (t - 1 - max_iter) % (2 * max_iter) == 0:
            lr = lr + base * (1 - math.cos(math.pi / max_iter)) / 2
        else:
            lr = (1 + math.cos(math.pi * t / max_iter)) / (1 + math.cos(math.pi * (t - 1) / max_iter)) * (
                lr - 0.0
            ) + 0.0


# ------------------------------------------------------------------ heads
class JointHeads:
    """Every head of the grid as stacked tensors, one ``[H_v, C, d_v]`` weight (and
    ``[H_v, C]`` bias) per input variant ``v = (n_blocks, avgpool)``.

    ``generator`` draws the initialisation in the reference's order: per head (in
    :func:`head_specs` order) ``nn.Linear``'s default (kaiming-uniform weight, uniform bias),
    then ``weight.normal_(0, init_std)``, ``bias.zero_()``."""

    def __init__(
        self,
        specs: Sequence[HeadSpec],
        D: int,
        n_classes: int,
        generator: torch.Generator,
        init_std: float = 0.01,
        keep: Sequence[int] | None = None,
    ) -> None:
        import torch

        self.index = list(range(len(specs))) if keep is None else sorted(keep)
        want = set(self.index)
        self.specs = [specs[i] for i in self.index]
        self.variants: list[tuple[int, bool]] = list(dict.fromkeys((s.n_blocks, s.avgpool) for s in self.specs))
        self.members = {v: [i for i, s in enumerate(self.specs) if (s.n_blocks, s.avgpool) == v] for v in self.variants}
        ws, bs = [], []
        for i, s in enumerate(specs):  # every head is drawn; those not kept are dropped
            d = (s.n_blocks + int(s.avgpool)) * D
            w, b = torch.empty(n_classes, d), torch.empty(n_classes)
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
            bound = 1 / math.sqrt(d) if d > 0 else 0
            torch.nn.init.uniform_(b, -bound, bound, generator=generator)
            w.normal_(mean=0.0, std=init_std, generator=generator)
            b.zero_()
            if i in want:
                ws.append(w)
                bs.append(b)
        self.W = {v: torch.stack([ws[i] for i in m]) for v, m in self.members.items()}
        self.b = {v: torch.stack([bs[i] for i in m]) for v, m in self.members.items()}

    @classmethod
    def from_heads(cls, specs: Sequence[HeadSpec], index: Sequence[int], Ws: Sequence, bs: Sequence) -> JointHeads:
        """Heads ``index`` of the grid ``specs`` from their own weights (``Ws[k]`` [C, d], ``bs[k]``
        [C]), stacked per input variant in grid order."""
        import torch

        self = cls.__new__(cls)
        self.index = list(index)
        self.specs = [specs[i] for i in self.index]
        self.variants = list(dict.fromkeys((s.n_blocks, s.avgpool) for s in self.specs))
        self.members = {v: [i for i, s in enumerate(self.specs) if (s.n_blocks, s.avgpool) == v] for v in self.variants}
        self.W = {v: torch.stack([Ws[i] for i in m]) for v, m in self.members.items()}
        self.b = {v: torch.stack([bs[i] for i in m]) for v, m in self.members.items()}
        return self

    def to(self, device: str) -> JointHeads:
        self.W = {v: w.to(device) for v, w in self.W.items()}
        self.b = {v: b.to(device) for v, b in self.b.items()}
        return self

    @property
    def lr_base(self) -> np.ndarray:
        """The (scaled) lr of every head of the grid these heads come from, indexed by grid
        position (a head not held here: 0)."""
        out = np.zeros(max(self.index) + 1 if self.index else 0, np.float64)
        for i, s in zip(self.index, self.specs):
            out[i] = s.lr
        return out

    def head(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``i``'s (weight [C, d], bias [C]) as in :func:`head_specs` order."""
        s = self.specs[i]
        v = (s.n_blocks, s.avgpool)
        k = self.members[v].index(i)
        return self.W[v][k], self.b[v][k]

    def logits(self, X: torch.Tensor, v: tuple[int, bool]) -> torch.Tensor:
        """``[B, H_v, C]`` logits of variant ``v``'s heads on an ``[B, S, D]`` batch."""
        import torch

        W, b = self.W[v], self.b[v]
        H, C, d = W.shape
        x = linear_input(X, *v)
        return torch.addmm(b.reshape(1, H * C), x, W.reshape(H * C, d).T).view(-1, H, C)


def train_joint(
    heads: JointHeads,
    X: torch.Tensor,
    y: torch.Tensor,
    max_iter: int,
    batch_size: int,
    seed: int,
    momentum: float,
    *,
    steps: int | None = None,
    views: torch.Tensor | None = None,
    view_seed: int = 0,
    amp: Any = None,
) -> dict[str, Any]:
    """SGD (momentum, no weight decay, dampening 0) of every head at once, the loss the sum of
    each head's mean cross-entropy, cosine lrs over ``max_iter`` (:func:`cosine_lrs`), batches
    from :func:`infinite_batches`; ``steps`` (default ``max_iter``) of them. Gradients are
    written out: (softmax - one-hot) / B. ``views`` (``[K, n, S, D]``, ``--views K``): each
    row is read in one view per pass over the rows (:class:`~featcache.probes.views.PassViews`).
    ``amp`` (``torch.bfloat16`` or None): the two matmuls of a step under that autocast, the
    weights, momentum buffers and softmax in fp32."""
    import torch

    bufW = {v: torch.zeros_like(w) for v, w in heads.W.items()}
    bufb = {v: torch.zeros_like(b) for v, b in heads.b.items()}
    stream = JointStream(X, y, max_iter, batch_size, seed, views, view_seed, heads.lr_base)
    joint_steps(heads, bufW, bufb, stream, 0, max_iter if steps is None else steps, momentum, amp)
    finite = all(bool(torch.isfinite(w).all()) for w in heads.W.values())
    return {"finite": finite}


class JointStream:
    """The grid's batches and lrs (:func:`infinite_batches`, :func:`cosine_lrs` of every head's
    ``lr_base``, the views of :class:`~featcache.probes.views.PassViews`), replayable: ``steps(s0,
    s1)`` yields ``(step, xb, yb, lrs)`` of steps ``s0+1..s1`` from a fresh stream (the steps
    before ``s0`` drawn, not computed), so a head trained in segments or groups sees the batches
    of one uninterrupted run."""

    def __init__(self, X, y, max_iter: int, batch_size: int, seed: int, views, view_seed: int, lr_base) -> None:
        self.X, self.y, self.max_iter, self.batch_size, self.seed = X, y, max_iter, batch_size, seed
        self.views, self.view_seed, self.lr_base = views, view_seed, np.asarray(lr_base, np.float64)

    def steps(self, s0: int, s1: int) -> Iterator[tuple[int, Any, Any, Any]]:
        import torch

        from featcache.probes.views import PassViews

        X, views = self.X, self.views
        pv = None if views is None else PassViews(self.view_seed, int(X.shape[0]), int(views.shape[0]))
        batches = infinite_batches(int(X.shape[0]), self.batch_size, self.seed)
        lrs = cosine_lrs(self.lr_base, self.max_iter)
        for step in range(1, s1 + 1):
            idx_np, lr_np = next(batches), next(lrs)
            v_np = None if pv is None else pv.views_of(idx_np)
            if step <= s0:
                continue
            idx = torch.from_numpy(idx_np).to(X.device)
            xb = X[idx] if v_np is None or views is None else views[torch.from_numpy(v_np).to(X.device), idx]
            yield step, xb, self.y[idx], torch.from_numpy(lr_np).to(X.device)


def joint_steps(heads: JointHeads, bufW: dict, bufb: dict, stream: JointStream, s0: int, s1: int, momentum: float,
                amp: Any = None, progress: Any = None) -> None:  # fmt: skip
    """Steps ``s0+1..s1`` of :func:`train_joint` on ``heads`` (a whole grid or some of its
    heads, ``heads.index``) and their momentum buffers, in place; ``progress(step, heads)``
    after each step."""
    import torch

    lr_index = {v: torch.tensor([heads.index[i] for i in m]) for v, m in heads.members.items()}
    batch_size = stream.batch_size
    rows = torch.arange(batch_size, device=stream.X.device)
    cast = torch.autocast(stream.X.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None)
    with torch.no_grad(), cast:
        for _step, xb, yb, lr_all in stream.steps(s0, s1):
            for v in heads.variants:
                W, b = heads.W[v], heads.b[v]
                H, C, d = W.shape
                x = linear_input(xb, *v)
                P = softmax_rows(torch.addmm(b.reshape(1, H * C), x, W.reshape(H * C, d).T).float().view(-1, H, C))
                P[rows, :, yb] -= 1.0
                P /= batch_size
                G = P.reshape(batch_size, H * C)
                bufW[v].mul_(momentum).add_((G.T @ x).float().view(H, C, d))
                bufb[v].mul_(momentum).add_(G.sum(0).view(H, C))
                lr = lr_all[lr_index[v]].to(W.dtype)
                W.sub_(lr.view(H, 1, 1) * bufW[v])
                b.sub_(lr.view(H, 1) * bufb[v])
            if progress is not None:  # (step, heads stepped)
                progress(_step, len(heads.specs))


def score_heads(heads: JointHeads, X: torch.Tensor, y: np.ndarray, metric: str, block: int = 8192) -> list[float]:
    """Each head's ``metric`` on (X, y) (probabilities of its softmax; top-1 as the reference)."""
    import torch

    from featcache.core.metrics import METRICS

    def val_score(metric: str, y: np.ndarray, P: np.ndarray) -> float:  # solvers.val_score (no import circle)
        return float(np.mean(P.argmax(1) == y)) if metric == "top1" else float(METRICS[metric](y, P))

    scores: list[float] = [0.0] * len(heads.specs)
    with torch.no_grad():
        for v in heads.variants:
            P = torch.cat([torch.softmax(heads.logits(X[a : a + block], v), -1) for a in range(0, X.shape[0], block)])
            Pn = P.double().cpu().numpy()
            for k, i in enumerate(heads.members[v]):
                scores[i] = val_score(metric, y, Pn[:, k])
    return scores


# ------------------------------------------------------------------ input from the store
_BLOCKS = re.compile(r"^blocks:(\d+)$")
_GRID = re.compile(r"^tokens@(\d+)x(\d+)$")
#: the class-token slots kept: the reference's largest n_last_blocks
MAX_BLOCKS = 4


def _patch_rank(kind: str) -> tuple[int, int] | None:
    """Preference of a patch-token source (lower first): tokens_mean, tokens, tokens@GxG (finest)."""
    if kind == "tokens_mean":
        return (0, 0)
    if kind == "tokens":
        return (1, 0)
    m = _GRID.match(kind)
    return (2, -int(m.group(1)) * int(m.group(2))) if m else None


def resolve_input_kinds(available: Sequence[str], kind: str = "auto") -> tuple[str, str]:
    """(class-token kind, patch-token kind) of the input. ``kind`` ``CLS+PATCH`` names both
    (e.g. ``blocks:4+tokens@2x2``); anything else picks from ``available``: the class tokens
    of the most blocks (``blocks:K``), else ``cls`` (the last block's), else ``pooled`` (a
    backbone without class tokens); the mean patch token from ``tokens_mean``, else ``tokens``,
    else the finest ``tokens@GxG``."""
    avail = list(available)
    if kind.startswith("layers:") or parse_layer_kind(kind.split("+")[0].split(",")[0]) is not None:
        return _layer_input_kinds(avail, kind)
    if "+" in kind:
        cls_kind, patch_kind = (k.strip() for k in kind.split("+", 1))
        missing = [k for k in (cls_kind, patch_kind) if k not in avail]
        if missing:
            raise NotInStoreError(f"dinov2-linear input {kind!r}: the store has no kind {missing} (has {avail})")
        if not (_BLOCKS.match(cls_kind) or cls_kind in ("cls", "pooled")) or _patch_rank(patch_kind) is None:
            raise ProbeError(
                f"dinov2-linear input {kind!r}: give CLS+PATCH with CLS one of blocks:K, cls, pooled and PATCH "
                "one of tokens_mean, tokens, tokens@GxG"
            )
        return cls_kind, patch_kind
    blocks = sorted((int(m.group(1)), k) for k in avail if (m := _BLOCKS.match(k)))
    cls_kind = blocks[-1][1] if blocks else "cls" if "cls" in avail else "pooled" if "pooled" in avail else None
    patches = sorted((r, k) for k in avail if (r := _patch_rank(k)) is not None)
    if cls_kind is None or not patches:
        raise NotInStoreError(
            f"dinov2-linear reads class tokens (blocks:4, or cls / pooled) and the mean patch token "
            f"(tokens_mean, tokens or tokens@GxG); the store has {avail}. Extract them in one pass: "
            "featcache extract ... --features blocks:4,tokens_mean (a ViT) or --features pooled,tokens@7x7 (a CNN)"
        )
    return cls_kind, patches[0][1]


def _layer_input_kinds(avail: list[str], kind: str) -> tuple[str, str]:
    """The input of per-layer kinds (issue 56): ``layers:LIST`` takes the class tokens of the
    listed layers (oldest first, one slot each) and the last one's mean patch token; a single
    ``layer{i}_cls`` (a layer sweep's point) pairs it with ``layer{i}_mean`` (``_raw``: before
    the final norm, both); ``CLS,...+PATCH`` names them."""
    from featcache.core.layers import layer_kind, select_layers

    if "+" in kind:
        cls_part, patch_kind = kind.split("+", 1)
        cls_kinds = cls_part.split(",")
    elif kind.startswith("layers:"):
        idx = [i for i, _ in select_layers(avail, kind.removeprefix("layers:"), "cls")]
        cls_kinds, patch_kind = [layer_kind(i, "cls") for i in idx], layer_kind(idx[-1], "mean")
    else:
        i, part = parse_layer_kind(kind) or (0, "")
        cls_kinds, patch_kind = [kind], layer_kind(i, part.replace("cls", "mean"))
    bad = [k for k in cls_kinds if (p := parse_layer_kind(k)) is None or not p[1].startswith("cls")]
    if bad or not patch_kind.startswith("layer"):
        raise ProbeError(
            f"dinov2-linear input {kind!r}: give layers:LIST, layer<i>_cls or layer<i>_cls,...+layer<j>_mean"
        )
    missing = [k for k in (*cls_kinds, patch_kind) if k not in avail]
    if missing:
        raise NotInStoreError(f"dinov2-linear input {kind!r}: the store has no kind {missing} (has {avail})")
    return ",".join(cls_kinds), patch_kind


def _mean_tokens(cache: FeatureCache, f: Features) -> np.ndarray:
    """The mean over the token axis of ``f``'s ``[n, T, D]`` kind, streamed from the store in
    row blocks of whole chunks (:meth:`FeatureCache.iter_blocks`, memory bounded), float32."""
    if f.X.ndim == 2:  # tokens_mean: the mean the extract computed (float32, before storage)
        return np.asarray(f.X, np.float32)
    out = np.empty((f.X.shape[0], f.X.shape[-1]), np.float32)
    for start, X in cache.iter_blocks(f.backbone, f.dataset, f.split, f.kind):
        out[start : start + X.shape[0]] = X.mean(axis=1)
    return out


def stored_input_fingerprint(cache: FeatureCache, backbone: str, dataset: str, split: str, kind: str = "auto") -> str:
    """:func:`load_linear_input`'s fingerprint from the provenance records alone (no read)."""
    from featcache.store import combine_fingerprints

    cls_kind, patch_kind = resolve_input_kinds(cache.kinds(backbone, dataset, split), kind)
    kinds = [*cls_kind.split(","), patch_kind]  # per-layer class tokens: one kind a slot
    return combine_fingerprints(*(cache.stored_fingerprint(backbone, dataset, split, k) for k in kinds))


def load_linear_input(cache: FeatureCache, backbone: str, dataset: str, split: str, kind: str = "auto") -> Features:
    """The split's ``[n, S, D]`` input (:class:`~featcache.store.Features`, ``kind``
    ``"CLS+PATCH"``): the last :data:`MAX_BLOCKS` class-token slots of the class-token kind,
    then the mean patch token; ``input_info`` records the sources. Rows are valid where both
    kinds are; the fingerprint combines both."""
    from featcache.store import Features, combine_fingerprints

    cls_kind, patch_kind = resolve_input_kinds(cache.kinds(backbone, dataset, split), kind)
    fcs = [cache.load(backbone, dataset, split, kind=k) for k in cls_kind.split(",")]  # layer kinds: one a slot
    fc = fcs[0]
    vector = patch_kind == "tokens_mean" or parse_layer_kind(patch_kind) is not None  # [n, D]: no token axis
    fp = cache.load(backbone, dataset, split, kind=patch_kind, lazy=not vector)
    if not all(np.array_equal(np.asarray(f.ids), np.asarray(fp.ids)) for f in fcs):
        raise ProbeError(f"{backbone}/{dataset}/{split}: kinds {cls_kind} and {patch_kind} hold different rows")
    Xc = np.stack([np.asarray(f.X, np.float32) for f in fcs], axis=1) if len(fcs) > 1 else np.asarray(fc.X, np.float32)
    Xc = Xc[:, None, :] if Xc.ndim == 2 else Xc[:, -MAX_BLOCKS:]
    Xp = _mean_tokens(cache, fp)
    if Xp.shape[-1] != Xc.shape[-1]:
        raise ProbeError(
            f"{backbone}/{dataset}/{split}: {cls_kind} has width {Xc.shape[-1]} but {patch_kind} {Xp.shape[-1]}; "
            "dinov2-linear concatenates class and patch tokens of one width"
        )
    name = f"{cls_kind}+{patch_kind}"
    out = Features(
        backbone=backbone,
        dataset=dataset,
        split=split,
        kind=name,
        X=np.concatenate([Xc, Xp[:, None, :]], axis=1),
        labels=fc.labels,
        ids=fc.ids,
        valid=np.logical_and.reduce([np.asarray(f.valid, bool) for f in (*fcs, fp)]),
        class_names=fc.class_names,
        provenance=fc.provenance,
        dataset_fingerprint=fc.dataset_fingerprint,
        fingerprint=combine_fingerprints(*(f.fingerprint for f in fcs), fp.fingerprint),
    )
    out.input_info = {  # type: ignore[attr-defined]
        "input": name,
        "cls_source": cls_kind,
        "patch_source": patch_kind if vector else f"mean({patch_kind})",
        "slots": int(out.X.shape[1]),
    }
    return out


# ------------------------------------------------------------------ solver
@dataclass(frozen=True)
class Dinov2LinearOptions:
    """``dinov2-linear``'s schedule; ``None``: the protocol grid's (10 epochs of 1250 iterations
    of 128 rows). Another protocol refuses ``--batch-size`` and ``--epoch-length`` (it fixes its own
    batches) rather than ignoring them (``exclusive``)."""

    exclusive: ClassVar[tuple[str, ...]] = ("batch_size", "epoch_length", "grid_schedule", "halving_eta", "max_memory")

    sgd_epochs: int | None = epochs_option()
    grid_schedule: str = grid_schedule_option()
    halving_eta: int = halving_eta_option()
    max_memory: str | None = max_memory_option()
    batch_size: int | None = flag(
        None, "dinov2-linear: rows per training batch (reference: 128)", type=int, check=Interval(int, 1)
    )
    epoch_length: int | None = flag(
        None,
        "dinov2-linear: iterations per epoch (reference: 1250; an epoch is not a pass over the data)",
        type=int,
        check=Interval(int, 1),
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def resolve(self, proto: Any) -> Dinov2LinearOptions:
        """The grid's schedule where not given (a grid without one: refused)."""
        from dataclasses import replace

        from featcache.core.protocols import Dinov2LinearGrid

        g = proto.grid
        if not isinstance(g, Dinov2LinearGrid):
            raise ProbeConfigError(f"the dinov2-linear solver needs a Dinov2LinearGrid; {proto.spec} has {g!r}")
        return replace(
            self,
            sgd_epochs=g.epochs if self.sgd_epochs is None else self.sgd_epochs,
            batch_size=g.batch_size if self.batch_size is None else self.batch_size,
            epoch_length=g.epoch_length if self.epoch_length is None else self.epoch_length,
        )


def _grid_heads(req: FitRequest, S: int) -> tuple[list[HeadSpec], dict[str, Any]]:
    """The grid's heads for an input of ``S`` slots (n_last_blocks limited to S - 1)."""
    g, opts = req.proto.grid, req.opts
    K = S - 1
    blocks = tuple(n for n in g.n_last_blocks if n <= K)
    if not blocks:
        raise ProbeError(f"dinov2-linear needs at least one class-token slot; the input has {S} slot(s)")
    sched = {
        "batch_size": int(opts["batch_size"]),
        "epochs": int(opts["sgd_epochs"]),
        "epoch_length": int(opts["epoch_length"]),
    }
    return head_specs(blocks, g.lrs, sched["batch_size"]), {**sched, "n_last_blocks_list": list(blocks)}


@register_solver(
    "dinov2-linear",
    options=Dinov2LinearOptions,
    views=True,
    run_options=("sgd_epochs", "grid_schedule", "halving_eta", "batch_size", "epoch_length"),
    load=load_linear_input,
    input_fingerprint=stored_input_fingerprint,
)
def fit_dinov2_linear(req: FitRequest) -> FitOutcome:
    """Train the grid's heads jointly on the plan's train rows, pick the first best head on
    its val rows by the task metric, report it (no refit, as the reference)."""
    import torch
    from scipy.special import softmax

    from featcache.probes.dinov2_grid import dinov2_grid
    from featcache.probes.head_grid import GridPlan
    from featcache.probes.logistic import cpu_threads, resolve_backend

    g, opts = req.proto.grid, req.opts
    (Xtr, ytr), (Xva, yva) = req.plan.tr, req.plan.va
    Xtr, Xva = np.asarray(Xtr, np.float32), np.asarray(Xva, np.float32)
    if Xtr.ndim != 3:
        raise ProbeError(f"dinov2-linear takes [n, S, D] inputs (class tokens + mean patch token); got {Xtr.shape}")
    if yva.size == 0:
        raise ProbeError("dinov2-linear selects its head on validation rows and the plan has none")
    classes = np.unique(ytr)
    specs, sched = _grid_heads(req, Xtr.shape[1])
    max_iter = sched["epochs"] * sched["epoch_length"]
    device = resolve_backend("torch")[1]
    pos = np.searchsorted(classes, yva)
    if (classes[np.minimum(pos, classes.size - 1)] != yva).any():
        raise ProbeError("the validation rows hold classes absent from the training rows; resample the split")
    plan = GridPlan.from_opts(opts, req.proto.spec)
    t0 = time.perf_counter()
    with cpu_threads(device):
        X_t = torch.from_numpy(np.ascontiguousarray(Xtr)).to(device)
        y_t = torch.from_numpy(np.searchsorted(classes, ytr).astype(np.int64)).to(device)
        V_t = None
        if req.plan.views:  # --views K: one view per row per pass, seeded
            V_t = torch.from_numpy(np.stack([np.asarray(v, np.float32) for v in req.plan.views["tr"]])).to(device)
        base = np.array([s.lr for s in specs], np.float64)
        stream = JointStream(X_t, y_t, max_iter, sched["batch_size"], g.sampler_seed + req.seed, V_t, req.seed, base)
        ctx = {"ops": sys.modules[__name__], "specs": specs, "D": Xtr.shape[2], "C": classes.size, "seed": req.seed, "init_std": g.init_std,
               "device": device, "stream": stream, "momentum": g.momentum, "Xva": torch.from_numpy(Xva).to(device),
               "yva": pos, "metric": opts["metric"], "batch": sched["batch_size"], "epoch_length": sched["epoch_length"], "S": Xtr.shape[1]}  # fmt: skip
        run, _mem = dinov2_grid(ctx, plan, max_iter)
    best = run.best  # the reference: the first head with the highest score
    scores = [-np.inf if v != v else v for v in run.val]
    W, b = run.kept[best]
    s = specs[best]

    def predict(Xe: np.ndarray) -> np.ndarray:
        x = linear_input(torch.from_numpy(np.ascontiguousarray(Xe, np.float32)), s.n_blocks, s.avgpool)
        with torch.no_grad():
            return softmax(torch.addmm(b, x, W.T).double().numpy(), axis=1)

    hp = _hparams(req, specs, scores, best, sched, max_iter, device)
    hp["precision"] = ctx["precision"]
    hp.update(plan.record(run))
    if plan.schedule != "full":
        hp["selection"] = f"val {opts['metric']}, first best of the heads trained to the end by successive halving"
        hp["head_status"] = {sp.name: st for sp, st in zip(specs, run.status)}
    finite = bool(np.isfinite(scores[best]))
    return FitOutcome(predict, classes, hp, finite, time.perf_counter() - t0)


def _precision(heads: JointHeads, X: torch.Tensor, device: str, batch_size: int) -> tuple[Any, dict[str, Any]]:
    """bf16 autocast for training where the device has it and the fresh heads' logits on the
    first rows agree with fp32 (:func:`~featcache.probes._precision.bf16_choice`); else fp32.
    (The grid checks its heads group by group: :func:`featcache.probes.dinov2_grid._precision`.)"""
    import torch

    from featcache.probes._precision import bf16_choice

    xb = X[:batch_size]
    return bf16_choice(device, lambda: torch.cat([heads.logits(xb, v) for v in heads.variants], 1), BF16_MIN_COSINE)


def _hparams(req: FitRequest, specs, scores, best: int, sched, max_iter: int, device: str) -> dict[str, Any]:
    g, s, m = req.proto.grid, specs[best], req.opts["metric"]
    hp: dict[str, Any] = {
        "solver": "dinov2-linear",
        "reference": REFERENCE,
        "device": device,
        "head": s.name,
        "n_last_blocks": s.n_blocks,
        "avgpool": s.avgpool,
        "lr": s.lr,
        "base_lr": s.base_lr,
        f"val_{m}": scores[best],
        "selection": f"val {m}, first best head of {len(specs)} (reference order)",
        "refit": "none (dinov2/eval/linear.py reports the heads it trained on train)",
        "heads": len(specs),
        **sched,
        "iterations": max_iter,
        "momentum": g.momentum,
        "weight_decay": g.weight_decay,
        "init_std": g.init_std,
        "sampler_seed": g.sampler_seed + req.seed,
        "per_head": {sp.name: sc for sp, sc in zip(specs, scores)},
        "differs_from_dinov2": (
            "all heads are scored (the reference's .5f head names collide at batch x world 128, "
            "leaving the 1e-5 heads unscored); the head is selected on val and reported on test"
        ),
    }
    if req.plan.views:
        hp.update(
            views=len(req.plan.views["tr"]),
            view_draw="one view per row per pass over the training rows (probes.views.PassViews)",
        )
    if (sched["epochs"], sched["epoch_length"], sched["batch_size"]) != (g.epochs, g.epoch_length, g.batch_size):
        hp.update(
            scaled=True, scaled_from={"epochs": g.epochs, "epoch_length": g.epoch_length, "batch_size": g.batch_size}
        )
    return hp
